"""Verification and acceptance on stub logits: hand-worked cases, and chi-square tests that chain
and tree sampling emit exactly the target's distribution."""

from __future__ import annotations

import itertools

import pytest
import torch

from serve_eval.verify import (
    SamplingConfig,
    greedy_chain,
    greedy_tree,
    sample_chain,
    sample_tree,
    target_probs,
    tree_attention_mask,
    tree_depths,
)

V = 5


def one_hot_logits(tokens: list[int], vocab: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float() * 5.0


def test_target_probs_by_hand() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert target_probs(logits, SamplingConfig()).tolist() == [1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(target_probs(logits, SamplingConfig(temperature=1.0)), torch.tensor([.5, .3, .15, .05]))
    torch.testing.assert_close(target_probs(logits, SamplingConfig(temperature=1.0, top_k=2)),
                               torch.tensor([.625, .375, 0, 0]))
    # top-p 0.8: 0.5 + 0.3 reaches it, so two tokens stay
    torch.testing.assert_close(target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.8)),
                               torch.tensor([.625, .375, 0, 0]))
    torch.testing.assert_close(target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.81)),
                               torch.tensor([.5, .3, .15, 0]) / 0.95)
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingConfig(top_p=0.0)


def test_greedy_chain_by_hand() -> None:
    # target argmaxes after x, d1, d2, d3: 3, 1, 4, 2
    logits = one_hot_logits([3, 1, 4, 2])
    assert greedy_chain([3, 1, 4], logits).tokens == [3, 1, 4, 2]  # all accepted + bonus
    assert greedy_chain([3, 0, 4], logits).tokens == [3, 1]  # second rejected: correction 1
    got = greedy_chain([2, 1, 4], logits)
    assert (got.accepted, got.tokens) == (0, [3])


def test_tree_mask_and_greedy_by_hand() -> None:
    #        root
    #       /    \
    #     n0(3)  n1(2)
    #     /   \      \
    #  n2(1) n3(0)  n4(1)
    #    |
    #  n5(4)
    tokens, parents = [3, 2, 1, 0, 1, 4], [-1, -1, 0, 0, 1, 2]
    mask = tree_attention_mask(parents)
    assert mask[5].nonzero().flatten().tolist() == [0, 2, 5] and mask[4].nonzero().flatten().tolist() == [1, 4]
    assert tree_depths(parents) == [1, 1, 2, 2, 2, 3]
    # argmax at root=3 -> n0; at n0=1 -> n2; at n2=4 -> n5; at n5=0 (bonus)
    logits = one_hot_logits([3, 1, 0, 4, 0, 0, 0])  # rows: root, n0..n5
    got = greedy_tree(tokens, parents, logits)
    assert (got.accepted, got.path, got.tokens) == (3, [0, 2, 5], [3, 1, 4, 0])
    # at root the argmax is 2 -> n1; at n1 the argmax 3 has no child -> bonus 3
    logits = one_hot_logits([2, 0, 3, 0, 0, 0, 0])
    got = greedy_tree(tokens, parents, logits)
    assert (got.path, got.tokens) == ([1], [2, 3])
    with pytest.raises(ValueError, match="parents must come earlier"):
        tree_attention_mask([1, -1])


# ---------------------------------------------------------------- chi-square: exact distributions

