"""The target's static cache in the bundled loop (serve_eval/static_cache.py): with
``target_cache=static`` (one preallocated cache rolled back by length) or ``graphs`` (the same, its
fixed-length forwards compiled: CUDA graphs on CUDA), the loop generates exactly what it does with
the dynamic cache, for every family, chains and trees, greedy and sampled, through accepted and
rejected rounds, and with one cache reused by prompts longer and shorter than the last."""

from __future__ import annotations

import pytest
import torch

from eagle3.config import SamplingConfig
from serve_eval.config import SpecConfig
from serve_eval.spec_decode import SpeculativeDecoder
from tests.helpers import PROMPTS, OracleDecoder, dflash_for, make_draft, make_target, peagle_for, plain

GREEDY, SAMPLED = SamplingConfig(), SamplingConfig(temperature=1.0)


@pytest.mark.parametrize("family", ["eagle3", "peagle", "dflash"])
def test_a_static_target_cache_generates_what_the_dynamic_one_does(family: str) -> None:
    target = make_target()
    draft = {"eagle3": make_draft, "peagle": peagle_for, "dflash": dflash_for}[family](target)
    dynamic = SpeculativeDecoder(target, draft, SpecConfig("chain", k=3))
    static = SpeculativeDecoder(target, draft, SpecConfig("chain", k=3, target_cache="static"))
    for prompt in (PROMPTS[1], PROMPTS[0], PROMPTS[1]):  # longer, shorter, longer: stale slots each time
        for params, seed in ((GREEDY, 0), (SAMPLED, 5)):
            want = dynamic.generate(prompt, 24, params=params, seed=seed)
            got = static.generate(prompt, 24, params=params, seed=seed)
            assert got.tokens == want.tokens and got.stats.accepted == want.stats.accepted
        assert static.generate(prompt, 24, speculate=False).tokens == plain(target, prompt, 24)


@pytest.mark.parametrize("wrong", [0, 3])
def test_a_static_cache_rolls_back_accepted_and_rejected_rounds(wrong: int) -> None:
    """An oracle draft (always right, or wrong every third token): long accepted runs and rejections
    at every depth, each rolled back by moving the cache's length."""
    target = make_target()
    decoder = OracleDecoder(target, make_draft(target), SpecConfig("chain", k=4, target_cache="static"), wrong=wrong)
    for prompt in PROMPTS:
        got = decoder.generate(prompt, 30)
        assert got.tokens == plain(target, prompt, 30)
        assert got.stats.tau > (4.0 if wrong == 0 else 1.0)


@pytest.mark.parametrize("window", [None, 4])
def test_the_static_draft_cache_steps_and_rolls_back_as_the_dynamic_one(window: int | None) -> None:
    """Catch-up rows, compiled single-token steps, a rollback to an earlier length, more rows and
    steps over the now stale slots, a tree's compiled expansions under their masks: every state and
    logit equals the dynamic cache's (a sliding-window draft's too)."""
    from eagle3.draft.model import KVCache
    from serve_eval.static_cache import StaticDraftKV

    target = make_target()
    draft = make_draft(target)
    draft.config.sliding_window = window
    g = torch.Generator().manual_seed(0)
    static, dynamic = StaticDraftKV(draft).start(64), KVCache()
    h = draft.config.hidden_size

    def rows(start: int, n: int) -> None:
        ids = torch.randint(0, 100, (1, n), generator=g)
        hidden, pos = torch.randn(1, n, h, generator=g), torch.arange(start, start + n)[None]
        for got, want in zip(draft(ids, hidden, pos, static), draft(ids, hidden, pos, dynamic), strict=True):
            torch.testing.assert_close(got, want)

    def steps(start: int, n: int) -> None:
        state = torch.randn(1, 1, h, generator=g)
        for i in range(n):
            token, pos = torch.randint(0, 100, (1, 1), generator=g), torch.tensor([[start + i]])
            got = static.step(token, state, pos)
            want_state, want_logits = draft(token, state, pos, dynamic)
            torch.testing.assert_close(got[0], want_state)
            torch.testing.assert_close(got[1], want_logits[:, -1])
            state = got[0]

    def tree(start: int, n: int) -> None:  # a tree's expansion: each node sees some earlier slots and itself
        ids, states = torch.randint(0, 100, (1, n), generator=g), torch.randn(1, n, h, generator=g)
        pos = torch.full((1, n), start)
        mask = torch.rand(n, start + n, generator=g) < 0.5
        mask[:, start:] = torch.eye(n, dtype=torch.bool)
        wide = torch.zeros(n, static.slots, dtype=torch.bool)
        wide[:, :start + n] = mask
        got = static.tree_step(ids, states, pos, wide)
        for a, b in zip(got, draft(ids, states, pos, dynamic, attn_mask=mask), strict=True):
            torch.testing.assert_close(a, b, **({} if window is None else {"rtol": 1e-4, "atol": 1e-4}))  # fp32 sums

    from torch._dynamo.utils import counters

    compiled = counters["stats"]["unique_graphs"]
    with torch.no_grad():  # as the loop runs it
        rows(0, 5)
        steps(5, 3)
        static.truncate(6)
        dynamic.truncate(6)
        steps(6, 2)
        rows(8, 3)
        steps(11, 4)
        tree(15, 3)
        tree(18, 3)  # the same capture, later slots
        static.truncate(16)
        dynamic.truncate(16)
        tree(16, 3)
    assert int(static.pos) == len(static) == len(dynamic) == 19
    assert counters["stats"]["unique_graphs"] - compiled <= 2  # one step and one expansion: no recompiles


