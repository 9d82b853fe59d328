"""The lookup proposer (serve_eval.lookup) and the hybrid tree: matches found and ranked, no proposal
without one, memory bounded on long contexts, the shared index capped; greedy output equal to plain
decoding with the lookup alone or beside a draft (chain, tree, static cache), sampled output the
target's distribution (chi-square), accepted tokens counted by proposer, bad settings refused."""

from __future__ import annotations

import random

import pytest

from eagle3.errors import ConfigError
from serve_eval.config import EvalConfig, SpecConfig
from serve_eval.lookup import (
    DRAFT,
    LOOKUP,
    LookupIndex,
    LookupPolicy,
    SharedLookup,
    branch_length,
    fit_budget,
    merge_branch,
)
from serve_eval.spec_decode import SpeculativeDecoder
from tests.helpers import (
    PROMPTS,
    OracleDecoder,
    assert_sampling_matches_target,
    dflash_for,
    make_draft,
    make_target,
    peagle_for,
    plain,
)

# ---------------------------------------------------------------- the index


def test_the_longest_match_wins_and_its_continuation_is_proposed() -> None:
    index = LookupIndex(min_match=1, max_match=3)
    #                 0  1  2  3  4  5  6  7  8  9 10 11
    index.extend([5, 1, 2, 9, 8, 3, 1, 2, 7, 6, 4, 1, 2])
    # "1 2" occurred at 1-2 (then 9) and 6-7 (then 7): both match 2 tokens ("4 1 2" vs "5 1 2" / "3 1 2"),
    # so the most recent wins
    assert index.find() == (8, 2)
    got = index.propose(limit=8, scale=2)
    assert got is not None and got.match == 2 and got.tokens == [7, 6, 4, 1]
    # a longer match beats a more recent one: "3 1 2" occurs once, at 5-7
    index.extend([0, 3, 1, 2])
    assert index.find() == (8, 3)


def test_a_match_is_measured_beyond_the_indexed_ngrams() -> None:
    index = LookupIndex(min_match=1, max_match=2)
    text = [3, 4, 5, 6, 7, 8]
    index.extend([*text, 9, 1, *text])
    after, match = index.find()
    assert after == 6 and match == 6  # the whole copy, though only 2-grams are indexed
    assert index.propose(limit=4, scale=1).tokens == [9, 1, 3, 4]  # scale 1 x 6 matched, capped at 4


def test_no_proposal_without_a_match_and_never_the_end_itself() -> None:
    index = LookupIndex(min_match=2, max_match=4)
    index.extend([1, 2, 3, 4])
    assert index.find() is None and index.propose(8, 2) is None  # "3 4" occurs only at the end
    assert LookupIndex().propose(8, 2) is None  # empty
    index = LookupIndex(min_match=1, max_match=1)
    index.extend([7])
    assert index.find() is None  # one token: nothing before it


def test_branch_length_grows_with_the_match_up_to_the_limit() -> None:
    assert [branch_length(m, 8, 2) for m in (0, 1, 2, 3, 4, 10)] == [0, 2, 4, 6, 8, 8]
    index = LookupIndex(min_match=1, max_match=4)
    index.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 1])
    got = index.propose(limit=8, scale=2)
    assert got.match == 1 and got.tokens == [2, 3]  # a one-token match: two tokens


def test_memory_is_bounded_on_a_long_context() -> None:
    rng = random.Random(0)
    index = LookupIndex(min_match=1, max_match=4, per_key=4)
    tokens = [rng.randrange(50) for _ in range(20_000)]
    index.extend(tokens)
    assert index.keys <= 4 * len(tokens)
    assert max(len(v) for v in index.index.values()) <= 4  # a frequent unigram keeps its 4 latest
    assert all(after < len(tokens) for v in index.index.values() for after in v)


def test_the_shared_index_is_capped_counted_and_asked_by_suffix() -> None:
    shared = SharedLookup(max_tokens=100, context=4)
    shared.add([0, 0, 0, 11, 12], [13, 14, 15, 16])
    got = shared.propose([99, 11, 12, 13], limit=4, scale=2)
    assert got is not None and got.shared and got.tokens == [14, 15, 16] and got.match == 3
    assert shared.propose([98, 97], 4, 2) is None
    for i in range(30):
        shared.add([], list(range(100 + 10 * i, 110 + 10 * i)))
    assert shared.tokens <= 100 and shared.evicted > 0 and shared.added == 31
    assert shared.propose([11, 12, 13], 4, 2) is None  # the first reply was dropped
    off = SharedLookup(max_tokens=0)
    off.add([1], [2, 3])
    assert off.tokens == 0 and not off.docs


# ---------------------------------------------------------------- the merged tree


