"""Tool-use and agent prompts: the ``bfcl``, ``bfcl_agent`` and ``code_agent`` pool sources and their
held-out eval sets.

- ``bfcl`` (domain ``tool_use``): the single-turn categories of the Berkeley Function Calling
  Leaderboard v4 (``bfcl-eval``'s wheel: simple in Python, Java and JavaScript, multiple, parallel,
  parallel-multiple, and their user-contributed "live" versions), each question with its function
  schemas as the record's ``tools``.
- ``bfcl_agent`` (domain ``agent``): BFCL's multi-turn conversations (``multi_turn_base``: a file
  system, a trading bot, travel booking, vehicle control, messaging, tickets, ...). Each user turn
  is followed by the calls of BFCL's ground truth, one assistant turn per call, each with its tool
  result, then an answer. The results are real: each call is run, in order, against BFCL's own
  simulated backends (the wheel's ``func_source_code`` classes, loaded from the wheel, seeded as
  BFCL seeds them) from the conversation's initial state; a call's arguments are read with
  :func:`ast.literal_eval`, never evaluated. The tools are the schemas of the functions the ground
  truth calls (BFCL's full class documentation runs to 6k tokens a conversation).
- ``code_agent`` (domain ``agent``): a coding agent's exchange: a change asked to a function of a
  file, the file read with a ``read_file`` call whose result is the file around the function, then
  the change written out. Functions of the standard library's pure-Python modules for training,
  Jinja2's for the eval set (as the long-context sets).

Regeneration writes every assistant turn (the target's own calls and answers); the tool results are
spliced in from here, as the data has them (:func:`data_gen.generate.reply_slots`).
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from data_gen.long_context import jinja_sources, short_functions
from data_gen.reuse import stdlib_sources
from data_gen.sources import SOURCES, Prompt, Source
from eagle3.errors import Eagle3Error
from eagle3.target.wheels import read_member

BFCL_WHEEL = ("bfcl-eval", "2026.3.23", "bfcl_eval/data")
SINGLE_TURN = ("simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple",
               "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
MULTI_TURN = "multi_turn_base"
BACKENDS = {  # BFCL's simulated API classes: (module under func_source_code, function documentation file)
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system"),
    "MathAPI": ("math_api", "math_api"),
    "MessageAPI": ("message_api", "message_api"),
    "TwitterAPI": ("posting_api", "posting_api"),
    "TicketAPI": ("ticket_api", "ticket_api"),
    "TradingBot": ("trading_bot", "trading_bot"),
    "TravelAPI": ("travel_booking", "travel_booking"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control"),
}
STATELESS = ("MathAPI",)
_BACKEND_PACKAGE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
_JSON_TYPES = {"dict": "object", "float": "number", "tuple": "array", "list": "array", "int": "integer",
               "bool": "boolean", "str": "string"}

READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a text file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "Path of the file."}},
                   "required": ["path"]}}}
WRITE_FILE = {"type": "function", "function": {
    "name": "write_file", "description": "Replace the contents of a text file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"]}}}
CODE_AGENT_ASKS = (
    "In `{member}`, add a docstring to `{name}`, then show me the whole function.",
    "Please add type hints to the parameters of `{name}` in `{member}` and show the updated function.",
    "The variable names in `{name}` (`{member}`) are hard to follow; rename them and show the function.",
    "Add a short comment above each block of `{name}` in `{member}` and give me the result.",
)


class AgentDataError(Eagle3Error, ValueError):
    """A BFCL entry this module cannot turn into a conversation (named with its id)."""


def json_schema(value: Any) -> Any:
    """BFCL's parameter schemas with Python type names (``dict``, ``float``, ``tuple``) as JSON Schema's."""
    if isinstance(value, dict):
        out = {k: json_schema(v) for k, v in value.items()}
        if isinstance(out.get("type"), str):
            out["type"] = _JSON_TYPES.get(out["type"], out["type"])
        return out
    if isinstance(value, list):
        return [json_schema(v) for v in value]
    return value


def _tool(schema: dict[str, Any]) -> dict[str, Any]:
    fn = {k: json_schema(schema[k]) if k == "parameters" else schema[k]
          for k in ("name", "description", "parameters") if k in schema}
    return {"type": "function", "function": fn}


def _rows(wheel: Path, member: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in read_member(wheel, member).decode("utf-8").splitlines() if line.strip()]


def bfcl_single_turn(wheel: Path | None, path: str) -> Iterator[Prompt]:
    """One prompt per single-turn BFCL question, with its functions as ``tools``."""
    if wheel is None:
        raise ValueError("bfcl reads bfcl-eval's wheel")
    for category in SINGLE_TURN:
        for row in _rows(wheel, f"{path}/BFCL_v4_{category}.json"):
            messages = [dict(m) for m in row["question"][0]]
            yield Prompt("bfcl", "tool_use", messages, group=f"bfcl:{row['id']}",  # language: detected (live: many)
                         tools=[_tool(f) for f in row["function"]], meta={"bfcl_id": row["id"], "category": category})


def parse_call(text: str, method: Any) -> tuple[str, dict[str, Any]]:
    """A ground-truth call ``name('a.pdf', lines=20)`` as (name, arguments), positional arguments named
    after ``method``'s parameters; the arguments must be literals (read, never evaluated)."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as err:
        raise AgentDataError(f"call {text!r} does not parse ({err.msg})") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise AgentDataError(f"call {text!r}: expected name(...)")
    names = [p for p in inspect.signature(method).parameters if p != "self"]
    try:
        args = {names[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
        args.update({k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None})
    except (ValueError, IndexError):
        raise AgentDataError(f"call {text!r}: arguments are not literals matching {node.func.id}'s") from None
    return node.func.id, args


def _backend_classes(wheel: Path) -> dict[str, type]:
    """BFCL's simulated API classes, imported from its wheel (pure Python, standard library and mpmath)."""
    where = str(wheel)
    sys.path.insert(0, where)
    try:
        return {name: getattr(importlib.import_module(f"{_BACKEND_PACKAGE}.{module}"), name)
                for name, (module, _) in BACKENDS.items()}
    finally:
        sys.path.remove(where)


def _result_text(value: Any) -> str:
    """A call's result as BFCL hands it to the model: a string as it is, a dict as JSON, else ``str``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


def run_calls(classes: dict[str, type], entry: dict[str, Any], turns: list[list[str]],
              ) -> list[list[tuple[str, dict[str, Any], str]]]:
    """Each turn's calls run in order against fresh backends in the entry's initial state:
    (name, arguments, result text) per call."""
    instances = {}
    for name in entry["involved_classes"]:
        if name not in classes:
            raise AgentDataError(f"{entry['id']}: backend {name} is not one this module runs")
        instance = classes[name]()
        if name not in STATELESS:
            instance._load_scenario(copy.deepcopy(entry.get("initial_config", {}).get(name, {})), long_context=False)
        instances[name] = instance
    methods = {m: getattr(inst, m) for inst in instances.values()
               for m, _ in inspect.getmembers(inst, inspect.ismethod) if not m.startswith("_")}
    out = []
    for calls in turns:
        done = []
        for text in calls:
            name = text.split("(", 1)[0].strip()
            if name not in methods:
                raise AgentDataError(f"{entry['id']}: {name} is not a function of "
                                     f"{', '.join(entry['involved_classes'])}")
            name, arguments = parse_call(text, methods[name])
            try:
                result = _result_text(methods[name](**arguments))
            except Exception as err:  # noqa: BLE001 - BFCL reports a failing call to the model the same way
                result = f"Error during execution: {err}"
            done.append((name, arguments, result))
        out.append(done)
    return out


def _docs(wheel: Path, path: str) -> dict[str, dict[str, Any]]:
    docs = {}
    for _, doc_file in BACKENDS.values():
        for schema in _rows(wheel, f"{path}/multi_turn_func_doc/{doc_file}.json"):
            docs.setdefault(schema["name"], schema)
    return docs


def agent_messages(entry: dict[str, Any], executed: list[list[tuple[str, dict[str, Any], str]]],
                   ) -> list[dict[str, Any]]:
    """The conversation: each user turn, one assistant turn per call (the data's call) with its result,
    then the answer (empty: the target writes it)."""
    messages: list[dict[str, Any]] = []
    n = 0
    for question, calls in zip(entry["question"], executed, strict=False):
        messages += [dict(m) for m in question]
        for name, arguments, result in calls:
            call_id = f"call_{n}"
            n += 1
            messages += [{"role": "assistant", "content": "", "tool_calls": [
                             {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
                         {"role": "tool", "tool_call_id": call_id, "name": name, "content": result}]
        messages.append({"role": "assistant", "content": ""})
    return messages


def bfcl_agent_entries(wheel: Path, path: str, max_user_turns: int) -> Iterator[tuple[dict[str, Any], list[dict]]]:
    """(entry, messages) per multi-turn BFCL conversation, its first ``max_user_turns`` turns run."""
    classes = _backend_classes(wheel)
    docs = _docs(wheel, path)
    answer_file = f"{path}/possible_answer/BFCL_v4_{MULTI_TURN}.json"
    answers = {row["id"]: row["ground_truth"] for row in _rows(wheel, answer_file)}
    for entry in _rows(wheel, f"{path}/BFCL_v4_{MULTI_TURN}.json"):
        turns = [t for t in entry["question"][:max_user_turns] if t]
        entry = {**entry, "question": turns}
        executed = run_calls(classes, entry, answers[entry["id"]][:len(turns)])
        messages = agent_messages(entry, executed)
        called = dict.fromkeys(name for calls in executed for name, _, _ in calls)
        tools = [_tool(docs[name]) for name in called if name in docs]
        yield {**entry, "tools": tools}, messages


def bfcl_agent(wheel: Path | None, path: str, max_user_turns: int = 2) -> Iterator[Prompt]:
    if wheel is None:
        raise ValueError("bfcl_agent reads bfcl-eval's wheel")
    for entry, messages in bfcl_agent_entries(wheel, path, max_user_turns):
        yield Prompt("bfcl_agent", "agent", messages, language="en", group=f"bfcl:{entry['id']}",
                     tools=entry["tools"], meta={"bfcl_id": entry["id"], "classes": entry["involved_classes"]})


def code_agent_messages(member: str, name: str, file_text: str, body: str, context_chars: int,
                        ask: str, rng: random.Random) -> list[dict[str, Any]]:
    """A change asked to ``name`` of ``member``; the file read (a window of about ``context_chars``
    around the function); the change left for the target to write."""
    start = file_text.find(body)
    room = max(context_chars - len(body), 0)
    before = rng.randint(0, room) if room else 0
    lo = max(start - before, 0)
    hi = min(start + len(body) + (room - before), len(file_text))
    lo = file_text.rfind("\n", 0, lo) + 1 if lo > 0 else 0  # whole lines
    cut = file_text.find("\n", hi)
    window = file_text[lo: len(file_text) if cut < 0 else cut]
    return [{"role": "user", "content": ask},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_0", "type": "function",
                 "function": {"name": "read_file", "arguments": {"path": member}}}]},
            {"role": "tool", "tool_call_id": "call_0", "name": "read_file", "content": window},
            {"role": "assistant", "content": ""}]


def _code_agent_prompts(files: dict[str, str], source: str, tasks: int, context_chars: int,
                        seed: int) -> Iterator[Prompt]:
    candidates = short_functions(files)
    random.Random(seed).shuffle(candidates)
    for i, (member, name, body) in enumerate(candidates[:tasks]):
        ask = CODE_AGENT_ASKS[i % len(CODE_AGENT_ASKS)].format(name=name, member=member)
        messages = code_agent_messages(member, name, files[member], body, context_chars, ask,
                                       random.Random(f"{seed}:{member}:{name}"))
        yield Prompt(source, "agent", messages, language="en", tools=[READ_FILE, WRITE_FILE],
                     meta={"task": f"{member}:{name}", "kind": "code_agent"})


def code_agent(wheel: Path | None, path: str, tasks: int = 300, context_chars: int = 3000,
               seed: int = 0) -> Iterator[Prompt]:
    """Training tasks on the standard library's pure-Python modules."""
    yield from _code_agent_prompts(stdlib_sources(), "code_agent", tasks, context_chars, seed)


def code_agent_eval(tasks: int, context_chars: int = 3000, seed: int = 0) -> list[Prompt]:
    """Eval tasks on Jinja2's modules (never in training: the long-context eval sets' code)."""
    return list(_code_agent_prompts(jinja_sources(), "code_agent_eval", tasks, context_chars, seed))


def eval_cut(p: Prompt, rng: random.Random) -> Prompt:
    """An agent conversation cut for evaluation: up to a seeded tool result of its first user turn (or
    the turn itself where it makes no call), then the reply left to write."""
    first_turn = next((i for i, m in enumerate(p.messages[1:], 1) if m["role"] == "user"), len(p.messages))
    results = [i for i, m in enumerate(p.messages[:first_turn]) if m["role"] == "tool"]
    end = results[rng.randrange(len(results))] + 1 if results else 1
    messages = [*p.messages[:end], {"role": "assistant", "content": ""}]
    return Prompt(p.source, p.domain, messages, language=p.language, group=p.group, tools=p.tools, meta=p.meta)


SOURCES["bfcl"] = Source("bfcl", *BFCL_WHEEL, bfcl_single_turn)
SOURCES["bfcl_agent"] = Source("bfcl_agent", *BFCL_WHEEL, bfcl_agent, long=True)
SOURCES["code_agent"] = Source("code_agent", None, None, "", code_agent, long=True)

__all__ = ["AgentDataError", "BFCL_WHEEL", "READ_FILE", "WRITE_FILE", "agent_messages", "bfcl_agent",
           "bfcl_single_turn", "code_agent", "code_agent_eval", "eval_cut", "json_schema", "parse_call", "run_calls"]
