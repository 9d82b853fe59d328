"""Conversation records: the one schema every stage passes prompts in, and reading users' files.

A record is a dict::

    {"id": "3f2a...", "domain": "coding", "source": "sharegpt", "language": "en",
     "messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...],
     "tools": [...]}                                   # optional: the function schemas it may call

``messages`` holds an optional leading system message, then user and assistant turns
alternating, starting with a user turn; an assistant turn may be followed by tool results
(``tool``) and another assistant turn (:func:`check_messages`). Assistant contents are what the
original data said (or empty): the target regenerates them; tool results are the data's.
``id`` is a content hash of the normalised system and user turns, so the same prompt gets the
same id wherever it comes from.

Users bring prompts as jsonl (ShareGPT ``conversations`` with ``from``/``value``, or OpenAI
``messages`` with ``role``/``content``, the content a string or a list of text parts) or as an HF
``datasets`` folder with either column.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from eagle3.errors import Eagle3Error

ROLE_ALIASES = {
    "system": "system",
    "user": "user", "human": "user", "prompter": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant", "bot": "assistant",
    "tool": "tool", "function": "tool", "ipython": "tool", "observation": "tool",
}
DOMAINS = ("coding", "science", "multilingual", "general", "long", "tool_use", "agent")
TEXT_PART_SEPARATOR = "\n"  # between a message's text parts, as vLLM's chat endpoint joins them


class ConversationError(Eagle3Error, ValueError):
    """A conversation is malformed; the message says where (file:line or record) and why."""


def normalize_text(text: str) -> str:
    """The form used for dedup and overlap checks: NFKC, case-folded, whitespace collapsed."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def prompt_key(messages: list[dict[str, str]]) -> str:
    """Normalised system + user turns: equal keys mean the same prompt."""
    return "\x1f".join(f"{m['role']}:{normalize_text(m['content'])}" for m in messages if m["role"] != "assistant")


def record_id(messages: list[dict[str, str]]) -> str:
    return hashlib.sha256(prompt_key(messages).encode("utf-8")).hexdigest()[:16]


