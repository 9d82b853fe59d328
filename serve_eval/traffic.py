"""Traffic as a mining source: the server's opt-in request log, read back as candidate prompts.

Off by default. With ``--traffic-log PATH`` the server appends one JSON line per finished chat
request: the messages and tools as the request sent them (after the server's checks), the prompt's
token ids, the reply's token ids and how it ended, and the rounds the draft served (the context
before each round's first draft token, its depth, the tokens accepted, and of those how many the
draft, the lookup, or both proposed). Nothing else: no headers,
keys, client addresses or times. The file stops growing at ``--traffic-log-max-mb`` (one warning on
stderr), and a line is written whole or not at all (one ``write`` of the encoded line).

:func:`read_traffic` turns a log into prompt records (the messages the reply answered, ``domain``
``traffic``, the language of the last user turn, and the served acceptance in ``meta``), one per
distinct prompt, for ``hard_mining``'s ``traffic`` strategy.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

from eagle3.conversations import ConversationError, check_messages, check_tools, prompt_key, record_id
from eagle3.errors import Eagle3Error
from serve_eval.spec_decode import DecodeStats

TRAFFIC_DOMAIN = "traffic"


class TrafficError(Eagle3Error, ValueError):
    pass


def rounds_of(stats: DecodeStats) -> list[list[int]]:
    """Per round: [context before its first draft token, depth, tokens accepted, of those proposed by
    the draft only, the lookup only, both]."""
    return [[*r[:3], *r[3]] for r in zip(stats.contexts, stats.depths or [stats.proposed] * len(stats.accepted),
                                         stats.accepted, stats.sources or [(a, 0, 0) for a in stats.accepted],
                                         strict=True)]


class TrafficLog:
    """Appends finished chat requests to ``path`` (created with its folder) until ``max_bytes``."""

    def __init__(self, path: str | Path, max_bytes: int) -> None:
        if max_bytes < 1:
            raise TrafficError(f"--traffic-log-max-mb: must be > 0, got {max_bytes / 2**20:g}")
        self.path, self.max_bytes = Path(path), max_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.full = False

    def write(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, prompt_ids: list[int],
              reply_ids: list[int], finish_reason: str, stats: DecodeStats) -> bool:
        """One request's line; False where the cap is reached (nothing written)."""
        line = json.dumps({
            "messages": messages, **({"tools": tools} if tools else {}), "prompt_ids": prompt_ids,
            "reply_ids": reply_ids, "finish_reason": finish_reason, "k": stats.proposed,
            "rounds": rounds_of(stats),
            "tau": round(stats.tau, 4)}, ensure_ascii=False) + "\n"
        data = line.encode()
        with self.lock:
            size = self.path.stat().st_size if self.path.exists() else 0
            if size + len(data) > self.max_bytes:
                if not self.full:
                    print(f"traffic log {self.path}: {self.max_bytes / 2**20:g} MB reached; no more requests are "
                          "logged", file=sys.stderr)
                self.full = True
                return False
            with open(self.path, "ab") as f:
                f.write(data)
        return True


def served_tau(entry: dict[str, Any]) -> float:
    """1 + accepted / rounds over the rounds that proposed a draft token."""
    drafted = [r for r in entry.get("rounds", []) if r[1] > 0]
    return 1.0 + sum(r[2] for r in drafted) / len(drafted) if drafted else 1.0


def read_traffic(path: str | Path, min_rounds: int = 1) -> list[dict[str, Any]]:
    """A traffic log's requests as prompt records, one per distinct prompt (its most recent line), each
    with ``meta.served_tau`` and ``meta.rounds``; requests with fewer than ``min_rounds`` drafting
    rounds are left out (a few rounds say little). A bad line fails naming its file and line."""
    from data_gen.language import detect_language

    path = Path(path)
    if not path.is_file():
        raise TrafficError(f"{path}: no such traffic log (the server's --traffic-log)")
    out: dict[str, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            where = f"{path}:{number}"
            try:
                entry = json.loads(text)
                messages = check_messages(entry["messages"])
                tools = check_tools(entry["tools"]) if entry.get("tools") else None
                rounds = [r for r in entry["rounds"] if r[1] > 0]
            except (json.JSONDecodeError, ConversationError, KeyError, TypeError, IndexError) as err:
                raise TrafficError(f"{where}: not a traffic log line ({type(err).__name__}: {err})") from None
            if len(rounds) < min_rounds:
                continue
            user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
            record = {"id": record_id(messages), "domain": TRAFFIC_DOMAIN, "language": detect_language(user or ""),
                      "source": "traffic", "messages": messages, **({"tools": tools} if tools else {}),
                      "meta": {"served_tau": round(served_tau(entry), 4), "rounds": len(rounds), "line": number}}
            out[prompt_key(messages)] = record
    return list(out.values())


__all__ = ["TRAFFIC_DOMAIN", "TrafficError", "TrafficLog", "read_traffic", "served_tau"]
