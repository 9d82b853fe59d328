"""Adaptive speculation: each round's chain depth from the running acceptance and a measured cost model.

A chain of depth k whose token at depth i is accepted with probability a_i given that depth i-1
was (conditional acceptance) emits on average::

    E[tokens | k] = 1 + sum_{j=1..k} prod_{i=1..j} a_i          (the bonus token is the 1)

and costs one target forward over 1 + k tokens plus k draft steps. The policy picks the k in
0..K with the most tokens per second, ``E[tokens | k] / cost(k)``; k = 0 is a plain decoding
step (the draft still catches up, so it can resume). The a_i are Beta-smoothed counts: this
request's own rounds on top of a prior (the server's running totals, or a neutral guess).
Rounds at k = 0 teach nothing, so after ``probe_every`` of them one round proposes depth 1.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3.device import synchronize


@dataclass
class CostModel:
    """Seconds of one round at each depth: ``verify_s[k]`` (a target forward over 1 + k tokens)
    and ``draft_step_s`` (one draft forward of one token; with ``parallel``, the one draft forward
    that proposes a whole round, as P-EAGLE and DFlash drafts do)."""

    verify_s: list[float]
    draft_step_s: float
    parallel: bool = False

    def __post_init__(self) -> None:
        if not self.verify_s or min(self.verify_s) <= 0 or self.draft_step_s < 0:
            raise ValueError(f"cost model: verify_s {self.verify_s} must be positive, draft_step_s "
                             f"{self.draft_step_s} >= 0")

    @property
    def max_depth(self) -> int:
        return len(self.verify_s) - 1

    def round_seconds(self, k: int, width: int | None = None) -> float:
        """A round of depth k: the verify and k draft forwards (the batched catch-up whose last row
        proposes the first token, then k - 1 chain steps), or one with ``parallel``; a depth-0 round
        runs no draft forward (its catch-up rows join the next speculating round's). ``width``: draft
        tokens verified when they are not k (a tree's budget)."""
        drafts = min(k, 1) if self.parallel else k
        return self.verify_s[k if width is None else width] + drafts * self.draft_step_s

    def as_dict(self) -> dict[str, Any]:
        return {"verify_ms": [round(1e3 * t, 2) for t in self.verify_s],
                "draft_step_ms": round(1e3 * self.draft_step_s, 3), "parallel": self.parallel}

    def speedup(self, tau: float, k: int, width: int | None = None) -> float:
        """Predicted speedup over plain decoding of rounds at depth k emitting ``tau`` tokens each."""
        return tau * self.verify_s[0] / self.round_seconds(k, width)

    def explain(self, k: int, tau: float | None = None, width: int | None = None) -> dict[str, float]:
        """Why a speedup is what it is here: t(1), t(w+1) (w = k, or a tree's budget), one draft step, the tau at which
        speculation breaks even, the ceiling (every draft token accepted, tau = k + 1), the
        prediction at ``tau``, and what that tau would give where verifying k + 1 tokens costs
        what one does (batch-1 decoding on a GPU, bound by reading the weights), the draft step's
        share of t(1) kept as measured here."""
        w = k if width is None else width
        t1, tw = self.verify_s[0], self.verify_s[w]
        out = {"k": k, "verified": w + 1, "t1_ms": round(1e3 * t1, 3), "t_verify_ms": round(1e3 * tw, 3),
               "draft_step_ms": round(1e3 * self.draft_step_s, 3),
               "break_even_tau": round(self.round_seconds(k, w) / t1, 3),
               "ceiling": round(self.speedup(k + 1, k, w), 3)}
        if tau is not None:
            out |= {"predicted_speedup": round(self.speedup(tau, k, w), 3),
                    "speedup_if_verify_is_flat": round(tau * t1 / (t1 + self.round_seconds(k, w) - tw), 3)}
        return out


def expected_tokens(conditional: Sequence[float], k: int) -> float:
    """Mean tokens a chain of depth k emits per round, given conditional acceptance per depth."""
    total, reach = 1.0, 1.0
    for a in conditional[:k]:
        reach *= a
        total += reach
    return total


def best_depth(conditional: Sequence[float], cost: CostModel, max_depth: int | None = None) -> int:
    """The depth with the most expected tokens per second (the shallowest among equals)."""
    top = cost.max_depth if max_depth is None else min(max_depth, cost.max_depth)
    rates = [expected_tokens(conditional, k) / cost.round_seconds(k) for k in range(top + 1)]
    return max(range(top + 1), key=lambda k: (rates[k], -k))


@dataclass
class AcceptanceCounts:
    """Per depth i (1-based): rounds that proposed depth i with depth i-1 accepted (trials), and
    those whose depth-i token was accepted (hits)."""

    trials: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)

    def add(self, depth: int, accepted: int) -> None:
        self._grow(depth)
        for i in range(min(accepted + 1, depth)):  # depths 1..accepted+1 were tried
            self.trials[i] += 1
            if i < accepted:
                self.hits[i] += 1

    def merge(self, other: AcceptanceCounts) -> None:
        self._grow(len(other.trials))
        for i, (t, h) in enumerate(zip(other.trials, other.hits, strict=True)):
            self.trials[i] += t
            self.hits[i] += h

    def conditional(self, depth: int, prior: Sequence[float], prior_weight: float) -> list[float]:
        """Beta-smoothed conditional acceptance for depths 1..depth."""
        out = []
        for i in range(depth):
            t = self.trials[i] if i < len(self.trials) else 0.0
            h = self.hits[i] if i < len(self.hits) else 0.0
            p = prior[i] if i < len(prior) else (prior[-1] if prior else 0.5)
            out.append((h + prior_weight * p) / (t + prior_weight))
        return out

    def _grow(self, depth: int) -> None:
        while len(self.trials) < depth:
            self.trials.append(0.0)
            self.hits.append(0.0)


@dataclass
class AdaptiveDepth:
    """A per-request :class:`serve_eval.spec_decode.DepthPolicy`."""

    cost: CostModel
    prior: list[float]
    """Conditional acceptance per depth assumed before this request has rounds of its own."""
    prior_weight: float = 8.0
    """How many rounds the prior counts for."""
    probe_every: int = 8
    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    chosen: list[int] = field(default_factory=list)
    _plain_run: int = 0

    def choose(self) -> int:
        k = best_depth(self.counts.conditional(self.cost.max_depth, self.prior, self.prior_weight), self.cost)
        if k == 0:
            self._plain_run += 1
            if self._plain_run > self.probe_every:
                self._plain_run, k = 0, 1
        else:
            self._plain_run = 0
        self.chosen.append(k)
        return k

    def observe(self, depth: int, accepted: int, kept_depth: int | None = None, kept: int | None = None) -> None:
        """Learns from what the target accepted, whether or not the reply kept it all."""
        if depth > 0:
            self.counts.add(depth, accepted)


class AdaptiveSession:
    """Adaptive depth across requests: each request's policy starts from what the finished ones
    measured (on top of ``prior``, e.g. the draft's own held-out acceptance)."""

    def __init__(self, cost: CostModel, max_depth: int, prior: Sequence[float] | None = None,
                 prior_weight: float = 16.0) -> None:
        self.cost, self.max_depth, self.prior_weight = cost, min(max_depth, cost.max_depth), prior_weight
        self.prior = list(prior) if prior else [0.5] * max(self.max_depth, 1)
        self.totals = AcceptanceCounts()

    def start(self) -> AdaptiveDepth:
        return AdaptiveDepth(self.cost, self.totals.conditional(self.max_depth, self.prior, self.prior_weight))

    def finish(self, policy: AdaptiveDepth) -> None:
        self.totals.merge(policy.counts)


def fit_linear(times: Sequence[float]) -> list[float]:
    """Least-squares ``a + b k`` through measured times (b >= 0): a verify forward costs a fixed part
    plus a part per token, and single medians on a loaded machine are not even monotonic."""
    n = len(times)
    if n == 1:
        return list(times)
    mean_k, mean_t = (n - 1) / 2, sum(times) / n
    var = sum((k - mean_k) ** 2 for k in range(n))
    b = max(sum((k - mean_k) * (t - mean_t) for k, t in enumerate(times)) / var, 0.0)
    a = mean_t - b * mean_k
    if a <= 0:  # keep every time positive
        a, b = min(times), max(b, 0.0)
    return [a + b * k for k in range(n)]


def measure_cost(decoder: Any, max_depth: int, context: int = 256, repeats: int = 5, seed: int = 0) -> CostModel:
    """Time the decoder's target over 1 + k tokens (k = 0..max_depth) after a ``context``-token
    prefix (medians of ``repeats``, fitted by :func:`fit_linear`) and one draft step (median); for
    a parallel family, its one forward proposing ``max_depth`` tokens."""
    from serve_eval.spec_decode import keep_accepted

    target, draft, device = decoder.target, decoder.draft, decoder.device
    rng = random.Random(seed)  # timing only: any ids
    vocab = target.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(context)]
    times: list[list[float]] = [[] for _ in range(max_depth + 1)]
    with torch.no_grad():
        cache = decoder.target_cache(context + max_depth + 1)  # the kind the decoder generates with
        out = decoder._target(prefix, cache)
        for r in range(repeats + 1):  # depths interleaved, so that a burst of load hits them alike
            for k in range(max_depth + 1):
                ids = [rng.randrange(vocab) for _ in range(1 + k)]
                synchronize(device)
                t0 = time.perf_counter()
                decoder._target(ids, cache)
                synchronize(device)
                if r > 0:  # the first pass warms up (compiles, where the decoder compiles its forwards)
                    times[k].append(time.perf_counter() - t0)
                keep_accepted(cache, context, [])
        verify = fit_linear([statistics.median(t) for t in times])
        step = 0.0
        proposer = decoder.proposer
        if proposer is not None:
            proposer.start(context + max_depth + repeats + 2)  # the kind the decoder drafts with
            times = []
            if proposer.one_forward:  # one forward proposes the round: one catch-up row and the masks
                proposer.proposal_logits(out.aux, prefix[1:] + [prefix[0]], 0, 1)
                for r in range(repeats + 1):
                    synchronize(device)
                    t0 = time.perf_counter()
                    proposer.proposal_logits(out.aux[:, -1:], [prefix[r]], context, max_depth)
                    synchronize(device)
                    times.append(time.perf_counter() - t0)
                    proposer.rollback(context)
                return CostModel(verify, statistics.median(times[1:]), parallel=True)
            proposer.catch_up(out.aux, prefix[1:] + [prefix[0]], 0)
            state = torch.zeros(1, 1, draft.config.hidden_size, dtype=draft.fc.weight.dtype, device=device)
            for r in range(repeats + 1):  # the first pass warms up (compiles, where the decoder compiles)
                synchronize(device)
                t0 = time.perf_counter()
                proposer.step(prefix[r], state, context + r)
                synchronize(device)
                times.append(time.perf_counter() - t0)
            step = statistics.median(times[1:])
    return CostModel(verify, step)


__all__ = ["AcceptanceCounts", "AdaptiveDepth", "AdaptiveSession", "CostModel", "best_depth", "expected_tokens",
           "fit_linear", "measure_cost"]
