"""The speculative decoding loop on tiny random models: greedy output equals plain decoding for
chains and trees (with a random draft, an oracle draft that is always right, and one that is
right half the time, so that accepted paths, rejected siblings and both cache rollbacks are
exercised), and sampled generation matches the target's distribution (chi-square)."""

from __future__ import annotations

import pytest
import torch

from eagle3.target import Target
from serve_eval.config import SpecConfig
from serve_eval.spec_decode import SpeculativeDecoder
from serve_eval.verify import SamplingConfig, target_probs
from tests.helpers import PROMPTS, make_draft, make_target, tiny_llama, tiny_tokenizer


class OracleDecoder(SpeculativeDecoder):
    """Proposes the target's own greedy continuation (with every ``wrong``-th token changed), so
    that long accepted runs and rejections both happen; the catch-up still runs the real draft."""

    def __init__(self, *args, wrong: int = 0, **kw) -> None:
        super().__init__(*args, **kw)
        self.wrong = wrong

    def _greedy(self, context: list[int], k: int) -> list[int]:
        out: list[int] = []
        for _ in range(k):
            logits = self.target(torch.tensor([context + out]), return_logits=True).logits[0, -1]
            out.append(int(logits.argmax()))
        return out

    def _propose_chain(self, root_state, root_logits, n, cache, params, g, context, k):
        tokens = self._greedy(context, k)
        if self.wrong:
            tokens = [(t + 1) % self.target.vocab_size if (i + n) % self.wrong == 0 else t
                      for i, t in enumerate(tokens)]
        return tokens, list(range(-1, len(tokens) - 1)), None

    def _propose_tree(self, root_state, root_logits, n, cache, context):
        # a wrong root child first, then the right chain under the second root child
        right = self._greedy(context, self.config.k)
        return [(right[0] + 1) % self.target.vocab_size, *right], [-1, -1, *range(1, len(right))]


def plain(target: Target, prompt: list[int], n: int = 24) -> list[int]:
    return SpeculativeDecoder(target, None).generate(prompt, n).tokens


@pytest.mark.parametrize("config", [SpecConfig("chain", k=3), SpecConfig("chain", k=1),
                                    SpecConfig("tree", k=3, topk=3, budget=10), SpecConfig("tree", k=2, topk=2)])
@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_greedy_equals_plain_decoding_with_a_random_draft(config: SpecConfig, draft_vocab: int | None) -> None:
    target = make_target()
    decoder = SpeculativeDecoder(target, make_draft(target, draft_vocab), config)
    for prompt in PROMPTS:
        ref = plain(target, prompt)
        got = decoder.generate(prompt, 24)
        assert got.tokens == ref
        assert got.stats.target_forwards <= len(ref)


@pytest.mark.parametrize("mode,wrong", [("chain", 0), ("chain", 3), ("tree", 0)])
def test_greedy_equals_plain_decoding_when_drafts_are_accepted(mode: str, wrong: int) -> None:
    target = make_target()
    config = SpecConfig(mode, k=4, topk=2, budget=8)
    decoder = OracleDecoder(target, make_draft(target), config, wrong=wrong)
    for prompt in PROMPTS:
        ref = plain(target, prompt, 30)
        got = decoder.generate(prompt, 30)
        assert got.tokens == ref
        if wrong == 0:
            assert got.stats.tau > 4.0  # 4 accepted + bonus per round, but the last
            assert got.stats.acceptance_per_position()[0] == 1.0
        else:
            assert 1.0 < got.stats.tau < 5.0


def test_stop_ids_and_length_limits() -> None:
    target = make_target()
    decoder = SpeculativeDecoder(target, make_draft(target), SpecConfig("chain", k=3))
    ref = plain(target, PROMPTS[0], 20)
    stop = ref[6]
    got = decoder.generate(PROMPTS[0], 20, stop_ids={stop}).tokens
    assert got == ref[: ref.index(stop) + 1]
    assert len(decoder.generate(PROMPTS[0], 5).tokens) == 5
    with pytest.raises(ValueError, match="empty prompt"):
        decoder.generate([], 5)


class ScriptedDepth:
    """A depth policy that cycles through fixed depths (0 included) and records what it saw."""

    def __init__(self, depths: list[int]) -> None:
        self.depths, self.i, self.seen = depths, 0, []

    def choose(self) -> int:
        self.i += 1
        return self.depths[(self.i - 1) % len(self.depths)]

    def observe(self, depth: int, accepted: int) -> None:
        self.seen.append((depth, accepted))