def markov(seed: int, sharp: float = 1.0) -> torch.Tensor:
    """[V, V] next-token distributions given the previous token."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(V, V, generator=g), dim=-1)


P, Q = markov(1, 1.5), markov(2, 1.0)  # target and a different draft
START = 0
TRIALS = 12000


def chi_square(counts: dict[tuple[int, int], int], expected: dict[tuple[int, int], float]) -> tuple[float, int]:
    stat = sum((counts.get(k, 0) - e) ** 2 / e for k, e in expected.items() if e > 0)
    return stat, sum(1 for e in expected.values() if e > 0) - 1


def exact_pairs() -> dict[tuple[int, int], float]:
    return {(a, b): TRIALS * float(P[START, a] * P[a, b]) for a, b in itertools.product(range(V), repeat=2)}


# chi-square critical value at p = 1e-4 for 24 degrees of freedom is ~56; a wrong acceptance
# rule (e.g. accepting every draft token, or skipping the residual) scores in the hundreds.
CRITICAL = 56.0


def _first_two(step) -> dict[tuple[int, int], int]:
    counts: dict[tuple[int, int], int] = {}
    g = torch.Generator().manual_seed(0)
    for _ in range(TRIALS):
        emitted: list[int] = []
        prev = START
        while len(emitted) < 2:
            new = step(prev, g)
            emitted += new
            prev = emitted[-1]
        key = (emitted[0], emitted[1])
        counts[key] = counts.get(key, 0) + 1
    return counts


def chain_step(k: int, draft_probs_of=lambda prev: Q[prev]):
    def step(prev: int, g: torch.Generator) -> list[int]:
        tokens, qs, ctx = [], [], prev
        for _ in range(k):
            q = draft_probs_of(ctx)
            d = int(torch.multinomial(q, 1, generator=g))
            tokens.append(d)
            qs.append(q)
            ctx = d
        rows = [P[prev]] + [P[t] for t in tokens]  # the target after x, d1..dk
        return sample_chain(tokens, torch.stack(qs), torch.stack(rows), g).tokens
    return step


@pytest.mark.parametrize("k", [1, 3])
def test_chain_sampling_emits_the_target_distribution(k: int) -> None:
    stat, dof = chi_square(_first_two(chain_step(k)), exact_pairs())
    assert dof == 24 and stat < CRITICAL, stat


def test_chain_control_without_rejection_is_caught() -> None:
    """Accepting every draft token emits the draft's distribution: the test must see it."""
    def step(prev: int, g: torch.Generator) -> list[int]:
        return [int(torch.multinomial(Q[prev], 1, generator=g))]
    stat, _ = chi_square(_first_two(step), exact_pairs())
    assert stat > 10 * CRITICAL


def tree_step(width: int, depth: int):
    """Deterministic candidates: the draft's top-``width`` tokens at each node, ``depth`` levels."""
    def step(prev: int, g: torch.Generator) -> list[int]:
        tokens, parents, context = [], [], {-1: prev}
        frontier = [-1]
        for _ in range(depth):
            nxt = []
            for node in frontier:
                for t in Q[context[node]].topk(width).indices.tolist():
                    tokens.append(t)
                    parents.append(node)
                    context[len(tokens) - 1] = t
                    nxt.append(len(tokens) - 1)
            frontier = nxt
        rows = [P[prev]] + [P[t] for t in tokens]
        return sample_tree(tokens, parents, torch.stack(rows), g).tokens
    return step


@pytest.mark.parametrize("width,depth", [(2, 2), (3, 1), (1, 3)])
def test_tree_sampling_emits_the_target_distribution(width: int, depth: int) -> None:
    stat, dof = chi_square(_first_two(tree_step(width, depth)), exact_pairs())
    assert dof == 24 and stat < CRITICAL, stat


def test_sampling_with_top_k_and_greedy_params_stays_lossless() -> None:
    params = SamplingConfig(temperature=0.7, top_k=3)
    logits = torch.log(P)
    probs = target_probs(logits, params)  # [V, V]
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(V)
    for _ in range(6000):
        d = int(torch.multinomial(Q[START], 1, generator=g))
        counts[sample_chain([d], Q[START][None], torch.stack([probs[START], probs[d]]), g).tokens[0]] += 1
    expected = 6000 * probs[START]
    assert counts[expected == 0].sum() == 0  # top-k: tokens outside are never emitted
    stat = float((((counts - expected) ** 2)[expected > 0] / expected[expected > 0]).sum())
    assert stat < 25.0, stat  # 2 degrees of freedom: p ~ 4e-6
