"""A row split over ranks, started without a launcher: the ranks as processes on this machine.

``train.context_parallel=N`` splits every micro-batch's rows over N ranks; the steps, losses and
final weights are the one-process run's within round-off (:mod:`eagle3.draft.context`). Under a
launcher (torchrun, the ``deepspeed`` launcher, the pipeline's local or Slurm jobs) the launcher
starts the ranks. Called as one process, :func:`eagle3.train.loop.train` starts them here through
:func:`train_on_local_ranks`: N spawned processes joined over 127.0.0.1, each with
``train.threads`` torch threads on CPU or one GPU each; the caller gets rank 0's summary. On a
2-core CPU two ranks train the quickstart's draft about 1.6x faster than one process.

Where the machine has fewer CPU cores (over ``train.threads``) or GPUs than N, as many ranks run as
fit, said in one line: the split changes how the work is shared, not what is computed.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

import torch

from eagle3.errors import Eagle3Error, TrainError

if TYPE_CHECKING:
    from eagle3.config import TargetConfig
    from eagle3.train.config import TrainConfig


def launched() -> bool:
    """Whether a launcher started this process as one of several ranks (or a group of several exists)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def ranks_that_fit(cfg: TrainConfig) -> int:
    """How many ranks this machine gives a run of ``cfg``'s device and threads: its GPUs (device
    ``auto`` or ``cuda``), else its CPU cores over ``train.threads``; one on any other device."""
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return max(1, torch.cuda.device_count())
    if device != "cpu":
        return 1  # one named device (cuda:1, ...) holds one rank
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(cfg.threads, 1))


def local_ranks(cfg: TrainConfig) -> tuple[int, TrainConfig]:
    """The ranks to start here for ``cfg`` and the settings they run: 1 (this process trains)
    under a launcher or without a row split; else ``train.context_parallel`` capped by the machine."""
    if cfg.context_parallel == 1 or launched():
        return 1, cfg
    ranks = min(cfg.context_parallel, ranks_that_fit(cfg))
    if ranks < cfg.context_parallel:
        by = "GPUs" if cfg.device != "cpu" and torch.cuda.is_available() else f"cores over train.threads={cfg.threads}"
        print(f"train.context_parallel={cfg.context_parallel}: this machine fits {ranks} rank(s) ({by}); "
              f"training with context_parallel={ranks} (the same steps, within round-off)", file=sys.stderr, flush=True)
        cfg = replace(cfg, context_parallel=ranks)
    return ranks, cfg


def train_on_local_ranks(train: Callable[..., dict[str, Any]], cfg: TrainConfig, target_cfg: TargetConfig,
                         ranks: int) -> dict[str, Any]:
    """``train(cfg, target_cfg)`` in ``ranks`` spawned processes here (each loads the target
    itself); rank 0's summary.

    A rank that fails stops the others at once (a peer waiting in a collective would otherwise wait
    out ``train.collective_timeout_s``) and its error is raised here: a user error as itself, any
    other as a :class:`TrainError` naming the rank (its traceback printed above by the rank)."""
    import multiprocessing

    from eagle3.distributed import free_port

    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs, pipes = [], {}
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
            ready = wait(list(pipes.values()))
            for rank, conn in list(pipes.items()):
                if conn not in ready:
                    continue
                try:
                    results[rank] = conn.recv()
                except EOFError:  # it died without a word (killed, out of memory)
                    procs[rank].join(timeout=5.0)
                    results[rank] = ("died", procs[rank].exitcode)
                del pipes[rank]
                if results[rank][0] != "ok":
                    raise _failure(rank, results[rank], pipes)
        return results[0][1]
    finally:
        for proc in procs:
            proc.join(timeout=10.0 if all(p.exitcode == 0 or p.exitcode is None for p in procs) else 0.0)
            if proc.is_alive():
                proc.terminate()
                proc.join()


def _failure(rank: int, result: tuple[str, Any], others: dict[int, Any]) -> BaseException:
    """The error to raise for ``rank``'s ``result``; a peer's own error preferred when this one only
    says it lost that peer (the peer that failed first is the cause)."""
    from eagle3.distributed import PeerLost

    kind, what = result
    if kind == "error" and isinstance(what, PeerLost):
        ready = wait(list(others.values()), timeout=5.0)
        for conn in ready:
            try:
                other = conn.recv()
            except EOFError:
                continue
            if other[0] == "error" and not isinstance(other[1], PeerLost):
                return other[1]
    if kind == "error":
        return what
    if kind == "bug":
        return TrainError(f"train.context_parallel: rank {rank} failed: {what} (its traceback is above)")
    return TrainError(f"train.context_parallel: rank {rank} exited with code {what} before it finished "
                      "(killed, or out of memory?)")


def _rank(train: Callable[..., dict[str, Any]], rank: int, world: int, port: int, cfg: TrainConfig,
          target_cfg: TargetConfig, conn: Any) -> None:
    """One spawned rank: train, then send ("ok", summary), ("error", a user error) or ("bug", text)."""
    from eagle3.distributed import shutdown
    from eagle3.processes import exit_with_parent

    exit_with_parent()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = 0
    try:
        message: tuple[str, Any] = ("ok", train(cfg, target_cfg))
    except Eagle3Error as err:
        message, code = ("error", err if _picklable(err) else TrainError(str(err))), 1
    except BaseException as err:  # a bug: its traceback where the user sees it
        traceback.print_exc()
        message, code = ("bug", f"{type(err).__name__}: {err}"), 1
    try:
        conn.send(message)
        conn.close()
    finally:
        shutdown()
    sys.exit(code)


def _picklable(err: BaseException) -> bool:
    try:
        return isinstance(pickle.loads(pickle.dumps(err)), type(err))
    except Exception:
        return False


__all__ = ["launched", "local_ranks", "ranks_that_fit", "train_on_local_ranks"]