@pytest.mark.parametrize("wrong", [0, 3])
def test_a_depth_policy_varies_the_chain_and_greedy_output_is_unchanged(wrong: int) -> None:
    target = make_target()
    decoder = OracleDecoder(target, make_draft(target), SpecConfig("chain", k=4), wrong=wrong)
    for prompt in PROMPTS:
        ref = plain(target, prompt, 30)
        policy = ScriptedDepth([0, 2, 4, 1, 0, 0, 3])
        got = decoder.generate(prompt, 30, policy=policy)
        assert got.tokens == ref
        assert [d for d, _ in policy.seen] == got.stats.depths
        assert [a for _, a in policy.seen] == got.stats.accepted
        assert all(a <= d for d, a in policy.seen)
        if wrong == 0:  # the oracle is always right: every round accepts all it proposed (but the last)
            assert all(a == d for d, a in policy.seen[:-1])
        # acceptance at depth i counts only rounds that proposed depth i
        depths, accepted = got.stats.depths, got.stats.accepted
        rounds3 = [a for a, d in zip(accepted, depths, strict=True) if d >= 3]
        assert got.stats.acceptance_per_position()[2] == pytest.approx(sum(a >= 3 for a in rounds3) / len(rounds3))


def test_on_tokens_sees_every_token_and_can_stop_the_generation() -> None:
    target = make_target()
    decoder = SpeculativeDecoder(target, make_draft(target), SpecConfig("chain", k=3))
    ref = plain(target, PROMPTS[1], 20)
    seen: list[int] = []
    got = decoder.generate(PROMPTS[1], 20, on_tokens=lambda ids: seen.extend(ids) or True)
    assert seen == got.tokens == ref
    seen.clear()
    got = decoder.generate(PROMPTS[1], 20, on_tokens=lambda ids: seen.extend(ids) or len(seen) < 5)
    assert seen == got.tokens and 5 <= len(got.tokens) < 5 + 4 and got.tokens == ref[: len(got.tokens)]


def test_mismatched_draft_is_refused() -> None:
    target = make_target()
    other = Target(tiny_llama(num_layers=6, vocab=64), tiny_tokenizer(), aux_layer_ids=(1, 2, 3))
    with pytest.raises(ValueError, match="does not fit the target"):
        SpeculativeDecoder(target, make_draft(other))


# ---------------------------------------------------------------- sampling: chi-square on a tiny model

@pytest.mark.parametrize("config", [SpecConfig("chain", k=2), SpecConfig("tree", k=2, topk=2, budget=4)])
def test_sampled_generation_matches_the_target_distribution(config: SpecConfig) -> None:
    target = make_target(vocab=32, layers=4)
    draft = make_draft(target)
    params = SamplingConfig(temperature=1.0, top_k=4)
    prompt = [1, 7, 3]
    decoder = SpeculativeDecoder(target, draft, config)
    trials = 1500
    counts: dict[tuple[int, int, int], int] = {}
    for seed in range(trials):
        key = tuple(decoder.generate(prompt, 3, params=params, seed=seed).tokens)
        counts[key] = counts.get(key, 0) + 1
    # exact: p(a) p(b | a) p(c | a b) under the processed target distribution; the 2nd and 3rd
    # tokens come from speculative rounds
    p0 = target_probs(target(torch.tensor([prompt])).logits[0, -1], params)
    expected: dict[tuple[int, int, int], float] = {}
    for a in p0.nonzero().flatten().tolist():
        p1 = target_probs(target(torch.tensor([prompt + [a]])).logits[0, -1], params)
        for b in p1.nonzero().flatten().tolist():
            p2 = target_probs(target(torch.tensor([prompt + [a, b]])).logits[0, -1], params)
            for c in p2.nonzero().flatten().tolist():
                expected[(a, b, c)] = trials * float(p0[a] * p1[b] * p2[c])
    assert set(counts) <= set(expected)  # nothing outside the target's top-k is ever emitted
    # pool cells with small expectations into one, then chi-square
    small = [k for k, e in expected.items() if e < 5]
    stat = sum((counts.get(k, 0) - e) ** 2 / e for k, e in expected.items() if e >= 5)
    if small:
        e = sum(expected[k] for k in small)
        o = sum(counts.get(k, 0) for k in small)
        stat += (o - e) ** 2 / e
    dof = sum(1 for e in expected.values() if e >= 5) + bool(small) - 1
    # critical value at p = 1e-4: about dof + 4.3*sqrt(2*dof) + 10 for these sizes
    assert stat < dof + 4.3 * (2 * dof) ** 0.5 + 10, (stat, dof)
