"""A KV cache of independent rows for an HF target: each row one sequence, of its own length.

transformers' caches hold a batch whose rows grow together: every forward appends the same number
of slots to every row, so rows of different lengths carry padding, and one row's new turn pads all
the others. Here each row ``r`` keeps its tokens in slots ``[0, length[r])`` of its own, position =
slot. A forward runs either

- **one row** (``select([r])``): its new tokens written from ``length[r]`` on; the keys it attends
  over are a view of that row (no copy) — a conversation's next turn prefilled alone, or
- **rows 0..b-1, one token each** (``select(range(b))``): each token written at its own row's
  length; every row attends over its own slots (a view of the first ``b`` rows) under :meth:`mask` —
  the batched decode step. New sequences should take the lowest free row, so that ``b`` stays small.

Rolling a row back (a re-rendered prompt that differs from what was fed) is setting its length; a
row taken by a new sequence starts at 0. Slots grow by doubling. Only attention layers that see the
whole history through the mask are supported: a sliding-window layer gets its window from
:meth:`mask` too (a dict per layer type, as transformers' Gemma-3 takes it), the slots behind it
kept but hidden::

    keys[layer]: [rows, kv_heads, slots, head_dim]   row r valid on [0, length[r])
    a forward:   new tokens of the selected rows -> written at length[r] ... length[r] + q - 1
                 mask [b, 1, q, width] True where a query may attend (its own row, slot <= position)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from eagle3.device import sdpa

ROWS_ATTENTION = "eagle3_rows"


class _Rows:
    """What the layers share: the rows of the current forward, each row's length, the slot count."""

    def __init__(self, rows: int) -> None:
        self.length = [0] * rows
        self.selected: list[int] = []
        self.slots = 0


