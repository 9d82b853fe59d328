"""The draft's serving-time KV cache: keys and values of every token it has seen, the causal (or
sliding-window) mask over them, and the attention a serving forward runs through them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from eagle3.device import sdpa

# attend(q [B,M,nh,d], k [B,S,nkv,d], v [B,S,nkv,d]) -> [B,M,nh,d]; q and k already rotated. The query
# rows are all S rows except in training's unroll (``rows``); serving's cached attend assumes M == S.
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


def causal_window(past: int, new: int, device: torch.device, window: int | None = None) -> Tensor:
    """[new, past + new] bool: row i (position past + i) may see column j iff j <= past + i and,
    with ``window``, past + i - j < window."""
    query = past + torch.arange(new, device=device)[:, None]
    key = torch.arange(past + new, device=device)
    allowed = key <= query
    return allowed & (query - key < window) if window is not None else allowed


@dataclass
class KVCache:
    """Per-layer keys/values [B, T, nkv, d] (keys rotated) of every token the draft has seen."""

    keys: list[Tensor | None] = field(default_factory=list)
    values: list[Tensor | None] = field(default_factory=list)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=1)
            v = torch.cat([self.values[layer], v], dim=1)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def __len__(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else int(self.keys[0].shape[1])

    def fork(self) -> KVCache:
        """A copy that later updates do not share (tensors are never written in place)."""
        return KVCache(list(self.keys), list(self.values))

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (a rollback after verification)."""
        self.keys = [None if k is None else k[:, :length] for k in self.keys]
        self.values = [None if v is None else v[:, :length] for v in self.values]

    def attention_mask(self, past: int, new: int, device: torch.device, window: int | None = None) -> Tensor:
        """[new, past + new]: each new token sees the cache and the new ones up to itself (with
        ``window``: only the last ``window`` of them, itself included). A cache slot is a position."""
        return causal_window(past, new, device, window)

    def commit(self, new: int) -> None:
        """After a forward over ``new`` tokens (a static cache moves its length here)."""


class DraftKV(KVCache):
    """A draft's dynamic cache with the methods the serving proposers call, as the static one
    (``serve_eval.static_cache.StaticDraftKV``) has them: its steps run the draft eagerly."""

    def __init__(self, draft: Any) -> None:
        super().__init__()
        self.draft = draft

    def start(self, slots: int) -> DraftKV:
        """Empty, for a new generation (a dynamic cache grows as it goes: ``slots`` is not needed)."""
        self.truncate(0)
        return self

    def mask_width(self, new: int) -> int:
        """Columns of a tree mask over the cache and ``new`` rows."""
        return len(self) + new

    def step(self, token: Tensor, state: Tensor, position: Tensor) -> tuple[Tensor, Tensor]:
        """One draft step (token, position [1, 1]; state [1, 1, H]) -> (state [1, 1, H], logits [1, Vd])."""
        state, logits = self.draft(token, state, position, self)
        return state, logits[:, -1]

    def tree_step(self, ids: Tensor, states: Tensor, positions: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """A tree's expansion: nodes ``ids`` [1, C] fed ``states`` [1, C, H] under ``mask`` [C, T]."""
        return self.draft(ids, states, positions, self, attn_mask=mask)


def cached_attend(cache: KVCache, layer: int, mask: Tensor | None = None, window: int | None = None) -> Attend:
    """Attention over the cache plus the new tokens; ``mask`` [S_new, T] (True: may attend)
    replaces the causal default (each new token sees the cache and the new ones up to itself, the
    last ``window`` of them with a sliding-window layer)."""
    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        new = q.shape[1]
        keys, values = cache.update(layer, k, v)  # [B, T, nkv, d], T = past + new
        group = q.shape[2] // keys.shape[2]
        keys = keys.repeat_interleave(group, dim=2).transpose(1, 2)  # [B, nh, T, d]
        values = values.repeat_interleave(group, dim=2).transpose(1, 2)
        allowed = mask if mask is not None else cache.attention_mask(keys.shape[2] - new, new, q.device, window)
        out = sdpa(q.transpose(1, 2), keys, values, attn_mask=allowed)  # [B, nh, S, d]
        return out.transpose(1, 2)

    return attend


__all__ = ["Attend", "DraftKV", "KVCache", "cached_attend", "causal_window"]
