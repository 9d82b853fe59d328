"""A bounded spool: shards in the store's own format, passed from producers to trainers through a
folder (local, or a shared filesystem across nodes) that never holds more than its byte budget.

A spool is a folder::

    spool.json                     what every shard must be: the harvest spec, the plan's digest
    plan.json, index.safetensors   the harvest plan and every sample's tokens (written by producers)
    cursor-<reader>.json           the seq each reader waits for
    released.json                  the seq below which every shard was consumed and deleted
    producer-<i>-of-<n>.json       each producer's pid, host and heartbeat (a dead one is named)
    done                           the readers finished: producers stop
    shards/<name>.safetensors      one shard, exactly as a store's (``eagle3.store.shards.encode_shard``)
    shards/<name>.json             written after it, atomically: its seq, sha256, tokens, samples (the commit)

Shards carry their position in the readers' order (``seq``). A producer ``put``s a shard when the
committed shards plus this one fit the budget or the spool is empty, and otherwise waits
(backpressure); a shard a reader waits for goes in at once, evicting the shards made furthest
ahead until it fits (producers make them again), so producers that finish out of order never fill
the spool with shards nobody reads yet, and the spool passes its budget only by what the readers
read and have not released (the trainer saves early to release it): one shard per reader at most.
The check and the write happen under one lock file, so concurrent producers cannot overshoot
together (``fcntl`` locks; on NFS, use a filesystem whose locks work across nodes, e.g. Lustre).
A reader ``get``s a committed shard (its sha256 and shapes checked), and ``release``s it once
nothing can need it again. A producer killed mid-write leaves only a temporary file, never a
committed shard; a shard without its commit is rewritten by the next ``put`` of that name.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from eagle3.atomic import atomic_write_bytes, atomic_write_text
from eagle3.errors import ConfigError
from eagle3.fingerprint import sha256_file
from eagle3.store.batches import shard_sequence
from eagle3.store.planned import INDEX, PlannedSamples
from eagle3.store.shards import (
    MANIFEST,
    HarvestSpec,
    HarvestStore,
    Sample,
    StoreError,
    bytes_per_token,
    check_shard,
    encode_shard,
    read_shard,
    shard_entry,
    shard_name,
    write_manifest,
)

HEADER = "spool.json"
RELEASED = "released.json"
DONE = "done"
LOCK = ".lock"
PRODUCER_GRACE_S = 30.0  # a reader names a dead producer after this long (a restart may be on its way)


def shard_key(epoch: int, shard: int) -> str:
    """The spool name of a store shard's states in an epoch."""
    return f"e{epoch:04d}-{shard_name(shard).removesuffix('.safetensors')}"


