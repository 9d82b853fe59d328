"""A bounded spool: shards in the store's own format, passed from producers to trainers through a
folder (local, or a shared filesystem across nodes) that never holds more than its byte budget.

A spool is a folder::

    spool.json                     what every shard must be: the harvest spec, the plan's digest
    cursor-<reader>.json           the seq each reader waits for
    <name>.safetensors             one shard, exactly as a store's (``eagle3.shards.encode_shard``)
    <name>.json                    written after it, atomically: its sha256, tokens, samples (the commit)

Shards carry their position in the readers' order (``seq``). A producer ``put``s a shard when the
committed shards plus this one fit the budget, when the spool is empty, or when it is the shard a
reader waits for (so the spool exceeds the budget by at most one shard, and producers that finish
out of order cannot fill it with shards nobody reads yet), and otherwise waits: backpressure.
The check and the write happen under one lock file, so concurrent producers cannot overshoot
together (``fcntl`` locks; on NFS, use a filesystem whose locks work across nodes, e.g. Lustre).
A reader ``get``s a committed shard (its sha256 and shapes checked), and ``release``s it once
nothing can need it again. A producer killed mid-write leaves only a temporary file, never a
committed shard; a shard without its commit is rewritten by the next ``put`` of that name.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from eagle3.atomic import atomic_write_bytes, atomic_write_text, sha256_file
from eagle3.shards import HarvestSpec, Sample, StoreError, check_shard, encode_shard, read_shard

HEADER = "spool.json"
LOCK = ".lock"


class Spool:
    """One spool folder. Producers and readers must agree on the harvest spec and the plan's digest:
    opening an existing spool with others fails, naming the key. The budget may change on a rerun."""

    def __init__(self, root: str | os.PathLike[str], spec: HarvestSpec, *, budget_bytes: int,
                 plan_sha256: str, poll_s: float = 0.05) -> None:
        if budget_bytes < 1:
            raise ValueError(f"spool budget_bytes={budget_bytes}: must be >= 1")
        self.root, self.spec, self.budget_bytes, self.poll_s = Path(root), spec, budget_bytes, poll_s
        self.header = {"format": "eagle3-spool-1", "spec": spec.to_json(), "plan_sha256": plan_sha256,
                       "budget_bytes": budget_bytes}
        self.root.mkdir(parents=True, exist_ok=True)
        with self._locked():
            path = self.root / HEADER
            if not path.is_file():
                atomic_write_text(path, json.dumps(self.header, indent=1) + "\n")
                return
            try:
                found = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise StoreError(f"{path}: not valid JSON ({err})") from None
        for key in ("format", "spec", "plan_sha256"):
            mine, theirs = self.header[key], found.get(key)
            if key == "spec" and isinstance(theirs, dict):
                differ = sorted(k for k in mine if mine[k] != theirs.get(k))
                if differ:
                    raise StoreError(f"{path}: a spool of another harvest ({', '.join(f'spec.{k}' for k in differ)} "
                                     f"differ: {theirs.get(differ[0])!r} there, {mine[differ[0]]!r} here)")
            elif mine != theirs:
                raise StoreError(f"{path}: {key} is {theirs!r} there, {mine!r} here; a spool of another run")

    # -- the folder

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / LOCK, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def committed(self) -> dict[str, dict[str, Any]]:
        """``{name: its commit record}`` of every committed shard."""
        out = {}
        for path in self.root.glob("*.json"):
            if path.name != HEADER and not path.name.startswith("cursor-"):
                with contextlib.suppress(OSError, json.JSONDecodeError):  # a release racing this listing
                    out[path.stem] = json.loads(path.read_text())
        return out

    def used_bytes(self) -> int:
        """Bytes of the committed shards."""
        return sum(int(c["bytes"]) for c in self.committed().values())

    # -- producers

    def _waited_for(self) -> int | None:
        """The lowest seq a reader waits for (None before any reader asked)."""
        seqs = []
        for path in self.root.glob("cursor-*.json"):
            with contextlib.suppress(OSError, json.JSONDecodeError, KeyError):
                seqs.append(int(json.loads(path.read_text())["seq"]))
        return min(seqs, default=None)

    def put(self, name: str, seq: int, samples: Sequence[Sample], *,
            alive: Callable[[], bool] = lambda: True) -> int:
        """Commit ``samples`` as shard ``name`` (position ``seq`` in the readers' order) once it may
        (module docstring); returns its bytes. Waits as long as ``alive()`` (False: StoreError)."""
        data, tokens = encode_shard(samples, self.spec)
        while True:
            with self._locked():
                done = self.committed()
                if name in done:  # a rerun of a producer that had committed it: nothing to do
                    return int(done[name]["bytes"])
                used = sum(int(c["bytes"]) for c in done.values())
                if used == 0 or used + len(data) <= self.budget_bytes or seq == self._waited_for():
                    path = self.root / f"{name}.safetensors"
                    atomic_write_bytes(path, data)
                    record = {"file": path.name, "seq": seq, "sha256": sha256_file(path), "bytes": len(data),
                              "tokens": tokens,
                              "samples": len(samples), "loss_tokens": int(sum(int(s.loss_mask.sum()) for s in samples))}
                    atomic_write_text(self.root / f"{name}.json", json.dumps(record) + "\n")
                    return len(data)
            if not alive():
                raise StoreError(f"{self.root}: gave up waiting for room for {name} (the readers stopped)")
            time.sleep(self.poll_s)

    # -- readers

    def get(self, name: str, seq: int, *, reader: int = 0, timeout_s: float | None = None,
            alive: Callable[[], bool] = lambda: True) -> list[Sample]:
        """The samples of committed shard ``name`` (position ``seq``), checked against its commit
        (sha256) and the spec (tensor names and shapes); waits for the commit while ``alive()`` and
        within ``timeout_s``, telling producers that reader ``reader`` waits for ``seq``."""
        with self._locked():
            atomic_write_text(self.root / f"cursor-{reader}.json", json.dumps({"seq": seq}) + "\n")
        start = time.monotonic()
        commit = self.root / f"{name}.json"
        while not commit.is_file():
            if not alive():
                raise StoreError(f"{commit}: not produced, and no producer is left to produce it")
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise StoreError(f"{commit}: not produced within {timeout_s:.0f} s")
            time.sleep(self.poll_s)
        record = json.loads(commit.read_text())
        path = self.root / record["file"]
        if not path.is_file() or sha256_file(path) != record["sha256"]:
            raise StoreError(f"{path}: missing, or its sha256 differs from {commit.name} "
                             "(a truncated or corrupt shard)")
        check_shard(path, self.spec, record)
        return read_shard(path, self.spec)

    def release(self, name: str) -> None:
        """Delete shard ``name`` (its commit first, so a reader never sees a commit without its shard)."""
        with self._locked():
            for suffix in (".json", ".safetensors"):
                with contextlib.suppress(FileNotFoundError):
                    (self.root / f"{name}{suffix}").unlink()


__all__ = ["HEADER", "Spool"]
