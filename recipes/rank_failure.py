"""What a training job's rank does when the run fails: tell a lost node from a rank that crashed,
requeue the job for a lost node (``launcher.requeue``), and stop an online run's producers when the
trainer will not come back.

A rank that raises writes ``out_dir/.failed/rank-<r>.json`` (its host and error) before it exits;
a lost node writes nothing. A surviving rank whose collective lost a peer waits a few seconds for
such a record: one found means a crash (the job fails, naming that rank's error; a requeue would
only crash again), none means the node is gone (requeue, when allowed).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.atomic import atomic_write_text

if TYPE_CHECKING:
    from eagle3.distributed import PeerLost
    from recipes.config import LauncherConfig, PipelineConfig

FAILED = ".failed"
CRASH_WAIT_S = 10.0
"""How long a surviving rank looks for a crashed rank's record before it calls the peer's node lost
(a crashing rank writes it before its process ends, i.e. before any peer sees the connection close)."""


def _records(cfg: PipelineConfig) -> Path:
    return Path(cfg.train.out_dir) / FAILED


def clear_record(cfg: PipelineConfig, rank: str) -> None:
    """At a rank's start: its record from an earlier run is not this run's."""
    (_records(cfg) / f"rank-{rank}.json").unlink(missing_ok=True)


def record_crash(cfg: PipelineConfig, rank: str, err: BaseException) -> None:
    """This rank failed with ``err`` (not a lost peer): say so where the other ranks look."""
    line = f"{type(err).__name__}: {err}".strip().splitlines()[0][:400] if str(err).strip() else type(err).__name__
    _records(cfg).mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "host": socket.gethostname(), "error": line, "time": time.time()}
    atomic_write_text(_records(cfg) / f"rank-{rank}.json", json.dumps(record) + "\n")


def crashed_rank(cfg: PipelineConfig, wait_s: float = CRASH_WAIT_S) -> str | None:
    """Within ``wait_s``: 'rank r on host: error' of a rank that recorded a crash, else None."""
    deadline = time.monotonic() + wait_s
    while True:
        for path in sorted(_records(cfg).glob("rank-*.json")) if _records(cfg).is_dir() else []:
            try:
                r = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            return f"rank {r['rank']} on {r['host']} failed: {r['error']}"
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


def requeue(launcher: LauncherConfig, err: PeerLost) -> bool:
    """With requeues left on Slurm: ``scontrol requeue`` this job; True when Slurm took it (the caller
    then leaves at once, writing no result: the requeued job writes it)."""
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    job = os.environ.get("SLURM_JOB_ID")
    if launcher.kind != "slurm" or job is None or restarts >= launcher.requeue:
        if launcher.requeue:
            print(f"{err.what} (requeued {restarts} of launcher.requeue={launcher.requeue} times: not again)",
                  file=sys.stderr, flush=True)
        return False
    try:  # every surviving rank asks; one suffices
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as why:
        print(f"{err.what}; scontrol requeue {job} failed ({why}): the job fails", file=sys.stderr, flush=True)
        return False
    if done.returncode != 0 and "already" not in done.stderr.lower():  # another rank's request came first
        print(f"{err.what}; scontrol requeue {job} refused: {done.stderr.strip()}: the job fails",
              file=sys.stderr, flush=True)
        return False
    print(f"{err.what}; requeueing job {job} ({restarts + 1} of launcher.requeue={launcher.requeue})",
          file=sys.stderr, flush=True)
    return True


def stop_producers(cfg: PipelineConfig, err: BaseException) -> None:
    """Online: a trainer that fails for good tells the producers to stop (the spool's ``done`` with
    why), instead of leaving them to run until their time limit. A producer started later than
    this ignores it; a rerun trainer clears it."""
    from eagle3.store.spool import mark_done

    if cfg.train.data.mode in ("online", "hybrid") and Path(cfg.train.data.store).is_dir():  # any rank: the same file
        mark_done(cfg.train.data.store, f"the trainer failed: {type(err).__name__}: {err}"[:300])


__all__ = ["FAILED", "clear_record", "crashed_rank", "record_crash", "requeue", "stop_producers"]
