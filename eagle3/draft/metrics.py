"""Acceptance metrics, one definition each, for the trainer, mining and the serving reports.

Simulated (from a TTT unroll: ``match`` and ``counted`` are ``[K, ...]``, step k's draft argmax
equal to the target's and whether that position counts): the accuracy per step, the conditional
acceptance (step k's accuracy among positions whose earlier steps all matched) and ``tau_sim``,
1 + the mean over starts of the run of matches. :class:`AcceptanceTally` keeps the sums behind
them so that batches and ranks add up before the ratios are taken.

Served (from the speculative loop's rounds: ``accepted`` draft tokens per verify forward, and the
depth each round proposed): tau, the mean tokens per verify forward with the bonus token, and the
acceptance per position. The trainer's tau_sim is what the served tau would be for a chain as deep
as the unroll, greedy, with the target's own states.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from eagle3.distributed import all_reduce_sum
from eagle3.draft.ttt import TTTOutput

# ---------------------------------------------------------------- simulated, [K, ...] inputs


def step_hits(match: Tensor, counted: Tensor) -> Tensor:
    """[K, N] 1 where step k matched at a counted position (positions flattened)."""
    return (match & counted).flatten(1).long()


def accepted_runs(match: Tensor, counted: Tensor) -> tuple[Tensor, Tensor]:
    """([N] draft tokens accepted from each start: the run of matches, a miss or an uncounted step
    ending it; [N] whether the position is a start, i.e. counted at step 0)."""
    return torch.cumprod(step_hits(match, counted), dim=0).sum(0), counted[0].flatten()


def upto_before(match: Tensor, counted: Tensor) -> tuple[Tensor, Tensor]:
    """([K, N] steps 0..k all matched, [K, N] steps 0..k-1 all matched and step k counted)."""
    upto = torch.cumprod(step_hits(match, counted), dim=0)
    before = torch.cat([torch.ones_like(upto[:1]), upto[:-1]]).bool() & counted.flatten(1)
    return upto, before


class AcceptanceTally:
    """Sums behind per-step accuracy, conditional acceptance and tau_sim, so that batches and ranks
    can be added up before the ratios are taken."""

    def __init__(self, num_steps: int, device: torch.device) -> None:
        self.k = num_steps
        # hits, counted, upto, before, loss_sum, loss_count [K] each; then accepted, starts
        self.values = torch.zeros(6 * num_steps + 2, dtype=torch.float64, device=device)

    def add(self, out: TTTOutput) -> None:
        k, v = self.k, self.values
        upto, before = upto_before(out.match, out.counted)
        run, start = accepted_runs(out.match, out.counted)
        v[0:k] += step_hits(out.match, out.counted).sum(1)
        v[k:2 * k] += out.counted.flatten(1).sum(1)
        v[2 * k:3 * k] += upto.sum(1)
        v[3 * k:4 * k] += before.sum(1)
        v[4 * k:5 * k] += out.loss_sum.detach().double()
        v[5 * k:6 * k] += out.count.double()
        v[6 * k] += torch.where(start, run, 0).sum()  # not run[start]: a boolean index makes CUDA sync
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


# ---------------------------------------------------------------- served, per verify round


def served_tau(accepted: Sequence[int]) -> float:
    """Mean tokens per verify forward, the bonus token included (1.0 with no rounds: plain decoding)."""
    return sum(a + 1 for a in accepted) / len(accepted) if accepted else 1.0


def acceptance_per_position(accepted: Sequence[int], depths: Sequence[int], k: int) -> list[float]:
    """For positions 1..k: the share of the rounds proposing a token that deep in which it was accepted."""
    out = []
    for i in range(1, k + 1):
        rounds = [a for a, d in zip(accepted, depths, strict=True) if d >= i]
        out.append(sum(a >= i for a in rounds) / len(rounds) if rounds else 0.0)
    return out


CONTEXT_EDGES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
"""Upper edges (tokens) of the context-length buckets acceptance is reported in: 0-1k, 1-2k, 2-4k, ..."""


CONTEXT_BUCKETS = (*(f"{lo // 1024}-{hi // 1024}k" for lo, hi in zip((0, *CONTEXT_EDGES), CONTEXT_EDGES, strict=False)),
                   f"{CONTEXT_EDGES[-1] // 1024}k+")
"""The buckets' labels, shortest first: ``0-1k``, ``1-2k``, ``2-4k``, ... ``256k+``."""


