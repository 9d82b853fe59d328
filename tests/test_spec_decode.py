"""The speculative decoding loop on tiny random models: greedy output equals plain decoding for
chains and trees (with a random draft, an oracle draft that is always right, and one that is
right half the time, so that accepted paths, rejected siblings and both cache rollbacks are
exercised), and sampled generation matches the target's distribution (chi-square)."""

from __future__ import annotations

import pytest

from eagle3.target.model import Target
from serve_eval.config import SpecConfig
from serve_eval.spec_decode import SpeculativeDecoder
from tests.helpers import (
    PROMPTS,
    OracleDecoder,
    assert_sampling_matches_target,
    make_draft,
    make_target,
    plain,
    tiny_llama,
    tiny_tokenizer,
)


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
        self.depths, self.i, self.seen, self.kept = depths, 0, [], []

    def choose(self) -> int:
        self.i += 1
        return self.depths[(self.i - 1) % len(self.depths)]

    def observe(self, depth: int, accepted: int, kept_depth: int | None = None, kept: int | None = None) -> None:
        self.seen.append((depth, accepted))
        self.kept.append((depth if kept_depth is None else kept_depth, accepted if kept is None else kept))


@pytest.mark.parametrize("wrong", [0, 3])
def test_a_depth_policy_varies_the_chain_and_greedy_output_is_unchanged(wrong: int) -> None:
    target = make_target()
    decoder = OracleDecoder(target, make_draft(target), SpecConfig("chain", k=4), wrong=wrong)
    for prompt in PROMPTS:
        ref = plain(target, prompt, 30)
        policy = ScriptedDepth([0, 2, 4, 1, 0, 0, 3])
        got = decoder.generate(prompt, 30, policy=policy)
        assert got.tokens == ref
        assert policy.kept == list(zip(got.stats.depths, got.stats.accepted, strict=True))  # what the reply kept
        assert policy.seen[:-1] == policy.kept[:-1]  # only the last round can run past the token limit
        assert len(got.tokens) == 1 + sum(a + 1 for _, a in policy.kept)
        assert all(a <= d for d, a in policy.seen + policy.kept)
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

@pytest.mark.parametrize("config", [SpecConfig("chain", k=2),
                                    pytest.param(SpecConfig("tree", k=2, topk=2, budget=4), marks=pytest.mark.slow)])
def test_sampled_generation_matches_the_target_distribution(config: SpecConfig) -> None:
    assert_sampling_matches_target(config, make_draft)
