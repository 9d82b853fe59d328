"""The trainer's processes and device: one place that chooses the device and joins the process
group (gloo on CPU, nccl on CUDA), the two collectives the trainer uses, and the line that names a
rank lost mid-run (its host died, its process was killed, the network between them broke)."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from eagle3.errors import ConfigError, Eagle3Error
from eagle3.home import eagle3_home

OWN_GROUP = "EAGLE3_OWN_GROUP"
"""Set in the environment when :func:`init_runtime` made a group of one itself: the rendezvous
variables it left behind are its own, not a launcher's (:func:`launched`)."""


def launched() -> bool:
    """Whether a launcher (torchrun, the ``deepspeed`` launcher, a submitit job) started this
    process as a rank, of any world size; not when the only rendezvous variables are those a
    group of one made here left behind."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return True
    if os.environ.get(OWN_GROUP) == "1":
        return False
    return "RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    hosts: tuple[tuple[str, str], ...] = ()
    """Every rank's (hostname, address), in rank order: who a failed collective lost."""


class PeerLost(Eagle3Error, RuntimeError):
    """A collective failed because another rank is gone or silent; the message names this rank, the
    lost one where the error tells, and every rank's host (``what``: that, without the advice)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} (rerun the job, or set launcher.requeue: training resumes from its last checkpoint)")
        self.what = what


# what gloo and nccl say when the other end of a collective went away (or never answered)
_LOST = re.compile(r"connection (closed|reset)|closed by peer|broken pipe|timed out|timeout|"
                   r"remote process exited|ncclRemoteError|ncclSystemError|Socket Timeout|No route to host",
                   re.IGNORECASE)


def _address() -> str:
    """This rank's address as its peers see it: the interface the collectives are told to use
    (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, Linux), else the one the hostname resolves to; '?'."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME")
    if interface and "," not in interface:
        import fcntl
        import struct

        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface[:15].encode()))  # SIOCGIFADDR
            return socket.inet_ntoa(packed[20:24])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "?"


def lost_peer(err: BaseException, rt: Runtime) -> PeerLost | None:
    """``err`` as a :class:`PeerLost` naming who was lost, when it is a collective's lost peer; else None."""
    text = str(err)
    if rt.world_size < 2 or not _LOST.search(text):
        return None
    here, mine = rt.hosts[rt.rank] if rt.hosts else (socket.gethostname(), "?")
    named = [f"rank {r} on {host} ({addr})" for r, (host, addr) in enumerate(rt.hosts)
             if addr not in ("?", mine) and re.search(rf"\b{re.escape(addr)}\b", text)]
    ranks = ", ".join(f"{r}: {host}" for r, (host, _) in enumerate(rt.hosts)) or "unknown"
    who = "lost " + " / ".join(named) if named else "lost another rank (the error does not say which)"
    first = text.strip().splitlines()[0][:300] if text.strip() else type(err).__name__
    return PeerLost(f"rank {rt.rank} on {here}: a collective failed: {who}; ranks {ranks}: {first}")


@contextlib.contextmanager
def peers_named(rt: Runtime) -> Iterator[None]:
    """Inside: a collective that failed because a peer was lost (its node died) raises a
    :class:`PeerLost` naming it, not a bare gloo/nccl trace; anything else passes through."""
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, Eagle3Error) or (lost := lost_peer(err, rt)) is None:
            raise
        raise lost from err


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 (flushed); a no-op elsewhere."""
    if is_rank0():
        print(*args, **kwargs, flush=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_runtime(device: str = "auto", timeout_s: float = 600.0) -> Runtime:
    """Choose the device once and join (or create) the process group: gloo on CPU, nccl on CUDA.

    Without a launcher this is a group of one (the rendezvous variables are filled in). Run again
    in the same process, it reuses the existing group. ``timeout_s``: how long the rendezvous and
    each collective wait for the other ranks before they fail.
    """
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError(f"train.device={device!r}, but CUDA is not available")
    if not use_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(eagle3_home() / "torch_extensions"))
    dist = torch.distributed
    alone = False
    if dist.is_initialized():  # an earlier call in this process
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", "0"))
    else:
        alone = "RANK" not in os.environ
        if alone:  # no launcher: a group of one (marked as this process's own, not a launcher's)
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()), **{OWN_GROUP: "1"})
        rank, world, local = (int(os.environ.get(k, "0")) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if use_cuda:
        index = int(device.split(":")[1]) if ":" in device else local
        torch_device = torch.device("cuda", index)
        torch.cuda.set_device(torch_device)
    else:
        torch_device = torch.device("cpu")
    import deepspeed

    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if alone:  # its rendezvous in memory: no port for two runs on one machine to race for
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)
    hosts: list[Any] = [(socket.gethostname(), _address())]
    if world > 1:
        hosts = [None] * world
        dist.all_gather_object(hosts, (socket.gethostname(), _address()))
    return Runtime(device=torch_device, rank=rank, world_size=world, local_rank=local,
                   hosts=tuple(tuple(h) for h in hosts))


@dataclass(frozen=True)
class ContextGroup:
    """This rank's context-parallel group (``train.context_parallel`` ranks share a row) and the
    data-parallel view that follows: which of the world / size batch streams this rank reads."""

    size: int
    rank: int  # this rank's place in its group
    group: Any  # the group's process group (None: a group of one)
    data_rank: int
    data_world: int


def context_group(rt: Runtime, size: int) -> ContextGroup:
    """Groups of ``size`` consecutive ranks (every rank makes every group, as torch requires)."""
    if rt.world_size % size:
        raise ConfigError(f"train.context_parallel={size} does not divide the world size ({rt.world_size} ranks)")
    mine = None
    if size > 1:
        for first in range(0, rt.world_size, size):
            group = torch.distributed.new_group(list(range(first, first + size)))
            mine = group if first == rt.rank - rt.rank % size else mine
    return ContextGroup(size=size, rank=rt.rank % size, group=mine, data_rank=rt.rank // size,
                        data_world=rt.world_size // size)


def per_rank(value: float, rt: Runtime) -> list[float]:
    """Every rank's ``value``, in rank order (a collective: every rank calls it)."""
    out = torch.zeros(rt.world_size, dtype=torch.float64, device=rt.device)
    out[rt.rank] = value
    return all_reduce_sum(out).tolist()


def all_reduce_sum(x: Tensor) -> Tensor:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(x)
    return x


def any_rank(rt: Runtime, flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (a collective: every rank calls it)."""
    return bool(all_reduce_sum(torch.tensor([float(flag)], device=rt.device)).item())


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def shutdown() -> None:
    """Release the process groups while the interpreter is still whole: what still holds one (an
    autograd graph whose collective kept the group, a finished gloo work's tensors) is collected first,
    then every group is destroyed. A group left to the interpreter's exit is torn down after Python
    is gone, where gloo's threads releasing their tensors abort the process (SIGABRT, "terminate
    called without an active exception"), intermittently, after a run that succeeded."""
    import gc

    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


__all__ = ["OWN_GROUP", "ContextGroup", "PeerLost", "Runtime", "all_reduce_sum", "any_rank", "barrier", "context_group",
           "free_port", "init_runtime", "launched", "lost_peer", "peers_named", "per_rank", "shutdown"]
