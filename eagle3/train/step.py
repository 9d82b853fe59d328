"""The module the trainer's DeepSpeed engine wraps and one batch through it: the draft with its
training forward (its family's, :mod:`eagle3.draft.families`) as :class:`TTTModel`, and :func:`train_forward`
taking a batch from the host (as the loader builds it) to the loss on the device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from eagle3.device import to_device
from eagle3.distributed import ContextGroup
from eagle3.draft.context import ContextShard, split_batch
from eagle3.draft.families import family_of
from eagle3.draft.losses import SOFT_CE, Objective
from eagle3.draft.model import DraftHead
from eagle3.draft.target_head import TargetHead, needed_rows
from eagle3.draft.ttt import RowLayout, TTTOutput, TTTTargets, layout_rows, read_mask, step_weights
from eagle3.errors import TrainError


def add_feature_noise(aux: Tensor, scale: float) -> Tensor:
    """aux [.., A, H_t] plus Gaussian noise whose std is ``scale`` times each state's RMS (the
    target's layers differ in scale by orders of magnitude, so an absolute noise would drown the
    shallow states and miss the deep ones). Drawn from torch's global generator, which
    checkpoints save and restore."""
    x = aux.float()
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()  # [.., A, 1]
    return (x + scale * rms * torch.randn_like(x)).to(aux.dtype)


class TTTModel(nn.Module):
    """The module the DeepSpeed engine wraps: the draft and its TTT unroll; returns tensors only."""

    def __init__(self, draft: DraftHead, num_steps: int, step_decay: float,
                 gradient_checkpointing: bool = False, loss_on_oov: bool = False, feature_noise: float = 0.0,
                 gate_steps: bool = False, objective: Objective = SOFT_CE) -> None:
        super().__init__()
        self.draft = draft
        self.objective = objective
        self.loss_on_oov = loss_on_oov
        self.gate_steps = gate_steps
        self.feature_noise = feature_noise
        self.num_steps = num_steps
        self.weights = step_weights(num_steps, step_decay)
        self.gradient_checkpointing = gradient_checkpointing

    def forward(self, input_ids: Tensor, aux: Tensor, position_ids: Tensor, document_ids: Tensor,
                loss_mask: Tensor, target_probs: Tensor, target_argmax: Tensor,
                layout: RowLayout | None = None, shard: ContextShard | None = None,
                target_weight: Tensor | None = None) -> tuple[Tensor, ...]:
        if self.training and self.feature_noise > 0:
            aux = add_feature_noise(aux, self.feature_noise)
        sharded = {} if shard is None else {"shard": shard}  # only the families that split a row take one
        out = family_of(self.draft.config).forward(self.draft, input_ids, aux, position_ids, document_ids, loss_mask,
                          TTTTargets(probs=target_probs, argmax=target_argmax, weight=target_weight),
                          num_steps=self.num_steps,
                          weights=self.weights, gradient_checkpointing=self.gradient_checkpointing and self.training,
                          loss_on_oov=self.loss_on_oov, gate_steps=self.gate_steps, objective=self.objective,
                          layout=layout, **sharded)
        return out.loss, out.loss_sum, out.count, out.match, out.counted


def run_batch(engine: Any, head: TargetHead, batch: dict[str, Tensor], t2d: Tensor, dtype: torch.dtype,
         device: torch.device, context: ContextGroup | None = None,
         weigh: Callable[[dict[str, Tensor], Tensor], Tensor | None] | None = None) -> TTTOutput:
    """One batch as the loader builds it, on the host, through the engine on ``device`` (with a
    ``context`` group of several ranks: this rank's rows of it, :mod:`eagle3.draft.context`);
    ``weigh(batch, target_probs)``: the loss weight of each position (training only,
    :mod:`eagle3.train.token_weights`).

    What depends on the data's masks (the rows the target head and each step read) is worked out
    here, on the host, before the batch moves: the device then never reports a count back, which on
    CUDA would make the host wait for it (``tests/test_device.py`` counts such syncs)."""
    model = getattr(engine, "module", engine)  # the TTTModel, inside DeepSpeed's engine or not
    shard = None
    if context is not None and context.size > 1:
        cost = 1 + model.num_steps * read_mask(batch["loss_mask"], batch["document_ids"], model.num_steps).long()
        if batch["document_ids"].shape[1] < context.size:
            raise TrainError(f"train.context_parallel={context.size}: a batch row of {batch['document_ids'].shape[1]} "
                             "tokens cannot be split over that many ranks (raise train.data.micro_batch_tokens)")
        batch, shard = split_batch(batch, context.rank, context.size, model.num_steps + 1, context.group, cost)
    layout = layout_rows(batch["loss_mask"], batch["document_ids"], model.num_steps, own=shard and shard.own)
    rows = needed_rows(batch["loss_mask"], batch["document_ids"]) if "last" in batch else None
    batch = to_device(batch, device)
    targets = head.targets(batch, t2d, rows=None if rows is None else to_device(rows, device))
    if shard is not None:
        shard = replace(shard, keys_doc=to_device(shard.keys_doc, device), keys_row=to_device(shard.keys_row, device))
    weight = None if weigh is None else weigh(batch, targets.probs)
    loss, loss_sum, count, match, counted = engine(batch["input_ids"], batch["aux"].to(dtype), batch["position_ids"],
                                                   batch["document_ids"], batch["loss_mask"], targets.probs,
                                                   targets.argmax, layout=to_device(layout, device), shard=shard,
                                                   target_weight=weight)
    return TTTOutput(loss=loss, loss_sum=loss_sum, count=count, match=match, counted=counted, valid=counted)


def train_forward(engine: Any, head: TargetHead, batch: dict[str, Tensor], t2d: Tensor, dtype: torch.dtype,
                  device: torch.device, loss_positions: str = "replies",
                  context: ContextGroup | None = None,
                  weigh: Callable[[dict[str, Tensor], Tensor], Tensor | None] | None = None
                  ) -> tuple[TTTOutput, Tensor]:
    """A training micro-batch's forward (``batch`` on the host, as the loader builds it): its output
    and its [loss, tokens] (float64, on ``device``, to be summed over micro-batches and ranks
    without a host sync; a context group's tokens counted by its first rank)."""
    tokens = (batch["document_ids"] >= 0).sum()  # every token, padding excepted
    if context is not None and context.rank > 0:
        tokens = tokens * 0
    if loss_positions == "all":
        batch = {**batch, "loss_mask": batch["document_ids"] >= 0}  # [B, S]
    out = run_batch(engine, head, batch, t2d, dtype, device, context, weigh)
    return out, torch.stack([out.loss.detach().double(), to_device(tokens.double(), device)])


__all__ = ["TTTModel", "add_feature_noise", "run_batch", "train_forward"]