class RowLayer(CacheLayerMixin):
    """One attention layer's keys and values for every row (see the module docstring)."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, shared: _Rows, rows: int) -> None:
        super().__init__()
        self.shared, self.rows = shared, rows

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        _, heads, _, dim = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_zeros((self.rows, heads, self.shared.slots, dim))
        self.values = value_states.new_zeros((self.rows, heads, self.shared.slots, value_states.shape[-1]))
        self.is_initialized = True

    def grow(self, slots: int) -> None:
        if self.is_initialized and self.keys.shape[2] < slots:
            pad = slots - self.keys.shape[2]
            self.keys = torch.nn.functional.pad(self.keys, (0, 0, 0, pad))
            self.values = torch.nn.functional.pad(self.values, (0, 0, 0, pad))

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.grow(self.shared.slots)
        rows, length = self.shared.selected, self.shared.length
        q = key_states.shape[2]
        if len(rows) == 1:  # one row, any number of new tokens: slices, no copy
            r, start = rows[0], length[rows[0]]
            self.keys[r, :, start:start + q] = key_states[0]
            self.values[r, :, start:start + q] = value_states[0]
            end = start + q
            return self.keys[r:r + 1, :, :end], self.values[r:r + 1, :, :end]
        assert q == 1 and rows == list(range(len(rows))), "several rows: rows 0..b-1, one token each"
        b = len(rows)
        index = torch.arange(b, device=self.keys.device)
        slot = torch.tensor(length[:b], device=self.keys.device)
        self.keys[index, :, slot] = key_states[:, :, 0]  # [b, heads, dim]
        self.values[index, :, slot] = value_states[:, :, 0]
        width = max(length[:b]) + 1
        return self.keys[:b, :, :width], self.values[:b, :, :width]  # views: no copy

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        rows = self.shared.selected
        return max((self.shared.length[r] for r in rows), default=0)

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("rows are rolled back one at a time: RowCache.keep")


class RowCache(Cache):
    """Independent rows of a target's KV cache (module docstring). Use: :meth:`select` the rows of
    the next forward, pass :meth:`positions` and :meth:`mask` with it, then :meth:`advance`."""

    def __init__(self, config: Any, rows: int, slots: int = 256) -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.shared = _Rows(rows)
        self.shared.slots = slots
        self.num_rows = rows
        self.layer_types = list(getattr(text, "layer_types", None) or [])
        self.window = getattr(text, "sliding_window", None) if "sliding_attention" in self.layer_types else None
        super().__init__(layers=[RowLayer(self.shared, rows) for _ in range(text.num_hidden_layers)])

    @property
    def length(self) -> list[int]:
        return self.shared.length

    def select(self, rows: Sequence[int], new_tokens: int) -> None:
        """The rows of the next forward, slots grown to fit: one row, or rows ``0..b-1`` with one new
        token each (a view of the first ``b`` rows: a row with nothing to do runs a token whose key
        lands past its length, where the next write overwrites it; do not :meth:`advance` it)."""
        rows = list(rows)
        if len(rows) > 1 and (new_tokens != 1 or rows != list(range(len(rows)))):
            raise ValueError("several rows run rows 0..b-1 with one new token each; prefill a row alone")
        need = max(self.shared.length[r] for r in rows) + new_tokens
        while self.shared.slots < need:
            self.shared.slots *= 2
        self.shared.selected = rows

    def positions(self, new_tokens: int) -> Tensor:
        """``[b, q]`` position ids of the selected rows' new tokens."""
        start = torch.tensor([self.shared.length[r] for r in self.shared.selected])
        return start[:, None] + torch.arange(new_tokens)[None, :]

    def mask(self, new_tokens: int, device: torch.device | str) -> Tensor | dict[str, Tensor]:
        """``[b, 1, q, width]`` bool (True: may attend) for the selected rows' next forward: each
        query its own row's slots up to its position; a dict per layer type where the target has
        sliding-window layers (those see the last ``sliding_window`` positions)."""
        rows = self.shared.selected
        start = torch.tensor([self.shared.length[r] for r in rows])  # [b]
        width = int(start.max()) + new_tokens if len(rows) > 1 else int(start[0]) + new_tokens
        query = start[:, None] + torch.arange(new_tokens)[None, :]  # [b, q] positions
        slot = torch.arange(width)[None, None, :]  # [1, 1, width]
        full = (slot <= query[:, :, None])[:, None].to(device)  # [b, 1, q, width]
        if self.window is None:
            return full
        near = (slot > query[:, :, None] - self.window)[:, None].to(device)
        return {"full_attention": full, "sliding_attention": full & near}

    def advance(self, new_tokens: int, rows: Sequence[int] | None = None) -> None:
        """The selected rows (or ``rows`` of them) hold their new tokens."""
        for r in self.shared.selected if rows is None else rows:
            self.shared.length[r] += new_tokens

    def keep(self, row: int, length: int) -> None:
        """Roll row ``row`` back to its first ``length`` tokens (0: free for a new sequence)."""
        if not 0 <= length <= self.shared.length[row]:
            raise ValueError(f"row {row}: keep {length} of {self.shared.length[row]} tokens")
        self.shared.length[row] = length

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s tokens into row ``dst`` (a copy of its slots); ``src`` is then free."""
        n = self.shared.length[src]
        for layer in self.layers:
            if layer.is_initialized:
                layer.grow(self.shared.slots)
                layer.keys[dst, :, :n] = layer.keys[src, :, :n]
                layer.values[dst, :, :n] = layer.values[src, :, :n]
        self.shared.length[dst], self.shared.length[src] = n, 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if self.layers else 0


def rows_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                   dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                   **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' SDPA attention, except that several rows under a 4D mask each attend over their
    own slots only (up to the last one their last query may see), not the longest row's width: one
    long conversation among the rows no longer makes every row read its length of keys::

        query [b, heads, q, d], key/value [b, kv_heads, width, d] -> [b, q, heads, d]
    """
    b, heads, q, dim = query.shape
    if b == 1 or not isinstance(attention_mask, Tensor) or attention_mask.dim() != 4 or kwargs.get("softcap"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kv_heads = key.shape[1]
    group = heads // kv_heads
    last = attention_mask[:, 0, -1]  # [b, width]: what each row's last query may see
    ends = (last.shape[-1] - last.flip(-1).int().argmax(-1)).tolist()  # one past its last visible slot
    out = []
    for r, end in enumerate(ends):
        mask = attention_mask[r:r + 1, :, :, :end]  # [1, 1, q, end]
        k, v = key[r:r + 1, :, :end], value[r:r + 1, :, :end]
        if q == 1 and bool(mask.all()):  # the usual decode step: no mask, the query heads grouped per kv head
            o = sdpa(query[r:r + 1].reshape(1, kv_heads, group, dim), k, v, scale=scaling)
            out.append(o.reshape(1, heads, 1, dim))
        else:
            out.append(sdpa(query[r:r + 1], k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                            attn_mask=mask, scale=scaling))
    return torch.cat(out).transpose(1, 2).contiguous(), None


AttentionInterface.register(ROWS_ATTENTION, rows_attention)
AttentionMaskInterface.register(ROWS_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def row_attention(model: torch.nn.Module) -> Iterator[None]:
    """The model's attention is :func:`rows_attention` inside the block (where it runs SDPA: another
    implementation, eager for Gemma 2's soft-capping say, is left as it is)."""
    config = model.config
    saved = config._attn_implementation
    if saved != "sdpa":
        yield
        return
    config._attn_implementation = ROWS_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = saved


__all__ = ["RowCache", "RowLayer", "row_attention", "rows_attention"]
