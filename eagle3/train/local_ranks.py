"""A row split over ranks, started without a launcher: the ranks as processes on this machine.

``train.context_parallel=N`` splits every micro-batch's rows over N ranks; the steps, losses and
final weights are the one-process run's within round-off (:mod:`eagle3.draft.context`). Under a
launcher (torchrun, the ``deepspeed`` launcher, the pipeline's local or Slurm jobs) the launcher
starts the ranks. Called as one process, :func:`eagle3.train.loop.train` starts them here through
:func:`train_on_local_ranks`: N spawned processes joined over 127.0.0.1, each with
``train.threads`` torch threads on CPU or one GPU each; the caller gets rank 0's summary.

Where the machine has fewer CPU cores (over ``train.threads``) or GPUs than N, as many ranks run as
fit, said in one line: the split changes how the work is shared, not what is computed. A run that
resumes keeps the split its checkpoint was made with, where it fits.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle3.device import usable_cores
from eagle3.distributed import OWN_GROUP, PeerLost, free_port, launched
from eagle3.errors import TrainError, is_user_error
from eagle3.train.checkpoint import latest_tag, read_trainer_state

if TYPE_CHECKING:
    from eagle3.config import TargetConfig
    from eagle3.train.config import TrainConfig


def ranks_that_fit(cfg: TrainConfig) -> tuple[int, str]:
    """How many ranks this machine gives a run of ``cfg``'s device and threads, and why: its GPUs
    (device ``auto`` with CUDA, or ``cuda``), else its CPU cores over ``train.threads``; one on a
    named device (``cuda:1``, ...) or any other."""
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return max(1, torch.cuda.device_count()), "its GPUs"
    if device != "cpu":
        return 1, f"train.device={cfg.device} names one device"
    cores = usable_cores()
    return max(1, cores // max(cfg.threads, 1)), f"{cores} cores over train.threads={cfg.threads}"


def _checkpoint_split(cfg: TrainConfig) -> int | None:
    """The ``context_parallel`` of the checkpoint a resuming run of ``cfg`` would continue; None: none."""
    root = Path(cfg.out_dir) / "checkpoints"
    if not cfg.resume or not root.is_dir() or (tag := latest_tag(root)) is None:
        return None
    try:
        saved = read_trainer_state(root, tag).get("pinned", {}).get("train.context_parallel")
    except (OSError, ValueError):
        return None  # the resume itself names what is wrong with it
    return int(saved) if isinstance(saved, int) else None


def local_ranks(cfg: TrainConfig) -> tuple[int, TrainConfig]:
    """The ranks to start here for ``cfg`` and the settings they run: 1 (this process trains) under
    a launcher or without a row split; else ``train.context_parallel`` capped by the machine, or the
    split of the checkpoint it resumes where that fits."""
    if cfg.context_parallel == 1 or launched():
        return 1, cfg
    fit, why = ranks_that_fit(cfg)
    ranks = min(cfg.context_parallel, fit)
    saved = _checkpoint_split(cfg)
    if saved is not None and saved != cfg.context_parallel and saved <= fit:
        print(f"train.context_parallel={cfg.context_parallel}: {cfg.out_dir} resumes a run made with {saved}; "
              f"continuing with {saved}", file=sys.stderr, flush=True)
        ranks = saved
    elif ranks < cfg.context_parallel:
        print(f"train.context_parallel={cfg.context_parallel}: this machine fits {ranks} rank(s) ({why}); training "
              f"with context_parallel={ranks} (the same steps, within round-off)", file=sys.stderr, flush=True)
    return ranks, replace(cfg, context_parallel=ranks) if ranks != cfg.context_parallel else cfg


def train_on_local_ranks(train: Callable[..., dict[str, Any]], cfg: TrainConfig, target_cfg: TargetConfig,
                         ranks: int) -> dict[str, Any]:
    """``train(cfg, target_cfg)`` in ``ranks`` spawned processes here (each loads the target
    itself); rank 0's summary.

    A rank that fails stops the others (a peer waiting in a collective would otherwise wait out
    ``train.collective_timeout_s``) and the cause is raised here: a rank's user error as itself, a
    bug as a :class:`TrainError` naming the rank (its traceback printed above by the rank), a rank
    that died without a word by its exit code; a peer's lost-peer error only when nothing says more."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs, pipes = [], {}
    failed = False
    try:
        for rank in range(ranks):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank, args=(train, rank, ranks, port, cfg, target_cfg, send),
                               name=f"train-rank-{rank}")
            proc.start()
            send.close()
            procs.append(proc)
            pipes[rank] = recv
        results: dict[int, tuple[str, Any]] = {}
        while pipes:
            for rank in _ready(pipes, None):
                results[rank] = _receive(pipes.pop(rank), procs[rank])
            if any(kind != "ok" for kind, _ in results.values()):
                failed = True
                for rank in _ready(pipes, 5.0):  # what the others say within moments: the cause may be there
                    results[rank] = _receive(pipes.pop(rank), procs[rank])
                raise _cause(results)
        return results[0][1]
    finally:
        for proc in procs:
            proc.join(timeout=0.0 if failed else 10.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10.0)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _ready(pipes: dict[int, Any], timeout: float | None) -> list[int]:
    ready = wait(list(pipes.values()), timeout)
    return [rank for rank, conn in pipes.items() if conn in ready]


