"""A second device on a CPU-only machine, for tests that must catch what only a GPU used to show.

Inside :func:`other_device`, tensors that live on the "other" device report ``device.type ==
"meta"`` while computing on the CPU for real. Any operation that meets such a tensor together
with a plain CPU tensor raises, as CUDA does (``Expected all tensors to be on the same device``),
and so does a CPU generator used to sample on the other device. CPU 0-dim tensors are allowed in
elementwise operations, as CUDA allows them; nothing else is.

So a test can put the model on the other device (``model.to(OTHER)``), feed it what the library
builds, and see every tensor, index or generator that library code made without the device of
the data it meets. The meta device is the stand-in because torch has device guards for it on every
build; its tensors' values are never read (they are only the wrapper's face).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

OTHER = torch.device("meta")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROJECT = _ROOT + os.sep

# Advanced indexing takes CPU index tensors (a Python list becomes one) for data on CUDA.
_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
             torch.ops.aten._index_put_impl_.default}

# Ops that move data between devices on purpose.
_MOVES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten._copy_from.default,
          torch.ops.aten._copy_from_and_resize.default}


# Ops that make CUDA wait for the device (the host needs a value or a data-dependent shape):
# item()/float()/int()/bool(), nonzero and what calls it, copies back to the host.
_SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
          torch.ops.aten.masked_select.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default,
          torch.ops.aten.repeat_interleave.Tensor, torch.ops.aten._unique2.default,
          torch.ops.aten.unique_consecutive.default, torch.ops.aten.unique_dim.default, torch.ops.aten.bincount.default}


class DeviceMixError(RuntimeError):
    """What CUDA would have raised."""


class OnOther(torch.Tensor):
    """A CPU tensor that says it is on the other device."""

    elem: torch.Tensor  # the real data

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> OnOther:
        out = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                  storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                  device=OTHER, requires_grad=elem.requires_grad)
        out.elem = elem
        return out

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"OnOther({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"{func}: an OnOther tensor used outside other_device()")


class OtherGenerator(torch.Generator):
    """``torch.Generator(device=OTHER)``: a CPU generator that says it is on the other device."""

    def __new__(cls, device: Any = "cpu") -> OtherGenerator:
        out = super().__new__(cls, "cpu")
        out._device = torch.device(device)
        return out

    def __init__(self, device: Any = "cpu") -> None:
        pass

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._device


def _is_other(device: Any) -> bool:
    return device is not None and torch.device(device).type == OTHER.type


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        other, cpu = [], []
        wrappers: dict[int, OnOther] = {}

        def unwrap(x: Any) -> Any:
            if isinstance(x, OnOther):
                other.append(x)
                wrappers[id(x.elem)] = x
                return x.elem
            if isinstance(x, torch.Tensor):
                if x.device.type == OTHER.type:  # made on the device by a path that skips dispatch
                    raise RuntimeError(f"{func}: a tensor without data reached the harness (a torch path it "
                                       "does not follow made it); teach tests/fake_device.py that path")
                cpu.append(x)
            return x

        args, kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        if other and _RECORDING is not None and _syncs(func, args, kwargs, wrappers):
            _RECORDING.append(_where(func))
        if func in _INDEXING:  # the indices (argument 1) may stay on the CPU
            cpu = [t for t in cpu if not any(t is i for i in args[1] if isinstance(i, torch.Tensor))]
        if other and cpu and func not in _MOVES:
            pointwise = torch.Tag.pointwise in func.tags
            strays = [t for t in cpu if not (pointwise and t.dim() == 0)]
            if strays:
                raise DeviceMixError(f"{func}: tensors on {OTHER.type} (the model's device) and cpu "
                                     f"(shapes {[tuple(t.shape) for t in strays]}); CUDA refuses this")
        wrap = bool(other)
        if "device" in kwargs and _is_other(kwargs["device"]):  # factories and .to(OTHER)
            kwargs["device"] = torch.device("cpu")
            wrap = True
        elif func in _MOVES and "device" in kwargs and kwargs["device"] is not None:
            wrap = False  # .to("cpu") of an other-device tensor
        out = func(*args, **kwargs)
        if not wrap:
            return out

        def rewrap(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or isinstance(t, OnOther):
                return t
            mine = wrappers.get(id(t))  # an in-place op returns its own argument
            return OnOther(t) if mine is None else mine

        return tree_map(rewrap, out)


_RECORDING: list[str] | None = None


def _syncs(func: Any, args: Any, kwargs: dict[str, Any], wrappers: dict[int, OnOther]) -> bool:
    """Whether ``func`` on device data would make the host wait for the device on CUDA."""
    if func in _SYNCS:
        return not (func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None)
    if func in _INDEXING:  # a boolean mask on the device becomes indices through nonzero
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and id(i) in wrappers for i in args[1])
    if func in _MOVES:  # a copy back to the host
        to_host = func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None \
            and not _is_other(kwargs["device"])
        return to_host or (func is torch.ops.aten.copy_.default and id(args[0]) not in wrappers)
    return False


def _where(func: Any) -> str:
    """``op at file:line (function)`` of the innermost project frame that called it."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename
        if name.startswith(_PROJECT) and not any(part in name for part in ("/tests/", "site-packages")):
            return f"{func.__name__} at {os.path.relpath(frame.filename, _ROOT)}:{frame.lineno} ({frame.name})"
    return f"{func.__name__} (outside the project)"


