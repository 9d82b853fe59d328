"""Context parallelism for the training-time test: one packed row's query rows split over the ranks
of a group, for rows whose unroll does not fit one device.

Rank r of a group of n owns a range of consecutive rows of the row (the ranges cut where each holds
about the same share of the work: the trainer counts a row once, and K more times where some step is
counted at it, so a reply at the end of a long prompt does not fall on one rank alone) and
reads the K + 1 rows after them too (the *halo*: step k at row t is fed x[t+k+1] and learns
p[t+k+1], gated by the mask at t+k+2). Everything per row stays on the rank that owns the row: the
aux states, the target's distributions, the queries of every step, the diagonal keys, the MLP, the
logits and the loss. Only step 0's keys and values cross ranks: each layer's are gathered from every
rank (they are the window of every later query, at every step), and in backward each rank gets the
sum of every rank's gradient for its own rows. Memory per rank then holds its share of the row's
states, logits and activations, and every key and value of the row (2 x kv_heads x head_dim numbers a row
and layer: 1 KiB in bf16 for a 8 x 64-head layer, against the 14 KiB of one Kimi aux state).

This is all-gather context parallelism (as Llama 3's training): no head count needs to divide the
group, and a row need not divide it either (ranges of unequal length are padded to the longest for
the gather; padding keys are seen by no query). The loss of a step is its sum over the rank's rows
divided by the step's count over the whole row, so that the group's losses add up to the one-rank
loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

FILLS = {"document_ids": -1, "loss_mask": False}
"""What pads a batch tensor's rows (0 for the others): padding is never a document, never counted."""


class _GatherRows(torch.autograd.Function):
    """[B, c, ...] own rows -> [B, n*c, ...] every rank's, in rank order; backward: the sum over the
    group of the gradient of the whole, at this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, size: int, rank: int, group: Any) -> Tensor:  # noqa: ANN401
        ctx.rank, ctx.rows, ctx.group = rank, x.shape[1], group
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # noqa: ANN401
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total[:, ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None, None, None


@dataclass(frozen=True)
class ContextShard:
    """This rank's part of a row split over a context-parallel group (module docstring). The forward
    is given its rows [lo, lo + own + halo) of every batch tensor; the gathered keys are every rank's
    own rows, each padded to ``width``: ``keys_row`` holds their rows in the whole row (-1: padding),
    ``keys_doc`` their document ids (-2 on padding: no query's)."""

    rank: int
    size: int
    lo: int  # this rank's first row
    own: int  # its rows: [lo, lo + own)
    width: int  # the most rows a rank owns
    keys_row: Tensor  # [size * width]
    keys_doc: Tensor  # [B, size * width]
    group: Any = None  # the process group (None: the default group)

    def attention_mask(self, document_ids: Tensor, window: int | None = None) -> Tensor:
        """[B, L, n*w] bool: local query row i (row lo + i of the whole) may see key s iff its row is at
        most lo + i, in the same document (and, with ``window``, fewer than ``window`` rows back), as
        ``step0_attention_mask``. A row that sees no key (the halo's padding past the row, whose
        outputs nothing reads) sees the first, so that no softmax is taken over nothing."""
        device = document_ids.device
        q = torch.arange(self.lo, self.lo + document_ids.shape[1], device=device).unsqueeze(1)  # [L, 1]
        rows = self.keys_row.to(device).unsqueeze(0)  # [1, K]
        allowed = (rows >= 0) & (rows <= q)
        if window is not None:
            allowed &= q - rows < window
        allowed = allowed & (document_ids.unsqueeze(2) == self.keys_doc.to(device).unsqueeze(1))  # [B, L, K]
        allowed[..., 0] |= ~allowed.any(-1)
        return allowed

    def gather(self, x: Tensor) -> Tensor:
        """Every rank's own rows of ``x`` [B, L, ...], each padded to ``width``: [B, n*w, ...] (autograd)."""
        mine = x[:, :self.own]
        if self.own < self.width:
            mine = torch.cat([mine, mine.new_zeros((mine.shape[0], self.width - self.own, *mine.shape[2:]))], 1)
        return _GatherRows.apply(mine, self.size, self.rank, self.group)

    def total(self, x: Tensor) -> Tensor:
        """``x`` summed over the group (a copy; no gradient)."""
        out = x.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out


def balanced_bounds(cost: Tensor, size: int) -> list[int]:
    """Where ``size`` consecutive ranges of rows start and end (size + 1 bounds), each holding about the
    same part of ``cost`` [S] (each range at least one row)."""
    total = torch.cumsum(cost.double(), 0)
    s = cost.shape[0]
    bounds = [0]
    for r in range(1, size):
        cut = int(torch.searchsorted(total, total[-1] * r / size)) + 1  # the first range reaching its share
        bounds.append(min(max(cut, bounds[-1] + 1), s - (size - r)))
    return [*bounds, s]


def split_batch(batch: dict[str, Tensor], rank: int, size: int, halo: int, group: Any = None,
                cost: Tensor | None = None) -> tuple[dict[str, Tensor], ContextShard]:
    """This rank's rows of a batch of [B, S, ...] tensors (own rows and ``halo`` more, padded past the
    row) and its :class:`ContextShard`. The rows split into consecutive ranges of about equal
    ``cost`` [B, S] (summed over the batch rows; by default every row costs the same)."""
    doc = batch["document_ids"]
    s = doc.shape[1]
    if s < size:
        raise ValueError(f"a row of {s} tokens cannot be split over {size} ranks")
    bounds = (balanced_bounds(cost.sum(0), size) if cost is not None
              else [min(r * -(-s // size), s) for r in range(size + 1)])
    if cost is None and any(b1 <= b0 for b0, b1 in zip(bounds, bounds[1:], strict=False)):
        bounds = balanced_bounds(torch.ones(s), size)
    lo, own = bounds[rank], bounds[rank + 1] - bounds[rank]
    width = max(b1 - b0 for b0, b1 in zip(bounds, bounds[1:], strict=False))

    def rows(key: str, x: Tensor, first: int, n: int) -> Tensor:
        part = x[:, first:first + n]
        if part.shape[1] < n:
            pad = x.new_full((x.shape[0], n - part.shape[1], *x.shape[2:]), FILLS.get(key, 0))
            part = torch.cat([part, pad], dim=1)
        return part

    local = {k: rows(k, v, lo, own + halo) for k, v in batch.items()}
    keys_row = torch.full((size * width,), -1, dtype=torch.long)
    keys_doc = torch.full((doc.shape[0], size * width), -2, dtype=doc.dtype)
    for r, (b0, b1) in enumerate(zip(bounds, bounds[1:], strict=False)):
        keys_row[r * width:r * width + b1 - b0] = torch.arange(b0, b1)
        keys_doc[:, r * width:r * width + b1 - b0] = doc[:, b0:b1]
    return local, ContextShard(rank=rank, size=size, lo=lo, own=own, width=width, keys_row=keys_row,
                               keys_doc=keys_doc, group=group)


__all__ = ["ContextShard", "balanced_bounds", "split_batch"]
