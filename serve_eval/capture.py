"""The server's capture of training samples: every finished request becomes one harvest sample,
taken from the forwards the server ran anyway (opt-in, ``--live DIR``).

A capture folder::

    capture.json                  what every sample is: the harvest spec (target, weights, tokenizer,
                                  chat template, aux layers, dtype), written once
    writer.lock                   held by the one server writing here (an flock: released when it dies)
    requests/r-<seq>.safetensors  one request: a shard in the store's format (one sample)
    requests/r-<seq>.json         written after it, atomically (the commit): seq, sha256, tokens, loss
                                  tokens, bytes, the draft version that served it, its rounds

A sample is the request's prompt and every generated token (``loss_mask`` on the generated ones:
the target wrote them), with the aux-layer inputs and the pre-norm last state of each token from
the prefill and the verification forwards (:class:`serve_eval.spec_decode.StateTape`). The last
token was never fed to the target, so its row repeats the one before: no loss reads it (the loss at
row t is gated by token t + 2, and the last row's target would be a token after the end).
``tests/test_capture.py`` checks a sample against a harvest of the same ids and the training loss of
both.

Like the traffic log, nothing else is kept: no messages text, headers, keys, addresses or times. A
request is written whole or not at all (temp name, then rename; the commit last), after the client
has its reply. When the committed requests reach the byte budget, capture pauses (counted) until a
reader releases some (:func:`release_below`); serving is not affected. A server restarted on the
folder goes on after the highest committed seq, so nothing is written twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.atomic import atomic_write_bytes, atomic_write_text
from eagle3.errors import Eagle3Error
from eagle3.store.shards import HarvestSpec, Sample, StoreError, encode_shard, read_shard

FORMAT = "eagle3-capture-1"
SPEC = "capture.json"
REQUESTS = "requests"
_NAME = re.compile(r"r-(\d{8})\.json")


class CaptureError(Eagle3Error, ValueError):
    """A capture folder that does not fit this server (the message names the key), or one another
    live server writes to."""


def serving_spec(target: Any, name_or_path: str, chat: Any, dtype: str, max_seq_len: int) -> HarvestSpec:
    """The harvest spec of the samples a server of ``target`` captures (as the harvest would pin it)."""
    from eagle3.fingerprint import tokenizer_fingerprint, weights_fingerprint
    from eagle3.target.source import target_identity

    return HarvestSpec(target=target_identity(name_or_path), weights_fingerprint=weights_fingerprint(
        target.model.name_or_path), tokenizer_sha256=tokenizer_fingerprint(target.tokenizer),
        chat_template_sha256=chat.template_sha256, num_layers=target.num_layers, hidden_size=target.hidden_size,
        vocab_size=target.vocab_size, aux_layer_ids=tuple(target.aux_layer_ids), dtype=dtype,
        max_seq_len=max_seq_len)


def read_spec(folder: str | Path) -> HarvestSpec:
    """The spec a capture folder's samples were written with."""
    path = Path(folder) / SPEC
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT!r}")
        return HarvestSpec.from_json(data["spec"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CaptureError(f"{path}: not a capture folder's spec ({err})") from None


def check_spec(folder: Path, written: HarvestSpec, mine: HarvestSpec) -> None:
    """Refuse a folder whose samples another target (or settings) wrote, naming the key."""
    for key, made in written.to_json().items():
        now = mine.to_json()[key]
        if made != now:
            raise CaptureError(f"{folder}/{SPEC}: its samples were captured with {key}={made!r}, this server has "
                               f"{now!r} (another target or settings wrote this folder; use a new --live folder)")


@dataclass(frozen=True)
class Captured:
    """One committed request of a capture folder."""

    seq: int
    path: Path  # the shard
    record: dict[str, Any]  # its commit

    @property
    def tokens(self) -> int:
        return int(self.record["tokens"])

    @property
    def sample_id(self) -> str:
        return sample_id(self.seq)


def sample_id(seq: int) -> str:
    return f"live-{seq:08d}"


def shard_path(folder: Path, seq: int) -> Path:
    return folder / REQUESTS / f"r-{seq:08d}.safetensors"


def committed(folder: str | Path) -> list[Captured]:
    """The committed requests, in seq order (a shard without its commit is not one)."""
    root = Path(folder) / REQUESTS
    out = []
    for path in root.glob("r-*.json") if root.is_dir() else ():
        match = _NAME.fullmatch(path.name)
        if match is None:
            continue
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # released meanwhile
            continue
        out.append(Captured(int(match.group(1)), path.with_suffix(".safetensors"), record))
    return sorted(out, key=lambda c: c.seq)


def read_captured(item: Captured, spec: HarvestSpec) -> Sample:
    """A committed request's sample, its sha256 checked."""
    from eagle3.fingerprint import sha256_file

    try:
        digest = sha256_file(item.path)
    except OSError as err:
        raise StoreError(f"{item.path}: {err}") from None
    if digest != item.record["sha256"]:
        raise StoreError(f"{item.path}: sha256 {digest[:12]} differs from its commit's {item.record['sha256'][:12]}")
    return read_shard(item.path, spec)[0]


def release_below(folder: str | Path, seq: int) -> int:
    """Delete the committed requests below ``seq`` (a reader is done with them); how many."""
    gone = 0
    for item in committed(folder):
        if item.seq >= seq:
            break
        for path in (item.path.with_suffix(".json"), item.path):  # the commit first: never a commit without data
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        gone += 1
    return gone


def writer_of(folder: str | Path) -> dict[str, Any] | None:
    """What the last server writing ``folder`` said of itself (pid, host, its byte budget), or None."""
    try:
        return json.loads((Path(folder) / "writer.lock").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class CaptureWriter:
    """The server's side: one sample per finished request, within ``max_bytes`` of committed requests."""

    def __init__(self, folder: str | Path, spec: HarvestSpec, max_bytes: int) -> None:
        if max_bytes < 1:
            raise CaptureError(f"--capture-max-mb: must be > 0, got {max_bytes / 2**20:g}")
        self.folder, self.spec, self.max_bytes = Path(folder), spec, max_bytes
        (self.folder / REQUESTS).mkdir(parents=True, exist_ok=True)
        self._lock = (self.folder / "writer.lock").open("a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            owner = writer_of(self.folder) or {}
            owner = f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}"
            self._lock.close()
            raise CaptureError(f"{self.folder}: another server ({owner}) writes to this capture folder") from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "max_bytes": max_bytes}) + "\n")
        self._lock.flush()
        if (self.folder / SPEC).exists():
            check_spec(self.folder, read_spec(self.folder), spec)
        else:
            atomic_write_text(self.folder / SPEC, json.dumps({"format": FORMAT, "spec": spec.to_json()}, indent=2))
        for tmp in (self.folder / REQUESTS).glob(".*.tmp"):  # a write cut by a kill: never committed
            tmp.unlink(missing_ok=True)
        done = committed(self.folder)
        self.next_seq = done[-1].seq + 1 if done else 0
        self.written = self.paused = 0
        self._used = sum(int(c.record["bytes"]) for c in done)  # an upper bound: readers only release
        self.lock = threading.Lock()

    def used_bytes(self) -> int:
        return sum(int(c.record["bytes"]) for c in committed(self.folder))

    def has_room(self) -> bool:
        """Below the budget (a request is then captured if it fits); counted as paused where not."""
        if self._used >= self.max_bytes:  # read the folder again only when the bound says full
            self._used = self.used_bytes()
        if self._used < self.max_bytes:
            return True
        self.paused += 1
        return False

    def write(self, prompt: list[int], tokens: list[int], states: tuple[torch.Tensor, torch.Tensor],
              meta: dict[str, Any]) -> bool:
        """One finished request; False where the budget is full (nothing written, counted)."""
        aux, last = states
        fed = len(prompt) + len(tokens) - 1
        if aux.shape[0] != fed or last.shape[0] != fed or not tokens:
            raise ValueError(f"states for {aux.shape[0]} tokens, {fed} fed")
        ids = torch.tensor([*prompt, *tokens], dtype=torch.int64)[: self.spec.max_seq_len]
        n = int(ids.shape[0])
        aux, last = torch.cat([aux, aux[-1:]])[:n], torch.cat([last, last[-1:]])[:n]  # the unfed last row
        mask = torch.zeros(n, dtype=torch.bool)
        mask[len(prompt):] = True
        with self.lock:
            seq = self.next_seq
            data, _ = encode_shard([Sample(sample_id(seq), ids, mask, aux, last)], self.spec)
            if self._used + len(data) > self.max_bytes:
                self._used = self.used_bytes()
            if self._used + len(data) > self.max_bytes:
                self.paused += 1
                return False
            path = shard_path(self.folder, seq)
            atomic_write_bytes(path, data)
            entry = {"file": path.name, "samples": 1, "tokens": n, "loss_tokens": int(mask.sum()),
                     "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}  # as shard_entry, not read back
            atomic_write_text(path.with_suffix(".json"), json.dumps({**entry, "seq": seq, **meta}))
            self.next_seq += 1
            self.written += 1
            self._used += len(data)
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()


__all__ = ["CaptureError", "CaptureWriter", "Captured", "check_spec", "committed", "read_captured", "read_spec",
           "release_below", "sample_id", "serving_spec", "shard_path", "writer_of"]