def test_graphs_replay_the_draft_steps_through_accepted_and_rejected_rounds() -> None:
    """Under graphs an EAGLE-3 chain drafts over a static draft cache (its length on the device):
    rolled back after each verify, catch-up rows land where the dynamic cache has them, so the
    oracle's runs and rejections come out the same."""
    from serve_eval.static_cache import StaticDraftKV

    target = make_target()
    draft = make_draft(target)
    for wrong in (0, 3):
        graphs = OracleDecoder(target, draft, SpecConfig("chain", k=4, target_cache="graphs"), wrong=wrong)
        dynamic = OracleDecoder(target, draft, SpecConfig("chain", k=4), wrong=wrong)
        assert isinstance(graphs.proposer.cache, StaticDraftKV) and not isinstance(dynamic.proposer.cache,
                                                                                     StaticDraftKV)
        for prompt in PROMPTS:
            got, want = graphs.generate(prompt, 30), dynamic.generate(prompt, 30)
            assert got.tokens == want.tokens == plain(target, prompt, 30)
            assert got.stats.accepted == want.stats.accepted


def test_a_transformers_without_static_crop_rolls_the_counter_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.x before ``StaticLayer.crop`` (5.17 on the GPU image): the write counter itself."""
    from transformers.cache_utils import StaticLayer

    monkeypatch.delattr(StaticLayer, "crop", raising=False)
    target = make_target()
    decoder = OracleDecoder(target, make_draft(target), SpecConfig("chain", k=4, target_cache="static"), wrong=3)
    got = decoder.generate(PROMPTS[0], 30)
    assert got.tokens == plain(target, PROMPTS[0], 30) and got.stats.tau > 1.0


def test_graphs_compile_each_forward_length_once_and_change_nothing() -> None:
    """Compiled (mode reduce-overhead; CUDA graphs on CUDA, a compiled forward here): the same tokens
    as the dynamic cache, and a second prompt of another length compiles nothing new (the prefill,
    of any length, runs eagerly)."""
    from torch._dynamo.utils import counters

    target = make_target()
    draft = make_draft(target)
    dynamic = SpeculativeDecoder(target, draft, SpecConfig("chain", k=3))
    graphs = SpeculativeDecoder(target, draft, SpecConfig("chain", k=3, target_cache="graphs"))
    assert graphs.generate(PROMPTS[0], 16).tokens == dynamic.generate(PROMPTS[0], 16).tokens  # verify: 4 tokens
    assert graphs.generate(PROMPTS[0], 16, speculate=False).tokens == plain(target, PROMPTS[0], 16)  # 1 token
    compiled = counters["stats"]["unique_graphs"]
    assert compiled >= 1
    for params, seed in ((GREEDY, 0), (SAMPLED, 2)):
        want = dynamic.generate(PROMPTS[1], 16, params=params, seed=seed)
        assert graphs.generate(PROMPTS[1], 16, params=params, seed=seed).tokens == want.tokens
    assert graphs.generate(PROMPTS[1], 16, speculate=False).tokens == plain(target, PROMPTS[1], 16)
    assert counters["stats"]["unique_graphs"] == compiled  # the other prompt length compiled nothing


@pytest.mark.parametrize("target_cache", ["static", "graphs"])
def test_a_static_cache_verifies_trees_as_the_dynamic_one(target_cache: str) -> None:
    """A tree's verify in a static cache (its nodes in consecutive slots under a mask over every slot,
    the accepted ones moved down after; under graphs the draft's expansions replayed too): the same
    tokens and acceptance as the dynamic cache, greedy and sampled, across prompts longer and shorter
    than the last; an oracle tree whose accepted path skips a node (so entries move) gives plain
    decoding's tokens."""
    target = make_target()
    draft = make_draft(target)
    config = SpecConfig("tree", k=3, topk=4, budget=10)
    dynamic = SpeculativeDecoder(target, draft, config)
    static = SpeculativeDecoder(target, draft, SpecConfig("tree", k=3, topk=4, budget=10, target_cache=target_cache))
    from serve_eval.static_cache import StaticDraftKV

    assert isinstance(static.proposer.cache, StaticDraftKV) == (target_cache == "graphs")  # graphs: drafts replayed
    prompts = (PROMPTS[1], PROMPTS[0], PROMPTS[1]) if target_cache == "static" else (PROMPTS[1],)  # graphs: compiles
    for prompt in prompts:
        for params, seed in ((GREEDY, 0), (SAMPLED, 5)):
            want = dynamic.generate(prompt, 20, params=params, seed=seed)
            got = static.generate(prompt, 20, params=params, seed=seed)
            assert got.tokens == want.tokens and got.stats.accepted == want.stats.accepted
    long = [(7 * i) % 90 + 3 for i in range(1000)]  # near 1,024 slots: the tree's expansions must fit too
    assert static.generate(long, 20).tokens == dynamic.generate(long, 20).tokens
    oracle = OracleDecoder(target, draft, SpecConfig("tree", k=4, target_cache=target_cache))
    for prompt in prompts[:2]:
        got = oracle.generate(prompt, 30)
        assert got.tokens == plain(target, prompt, 30) and got.stats.tau > 4.0  # every round: the second child's run


def test_a_static_cache_is_refused_where_it_cannot_roll_back() -> None:
    with pytest.raises(ValueError, match="expected dynamic, static or graphs"):
        SpecConfig("chain", target_cache="paged")
    target = make_target()
    target.config.layer_types = ["sliding_attention"] * target.num_layers
    with pytest.raises(ValueError, match="target_cache=graphs: .* sliding-window"):
        SpeculativeDecoder(target, make_draft(target), SpecConfig("chain", target_cache="graphs"))
    assert torch.is_grad_enabled()  # nothing above left grad mode off
