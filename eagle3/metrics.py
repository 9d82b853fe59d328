"""Acceptance metrics summed over batches and ranks before the ratios are taken."""

from __future__ import annotations

import torch
from torch import Tensor

from eagle3.distributed import all_reduce_sum
from eagle3.ttt import TTTOutput


class AcceptanceTally:
    """Sums behind per-step accuracy, conditional acceptance and tau_sim (as in :mod:`eagle3.ttt`),
    so that batches and ranks can be added up before the ratios are taken."""

    def __init__(self, num_steps: int, device: torch.device) -> None:
        self.k = num_steps
        # hits, counted, upto, before, loss_sum, loss_count [K] each; then accepted, starts
        self.values = torch.zeros(6 * num_steps + 2, dtype=torch.float64, device=device)

    def add(self, out: TTTOutput) -> None:
        k = self.k
        hit = (out.match & out.counted).flatten(1).long()  # [K, N]
        upto = torch.cumprod(hit, dim=0)  # [K, N] steps 0..k all matched
        before = torch.cat([torch.ones_like(upto[:1]), upto[:-1]]).bool() & out.counted.flatten(1)  # [K, N]
        start = out.counted[0].flatten()  # [N]
        v = self.values
        v[0:k] += hit.sum(1)
        v[k:2 * k] += out.counted.flatten(1).sum(1)
        v[2 * k:3 * k] += upto.sum(1)
        v[3 * k:4 * k] += before.sum(1)
        v[4 * k:5 * k] += out.loss_sum.detach().double()
        v[5 * k:6 * k] += out.count.double()
        v[6 * k] += upto.sum(0)[start].sum()
        v[6 * k + 1] += start.sum()

    def all_reduce(self) -> AcceptanceTally:
        all_reduce_sum(self.values)
        return self

    def summary(self, weights: Tensor, prefix: str) -> dict[str, float]:
        k, v = self.k, self.values.cpu()
        acc = v[0:k] / v[k:2 * k].clamp_min(1)
        cond = v[2 * k:3 * k] / v[3 * k:4 * k].clamp_min(1)
        step_loss = v[4 * k:5 * k] / v[5 * k:6 * k].clamp_min(1)
        tau = 1.0 + float(v[6 * k] / v[6 * k + 1]) if v[6 * k + 1] > 0 else 1.0
        out = {f"{prefix}/loss": float((weights * step_loss).sum()), f"{prefix}/tau_sim": tau,
               f"{prefix}/positions": int(v[6 * k + 1])}
        out |= {f"{prefix}/acc_{i}": float(acc[i]) for i in range(k)}
        out |= {f"{prefix}/cond_acc_{i}": float(cond[i]) for i in range(k)}
        return out


__all__ = ["AcceptanceTally"]
