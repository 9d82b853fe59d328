"""Training prompts whose answers reuse a long context: the ``long_reuse`` pool source.

Agent work is made of reuse (a file in the context, then an edit that repeats most of it; a tool
result quoted back), and a draft learns to read its context only from replies that do. This source
makes such prompts from texts disjoint from the long-context eval sets (:mod:`data_gen.long_context`):

- code: a function of 10-60 lines of a pure-Python standard-library module (the eval set uses
  Jinja2's wheel), asked back with a change; other modules of the standard library around it;
- docs: a paragraph among the first ``per_language`` of dataset-build's texts (the ones the
  ``dataset_build`` source already trains on; the eval set uses those past them), asked back
  quoted; other paragraphs of those around it.

Each task is asked at one context length, in turn over ``context_chars`` (0: the text alone), so
that a pool mixes row lengths; every ``turns_every``-th task is a two-turn conversation whose second
request reuses the same context again (the assistant turns are the target's, written at
regeneration). Lengths are in characters, since a pool is built before a tokenizer is chosen:
about 4 characters a token for English and code, fewer for other scripts. Such prompts are longer
than ``pools.max_chars`` on purpose and are not cut by it; ``regenerate.max_prompt_tokens`` and the
target's context still apply (an overlong one is skipped and counted there).

Domain ``long``: add it to ``select.domains`` to mix these prompts in.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from data_gen.long_context import Task, fill, paragraphs_by_language, short_functions
from data_gen.sources import ISO3_TO_ISO1, SOURCES, STDLIB_MODULES, Prompt, Source, stdlib_file

CODE_ASKS = (
    "Copy the function `{name}` from `{member}` above, unchanged, and then add a docstring to it.",
    "Rename the local variables of `{name}` in `{member}` to clearer names and show the whole function.",
    "Show the function `{name}` of `{member}` again with a comment above each block of lines.",
    "Add type hints to every parameter of `{name}` from `{member}` and write the function out in full.",
)
DOCS_ASKS = (
    "Repeat, word for word, the paragraph above that starts with \"{opening}\"; then say in one sentence what it "
    "is about.",
    "Copy the paragraph beginning \"{opening}\" exactly as written, then list its two main points.",
    "Find the paragraph that opens with \"{opening}\", quote it in full, and give it a short title.",
)
FOLLOW_UPS = (
    "Now do the same for the text right after it.",
    "Write that part out once more, exactly as it appears above.",
)


def stdlib_sources() -> dict[str, str]:
    """The listed standard-library modules' source, by path (``json/decoder.py``)."""
    files = {module: stdlib_file(module) for module in dict.fromkeys(STDLIB_MODULES)}
    return {f"{m.replace('.', '/')}.py": f.read_text(encoding="utf-8") for m, f in files.items() if f is not None}


def code_reuse_tasks(seed: int) -> list[Task]:
    """Every function of 10-60 lines of the standard library's listed modules, in a seeded order."""
    files = stdlib_sources()
    tasks = []
    for member, name, body in short_functions(files):
        ask = CODE_ASKS[len(tasks) % len(CODE_ASKS)].format(name=name, member=member)
        others = [f"# file: {m}\n{text}" for m, text in sorted(files.items()) if m != member]
        tasks.append(Task(f"{member}:{name}", f"# file: {member}\n{body}", ask, others, "en"))
    random.Random(seed).shuffle(tasks)
    return tasks


def docs_reuse_tasks(wheel: Path, path: str, per_language: int, seed: int) -> list[Task]:
    """The first ``per_language`` paragraphs of each language, in turn over the languages."""
    by_language = paragraphs_by_language(wheel, path, slice(per_language))
    rng = random.Random(seed)
    order = {iso3: rng.sample(range(len(p)), len(p)) for iso3, p in by_language.items()}
    tasks: list[Task] = []
    for i in range(max((len(v) for v in order.values()), default=0)):
        for iso3, paragraphs in by_language.items():
            if i < len(order[iso3]):
                j = order[iso3][i]
                opening = " ".join(paragraphs[j].split()[:8])
                ask = DOCS_ASKS[len(tasks) % len(DOCS_ASKS)].format(opening=opening)
                others = [p for n, p in enumerate(paragraphs) if n != j]
                tasks.append(Task(f"{iso3}:{j}", paragraphs[j], ask, others, ISO3_TO_ISO1[iso3]))
    return tasks


def reuse_prompts(wheel: Path | None, path: str, tasks: int = 400, context_chars: Sequence[int] = (0, 8000, 16000),
                  turns_every: int = 3, per_language: int = 60, seed: int = 0) -> Iterator[Prompt]:
    """``tasks`` prompts, code and docs in turn, each kind at the next of ``context_chars`` (``wheel``:
    dataset-build's, for the docs)."""
    if wheel is None:
        raise ValueError("long_reuse reads dataset-build's wheel for its documents")
    code, docs = code_reuse_tasks(seed), docs_reuse_tasks(wheel, path, per_language, seed)
    picked = [t for pair in zip(code, docs, strict=False) for t in pair][:tasks]
    for i, task in enumerate(picked):
        chars = context_chars[(i // 2) % len(context_chars)]  # each kind in turn over every length
        rng = random.Random(f"{seed}:{task.id}")
        text, length = fill(task, chars, len, rng) if chars > 0 else (f"{task.focus}\n\n{task.request}", None)
        messages = [{"role": "user", "content": text}]
        if turns_every > 0 and i % turns_every == turns_every - 1:
            messages += [{"role": "assistant", "content": ""},
                         {"role": "user", "content": FOLLOW_UPS[i % len(FOLLOW_UPS)]}]
        kind = "code" if ":" in task.id and task.id.split(":")[0].endswith(".py") else "docs"
        yield Prompt("long_reuse", "long", messages, language=task.language,
                     meta={"task": task.id, "kind": kind, "context_chars": length or len(text)})


SOURCES["long_reuse"] = Source("long_reuse", "dataset-build", "0.1.11", "dataset_build/data", reuse_prompts, long=True)

__all__ = ["CODE_ASKS", "DOCS_ASKS", "code_reuse_tasks", "docs_reuse_tasks", "reuse_prompts"]
