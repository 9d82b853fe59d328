"""A fresh draft's start fitted on the run's first micro-batch: the scale of what its ``fc`` reads and
of a head copied from the target (:func:`fit_start`), probed and set before the engine wraps it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from eagle3.distributed import print0
from eagle3.train.config import InitSpec
from eagle3.train.step import train_forward

HEAD_SCALES = tuple(2.0 ** (-k / 2) for k in range(33))
"""The factors :func:`fit_start` tries on a copied head, in order until the loss rises: 1 down to
2^-16, half an octave apart."""


class _TargetsOnce:
    """A target head whose :meth:`targets` is computed on the first call and then returned as is
    (the probes below run one batch through the draft many times)."""

    def __init__(self, head: Any) -> None:
        self.head, self.computed = head, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.head, name)

    def targets(self, *args: Any, **kwargs: Any) -> Any:
        if self.computed is None:
            self.computed = self.head.targets(*args, **kwargs)
        return self.computed


SHARP = 4.0
"""``auto`` refits a copied start when the untrained draft's logits spread (std over the draft vocab)
more than this many times the target's on the first micro-batch: measured 22x on Gemma-3-270M, whose
copied start does not learn, and 1.2-1.3x on SmolLM2-135M, whose copied start beats a refitted one at the
quickstart's scale (docs/experiments.md, 2026-11-28)."""


def _logit_spreads(model: Any, head: Any, batch: dict[str, Tensor], t2d: Tensor, device: torch.device,
                   loss_positions: str) -> tuple[float, float]:
    """(the draft's, the target's) logits' std over the draft vocab, averaged over the positions: the
    draft's as its forward computes them on ``batch``, the target's from the batch's last-layer states."""
    seen: list[Tensor] = []
    hook = model.draft.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach().float().flatten(0, -2)))
    try:
        train_forward(model, head, batch, t2d, torch.float32, device, loss_positions)
    finally:
        hook.remove()
    w = head.lm_head.weight
    x = head.norm(batch["last"][batch["document_ids"] >= 0].to(device=device, dtype=w.dtype))
    target = head.transform((x @ w[t2d.nonzero().squeeze(1).to(w.device)].T).float())
    return float(torch.cat(seen).std(-1).mean()), float(target.std(-1).mean())


@torch.no_grad()
def fit_start(init: InitSpec, positions: str, model: Any, head: Any,
              first_batch: Callable[[], dict[str, Tensor]] | None, t2d: Tensor, device: torch.device) -> dict[str, Any]:
    """A fresh draft's start, set on the run's first micro-batch (``first_batch()``, read only when
    something may be set: host tensors, as the loader builds them; every rank reads the same one, so
    every rank starts the same draft). Nothing is set for a resumed run (``first_batch`` None: the
    checkpoint holds the weights) or one continuing ``train.init.draft``:

    - ``train.init.aux_scale=unit``: each channel of what ``fc`` reads at unit RMS over the batch's
      tokens (:meth:`DraftHead.scale_aux_inputs`);
    - ``train.init.head_scale=fit`` (with ``init.lm_head=target``): the copied head rows times the
      factor of :data:`HEAD_SCALES` whose untrained draft has the lowest loss on the batch (the
      loss is convex in that factor, so the search stops once it rises). A head copied from the
      target is as sharp as the target's on the target's own states; on an untrained draft's
      states it can be far sharper (Gemma-3's final norm scales some channels by 300), and a start
      that confident and wrong learns slowly;
    - ``auto`` (either key, with ``init.lm_head=target``): ``unit`` / ``fit`` when the copied start's
      logits spread more than :data:`SHARP` times the target's, else ``none`` / ``one``.

    Returns what was probed and set, for the run's summary. ``model`` is the :class:`TTTModel`
    before the engine wraps it (fp32 weights); no random number is drawn."""
    draft = model.draft
    out: dict[str, Any] = {}
    if first_batch is None or init.draft or (init.aux_scale == "none" and init.head_scale == "one"):
        return out
    batch = first_batch()
    head = _TargetsOnce(head)  # the batch's target distribution, computed once for every forward below
    was_training = model.training
    model.eval()  # no feature noise: nothing random is drawn
    sharp = False
    if "auto" in (init.aux_scale, init.head_scale) and init.lm_head == "target":
        if "last" in batch:
            spread, target = _logit_spreads(model, head, batch, t2d, device, positions)
            sharp = spread > SHARP * target
            out["logit_std"] = {"copied": round(spread, 4), "target": round(target, 4), "refit": sharp}
        else:
            print0("train: a top-k store has no last-layer states to probe the copied head with; auto keeps it")
    if init.aux_scale == "unit" or (init.aux_scale == "auto" and sharp):
        real = batch["document_ids"] >= 0
        factor = draft.scale_aux_inputs(batch["aux"][real].to(device))
        out["aux_scale"] = {"min": round(float(factor.min()), 6), "median": round(float(factor.median()), 6),
                            "max": round(float(factor.max()), 6)}
    if init.lm_head == "target" and (init.head_scale == "fit" or (init.head_scale == "auto" and sharp)):
        weight = draft.lm_head.weight
        copied = weight.detach().clone()
        losses: list[float] = []
        for scale in HEAD_SCALES:  # convex in the factor: past the minimum the loss only rises
            weight.copy_(copied * scale)
            result, _ = train_forward(model, head, batch, t2d, torch.float32, device, positions)
            losses.append(float(result.loss))
            if len(losses) > 1 and losses[-1] >= losses[-2]:
                break
        best = min(range(len(losses)), key=lambda i: (losses[i], i))
        weight.copy_(copied * HEAD_SCALES[best])
        out["head_scale"] = round(HEAD_SCALES[best], 6)
        out["first_batch_loss"] = {"copied": round(losses[0], 4), "fitted": round(losses[best], 4)}
    model.train(was_training)
    print0(f"train: the draft's start, probed on the first micro-batch: {json.dumps(out)}")
    return out
