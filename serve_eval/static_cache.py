"""The target's static KV cache for the bundled loop's chains, optionally under CUDA graphs.

transformers' ``StaticCache`` is allocated once, a token's slot being its position; it writes at
its own length (a counter on the device). A round's rejected proposals stay in their slots: rolling
back moves that counter back (``crop``, in place, no sync), the next forward writes its tokens
over them before attending, and the causal mask hides the slots past each query's position (a
tree's accepted nodes would have to move: chains only). The cache is kept between generations (a
new prompt overwrites from slot 0) and grows, by powers of two, only when one needs more slots.

``graphs``: the forwards of a fixed length (one token: plain steps; K + 1: a verify) run through
``torch.compile(mode="reduce-overhead", dynamic=False)``, i.e. captured and replayed as CUDA graphs
on CUDA (as gpt-fast does), one compiled forward per length elsewhere; the prefill, of any length,
runs eagerly. Their outputs are copied out at once (a replay overwrites them).
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3.target import Target, TargetOutput

_MIN_SLOTS = 1024


def check_static_target(target: Target, setting: str) -> None:
    """Refuse a target whose cache cannot be rolled back by length: sliding-window layers (their
    static cache rotates, so a rejected proposal overwrites a slot that is still needed)."""
    config = target.config
    kinds = set(getattr(config, "layer_types", None) or ())
    windowed = "sliding_attention" in kinds or (getattr(config, "sliding_window", None)
                                                and getattr(config, "use_sliding_window", True) and not kinds)
    if windowed:
        raise ValueError(f"target_cache={setting}: {target.name or 'the target'} has sliding-window attention "
                         "layers, whose static cache rotates and cannot be rolled back; use target_cache=dynamic")


class StaticKV:
    """The target's static cache and its live length (the tokens in it that count)."""

    def __init__(self, target: Target, graphs: bool) -> None:
        self.target, self.graphs = target, graphs
        self.cache: Any = None
        self.slots = 0
        self.length = 0
        self._compiled: Any = None

    def start(self, slots: int) -> StaticKV:
        """Ready for a generation that needs up to ``slots`` positions: length 0, grown if needed."""
        if slots > self.slots:
            from transformers import StaticCache

            self.slots = max(_MIN_SLOTS, 1 << (slots - 1).bit_length())
            self.cache = StaticCache(config=self.target.config, max_cache_len=self.slots)
            self._compiled = None  # its graphs read the old cache's tensors
            self.length = 0
        self.keep(0)
        return self

    def _step(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.target(input_ids, past_key_values=self.cache, use_cache=True, cache_position=cache_position)
        return out.logits, out.aux, out.last

    def forward(self, ids: list[int]) -> TargetOutput:
        """The target over ``ids`` at the next positions; the length moves past them."""
        if self.length + len(ids) > self.slots:
            raise ValueError(f"{self.length + len(ids)} positions in a static cache of {self.slots}")
        device = self.target.device
        x = torch.tensor([ids], device=device)
        positions = torch.arange(self.length, self.length + len(ids), device=device)
        if self.graphs and self.length > 0:  # a decode step or a verify: a fixed length, replayed
            if self._compiled is None:
                self._compiled = torch.compile(self._step, mode="reduce-overhead", dynamic=False)
            torch.compiler.cudagraph_mark_step_begin()
            logits, aux, last = (t.clone() for t in self._compiled(x, positions))
        else:
            logits, aux, last = self._step(x, positions)
        self.length += len(ids)
        return TargetOutput(aux=aux, last=last, logits=logits, past_key_values=None)

    def keep(self, length: int) -> None:
        """Roll back to the first ``length`` positions."""
        if not 0 <= length <= self.length:
            raise ValueError(f"keep {length} of {self.length} positions")
        if length < self.length:
            roll_back(self.cache, self.length - length)
        self.length = length


def roll_back(cache: Any, n: int) -> None:
    """Move every layer's write counter of a transformers ``StaticCache`` back by ``n``, in place (the
    tensors stay where CUDA graphs read them): ``crop(-n)`` where transformers has it (5.2x), the
    counter itself in the 5.x releases before it."""
    for layer in cache.layers:
        if hasattr(layer, "crop"):
            layer.crop(-n)
        elif isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            layer.cumulative_length.sub_(n)
        else:
            raise RuntimeError(f"{type(layer).__name__}: a static cache layer of this transformers version has no "
                               "write counter to roll back; use target_cache=dynamic")


__all__ = ["StaticKV", "check_static_target", "roll_back"]
