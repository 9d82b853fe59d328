"""The one HF capture: a target's aux states and last state for batches of token sequences, and a
shard of the harvest plan computed with fixed batches (the harvest, online producers and
co-located training all call these, so their states are the same bytes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from eagle3.errors import Eagle3Error
from eagle3.store.shards import Sample
from eagle3.target.model import Target


class CaptureError(Eagle3Error, RuntimeError):
    """The target produced states that cannot be trained on (NaN/Inf)."""


class HFCapture:
    """Batched capture with the project's one HF capture (:class:`eagle3.target.model.Target`)."""

    def __init__(self, target: Target, topk: int = 0) -> None:
        self.target, self.topk = target, topk

    def capture(self, sequences: Sequence[Sequence[int]]) -> list[dict[str, torch.Tensor]]:
        width = max(len(s) for s in sequences)
        pad = self.target.tokenizer.pad_token_id or 0
        ids = torch.full((len(sequences), width), pad, dtype=torch.long)  # [batch, width], right-padded
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for r, seq in enumerate(sequences):
            ids[r, : len(seq)] = torch.tensor(list(seq))
            mask[r, : len(seq)] = 1
        out = self.target(ids.to(self.target.device), attention_mask=mask.to(self.target.device),
                          return_logits=False)
        rows = []
        for r, seq in enumerate(sequences):
            n = len(seq)
            row = {"aux": out.aux[r, :n].float().cpu(), "last": out.last[r, :n].float().cpu()}  # [T, A, H], [T, H]
            if self.topk:
                logprobs = torch.log_softmax(self.target.head(out.last[r, :n]).float(), dim=-1)  # [T, V]
                values, indices = logprobs.topk(self.topk, dim=-1)
                row = {"aux": row["aux"], "topk_ids": indices.cpu(), "topk_logprobs": values.cpu()}
            rows.append(row)
        return rows


def check_states(sample_id: str, row: dict[str, torch.Tensor]) -> None:
    for name, tensor in row.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CaptureError(f"sample {sample_id}: the target produced NaN/Inf in {name}; "
                               "the sample is rejected (check the target's dtype and weights)")


def capture_rows(backend: Any, items: Sequence[tuple[int, str, Sequence[int]]], batch_size: int,
                 on_batch: Any = None) -> dict[int, dict[str, torch.Tensor]]:
    """``{index: its states}`` for ``items`` = (index, sample id, token ids): sorted by length
    (then index) and captured ``batch_size`` at a time, each row checked finite; ``on_batch(tokens)``
    after each batch."""
    order = sorted(items, key=lambda item: (len(item[2]), item[0]))
    rows: dict[int, dict[str, torch.Tensor]] = {}
    for k in range(0, len(order), batch_size):
        batch = order[k : k + batch_size]
        for (i, sample_id, _), row in zip(batch, backend.capture([ids for _, _, ids in batch]), strict=True):
            check_states(sample_id, row)
            rows[i] = row
        if on_batch is not None:
            on_batch(sum(len(ids) for _, _, ids in batch))
    return rows


def capture_shard(backend: Any, samples: Sequence[tuple[str, list[int], list[int]]], span: tuple[int, int],
                  batch_size: int, on_batch: Any = None) -> list[Sample]:
    """The samples ``span`` = [a, b) of the plan with their states: similar lengths batched together
    (fixed for the shard, so a rerun, or an online producer, computes the very same batches and
    bytes); ``on_batch(tokens)`` after each batch."""
    a, b = span
    rows = capture_rows(backend, [(i, samples[i][0], samples[i][1]) for i in range(a, b)], batch_size, on_batch)
    return [Sample(id=samples[i][0], input_ids=torch.tensor(samples[i][1]),
                   loss_mask=torch.tensor(samples[i][2], dtype=torch.bool), **rows[i]) for i in range(a, b)]


__all__ = ["CaptureError", "HFCapture", "capture_rows", "capture_shard", "check_states"]
