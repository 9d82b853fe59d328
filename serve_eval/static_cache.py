"""The target's static KV cache for the bundled loop, optionally under CUDA graphs.

transformers' ``StaticCache`` is allocated once; it writes at its own length (a counter on the
device), so in a chain a token's slot is its position. A round's rejected proposals stay in their
slots: rolling back moves that counter back (``crop``, in place, no sync), the next forward writes
its tokens over them before attending, and the causal mask hides the slots past each query's
position. A tree's verify writes its nodes in consecutive slots at their depth's positions under a
4D mask over every slot (the prefix, then each node's ancestors); the accepted nodes are then moved
down to the slots after the prefix, in place, and the counter set behind them. The cache is kept
between generations (a new prompt overwrites from slot 0) and grows, by powers of two, only when
one needs more slots.

``graphs``: the forwards of a fixed length (one token: plain steps; K + 1 or a tree's nodes: a
verify) run through
``torch.compile(mode="reduce-overhead", dynamic=False)``, i.e. captured and replayed as CUDA graphs
on CUDA (as gpt-fast does), one compiled forward per length elsewhere; the prefill, of any length,
runs eagerly. Their outputs are copied out at once (a replay overwrites them). An EAGLE-3 chain
draft's steps then run the same way over :class:`StaticDraftKV` (its length a device tensor, so one
captured step replays at every position).
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3.errors import ConfigError
from eagle3.target.model import Target, TargetOutput

_MIN_SLOTS = 1024


def check_static_target(target: Target, setting: str) -> None:
    """Refuse a target whose cache cannot be rolled back by length: sliding-window layers (their
    static cache rotates, so a rejected proposal overwrites a slot that is still needed)."""
    config = target.config
    kinds = set(getattr(config, "layer_types", None) or ())
    windowed = "sliding_attention" in kinds or (getattr(config, "sliding_window", None)
                                                and getattr(config, "use_sliding_window", True) and not kinds)
    if windowed:
        raise ConfigError(f"target_cache={setting}: {target.name or 'the target'} has sliding-window attention "
                          "layers, whose static cache rotates and cannot be rolled back; use target_cache=dynamic")


def _replayed(compiled: dict[Any, Any], key: Any, fn: Any, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``fn(*args)`` through its compiled forward (``compiled[key]``, made on first use; CUDA graphs on
    CUDA), its outputs copied out of the graph's buffers (the next replay overwrites them)."""
    if key not in compiled:
        compiled[key] = torch.compile(fn, mode="reduce-overhead", dynamic=False)
    torch.compiler.cudagraph_mark_step_begin()
    return tuple(t.clone() for t in compiled[key](*args))


def _grown(slots: int) -> int:
    """Slots to allocate for ``slots`` positions: a power of two, at least _MIN_SLOTS."""
    return max(_MIN_SLOTS, 1 << (slots - 1).bit_length())


