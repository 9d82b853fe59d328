"""Adaptive speculation: expected tokens, the depth choice and the acceptance counts, by hand."""

from __future__ import annotations

import pytest

from serve_eval.adaptive import AcceptanceCounts, AdaptiveDepth, CostModel, best_depth, expected_tokens, measure_cost
from serve_eval.config import SpecConfig
from serve_eval.spec_decode import SpeculativeDecoder
from tests.helpers import make_draft, make_target


def test_expected_tokens_by_hand() -> None:
    a = [0.5, 0.4, 0.25]
    assert expected_tokens(a, 0) == 1.0
    assert expected_tokens(a, 1) == pytest.approx(1.5)
    assert expected_tokens(a, 2) == pytest.approx(1.5 + 0.2)
    assert expected_tokens(a, 3) == pytest.approx(1.7 + 0.05)


def test_best_depth_follows_acceptance_and_cost() -> None:
    # verify cost 60 ms + 10 ms per extra token, draft forwards 2 ms: cost(k) = 60 + 10k + 2k
    cost = CostModel([0.060, 0.070, 0.080, 0.090], 0.002)
    assert cost.round_seconds(2) == pytest.approx(0.084) and cost.round_seconds(0) == pytest.approx(0.060)
    # a weak draft: 1.15 tokens per 72 ms (16.0/s) < 1 per 60 ms (16.7/s) -> plain decoding
    assert best_depth([0.15, 0.1, 0.1], cost) == 0
    # depth 1: 1.5 / 72 ms = 20.8/s; depth 2: 1.65 / 84 ms = 19.6/s
    assert best_depth([0.5, 0.3, 0.0], cost) == 1
    # depth 2: 1.75 / 84 ms = 20.83/s ties depth 1 (1.5 / 72 ms): the shallower wins
    assert best_depth([0.5, 0.5, 0.0], cost) == 1
    # depth 2: 1.8 / 84 ms = 21.4/s beats depth 1
    assert best_depth([0.5, 0.6, 0.0], cost) == 2
    # a strong draft: deeper is better all the way
    assert best_depth([0.9, 0.9, 0.9], cost) == 3
    assert best_depth([0.9, 0.9, 0.9], cost, max_depth=2) == 2
    # free verification of extra tokens: any acceptance > 0 pays for the draft steps at 1 ms
    flat = CostModel([0.06] * 4, 0.0)
    assert best_depth([0.05, 0.05, 0.05], flat) == 3


def test_acceptance_counts_by_hand() -> None:
    c = AcceptanceCounts()
    c.add(3, 0)  # depth 1 tried and missed
    c.add(3, 2)  # depths 1, 2 hit, depth 3 tried and missed
    c.add(2, 2)  # both hit
    c.add(1, 1)
    assert c.trials == [4, 2, 1]
    assert c.hits == [3, 2, 0]
    assert c.conditional(3, [0.5], prior_weight=0) == [0.75, 1.0, 0.0]
    # prior_weight 2 at prior 0.5: one pseudo-hit and one pseudo-miss per depth
    assert c.conditional(4, [0.5], prior_weight=2) == [4 / 6, 3 / 4, 1 / 3, 0.5]
    d = AcceptanceCounts()
    d.add(4, 4)
    c.merge(d)
    assert c.trials == [5, 3, 2, 1] and c.hits == [4, 3, 1, 1]


def test_adaptive_depth_learns_and_probes() -> None:
    cost = CostModel([0.060, 0.070, 0.080, 0.090], 0.002)
    policy = AdaptiveDepth(cost, prior=[0.9, 0.9, 0.9], prior_weight=4, probe_every=3)
    assert policy.choose() == 3  # the optimistic prior speculates deep
    for _ in range(20):
        policy.observe(3, 0)  # every draft rejected at depth 1: a1 = 3.6 / 24 = 0.15
    assert [policy.choose() for _ in range(8)] == [0, 0, 0, 1, 0, 0, 0, 1]  # plain, with a probe every 4th
    for _ in range(40):
        policy.observe(1, 1)
    assert policy.choose() >= 1


def test_measure_cost_on_a_tiny_model() -> None:
    target = make_target()
    decoder = SpeculativeDecoder(target, make_draft(target), SpecConfig("chain", k=3))
    cost = measure_cost(decoder, 3, context=32, repeats=2)
    assert len(cost.verify_s) == 4 and all(t > 0 for t in cost.verify_s) and cost.draft_step_s > 0
    with pytest.raises(ValueError, match="verify_s"):
        CostModel([], 0.0)


def test_fit_linear_by_hand() -> None:
    from serve_eval.adaptive import fit_linear

    assert fit_linear([1.0, 2.0, 3.0]) == pytest.approx([1.0, 2.0, 3.0])
    # a noisy, non-monotonic set: 0.11, 0.086, 0.083, 0.163 -> mean 0.1105, slope 0.0156
    fitted = fit_linear([0.11, 0.086, 0.083, 0.163])
    assert fitted == pytest.approx([0.0871, 0.1027, 0.1183, 0.1339], abs=1e-4)
    assert fit_linear([0.3, 0.2, 0.1]) == pytest.approx([0.2, 0.2, 0.2])  # never a negative slope


def test_a_parallel_drafts_round_costs_one_draft_forward() -> None:
    """P-EAGLE and DFlash drafts propose a round in one forward: the cost model counts one, at any depth."""
    from tests.helpers import dflash_for, peagle_for

    cost = CostModel([1.0, 1.5, 2.0, 2.5], 0.25, parallel=True)
    assert [cost.round_seconds(k) for k in range(4)] == [1.0, 1.75, 2.25, 2.75]
    assert CostModel([1.0, 1.5, 2.0, 2.5], 0.25).round_seconds(3) == 3.25
    target = make_target()
    for draft in (peagle_for(target), dflash_for(target)):
        decoder = SpeculativeDecoder(target, draft, SpecConfig("chain", k=3))
        measured = measure_cost(decoder, 3, context=32, repeats=2)
        assert measured.parallel and measured.draft_step_s > 0 and len(measured.verify_s) == 4
