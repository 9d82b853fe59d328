"""Which tokens the training loss weighs, and how much (``train.loss.hard_tokens``, ``train.loss.token_weights``).

Two sources multiply into one loss weight per position, :attr:`eagle3.draft.targets.TTTTargets.weight`
([B, S]: the weight of learning p[t], the target's distribution over x[t+1], at every TTT step that
predicts x[t+1]); each step's loss is then the weighted mean over its positions:

* **hard tokens**, from the target itself: a position whose target distribution (over the draft
  vocab) has an entropy above ``hard_token_entropy`` nats is one no draft can fit well (published:
  GRIFFIN, AdaSPEC, EDSD); ``downweight`` gives it ``hard_token_weight`` (0 drops it), ``phase_in``
  starts it there and raises it linearly to 1 at the last step. The threshold is absolute, so a
  position's weight never depends on what it is batched or sharded with.
* **listed tokens**, from a file ``{sample_id: [[token index, weight], ...]}``: mining's error replay
  weighs up the tokens the draft failed to propose (:mod:`hard_mining.replay`).

Matches, tau_sim and the eval loss count every position unweighted: weights change what is
learned, never what is measured.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from eagle3.errors import TrainError


def target_entropy(probs: Tensor) -> Tensor:
    """[..., Vd] probabilities -> [...] entropy in nats (0 for rows without mass)."""
    logs = torch.where(probs > 0, probs.clamp_min(1e-30).log(), 0.0)
    return -(probs * logs).sum(-1)


def read_token_weights(path: str | None, sample_ids: Sequence[str]) -> dict[str, list[tuple[int, float]]]:
    """``train.loss.token_weights`` read and checked: sample id -> [(token index, weight)], weights finite
    and >= 0; none of its ids in the store is refused (the wrong file)."""
    if not path:
        return {}
    key = f"train.loss.token_weights={path}"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise TrainError(f"{key}: {err}") from None
    if not isinstance(data, dict):
        raise TrainError(f"{key}: expected a JSON object of sample id -> [[token index, weight], ...]")
    out: dict[str, list[tuple[int, float]]] = {}
    for sample_id, pairs in data.items():
        ok = isinstance(pairs, list) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and p[0] >= 0
            and isinstance(p[1], (int, float)) and math.isfinite(p[1]) and p[1] >= 0 for p in pairs)
        if not ok:
            raise TrainError(f"{key}: sample {sample_id!r}: expected [[token index >= 0, weight >= 0], ...]")
        out[str(sample_id)] = [(int(j), float(w)) for j, w in pairs]
    if out and not set(out) & set(sample_ids):
        raise TrainError(f"{key}: none of its ids is a sample of the training store (e.g. {next(iter(out))!r}; "
                         f"the store's: {list(sample_ids[:1])})")
    return out


@dataclass
class TokenWeights:
    """The loss weights of a training run: built from its settings, asked per micro-batch."""

    listed: dict[str, list[tuple[int, float]]]
    hard_tokens: str = "keep"
    max_entropy: float = 2.0
    hard_weight: float = 0.0
    steps: int = 1

    @property
    def active(self) -> bool:
        return bool(self.listed) or self.hard_tokens != "keep"

    def hard_weight_at(self, step: int) -> float:
        """The weight of a hard position at optimizer step ``step`` (0-based)."""
        if self.hard_tokens == "phase_in":
            return self.hard_weight + (1.0 - self.hard_weight) * min(step / max(self.steps - 1, 1), 1.0)
        return self.hard_weight

    def attach(self, batch: dict[str, Tensor], sample_ids: Sequence[str], batching: str) -> dict[str, Tensor]:
        """``batch`` (as :func:`eagle3.store.batches.collate` built it from the samples ``sample_ids``, in
        order) with ``token_weight`` [B, S]: the listed tokens' weights at the position that predicts
        them (token j: position j - 1), 1 elsewhere. Unchanged when none of its samples is listed."""
        if not any(i in self.listed for i in sample_ids):
            return batch
        weight = torch.ones(batch["input_ids"].shape, dtype=torch.float32)  # [B, S]
        docs, positions = batch["document_ids"], batch["position_ids"]
        for n, sample_id in enumerate(sample_ids):
            pairs = self.listed.get(sample_id)
            if not pairs:
                continue
            row, doc = (0, n) if batching == "pack" else (n, 0)
            where = (docs[row] == doc).nonzero().flatten()  # [T] this sample's columns, in order
            first, length = int(where[0]), len(where)
            for j, w in pairs:
                if 1 <= j < length and int(positions[row, first + j - 1]) == j - 1:
                    weight[row, first + j - 1] = w
        return {**batch, "token_weight": weight}

    def __call__(self, batch: dict[str, Tensor], probs: Tensor, step: int) -> Tensor | None:
        """The loss weight [B, S] of a micro-batch (on its device) given its target probabilities
        [B, S, Vd]; None where every position weighs 1."""
        weight = batch.get("token_weight")
        if self.hard_tokens != "keep":
            w = self.hard_weight_at(step)
            if w != 1.0:
                hard = target_entropy(probs) > self.max_entropy  # [B, S]
                factor = torch.where(hard, w, 1.0)
                weight = factor if weight is None else weight.to(factor.device) * factor
        return weight


__all__ = ["TokenWeights", "read_token_weights", "target_entropy"]