def _receive(conn: Any, proc: Any) -> tuple[str, Any]:
    try:
        return conn.recv()
    except EOFError:  # it died without a word (killed, out of memory)
        proc.join(timeout=5.0)
        return "died", proc.exitcode


def _cause(results: dict[int, tuple[str, Any]]) -> BaseException:
    """The error to raise for the ranks' ``results``: a user error, then a bug, then a rank that died,
    then a lost peer (a rank that lost its peer says less than the peer's own failure)."""
    order = {"error": 0, "bug": 1, "died": 2, "lost": 3}
    _, rank, kind, what = min((order[kind], rank, kind, what) for rank, (kind, what) in results.items()
                              if kind != "ok")
    if kind == "error":
        return what
    if kind == "lost":
        return PeerLost(what)
    if kind == "bug":
        return TrainError(f"train.context_parallel: rank {rank} of the local ranks failed: {what} "
                          "(its traceback is above)")
    return TrainError(f"train.context_parallel: rank {rank} of the local ranks exited with code {what} before it "
                      "finished (killed, or out of memory?)")


def _rank(train: Callable[..., dict[str, Any]], rank: int, world: int, port: int, cfg: TrainConfig,
          target_cfg: TargetConfig, conn: Any) -> None:
    """One spawned rank: train, then send ("ok", summary), ("error", a user error), ("lost", what a
    lost peer's error says) or ("bug", text)."""
    from eagle3.distributed import shutdown
    from eagle3.processes import exit_with_parent

    exit_with_parent()
    for key in [k for k in os.environ if k.startswith("TORCHELASTIC_")] + [OWN_GROUP]:
        os.environ.pop(key, None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = 0
    try:
        message: tuple[str, Any] = ("ok", train(cfg, target_cfg))
    except BaseException as err:
        code = 1
        if isinstance(err, PeerLost):
            message = ("lost", err.what)
        elif is_user_error(err):
            message = ("error", err if _picklable(err) else TrainError(str(err)))
        else:  # a bug: its traceback where the user sees it
            traceback.print_exc()
            message = ("bug", f"{type(err).__name__}: {err}")
    try:
        conn.send(message)
        conn.close()
    finally:
        shutdown()
    sys.exit(code)


def _picklable(err: BaseException) -> bool:
    try:
        again = pickle.loads(pickle.dumps(err))
    except Exception:
        return False
    return type(again) is type(err) and str(again) == str(err)


__all__ = ["local_ranks", "ranks_that_fit", "train_on_local_ranks"]