def context_bucket(tokens: int) -> str:
    """The bucket of a round whose first drafted token has ``tokens`` tokens before it (``4-8k``:
    4,096 <= tokens < 8,192; the last one open: ``256k+``)."""
    return CONTEXT_BUCKETS[bisect_right(CONTEXT_EDGES, tokens)]


PROPOSER_SOURCES = ("draft", "lookup", "both")
"""Who proposed an accepted token: the draft only, the lookup only, or both (the same token at the
same node of a hybrid round's tree)."""


def accepted_by_source(sources: Sequence[Sequence[int]]) -> dict[str, int]:
    """Accepted tokens per :data:`PROPOSER_SOURCES` over rounds of (draft, lookup, both) counts."""
    return {name: int(sum(r[i] for r in sources)) for i, name in enumerate(PROPOSER_SOURCES)}


def acceptance_by_group(accepted: Sequence[int], depths: Sequence[int], groups: Sequence[str],
                        order: Sequence[str], k: int,
                        sources: Sequence[Sequence[int]] | None = None) -> dict[str, dict[str, Any]]:
    """Per group (in ``order``, those with rounds): rounds, tau and acceptance per position of the
    rounds ``groups`` puts in it (one name per round); with ``sources`` (per round, accepted tokens
    by proposer), the accepted tokens of each group by proposer too."""
    rows: dict[str, list[int]] = {}
    for i, group in enumerate(groups):
        rows.setdefault(group, []).append(i)
    out = {}
    for group in (g for g in order if g in rows):
        acc, dep = [accepted[i] for i in rows[group]], [depths[i] for i in rows[group]]
        out[group] = {"rounds": len(acc), "tau": round(served_tau(acc), 4),
                      "accept_per_pos": [round(a, 4) for a in acceptance_per_position(acc, dep, k)]}
        if sources is not None:
            out[group]["accepted_by"] = accepted_by_source([sources[i] for i in rows[group]])
    return out


def acceptance_by_context(accepted: Sequence[int], depths: Sequence[int], contexts: Sequence[int],
                          k: int, sources: Sequence[Sequence[int]] | None = None) -> dict[str, dict[str, Any]]:
    """Per context-length bucket (shortest first, those with rounds): rounds, tau and acceptance per
    position of the rounds whose first drafted token had that much context before it (and, with
    ``sources``, their accepted tokens by proposer)."""
    return acceptance_by_group(accepted, depths, [context_bucket(t) for t in contexts], CONTEXT_BUCKETS, k,
                               sources)


REPLY_PARTS = ("answer", "thinking")


def acceptance_by_part(accepted: Sequence[int], depths: Sequence[int], thinking: Sequence[bool],
                       k: int) -> dict[str, dict[str, Any]]:
    """``answer`` and ``thinking`` (those with rounds): rounds, tau and acceptance per position of the
    rounds whose first drafted token is an answer token, or lies in the target's thinking block."""
    return acceptance_by_group(accepted, depths, [REPLY_PARTS[bool(t)] for t in thinking], REPLY_PARTS, k)


__all__ = ["CONTEXT_BUCKETS", "CONTEXT_EDGES", "PROPOSER_SOURCES", "REPLY_PARTS", "AcceptanceTally",
           "acceptance_by_context", "acceptance_by_group", "acceptance_by_part", "accepted_by_source",
           "acceptance_per_position",
           "accepted_runs", "context_bucket", "served_tau", "step_hits", "upto_before"]