class StaticKV:
    """The target's static cache and its live length (the tokens in it that count)."""

    def __init__(self, target: Target, graphs: bool) -> None:
        self.target, self.graphs = target, graphs
        self.cache: Any = None
        self.slots = 0
        self.length = 0
        self._compiled: dict[bool, Any] = {}  # chain (or plain) and tree forwards

    def start(self, slots: int) -> StaticKV:
        """Ready for a generation that needs up to ``slots`` positions: length 0, grown if needed."""
        if slots > self.slots:
            from transformers import StaticCache

            self.slots = _grown(slots)
            self.cache = StaticCache(config=self.target.config, max_cache_len=self.slots)
            self._compiled = {}  # their graphs read the old cache's tensors
            self.length = 0
        self.keep(0)
        return self

    def _step(self, input_ids: torch.Tensor, cache_position: torch.Tensor, position_ids: torch.Tensor | None = None,
              mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        out = self.target(input_ids, attention_mask=mask, past_key_values=self.cache, use_cache=True,
                          position_ids=position_ids, cache_position=cache_position)
        return out.logits, out.aux, out.last

    def forward(self, ids: list[int], positions: list[int] | None = None,
                mask: torch.Tensor | None = None) -> TargetOutput:
        """The target over ``ids`` in the next slots; the length moves past them. A tree's verify gives
        each token's ``positions`` and ``mask`` [1, 1, len(ids), slots] bool (True: may attend)."""
        if self.length + len(ids) > self.slots:
            raise ValueError(f"{self.length + len(ids)} positions in a static cache of {self.slots}")
        device = self.target.device
        args: tuple[torch.Tensor, ...] = (torch.tensor([ids], device=device),
                                          torch.arange(self.length, self.length + len(ids), device=device))
        tree = positions is not None
        if tree:
            assert mask is not None and mask.shape == (1, 1, len(ids), self.slots)
            args += (torch.tensor([positions], device=device), mask.to(device))
        if self.graphs and self.length > 0:  # a decode step or a verify: a fixed length, replayed
            logits, aux, last = _replayed(self._compiled, tree, self._step, *args)  # a tree: its own graph
        else:
            logits, aux, last = self._step(*args)
        self.length += len(ids)
        return TargetOutput(aux=aux, last=last, logits=logits, past_key_values=None)

    def keep_path(self, prefix: int, path: list[int]) -> None:
        """Keep the first ``prefix`` slots and then the verified nodes ``path`` (ascending indices of
        the nodes written from slot ``prefix``): each moved down to slot prefix + i, in place."""
        if path != list(range(len(path))):
            device = self.target.device
            src = torch.tensor(path, device=device) + prefix
            dst = torch.arange(prefix, prefix + len(path), device=device)
            for layer in self.cache.layers:
                for x in (layer.keys, layer.values):  # [B, nkv, slots, d]
                    x.index_copy_(2, dst, x.index_select(2, src))
        self.keep(prefix + len(path))

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
            raise ConfigError(f"{type(layer).__name__}: a static cache layer of this transformers version has no "
                              "write counter to roll back; use target_cache=dynamic")


class StaticDraftKV:
    """An EAGLE-3 draft's keys/values in preallocated [1, slots, nkv, d] tensors per layer, written in
    place at the live length ``pos`` (a device tensor: a compiled step reads it, so one capture
    serves every position) and read whole under a mask of the live slots (a tree's: given). Kept
    between generations and grown like :class:`StaticKV`; the draft's single-token step and a tree's
    expansion each compiled once (``torch.compile(mode="reduce-overhead")``: CUDA graphs on CUDA)."""

    def __init__(self, draft: Any) -> None:
        self.draft = draft
        self.slots = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.pos = torch.zeros(1, dtype=torch.long, device=draft.fc.weight.device)
        self.length = 0  # ``pos`` as the host knows it (a tree's masks are built there)
        self._compiled: dict[str, Any] = {}  # the chain's step, a tree's step

    def start(self, slots: int) -> StaticDraftKV:
        if slots > self.slots:
            c, w = self.draft.config, self.draft.fc.weight
            self.slots = _grown(slots)
            shape = (1, self.slots, c.num_key_value_heads, c.head_dim)
            self.keys = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in range(c.num_layers)]
            self.values = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in range(c.num_layers)]
            for t in (*self.keys, *self.values, self.pos):
                torch._dynamo.mark_static_address(t)
            self._compiled = {}  # their graphs read the old tensors
        self.truncate(0)
        return self

    def __len__(self) -> int:
        return self.length

    def mask_width(self, new: int) -> int:
        """Columns of a tree mask: every slot (the compiled step attends over all of them)."""
        return self.slots

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        at = self.pos + torch.arange(k.shape[1], device=k.device)
        self.keys[layer].index_copy_(1, at, k)
        self.values[layer].index_copy_(1, at, v)
        return self.keys[layer], self.values[layer]

    def attention_mask(self, past: int, new: int, device: torch.device, window: int | None = None) -> torch.Tensor:
        """[new, slots]: slot j is seen by new token i where j <= pos + i and, with ``window``,
        pos + i - j < window (``past``, the slots, unused)."""
        query = self.pos + torch.arange(new, device=device)[:, None]
        key = torch.arange(self.slots, device=device)
        allowed = key <= query
        return allowed & (query - key < window) if window is not None else allowed

    def commit(self, new: int) -> None:
        self.pos.add_(new)
        if not torch.compiler.is_compiling():  # a compiled step's host count moves in step/tree_step: a
            self.length += new  # Python attribute written inside it would recompile it at every length

    def truncate(self, length: int) -> None:
        self.pos.fill_(length)
        self.length = length

    def step(self, token: torch.Tensor, state: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One draft step (token, position [1, 1]; state [1, 1, H]) through the compiled forward ->
        (state [1, 1, H], logits [1, Vd])."""
        state = state.clone(memory_format=torch.contiguous_format)  # a row of [1, R, H]: R's stride, one capture
        out = _replayed(self._compiled, "chain", self._step, token, state, position)
        self.length += 1
        return out

    def tree_step(self, ids: torch.Tensor, states: torch.Tensor, positions: torch.Tensor,
                  mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A tree's expansion: nodes ``ids`` [1, C] fed ``states`` [1, C, H] at ``positions`` [1, C],
        each seeing the slots ``mask`` [C, slots] allows, through the compiled forward -> (states
        [1, C, H], logits [1, C, Vd]); C is the same at every depth, so one capture serves them all."""
        out = _replayed(self._compiled, "tree", self._tree_step, ids, states.contiguous(), positions, mask)
        self.length += ids.shape[1]
        return out

    def _step(self, token: torch.Tensor, state: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, ...]:
        new_state, logits = self.draft(token, state, position, self)
        return new_state, logits[:, -1]

    def _tree_step(self, ids: torch.Tensor, states: torch.Tensor, positions: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.draft(ids, states, positions, self, attn_mask=mask)


__all__ = ["StaticDraftKV", "StaticKV", "check_static_target", "roll_back"]
