"""Devices and dtypes: where the target and draft run, in what precision, and how to time work there."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eagle3.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

def resolve_device(device: str) -> torch.device:
    """auto (CUDA when available, else CPU), cpu, cuda or cuda:N; CUDA that this torch cannot use fails
    here, naming the setting, rather than inside torch."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as err:
        raise ConfigError(f"device {device!r}: expected auto, cpu, cuda, cuda:N or mps ({err})") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r}: this torch has no usable CUDA device (use cpu or auto)")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return resolved

def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS tells it, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


CUDNN_SDPA_ENV = "EAGLE3_CUDNN_SDPA"
_cudnn_sdpa = os.environ.get(CUDNN_SDPA_ENV) == "1"  # read once: compiled forwards guard on the flag, not the env


def cudnn_sdpa_allowed() -> bool:
    return _cudnn_sdpa


@contextlib.contextmanager
def allow_cudnn_sdpa(allowed: bool = True) -> Iterator[None]:
    """Inside: :func:`sdpa_backends` lets torch pick cuDNN's backend too (or not), as
    ``EAGLE3_CUDNN_SDPA=1`` does for a whole process."""
    global _cudnn_sdpa
    before, _cudnn_sdpa = _cudnn_sdpa, allowed
    try:
        yield
    finally:
        _cudnn_sdpa = before


def sdpa_backends(device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """Scaled-dot-product attention without cuDNN's backend on CUDA (a no-op elsewhere).

    cuDNN's attention builds a graph for every new sequence length it meets, so a decode step (one
    more key each time), a verify, a prefill or a packed training row of a new length each pay the
    build (on one H100: ~4 s at a training row's first new length, bf16 decoding 17 ms a token
    against 2.7 ms at one fixed length; docs/experiments.md). Flash attention (no mask) and
    memory-efficient attention (masks; every head its own keys, see :func:`sdpa`) take any length.
    ``EAGLE3_CUDNN_SDPA=1`` keeps cuDNN among the choices (fixed shapes)."""
    if torch.device(device).type != "cuda" or _cudnn_sdpa:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def every_head(q: Tensor, k: Tensor, v: Tensor, kwargs: dict[str, Any]) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """Grouped keys and values (``enable_gqa``) repeated to every query head, as torch's grouped
    attention pairs them (query head h reads key head h // group)."""
    if not kwargs.get("enable_gqa") or k.shape[-3] == q.shape[-3]:
        return k, v, kwargs
    group = q.shape[-3] // k.shape[-3]
    return k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3), {**kwargs, "enable_gqa": False}


def sdpa(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    """``F.scaled_dot_product_attention`` ([B, heads, S, d] each) under :func:`sdpa_backends` of
    ``q``'s device. Where cuDNN is left out on CUDA, grouped keys (``enable_gqa``) are repeated to
    every query head first: memory-efficient attention, the one that takes a mask, has no grouped
    heads, and torch would fall back to the math backend, which keeps every score for backward."""
    if q.is_cuda and not _cudnn_sdpa:
        k, v, kwargs = every_head(q, k, v, kwargs)
    with sdpa_backends(q.device):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU): read a clock after this, never
    after a kernel launch alone."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)

def to_device(x: Any, device: torch.device) -> Any:
    """``x`` (a tensor, a dict of tensors, or anything with ``.to(device)``) on ``device``. A host tensor
    goes to CUDA through pinned memory, without blocking: a copy from pageable memory would make the
    host wait until the device's queue reaches it."""
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, Tensor) and x.device.type == "cpu" and device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def cpu_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX, as Linux lists its flags); the
    environment's ``EAGLE3_CPU_BF16=0|1`` decides instead where set (the tests pin 0)."""
    forced = os.environ.get("EAGLE3_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on accelerators and on CPUs with native bf16 (:func:`cpu_native_bf16`), fp32 on
    the others (on an AVX2-only CPU a bf16 matmul ran ~170x slower than fp32)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or device.type == "cpu" and cpu_native_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]

@functools.cache
def bf16_matmul_speedup(device_type: str) -> float:
    """How many times faster a bf16 matmul runs than an fp32 one on this kind of device.

    Accelerators (CUDA and others): taken as fast (2.0) without measuring. CPUs differ by orders
    of magnitude: with AMX or AVX512-BF16 units bf16 is the faster one, but on an AVX2-only CPU
    (AMD EPYC, torch 2.13) a bf16 matmul ran ~170x slower than fp32. So a CPU is measured once
    per process on a small product (best of three each, ~1 ms where bf16 is fast, ~0.3 s where
    it is not).
    """
    if device_type != "cpu":
        return 2.0
    import time

    g = torch.Generator(device="cpu").manual_seed(0)  # its own: the global stream is the trainer's, checkpointed
    a, b = torch.randn(64, 512, generator=g), torch.randn(512, 512, generator=g)

    def best(x: Tensor, y: Tensor) -> float:
        x @ y  # warm-up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            x @ y
            times.append(time.perf_counter() - start)
        return min(times)

    return best(a, b) / max(best(a.bfloat16(), b.bfloat16()), 1e-9)