@contextlib.contextmanager
def host_syncs() -> Iterator[list[str]]:
    """Inside :func:`other_device`: yields the list of host syncs (``op at file:line``) that the
    operations on the other device would cost on CUDA, filled as they run."""
    global _RECORDING
    seen: list[str] = []
    _RECORDING = seen
    try:
        yield seen
    finally:
        _RECORDING = None


def _host_list(index: Any) -> Any:
    return torch.tensor(index) if isinstance(index, list) else index


class _FunctionMode(TorchFunctionMode):
    """What is seen where torch is called: generators (below, torch sees a plain CPU generator) and
    tensors made from Python data (below, torch makes them on the device without dispatching)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(args[0], OnOther):
            # torch turns a list index into a tensor on the indexed tensor's device without
            # dispatching (a data-less meta tensor here); CUDA takes it from the host, as here
            index = args[1]
            index = tuple(map(_host_list, index)) if isinstance(index, tuple) else _host_list(index)
            args = (args[0], index, *args[2:])
        if func is torch.Tensor.tolist and isinstance(args[0], OnOther):
            if _RECORDING is not None:
                _RECORDING.append(_where(func))
            return args[0].elem.tolist()
        if func is torch.Tensor.numpy and isinstance(args[0], OnOther):
            raise DeviceMixError("Tensor.numpy() of a tensor on the model's device; CUDA refuses this (use .cpu())")
        if func in (torch.tensor, torch.as_tensor) and _is_other(kwargs.get("device")):
            return func(*args, **{**kwargs, "device": "cpu"}).to(OTHER)
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator):
            devices = {x.device.type for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
            if kwargs.get("device") is not None:
                devices.add(torch.device(kwargs["device"]).type)
            devices.add("cpu") if not devices else None  # a factory without a device makes a CPU tensor
            if devices != {gen.device.type}:
                raise DeviceMixError(f"{getattr(func, '__name__', func)}: a generator on {gen.device.type} for data "
                                     f"on {', '.join(sorted(devices))}; CUDA refuses this")
        return func(*args, **kwargs)


@contextlib.contextmanager
def other_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[torch.device]:
    """Inside: ``OTHER`` behaves as a second device; yields it."""
    monkeypatch.setattr(torch, "Generator", OtherGenerator)
    with _FunctionMode(), _Mode():
        yield OTHER