def user_turns(messages: list[dict[str, str]]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate and normalise a message list; raises ConversationError with the reason.

    Order: an optional system message, then a user turn; a user turn is answered by an assistant
    turn; an assistant turn is followed by a user turn or by tool results (``tool``), which are
    followed by more results or the assistant turn that reads them. An assistant turn that carries
    ``tool_calls`` (the data's calls) must be followed by one result per call (by ``tool_call_id``
    where the calls have ids). Tool messages keep ``name`` and ``tool_call_id``; an assistant's
    ``tool_calls`` are kept for reference (regeneration replaces them with the target's own text)."""
    if not isinstance(messages, list) or not messages:
        raise ConversationError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConversationError(f"message {i} is {type(m).__name__}, expected an object")
        role = m.get("role", m.get("from"))
        key = "value" if "from" in m and "role" not in m else "content"  # ShareGPT's turn, or OpenAI's
        content = m.get("content", m.get("value"))
        if not isinstance(role, str) or role.strip().lower() not in ROLE_ALIASES:
            raise ConversationError(f"message {i} has unknown role {role!r}")
        role = ROLE_ALIASES[role.strip().lower()]
        if content is None and role == "assistant" and m.get("tool_calls"):
            content = ""  # OpenAI's form of a reply that is only calls
        if isinstance(content, list):
            content = _text_of_parts(content, f"message {i} ({role})")
        if "content" not in m and "value" not in m:
            raise ConversationError(f"message {i} ({role}) has no '{key}'")
        if not isinstance(content, str):
            raise ConversationError(f"message {i} ({role}) has non-text content of type {type(content).__name__}")
        previous = out[-1]["role"] if out else None
        if role == "system":
            if i != 0:
                raise ConversationError(f"message {i} is a system message after the start")
        elif previous in (None, "system"):
            if role != "user":
                raise ConversationError(f"conversation starts with {role}, not user")
        elif previous == "assistant" and out[-1].get("tool_calls") and role != "tool":
            _check_results_follow_calls(out)  # names the call whose result is missing
        elif role not in _MAY_FOLLOW[previous]:
            raise ConversationError(f"message {i} is {role} after {previous} (expected "
                                    f"{' or '.join(_MAY_FOLLOW[previous])})")
        if role != "assistant" and not content.strip():
            raise ConversationError(f"message {i} ({role}) is empty")
        # a reply stays as written: after regeneration it is the target's own decoded text
        message: dict[str, Any] = {"role": role,
                                   "content": content if role == "assistant" else content.replace("\r\n", "\n")}
        if role == "tool":
            message.update(_tool_result_fields(m, i))
        if role == "assistant" and m.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(m["tool_calls"], i)
        out.append(message)
    if not user_turns(out):
        raise ConversationError("conversation has no user turn")
    _check_results_follow_calls(out)
    return out


_MAY_FOLLOW = {"user": ("assistant",), "assistant": ("user", "tool"), "tool": ("tool", "assistant")}


def _tool_result_fields(m: dict[str, Any], i: int) -> dict[str, str]:
    fields = {}
    for name in ("name", "tool_call_id"):
        if m.get(name) is not None:
            if not isinstance(m[name], str) or not m[name]:
                raise ConversationError(f"message {i} (tool) has '{name}' {m[name]!r}: expected a non-empty string")
            fields[name] = m[name]
    return fields


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant's ``tool_calls`` (OpenAI's form, or bare ``{"name", "arguments"}``) normalised."""
    if not isinstance(calls, list):
        raise ConversationError(f"message {i} (assistant) has 'tool_calls' of type {type(calls).__name__}: "
                                "expected a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ConversationError(f"message {i} (assistant): tool call {j} has no function name")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as err:
                raise ConversationError(f"message {i} (assistant): tool call {j} ({fn['name']}) has arguments "
                                        f"that are not JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(arguments, dict):
            raise ConversationError(f"message {i} (assistant): tool call {j} ({fn['name']}) has arguments of "
                                    f"type {type(arguments).__name__}: expected an object")
        entry: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        if isinstance(call, dict) and isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _check_results_follow_calls(messages: list[dict[str, Any]]) -> None:
    """Every call an assistant message carries has its result right after it (a result missing from
    the data would leave the target answering a call nobody answered)."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") or []
        if not calls:
            continue
        results = []
        for later in messages[i + 1:]:
            if later["role"] != "tool":
                break
            results.append(later)
        ids = [c.get("id") for c in calls]
        answered = {r.get("tool_call_id") for r in results}
        for call, call_id in zip(calls, ids, strict=True):
            if call_id is not None and call_id not in answered:
                raise ConversationError(f"message {i} (assistant) calls {call['function']['name']} "
                                        f"(id {call_id}) but no tool result with that tool_call_id follows it")
        if len(results) < len(calls):
            missing = calls[len(results)]["function"]["name"]
            raise ConversationError(f"message {i} (assistant) makes {len(calls)} tool call(s) but "
                                    f"{len(results)} tool result(s) follow it: the result of {missing} is missing")


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """A record's ``tools`` (the function schemas the conversation may call) in OpenAI's form,
    ``{"type": "function", "function": {"name", "description", "parameters"}}``; a bare
    ``{"name", ...}`` is wrapped, a JSON string is parsed. Raises ConversationError naming the tool."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise ConversationError(f"'tools' is a string that is not JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(tools, list):
        raise ConversationError(f"'tools' is {type(tools).__name__}: expected a list of function schemas")
    out = []
    for j, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict):
            raise ConversationError(f"tools[{j}] is {type(tool).__name__}: expected an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ConversationError(f"tools[{j}] has no function name")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ConversationError(f"tools[{j}] ({name}): 'parameters' is {type(fn['parameters']).__name__}, "
                                    "expected a JSON schema object")
        if "description" in fn and not isinstance(fn["description"], str):
            raise ConversationError(f"tools[{j}] ({name}): 'description' is not a string")
        out.append({"type": "function", "function": dict(fn)})
    return out


def _text_of_parts(parts: list[Any], where: str) -> str:
    """OpenAI content parts (``[{"type": "text", "text": ...}, ...]``) as one text, joined by
    newlines as vLLM's chat endpoint joins them; any other part (an image) is refused."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise ConversationError(f"{where}: content part {j} is {kind!r}, not text (text-only targets)")
        if not isinstance(part.get("text"), str):
            raise ConversationError(f"{where}: content part {j} has no string 'text'")
        texts.append(part["text"])
    return TEXT_PART_SEPARATOR.join(texts)


def make_record(messages: list[dict[str, str]], *, domain: str, source: str, language: str,
                **extra: Any) -> dict[str, Any]:
    if domain not in DOMAINS:
        raise ConversationError(f"domain {domain!r} is not one of {', '.join(DOMAINS)}")
    messages = check_messages(messages)
    if "tools" in extra:
        extra["tools"] = check_tools(extra["tools"])
    return {"id": record_id(messages), "domain": domain, "source": source, "language": language,
            "messages": messages, **extra}