def _read_header(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreError(f"{path}: missing; no producer has created this spool") from None
    except json.JSONDecodeError as err:
        raise StoreError(f"{path}: not valid JSON ({err})") from None


def _check_header(path: Path, mine: dict[str, Any]) -> None:
    """Raise naming the first key of ``mine`` that the spool's header has otherwise."""
    found = _read_header(path)
    for key in ("format", "spec", "plan_sha256", "seed"):
        ours, theirs = mine[key], found.get(key)
        if key == "spec" and isinstance(theirs, dict) and isinstance(ours, dict):
            differ = sorted(k for k in ours if ours[k] != theirs.get(k))
            if differ:
                raise StoreError(f"{path}: a spool of another harvest ({', '.join(f'spec.{k}' for k in differ)} "
                                 f"differ: {theirs.get(differ[0])!r} there, {ours[differ[0]]!r} here)")
        elif ours != theirs:
            raise StoreError(f"{path}: {key} is {theirs!r} there, {ours!r} here; a spool of another run")


class Spool:
    """One spool folder. Producers and readers must agree on the harvest spec, the plan's digest
    and the seed of the shard order: opening an existing spool with others fails, naming the key.
    The budget may change on a rerun."""

    def __init__(self, root: str | os.PathLike[str], spec: HarvestSpec, *, budget_bytes: int,
                 plan_sha256: str, seed: int = 0, poll_s: float = 0.05) -> None:
        if budget_bytes < 1:
            raise ConfigError(f"spool budget_bytes={budget_bytes}: must be >= 1")
        self.root, self.spec, self.budget_bytes, self.poll_s = Path(root), spec, budget_bytes, poll_s
        self.header = {"format": "eagle3-spool-1", "spec": spec.to_json(), "plan_sha256": plan_sha256,
                       "seed": seed, "budget_bytes": budget_bytes}
        self.root.mkdir(parents=True, exist_ok=True)
        with self._locked():
            path = self.root / HEADER
            if not path.is_file():
                atomic_write_text(path, json.dumps(self.header, indent=1) + "\n")
                return
        _check_header(path, self.header)

    @classmethod
    def open(cls, root: str | os.PathLike[str], *, plan_sha256: str, seed: int, poll_s: float = 0.05) -> Spool:
        """A spool a producer created (its spec and budget), checked against this run's plan and seed."""
        path = Path(root) / HEADER
        found = _read_header(path)
        _check_header(path, {"format": "eagle3-spool-1", "spec": found.get("spec"), "plan_sha256": plan_sha256,
                             "seed": seed})
        return cls(root, HarvestSpec.from_json(found["spec"]), budget_bytes=int(found["budget_bytes"]),
                   plan_sha256=plan_sha256, seed=seed, poll_s=poll_s)

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
        for path in (self.root / "shards").glob("*.json"):
            with contextlib.suppress(OSError, json.JSONDecodeError):  # a release racing this listing
                out[path.stem] = json.loads(path.read_text())
        return out

    def used_bytes(self) -> int:
        """Bytes of the committed shards."""
        return sum(int(c["bytes"]) for c in self.committed().values())

    # -- producers

    def _cursors(self) -> set[int]:
        """The seq each reader last asked for (several readers: one per trainer rank)."""
        seqs = set()
        for path in self.root.glob("cursor-*.json"):
            with contextlib.suppress(OSError, json.JSONDecodeError, KeyError):
                seqs.add(int(json.loads(path.read_text())["seq"]))
        return seqs

    def waiting(self) -> list[int]:
        """The seqs some reader waits for and no producer has committed yet, lowest first."""
        done = {int(c.get("seq", -1)) for c in self.committed().values()}
        return sorted(self._cursors() - done)

    def readers_past(self, seq: int) -> bool:
        """Whether every reader has asked for a shard at ``seq`` or later (none needs an earlier one
        again, unless a trainer resumes from an earlier checkpoint)."""
        cursors = self._cursors()
        return bool(cursors) and min(cursors) >= seq

    def waited_for(self) -> int | None:
        """The lowest seq a reader waits for that is not committed (None when none is)."""
        return next(iter(self.waiting()), None)

    def is_committed(self, name: str) -> bool:
        return (self.root / "shards" / f"{name}.json").is_file()

    def released_below(self) -> int:
        """Every shard of a seq below this was consumed and deleted: producers need not make it again."""
        with contextlib.suppress(OSError, json.JSONDecodeError, KeyError):
            return int(json.loads((self.root / RELEASED).read_text())["seq"])
        return 0

    started: float | None = None
    """A producer's start (epoch seconds), set by it: a failed trainer's ``done`` written before
    does not count (that producer is the restart the failure asked for)."""

    def done(self) -> bool:
        """The readers are done (module docstring; ``started``)."""
        path = self.root / DONE
        try:
            if self.started is not None and path.stat().st_mtime < self.started \
                    and self.done_why().startswith("the trainer failed"):
                return False
        except OSError:
            pass
        return path.is_file()

    def finish(self) -> None:
        """The readers are done: producers stop."""
        mark_done(self.root)

    def done_why(self) -> str:
        """Why the readers are done: "the trainer is done", or what the trainer wrote when it failed."""
        try:
            return (self.root / DONE).read_text().strip() or "the trainer is done"
        except OSError:
            return "the trainer is done"

    def put(self, name: str, seq: int, samples: Sequence[Sample], *,
            alive: Callable[[], bool] = lambda: True) -> int:
        """Commit ``samples`` as shard ``name`` (position ``seq`` in the readers' order) once it may
        (module docstring); returns its bytes, or 0 when ``alive()`` turned False while it waited
        (the readers are done, or the producer has a more urgent shard to make)."""
        data, tokens = encode_shard(samples, self.spec)
        while True:
            with self._locked():
                if seq < self.released_below() or self.done():  # consumed already, or nobody reads any more
                    return 0
                done = self.committed()
                if name in done:  # a rerun of a producer that had committed it: nothing to do
                    return int(done[name]["bytes"])
                used = sum(int(c["bytes"]) for c in done.values())
                waited = seq in self._cursors()
                if waited and used + len(data) > self.budget_bytes:
                    # the shard a reader waits for: evict work made furthest ahead (made again later);
                    # what is left was read and not yet released, so this passes the budget by one shard at most
                    for _, ahead, size in sorted(((int(c["seq"]), n, int(c["bytes"])) for n, c in done.items()
                                                  if int(c["seq"]) > seq), reverse=True):
                        if used + len(data) <= self.budget_bytes:
                            break
                        self._delete(ahead)
                        used -= size
                if used == 0 or used + len(data) <= self.budget_bytes or waited:
                    path = self.root / "shards" / f"{name}.safetensors"
                    atomic_write_bytes(path, data)
                    record = {"file": path.name, "seq": seq, "sha256": hashlib.sha256(data).hexdigest(),
                              "bytes": len(data), "tokens": tokens,
                              "samples": len(samples), "loss_tokens": int(sum(int(s.loss_mask.sum()) for s in samples))}
                    atomic_write_text(self.root / "shards" / f"{name}.json", json.dumps(record) + "\n")
                    return len(data)
            if not alive():
                return 0
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
        commit = self.root / "shards" / f"{name}.json"
        while not commit.is_file():
            if not alive():
                raise StoreError(f"{commit}: not produced, and no producer is left to produce it")
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise StoreError(f"{commit}: not produced within {timeout_s:.0f} s")
            time.sleep(self.poll_s)
        record = json.loads(commit.read_text())
        path = self.root / "shards" / record["file"]
        if not path.is_file() or sha256_file(path) != record["sha256"]:
            raise StoreError(f"{path}: missing, or its sha256 differs from {commit.name} "
                             "(a truncated or corrupt shard)")
        check_shard(path, self.spec, record)
        return read_shard(path, self.spec)

    def release(self, name: str) -> None:
        """Delete shard ``name`` (its commit first, so a reader never sees a commit without its shard)."""
        with self._locked():
            self._delete(name)

    def _delete(self, name: str) -> None:
        for suffix in (".json", ".safetensors"):
            with contextlib.suppress(FileNotFoundError):
                (self.root / "shards" / f"{name}{suffix}").unlink()

    def release_below(self, seq: int, keep: Callable[[str], Path | None] = lambda name: None) -> list[str]:
        """Delete every committed shard of a seq below ``seq`` and record that none is needed again;
        a shard ``keep(name)`` gives a path for is moved there instead (hybrid training keeps them)."""
        with self._locked():
            if seq > self.released_below():
                atomic_write_text(self.root / RELEASED, json.dumps({"seq": seq}) + "\n")
            gone = [n for n, c in self.committed().items() if int(c.get("seq", -1)) < seq]
            for name in gone:
                self._keep_or_delete(name, keep(name))
        return gone

    def clear(self) -> None:
        """Delete every committed shard, recording nothing as consumed (a rerun may need them again)."""
        with self._locked():
            for name in self.committed():
                self._delete(name)

    def keep(self, name: str, dest: Path) -> None:
        """Move committed shard ``name`` to ``dest`` (out of the spool and its budget)."""
        with self._locked():
            self._keep_or_delete(name, dest)

    def _keep_or_delete(self, name: str, dest: Path | None) -> None:
        """The shard file first, its commit after: killed between, the commit stays and a rerun
        moves (or deletes) again; the shard is never lost."""
        if dest is not None:
            src = self.root / "shards" / f"{name}.safetensors"
            if src.is_file():
                os.replace(src, dest)
        self._delete(name)


class Heartbeat:
    """What a producer tells the readers about itself (``producer-<i>-of-<n>.json``): pid, host,
    the time of its last sign of life, its state and the shards it made; written at most every
    ``every_s`` seconds unless forced."""

    def __init__(self, root: str | os.PathLike[str], worker: int, workers: int, every_s: float = 2.0) -> None:
        self.path = Path(root) / f"producer-{worker}-of-{workers}.json"
        self.record: dict[str, Any] = {"worker": worker, "workers": workers, "pid": os.getpid(),
                                       "host": socket.gethostname(), "state": "running", "made": 0}
        self.every_s, self._last = every_s, -float("inf")

    def beat(self, force: bool = False, **changes: Any) -> None:
        self.record.update(changes)
        now = time.monotonic()
        if force or changes or now - self._last >= self.every_s:
            self._last = now
            atomic_write_text(self.path, json.dumps({**self.record, "time": time.time()}) + "\n")


def mark_done(root: str | os.PathLike[str], why: str = "") -> None:
    """Tell the producers of the spool ``root`` to stop: the readers are done (``why``: a trainer that
    failed says so, and the producers report it)."""
    atomic_write_text(Path(root) / DONE, why)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def missing_producer(root: str | os.PathLike[str], seq: int, stale_s: float) -> str | None:
    """Why the shard at ``seq`` will not come: every producer whose share it is has stopped, died
    (its pid gone on this host) or fallen silent for ``stale_s``; None while one of them lives, or
    before any producer has started (the reader's wait limit covers that)."""
    records = []
    for path in Path(root).glob("producer-*-of-*.json"):
        with contextlib.suppress(OSError, json.JSONDecodeError):
            records.append(json.loads(path.read_text()))
    mine = [r for r in records if int(r.get("workers", 0)) > 0 and seq % int(r["workers"]) == int(r["worker"])]
    if not mine:
        return None
    host, now, why = socket.gethostname(), time.time(), []
    for r in mine:
        who = f"producer {r['worker']}/{r['workers']} (pid {r['pid']} on {r['host']})"
        age = now - float(r.get("time", 0))
        if r.get("state") != "running":
            why.append(f"{who} {r.get('state')} ({r.get('made', 0)} shards made)")
        elif r.get("host") == host and not _pid_alive(int(r["pid"])):
            why.append(f"{who} died (last heard of {age:.0f} s ago, {r.get('made', 0)} shards made)")
        elif age > stale_s:
            why.append(f"{who} silent for {age:.0f} s")
        else:
            return None
    return "; ".join(why) + f": restart it (python -m data_gen.produce --shard {mine[0]['worker']}/" \
        f"{mine[0]['workers']} ...)"


class SpoolStore(PlannedSamples):
    """The trainer's store in online training: the plan and every sample's tokens from the index
    the producers wrote (planning, the draft vocab and the split need no state), and each shard's
    states from the spool when a micro-batch needs them. Epoch ``e`` reads shard ``k`` as
    :func:`shard_key` (e, k), at position ``seq = e * shards + `` its place in
    :func:`eagle3.store.batches.shard_sequence` (e): the order producers make them in."""

    def __init__(self, root: str | os.PathLike[str], *, seed: int, reader: int = 0, wait_s: float = 600.0,
                 poll_s: float = 0.2, keep_first_epoch: bool = False, stale_s: float | None = None,
                 grace_s: float = PRODUCER_GRACE_S) -> None:
        self.root, self.reader, self.wait_s, self.seed = Path(root), reader, wait_s, seed
        self.stale_s = wait_s if stale_s is None else stale_s  # a producer on another host: silent this long, lost
        self.grace_s = grace_s
        self.keep_first_epoch, self.poll_s = keep_first_epoch, poll_s
        self.kept: HarvestStore | None = None  # hybrid, from the second epoch: the first one's shards, a store
        start = time.monotonic()
        while not (self.root / HEADER).is_file():  # the first producer writes the plan, the index, then this
            if time.monotonic() - start > wait_s:
                raise StoreError(f"{self.root / HEADER}: no producer has started on this spool within {wait_s:.0f} s "
                                 "(python -m data_gen.produce)")
            time.sleep(poll_s)
        super().__init__(self.root)
        self.spool = Spool.open(self.root, plan_sha256=self.digest, seed=seed)
        if reader == 0:
            (self.root / DONE).unlink(missing_ok=True)  # a run (or a resumed one) reads again
        if keep_first_epoch and (self.root / MANIFEST).is_file():
            self.kept = HarvestStore(self.root)  # a hybrid run's store is complete: every epoch reads it
        self.epoch = 0
        self._positions: dict[int, int] = {}
        self._cache: dict[str, list[Sample]] = {}
        self.stall_s = 0.0  # time spent waiting for shards (the producers fell behind)

    reads_ahead = False  # its reads wait for the producers
    saves_early = True  # when the shards read since the last checkpoint fill half the spool

    def needs_save(self) -> bool:
        """The shards this reader read since the last checkpoint fill half the spool (a checkpoint
        releases them)."""
        return self.unreleased_bytes() > self.spool.budget_bytes // 2

    def after_checkpoint(self, remaining: Sequence[Sequence[int]], *, leader: bool) -> None:
        """A resume starts from this checkpoint: the shards before what is left of the epoch go."""
        self.release_unneeded(remaining, delete=leader)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"spool_wait_seconds": round(self.stall_s, 2)}  # how long this reader waited
        if self.keep_first_epoch:  # hybrid: the first epoch's shards as a store, once that epoch was made in full
            out["kept_store"] = str(self.root) if self.kept is not None else None
        return out

    def begin_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self.keep_first_epoch and epoch >= 1 and self.kept is None:
            self.kept = self._kept_store()
        self._positions = {k: p for p, k in enumerate(shard_sequence(len(self.plan), self.seed, epoch))}

    def seq_of(self, shard: int) -> int:
        return self.epoch * len(self.plan) + self._positions[shard]

    def check_budget(self, window: int) -> None:
        """The spool must hold a window of shards and the next one, or the trainer would wait for a
        shard that cannot be committed without passing the budget by more than one shard."""
        per_token = bytes_per_token(self.spec)
        largest = max((sum(self.lengths[a:b]) for a, b in self.plan), default=0) * per_token
        if self.spool.budget_bytes < (window + 1) * largest:
            raise StoreError(f"{self.root / HEADER}: budget_bytes={self.spool.budget_bytes} holds fewer than "
                             f"train.data.shard_window + 1 = {window + 1} shards of up to {largest:.0f} bytes; "
                             "give the "
                             "producers a larger --spool-budget-mb (harvest.spool_budget_mb in a recipe) or train "
                             "with a smaller train.data.shard_window")

    def unreleased_bytes(self) -> int:
        """Bytes of the committed shards this trainer has read and not yet released (a checkpoint
        releases them; the trainer saves one early when they fill half the budget)."""
        done = self.spool.committed()
        return sum(int(done[n]["bytes"]) for n in self._cache if n in done)

    def __getitem__(self, i: int) -> Sample:
        if self.kept is not None:
            return self.kept[i]
        k = self.shard_of[i]
        name = shard_key(self.epoch, k)
        if name not in self._cache:
            t0 = time.perf_counter()
            seq = self.seq_of(k)
            self._cache[name] = self.spool.get(name, seq, reader=self.reader, timeout_s=self.wait_s,
                                               alive=self._producers_alive(name, seq))
            self.stall_s += time.perf_counter() - t0
        return self._cache[name][i - self.plan[k][0]]

    def _producers_alive(self, name: str, seq: int) -> Callable[[], bool]:
        """For ``Spool.get``: names the producer of ``seq`` on stderr once it is lost (its pid gone
        on this host, or silent for ``stale_s``), and raises naming it when no producer has taken
        over within ``grace_s`` (a producer restarted meanwhile, on any host, carries on; looked at
        each second)."""
        last, dead_since = [time.monotonic()], [None]

        def alive() -> bool:
            now = time.monotonic()
            if now - last[0] >= 1.0:
                last[0] = now
                why = missing_producer(self.root, seq, self.stale_s)
                if why is None:
                    if dead_since[0] is not None:
                        print(f"spool {self.root}: a producer took over shard {name}", file=sys.stderr, flush=True)
                    dead_since[0] = None
                elif dead_since[0] is None:
                    dead_since[0] = now
                    print(f"spool {self.root}: shard {name} waits on a lost producer: {why}; this trainer "
                          f"waits {min(self.grace_s, self.wait_s):.0f} s for it", file=sys.stderr, flush=True)
                elif now - dead_since[0] >= min(self.grace_s, self.wait_s):
                    raise StoreError(f"{self.root / 'shards' / name}: not produced: {why}, and rerun the trainer, "
                                     "which resumes")
            return True

        return alive

    def release_unneeded(self, remaining: Iterable[Sequence[int]], *, delete: bool = True) -> None:
        """After a checkpoint: forget and delete every shard of this epoch before the first one the
        ``remaining`` micro-batches of the epoch read (and everything of earlier epochs)."""
        seqs = [self.seq_of(self.shard_of[i]) for batch in remaining for i in batch]
        floor = min(seqs, default=(self.epoch + 1) * len(self.plan))
        self._cache = {n: v for n, v in self._cache.items() if n.startswith(f"e{self.epoch:04d}-")
                       and self.seq_of(int(n.rsplit("-", 1)[1])) >= floor}
        if delete:  # one reader deletes (hybrid: keeps the first epoch's shards); every reader forgets
            self.spool.release_below(floor, keep=self._keep_path)

    def _keep_path(self, name: str) -> Path | None:
        """Hybrid: where shard ``name`` of the first epoch goes in the store this run leaves."""
        epoch, _, k = name.partition("-shard-")
        return self.root / shard_name(int(k)) if self.keep_first_epoch and epoch == "e0000" else None

    def _kept_store(self, wait: bool = True) -> HarvestStore | None:
        """Hybrid: the first epoch's shards as a finished store in the spool's folder (reader 0 moves
        what is left in the spool and writes the manifest, as the offline harvest writes it; other
        readers wait for it). None when ``wait`` is False and a shard was never made."""
        if (self.root / MANIFEST).is_file():
            return HarvestStore(self.root)
        if self.reader != 0:
            start = time.monotonic()
            while not (self.root / MANIFEST).is_file():
                if time.monotonic() - start > self.wait_s:
                    raise StoreError(f"{self.root / MANIFEST}: reader 0 has not kept the first epoch within "
                                     f"{self.wait_s:.0f} s")
                time.sleep(self.poll_s)
            return HarvestStore(self.root)
        committed = self.spool.committed()
        for k in range(len(self.plan)):
            path = self.root / shard_name(k)
            if not path.is_file() and shard_key(0, k) not in committed:
                if not wait:
                    return None
                raise StoreError(f"{path}: missing; the first epoch's shard {k} is neither kept nor in the spool "
                                 "(train.data.mode=hybrid keeps every shard the first epoch reads)")
        entries = []
        for k, (a, b) in enumerate(self.plan):
            path = self.root / shard_name(k)
            if not path.is_file():
                self.spool.keep(shard_key(0, k), path)
            entries.append(shard_entry(path, b - a, sum(self.lengths[a:b]),
                                       int(self._loss_mask[self._offsets[a]:self._offsets[b]].sum())))
        write_manifest(self.root, self.spec, entries, self.plan_record.get("counts", {}),
                       self.plan_record.get("settings", {}))
        self.spool.release_below(len(self.plan), keep=self._keep_path)  # producers: the first epoch is kept
        store = HarvestStore(self.root)
        if store.sample_ids != self.sample_ids:
            raise StoreError(f"{self.root}: the kept shards hold other samples than {INDEX} lists")
        return store

    def finish(self) -> None:
        """The run is done: producers stop; hybrid, the first epoch's shards become a store if all were made."""
        if self.keep_first_epoch and self.kept is None and self.reader == 0:
            self.kept = self._kept_store(wait=False)
        self.spool.finish()
        if self.reader == 0 and (self.kept is not None or not self.keep_first_epoch):
            self.spool.clear()  # what producers made ahead: nothing will read it (a longer rerun makes it again)


__all__ = ["HEADER", "Heartbeat", "Spool", "SpoolStore", "mark_done", "missing_producer", "shard_key"]