def test_merging_shares_the_draft_prefix_and_appends_the_rest() -> None:
    # a draft tree: root children 5 (0) and 6 (1); 7 under 5 (2); 8 under 7 (3)
    merged = merge_branch([5, 6, 7, 8], [-1, -1, 0, 2], [5, 7, 9, 4])
    assert merged.tokens == [5, 6, 7, 8, 9, 4]
    assert merged.parents == [-1, -1, 0, 2, 2, 4]
    assert merged.sources == [DRAFT | LOOKUP, DRAFT, DRAFT | LOOKUP, DRAFT, LOOKUP, LOOKUP]
    assert merged.added == 2 and not merged.is_chain
    chain = merge_branch([5, 7], [-1, 0], [5, 7, 9])
    assert chain.is_chain and chain.sources == [3, 3, LOOKUP]
    alone = merge_branch([], [], [1, 2])
    assert alone.is_chain and alone.sources == [LOOKUP, LOOKUP]


def test_a_budget_drops_the_drafts_last_leaves_and_keeps_the_lookup() -> None:
    merged = merge_branch([5, 6, 7, 8], [-1, -1, 0, 2], [1, 2, 3])
    fitted = fit_budget(merged, 5)
    assert len(fitted.tokens) == 5
    assert [t for t, s in zip(fitted.tokens, fitted.sources, strict=True) if s & LOOKUP] == [1, 2, 3]
    assert fitted.tokens[:2] == [5, 6]  # the deepest draft nodes (8, then 7) made way
    for i, parent in enumerate(fitted.parents):
        assert -1 <= parent < i
    assert fit_budget(merged, 20) is merged


def test_the_policy_keeps_the_tokens_worth_their_cost_and_learns_per_match() -> None:
    free = LookupPolicy()  # verifying costs nothing more: the whole continuation
    assert free.length(1, 6) == 6 and free.length(8, 3) == 3
    dear = LookupPolicy(token_cost=0.4)  # prior: p(1) = 1/3, p(4) = 2/3, c = 0.8
    assert dear.length(1, 6) == 0  # a one-token match is not worth a verified token here
    assert dear.length(4, 6) == 3  # 0.67, 0.53, 0.43 > 0.4 > 0.34
    for _ in range(40):  # one-token matches that turn out right, and long runs after them
        dear.observe(1, True, 6, 6)
    assert dear.p_first(1) > 0.9 and dear.p_later() > 0.9 and dear.length(1, 6) == 6
    for _ in range(200):
        dear.observe(9, False, 0, 0)  # never verified, still counted: the target's token is known
    assert dear.p_first(8) < 0.05 and dear.length(12, 6) == 0
    with pytest.raises(ValueError, match="token cost"):
        LookupPolicy(token_cost=-1)


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize("config", [
    SpecConfig("chain", k=3, proposer="lookup"),
    SpecConfig("chain", k=3, proposer="hybrid", lookup_k=4, lookup_scale=1),
    SpecConfig("tree", k=3, topk=3, budget=10, proposer="hybrid", lookup_k=6),
    SpecConfig("chain", k=3, proposer="hybrid", target_cache="static"),
])
def test_greedy_equals_plain_decoding_with_the_lookup(config: SpecConfig) -> None:
    target = make_target()
    draft = make_draft(target) if config.uses_draft else None
    decoder = SpeculativeDecoder(target, draft, config)
    rounds_with_lookup = 0
    for prompt in [*PROMPTS, [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]]:
        ref = plain(target, prompt, 30)
        got = decoder.generate(prompt, 30)
        assert got.tokens == ref
        stats = got.stats
        assert [sum(r) for r in stats.sources] == stats.accepted  # every accepted token has a proposer
        rounds_with_lookup += sum(1 for n in stats.lookup if n)
        if config.proposer == "lookup":
            assert all(r[0] == 0 and r[2] == 0 for r in stats.sources)
    assert rounds_with_lookup > 0


@pytest.mark.parametrize("family", ["peagle", "dflash"])
def test_the_parallel_families_serve_the_hybrid_losslessly(family: str) -> None:
    target = make_target()
    draft = {"peagle": peagle_for, "dflash": dflash_for}[family](target)
    decoder = SpeculativeDecoder(target, draft, SpecConfig("chain", k=3, proposer="hybrid"))
    branches = 0
    for prompt in ([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], PROMPTS[0]):
        got = decoder.generate(prompt, 30)
        assert got.tokens == plain(target, prompt, 30)
        branches += sum(1 for n in got.stats.lookup if n)
    assert branches > 0


def test_a_right_draft_and_a_right_lookup_are_counted_as_both() -> None:
    target = make_target()
    ref = plain(target, PROMPTS[0], 40)
    prompt = PROMPTS[0] + ref[:30]  # the continuation is in the context: the lookup copies it
    decoder = OracleDecoder(target, make_draft(target), SpecConfig("chain", k=3, proposer="hybrid"))
    got = decoder.generate(prompt, 24)
    assert got.tokens == plain(target, prompt, 24)
    by = got.stats.accepted_by()
    assert by["both"] > 0 and by["lookup_rounds"] > 0


