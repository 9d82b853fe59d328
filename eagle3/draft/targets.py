"""What the draft learns from at each position: the target's distribution restricted to the draft
vocabulary and renormalised, and the target's argmax (the token greedy verification accepts), from
the target's logits, probabilities or a top-k store's log-probs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TTTTargets:
    probs: Tensor  # [B, S, Vd] float32: p[t] restricted to the draft vocab, renormalised
    argmax: Tensor  # [B, S] int64: the target's argmax at t (a target id)
    weight: Tensor | None = None
    """[B, S] float32: the loss weight of learning p[t] at every step that predicts x[t+1] (None: 1
    everywhere); 0 leaves the position out of the loss, never out of the matches
    (:mod:`eagle3.train.token_weights`)."""


def prepare_targets(target: Tensor, t2d: Tensor, *, are_probs: bool = False, temperature: float = 1.0) -> TTTTargets:
    """From the target's logits or log-probs (or, with ``are_probs``, probabilities) [B, S, V].

    ``t2d``: the draft vocab, a [V] bool mask or its [Vd] target ids in ascending order (the same
    columns; the ids spare CUDA the host sync a boolean index costs). ``temperature`` divides the
    scores before the softmax (< 1 sharpens the distribution the draft learns from; the argmax
    stays). Callers with a large vocabulary can run this on slices of S and concatenate.
    """
    scores = target.float().log() if are_probs else target.float()  # [B, S, V]
    sub = scores[..., t2d.to(target.device)]  # [B, S, Vd] (ids: a gather; a mask: nonzero first)
    probs = torch.nan_to_num(torch.softmax(sub / temperature, dim=-1), nan=0.0)  # no draft-vocab mass -> 0
    return TTTTargets(probs=probs, argmax=target.argmax(-1))


def prepare_targets_from_topk(topk_ids: Tensor, topk_logprobs: Tensor, t2d: Tensor,
                              temperature: float = 1.0, draft_vocab_size: int | None = None) -> TTTTargets:
    """From a ``store=topk`` harvest: the target's top-K ids and log-probs [B, S, K].

    The distribution is the top-K restricted to the draft vocab and renormalised (log-probs
    divided by ``temperature`` first); the argmax is the top-1 id (outside the draft vocab ->
    masked, as with full logits). ``draft_vocab_size``: ``t2d.sum()`` where the caller knows it
    (reading it from the device makes CUDA sync).
    """
    t2d = t2d.to(topk_ids.device)
    draft_id = torch.cumsum(t2d.long(), 0) - 1  # [V] draft id of each target id (where t2d)
    inside = t2d[topk_ids]  # [B, S, K]
    vd = int(t2d.sum()) if draft_vocab_size is None else draft_vocab_size
    sub = topk_logprobs.float().new_full((*topk_ids.shape[:-1], vd), float("-inf"))  # [B, S, Vd]
    # ids outside the draft vocab go to column 0 as -inf; amax keeps a real value there
    sub.scatter_reduce_(-1, torch.where(inside, draft_id[topk_ids], 0),
                        torch.where(inside, topk_logprobs.float(), float("-inf")), reduce="amax")
    probs = torch.nan_to_num(torch.softmax(sub / temperature, dim=-1), nan=0.0)
    best = topk_logprobs.argmax(-1, keepdim=True)  # [B, S, 1]
    return TTTTargets(probs=probs, argmax=topk_ids.gather(-1, best).squeeze(-1))


__all__ = ["TTTTargets", "prepare_targets", "prepare_targets_from_topk"]
