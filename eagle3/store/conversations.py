"""Conversation records: the one schema every stage passes prompts in, and reading users' files.

A record is a dict::

    {"id": "3f2a...", "domain": "coding", "source": "sharegpt", "language": "en",
     "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}

``messages`` holds an optional leading system message, then user and assistant turns
alternating, starting with a user turn. Assistant contents are what the original data
said (or empty): the target regenerates them. ``id`` is a content hash of the normalised
system and user turns, so the same prompt gets the same id wherever it comes from.

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
}
DOMAINS = ("coding", "science", "multilingual", "general", "long")
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


def check_messages(messages: Any) -> list[dict[str, str]]:
    """Validate and normalise a message list; raises ConversationError with the reason."""
    if not isinstance(messages, list) or not messages:
        raise ConversationError("messages must be a non-empty list")
    out: list[dict[str, str]] = []
    turn = 0  # index among non-system messages: even = user, odd = assistant
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConversationError(f"message {i} is {type(m).__name__}, expected an object")
        role = m.get("role", m.get("from"))
        key = "value" if "from" in m and "role" not in m else "content"  # ShareGPT's turn, or OpenAI's
        content = m.get("content", m.get("value"))
        if not isinstance(role, str) or role.strip().lower() not in ROLE_ALIASES:
            raise ConversationError(f"message {i} has unknown role {role!r}")
        role = ROLE_ALIASES[role.strip().lower()]
        if isinstance(content, list):
            content = _text_of_parts(content, f"message {i} ({role})")
        if "content" not in m and "value" not in m:
            raise ConversationError(f"message {i} ({role}) has no '{key}'")
        if not isinstance(content, str):
            raise ConversationError(f"message {i} ({role}) has non-text content of type {type(content).__name__}")
        if role == "system":
            if i != 0:
                raise ConversationError(f"message {i} is a system message after the start")
        else:
            expected = "user" if turn % 2 == 0 else "assistant"
            if role != expected:
                if turn == 0:
                    raise ConversationError(f"conversation starts with {role}, not user")
                raise ConversationError(f"message {i} is {role} where {expected} was expected (turns must alternate)")
            turn += 1
        if role != "assistant" and not content.strip():
            raise ConversationError(f"message {i} ({role}) is empty")
        # a reply stays as written: after regeneration it is the target's own decoded text
        out.append({"role": role, "content": content if role == "assistant" else content.replace("\r\n", "\n")})
    if not user_turns(out):
        raise ConversationError("conversation has no user turn")
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
