"""What each TTT step's draft distribution is trained against the target's, per position.

All functions take the draft's logits over its vocabulary ``[..., Vd]`` and the target's
probabilities ``p`` restricted to the draft vocabulary and renormalised ``[..., Vd]`` (rows with no
draft-vocab mass are all zeros), and return one value per position ``[...]``; the trainer sums
them over each step's loss positions and weights the steps.

- ``soft_ce``: -sum p log q, the EAGLE-3 objective.
- ``tv``: 1 - alpha, where alpha = sum min(p, q) is the probability that a token the draft samples
  is accepted by speculative sampling (1 - alpha is the total-variation distance of p and q).
- ``nla``: -log alpha (alpha floored at ``ALPHA_FLOOR``), steeper where acceptance is low.
- ``lk_hybrid``: lambda KL(p || q) + (1 - lambda)(1 - alpha), lambda = exp(-eta alpha) with alpha
  detached: KL's dense gradient while the draft is far from the target, the acceptance objective
  as it gets close.

The acceptance objectives and their hybrid are the LK losses of arXiv 2602.23881 (its authors
report up to 8-10% longer acceptance); ``tv``, ``nla`` and ``lk_hybrid`` follow the per-position
forms of speculators' ``--loss-fn`` (``src/speculators/losses/eager.py``: eta 3, floor 1e-5).
None changes what is served: the draft's architecture and export are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

LOSSES = ("soft_ce", "tv", "nla", "lk_hybrid")
"""The objectives ``train.loss.kind`` names."""
ALPHA_FLOOR = 1e-5


def soft_cross_entropy(logits: Tensor, target_probs: Tensor) -> Tensor:
    """[..., Vd] draft logits and target probabilities -> [...] -sum p log q."""
    return -(target_probs * F.log_softmax(logits.float(), dim=-1)).sum(-1)


def acceptance(logits: Tensor, target_probs: Tensor) -> Tensor:
    """[..., Vd], [..., Vd] -> [...] alpha = sum min(p, q): the chance speculative sampling accepts
    a token drawn from the draft's q."""
    return torch.minimum(target_probs, torch.softmax(logits.float(), dim=-1)).sum(-1)


def kl_divergence(logits: Tensor, target_probs: Tensor) -> Tensor:
    """[..., Vd], [..., Vd] -> [...] KL(p || q) = sum p (log p - log q), 0 log 0 taken as 0."""
    log_p = torch.where(target_probs > 0, target_probs.clamp_min(1e-30).log(), 0.0)
    return (target_probs * log_p).sum(-1) + soft_cross_entropy(logits, target_probs)


def draft_loss(name: str, logits: Tensor, target_probs: Tensor, eta: float = 3.0) -> Tensor:
    """The loss ``name`` (one of :data:`LOSSES`) at every position: [..., Vd], [..., Vd] -> [...]."""
    if name == "soft_ce":
        return soft_cross_entropy(logits, target_probs)
    alpha = acceptance(logits, target_probs)  # [...]
    if name == "tv":
        return 1.0 - alpha
    if name == "nla":
        return -alpha.clamp_min(ALPHA_FLOOR).log()
    if name == "lk_hybrid":
        weight = torch.exp(-eta * alpha.detach())  # [...] lambda: KL's share
        return weight * kl_divergence(logits, target_probs) + (1.0 - weight) * (1.0 - alpha)
    raise ValueError(f"loss {name!r}: expected one of {', '.join(LOSSES)}")


@dataclass(frozen=True)
class Objective:
    """A loss of :data:`LOSSES` and its setting, what the TTT unroll applies at each step's rows."""

    name: str = "soft_ce"
    eta: float = 3.0  # lk_hybrid: lambda = exp(-eta alpha)

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise ValueError(f"loss {self.name!r}: expected one of {', '.join(LOSSES)}")

    def __call__(self, logits: Tensor, target_probs: Tensor) -> Tensor:
        return draft_loss(self.name, logits, target_probs, self.eta)


SOFT_CE = Objective()
"""The default: EAGLE-3's soft cross-entropy."""

__all__ = ["ALPHA_FLOOR", "LOSSES", "SOFT_CE", "Objective", "acceptance", "draft_loss", "kl_divergence",
           "soft_cross_entropy"]
