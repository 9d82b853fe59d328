"""``long_edit``: the agent pattern at length, a file read through a tool and then written back with an edit.

A coding agent asked to change a function reads files with a ``read_file`` tool (other modules
first, looking around, then the one that holds the function), and its reply shows the function
again with the change: most of the reply repeats a tool result already in its context. Each task
is one function of 10-60 lines from a module of Jinja2's wheel (past the ones ``long_code`` and
``long_chat`` ask), one edit of :data:`EDITS` (a rename, a docstring, a guard clause, a comment),
asked short (only the function's file read) and after other modules read whole, at each length
(tokens of the target's chat template, the tool schemas included). Records follow the agent eval
set's shape: ``messages`` up to the last tool result, then the assistant turn left to write, and
``tools``; ``meta`` names the task, variant and prompt length, as the other long sets' do.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

EDITS = (
    "rename `{name}` to `{name}_v2` (its own recursive calls included; nothing else changes)",
    "add a one-line docstring to `{name}` saying what it returns (nothing else changes)",
    "add a guard clause at the top of `{name}` that raises ValueError on a None first argument",
    "add a `# reviewed` comment line right above `def {name}`",
)
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "Path of the file."}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace the contents of a text file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
]


def _path(text: str) -> str:
    """A context text's file path: its ``# file: PATH`` first line."""
    return text.splitlines()[0].removeprefix("# file: ").strip()


def _body(text: str) -> str:
    """A context text without its ``# file:`` line (what read_file returns)."""
    return text.split("\n", 1)[1] if "\n" in text else ""


def edit_messages(task: Any, files: Sequence[str], ask: str) -> list[dict[str, Any]]:
    """The conversation: the ask, one read_file call and its result per file of ``files`` (the focus
    among them, as ``# file:`` texts), then the reply left to write."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": ask}]
    for n, text in enumerate(files):
        call = f"call_{n}"
        read = {"name": "read_file", "arguments": {"path": _path(text)}}
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [{"id": call, "type": "function", "function": read}]},
            {"role": "tool", "content": _body(text), "name": "read_file", "tool_call_id": call}]
    return [*messages, {"role": "assistant", "content": ""}]


def fit_reads(task: Any, ask: str, length: int, count: Callable[[list[dict[str, Any]]], int],
              rng: random.Random) -> tuple[list[dict[str, Any]], int]:
    """Other modules read before the focus, in a seeded order, as many as keep the prompt within
    ``length`` tokens; -> (messages, tokens)."""
    chosen: list[str] = []
    for text in rng.sample(task.others, len(task.others)):
        if count(edit_messages(task, [*chosen, text, task.focus], ask)[:-1]) <= length:
            chosen.append(text)
    messages = edit_messages(task, [*chosen, task.focus], ask)
    return messages, count(messages[:-1])


def edit_records(tasks: Sequence[Any], count: Callable[[list[dict[str, Any]]], int], lengths: Sequence[int],
                 seed: int) -> list[dict[str, Any]]:
    """``long_edit``'s records: each code task (:class:`data_gen.long_context.Task`: an id
    ``module:function``, the ``# file:`` focus text, the other modules) short, then at each length.
    ``count``: a prompt's tokens (the turns up to the last tool result, :data:`TOOLS` rendered in)."""
    records = []
    for i, task in enumerate(tasks):
        member, name = _path(task.focus), task.id.rsplit(":", 1)[-1]  # code tasks: "module.py:function"
        ask = f"In `{member}`, {EDITS[i % len(EDITS)].format(name=name)}. Then show me the whole updated function."
        rng = random.Random(f"{seed}:edit:{task.id}")
        short = edit_messages(task, [task.focus], ask)
        variants = [("short", short, count(short[:-1]))]
        variants += [(str(n), *fit_reads(task, ask, n, count, rng)) for n in sorted(lengths)]
        for variant, messages, tokens in variants:
            records.append({"id": f"long_edit:{task.id}:{variant}", "domain": "agent", "messages": messages,
                            "tools": TOOLS, "meta": {"task": task.id, "variant": variant, "prompt_tokens": tokens,
                                                     "reads": sum(1 for m in messages if m["role"] == "tool"),
                                                     "text_language": "en"}})
    return records


__all__ = ["EDITS", "TOOLS", "edit_messages", "edit_records", "fit_reads"]