@dataclass
class LoadReport:
    """What loading a user file kept and skipped, with the reasons counted."""

    kept: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    first_errors: list[str] = field(default_factory=list)

    def skip(self, where: str, reason: str) -> None:
        self.skipped[reason.split(" (")[0]] += 1
        if len(self.first_errors) < 10:
            self.first_errors.append(f"{where}: {reason}")


def messages_of(row: Any) -> Any:
    if not isinstance(row, dict):
        raise ConversationError(f"expected a JSON object, got {type(row).__name__}")
    if "messages" in row:
        return row["messages"]
    if "conversations" in row:
        return row["conversations"]
    raise ConversationError("no 'messages' or 'conversations' key")


def iter_user_conversations(path: str | Path, *, strict: bool = False,
                            report: LoadReport | None = None) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """Yield ``(where, messages)`` from a jsonl file or an HF datasets folder.

    Bad rows raise ConversationError naming ``file:line`` when ``strict``; otherwise they
    are skipped and counted in ``report``. UTF-8 with or without BOM and CRLF lines are
    accepted; other encodings are an error naming the line.
    """
    path = Path(path)
    report = report if report is not None else LoadReport()
    if path.is_dir():
        rows: Iterator[tuple[str, Any]] = _dataset_rows(path)
    elif path.is_file():
        rows = iter_jsonl(path)
    else:
        raise ConversationError(f"{path}: no such file or folder")
    for where, row in rows:
        try:
            if isinstance(row, ConversationError):
                raise row
            messages = check_messages(messages_of(row))
        except ConversationError as err:
            if strict:
                raise ConversationError(f"{where}: {err}") from None
            report.skip(where, str(err))
            continue
        report.kept += 1
        yield where, messages


T = TypeVar("T")


def take_in_turn(queues: Iterable[Iterable[T]], n: int) -> list[T]:
    """Up to ``n`` items, one from each queue in turn (queues in the given order, each in its own
    order); a queue that runs out leaves its turns to the others."""
    end = object()
    live = [iter(q) for q in queues]
    out: list[T] = []
    while live and len(out) < n:
        for it in list(live):
            item = next(it, end)
            if item is end:
                live.remove(it)
            elif len(out) < n:
                out.append(item)  # type: ignore[arg-type]
    return out


def iter_jsonl(path: str | Path) -> Iterator[tuple[str, Any]]:
    """``(file:line, parsed row)`` per non-blank line; a bad line yields a ConversationError instead.

    UTF-8 with or without a BOM, LF or CRLF line ends.
    """
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as err:
                yield where, ConversationError(f"not UTF-8 (byte {err.start})")
                continue
            if not line:
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as err:
                yield where, ConversationError(f"malformed JSON ({err.msg} at column {err.colno})")


def _dataset_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as err:
        raise ConversationError(f"{path}: not an HF datasets folder saved with save_to_disk ({err})") from err
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds.items())
    else:
        splits = [("", ds)]
    for split, part in splits:
        for i, row in enumerate(part):
            yield f"{path}[{split + ':' if split else ''}{i}]", row


def read_pool(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Records of a pool jsonl file, the first ``limit`` if given; messages validated.

    Pool records from ``data_gen.pools`` pass as they are; a user's own jsonl (ShareGPT
    ``conversations`` or OpenAI ``messages``) works too, ids derived from the content. A bad
    row (malformed JSON, not UTF-8, unknown role, empty turn, ...) raises ConversationError naming
    ``file:line``: nothing is generated from a pool that cannot be read whole.
    """
    records = []
    first_at: dict[str, str] = {}  # record id -> where it was first read
    for where, row in iter_jsonl(path):
        if limit is not None and len(records) >= limit:
            break
        try:
            if isinstance(row, ConversationError):
                raise row
            messages = check_messages(messages_of(row))
            tools = check_tools(row["tools"]) if row.get("tools") is not None else None
        except ConversationError as err:
            raise ConversationError(f"{where}: {err}") from None
        record = {k: v for k, v in row.items() if k != "conversations"}
        record["messages"] = messages
        if tools is not None:
            record["tools"] = tools
        record.setdefault("id", record_id(messages))
        if not isinstance(record["id"], (str, int)) or record["id"] == "":
            raise ConversationError(f"{where}: 'id' {record['id']!r} is not a non-empty string or an integer")
        key = str(record["id"])  # as the harvest names samples: 1 and "1" are one id
        if key in first_at:  # two records, one id: the harvest would refuse it after all the generation
            derived = "" if "id" in row else " (ids derived from the content: the same conversation twice)"
            raise ConversationError(f"{where}: record id {record['id']!r} is also the id of {first_at[key]}{derived}")
        first_at[key] = where
        records.append(record)
    return records