@pytest.mark.parametrize("proposer", ["lookup", "hybrid"])
def test_tokens_past_a_stop_token_are_not_counted_as_accepted(proposer: str) -> None:
    """A copied reply that ends inside a round at a stop token counts only the tokens it keeps: every
    round gives ``accepted + 1`` tokens, the prefill one more."""
    target = make_target()
    ref = plain(target, PROMPTS[0], 40)
    prompt = PROMPTS[0] + ref[:30]  # the lookup copies long continuations from here
    decoder = SpeculativeDecoder(target, make_draft(target) if proposer == "hybrid" else None,
                                 SpecConfig("chain", k=3, proposer=proposer))
    for limit, stops in [*((n, frozenset()) for n in range(3, 25, 3)), (24, frozenset({plain(target, prompt, 9)[-1]}))]:
        got = decoder.generate(prompt, limit, stops)
        assert got.tokens == _until(plain(target, prompt, limit), stops)
        stats = got.stats
        assert len(got.tokens) == 1 + sum(a + 1 for a in stats.accepted)
        assert [sum(r) for r in stats.sources] == stats.accepted


@pytest.mark.parametrize("config", [SpecConfig("chain", k=3), SpecConfig("tree", k=3, topk=2, budget=8),
                                    SpecConfig("chain", k=3, proposer="hybrid")])
def test_a_round_cut_short_by_the_token_limit_counts_what_the_reply_kept(config: SpecConfig) -> None:
    """A draft that is always right proposes past the token limit in the last round: the target accepts
    all of it, the reply keeps what fits, and the round is counted as proposing and accepting that."""
    target = make_target()
    decoder = OracleDecoder(target, make_draft(target), config)
    for limit in (7, 10, 12):  # the last round has room for fewer than k + 1 tokens
        got = decoder.generate(PROMPTS[1], limit)
        assert got.tokens == plain(target, PROMPTS[1], limit)
        stats = got.stats
        assert len(got.tokens) == 1 + sum(a + 1 for a in stats.accepted)
        assert [sum(r) for r in stats.sources] == stats.accepted
        assert all(a <= d for a, d in zip(stats.accepted, stats.depths, strict=True))
        assert stats.accepted[-1] == stats.depths[-1] < 3  # cut short, and every kept token accepted
        assert stats.acceptance_per_position()[0] == 1.0  # no rejection made up for the tokens dropped


def _until(tokens: list[int], stops: frozenset[int]) -> list[int]:
    return next((tokens[:i + 1] for i, t in enumerate(tokens) if t in stops), tokens)


@pytest.mark.parametrize("config", [  # slow: 30 s each here; CI runs them beside the quickstart
    pytest.param(SpecConfig("chain", k=2, proposer="hybrid", lookup_k=3, lookup_scale=1), marks=pytest.mark.slow),
    pytest.param(SpecConfig("chain", k=2, proposer="lookup", lookup_k=3), marks=pytest.mark.slow),
    pytest.param(SpecConfig("tree", k=2, topk=2, budget=5, proposer="hybrid", lookup_k=3), marks=pytest.mark.slow),
])
def test_sampled_generation_with_the_lookup_matches_the_target_distribution(config: SpecConfig) -> None:
    # a prompt made of the target's own likely tokens, so that the lookup proposes in most rounds
    prompt = [1, 7, 3] + plain(make_target(vocab=32, layers=4), [1, 7, 3], 8)
    assert_sampling_matches_target(config, make_draft if config.uses_draft else None, prompt=prompt)


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("kwargs,key", [
    ({"lookup_k": 0}, "lookup_k=0"), ({"lookup_min": 0}, "lookup_min=0"), ({"lookup_scale": 0}, "lookup_scale=0"),
    ({"lookup_min": 3, "lookup_max": 2}, "lookup_max=2"), ({"proposer": "suffix"}, "proposer='suffix'"),
    ({"mode": "tree", "proposer": "hybrid", "budget": 8, "lookup_k": 8}, "budget=8"),
])
def test_bad_lookup_settings_are_refused_naming_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        SpecConfig(**kwargs)


def test_a_hybrid_needs_a_draft_and_compare_names_proposers() -> None:
    with pytest.raises(ConfigError, match="proposer=hybrid needs a draft"):
        SpeculativeDecoder(make_target(), None, SpecConfig(proposer="hybrid"))
    with pytest.raises(ConfigError, match="eval.compare: 'ngram'"):
        EvalConfig(compare=["ngram"])
    with pytest.raises(ConfigError, match="eval.compare: hybrid: budget=4"):
        EvalConfig(mode="tree", budget=4, compare=["hybrid"])
