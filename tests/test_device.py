"""Device-clean library code, checked on a CPU-only machine: the model on a second device
(:mod:`tests.fake_device`), the data as the library builds it. Each test fails where library code
makes a tensor, an index or a generator without the device of the data it meets, which CUDA
refuses and a CPU never notices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data_gen.config import HarvestConfig
from data_gen.harvest import run as harvest
from eagle3.config import SamplingConfig, TargetConfig
from eagle3.draft.families import family_of
from eagle3.draft.metrics import AcceptanceTally
from eagle3.draft.model import DraftConfig, Eagle3Draft
from eagle3.draft.target_head import TargetHead
from eagle3.draft.ttt import step_weights
from eagle3.draft.vocab import DraftVocab
from eagle3.store.batches import load_batch
from eagle3.store.shards import HarvestStore
from eagle3.target.model import Target
from eagle3.train.step import TTTModel, train_forward
from hard_mining.score import score_store, target_head
from serve_eval.config import SpecConfig
from serve_eval.eval_runs import top2_margin
from serve_eval.evaluate import evaluate
from serve_eval.spec_decode import SpeculativeDecoder
from tests.fake_device import DeviceMixError, host_syncs, other_device
from tests.helpers import (
    PROMPTS,
    dflash_for,
    lively_target,
    make_draft,
    make_target,
    peagle_for,
    regenerated_data,
)


def test_the_fake_device_catches_what_cuda_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness itself: mixing devices raises, moving does not, CPU scalars pass in elementwise ops."""
    with other_device(monkeypatch) as dev:
        x = torch.ones(3, device=dev)
        assert x.device == dev and float((x * torch.tensor(2.0)).sum()) == 6.0  # a CPU 0-dim scalar: allowed
        assert torch.equal((x + torch.ones(3).to(dev)).cpu(), torch.full((3,), 2.0))
        with pytest.raises(DeviceMixError):
            torch.stack([x.sum(), torch.ones(3).sum()])  # the trainer's step-1 CUDA crash (0-dim, but cat)
        with pytest.raises(DeviceMixError):
            x + torch.ones(3)
        with pytest.raises(DeviceMixError):
            torch.nn.functional.embedding(torch.tensor([[0, 1]]), torch.ones(4, 2, device=dev))  # CPU ids
        with pytest.raises(DeviceMixError):
            torch.multinomial(x, 1, generator=torch.Generator(device="cpu"))
        assert int(torch.multinomial(x, 1, generator=torch.Generator(device=dev).manual_seed(0))) in (0, 1, 2)


def test_the_fake_device_records_what_makes_cuda_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sync recorder itself: reading a value, nonzero, a boolean index, a copy back to the host and
    tolist() on device data are recorded, in order; work that stays on the device, or host data, is not."""
    with other_device(monkeypatch) as dev:
        x, mask = torch.arange(6.0, device=dev), torch.tensor([True, False] * 3).to(dev)
        with host_syncs() as seen:
            y = torch.where(mask, x, 0).sum() + x[torch.tensor([0, 2])].sum()  # gathers and sums: no sync
            assert seen == []
            float(y), mask.nonzero(), x[mask], x.cpu(), x.tolist()
        assert [s.split()[0] for s in seen] == ["_local_scalar_dense.default", "nonzero.default", "index.Tensor",
                                                "_to_copy.default", "tolist"]
        with host_syncs() as seen:
            torch.ones(3).sum().item()  # host data: nothing to wait for
        assert seen == []


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_speculative_loop_runs_with_the_model_on_another_device(monkeypatch: pytest.MonkeyPatch, mode: str,
                                                                   temperature: float) -> None:
    target = make_target()
    draft = make_draft(target)
    config, params = SpecConfig(mode, k=3, topk=3, budget=8), SamplingConfig(temperature=temperature)
    want = SpeculativeDecoder(target, draft, config).generate(PROMPTS[1], 16, params=params, seed=3)
    with other_device(monkeypatch) as dev:
        target.model.to(dev)
        draft.to(dev)
        got = SpeculativeDecoder(target, draft, config).generate(PROMPTS[1], 16, params=params, seed=3)
        plain = SpeculativeDecoder(target, None).generate(PROMPTS[1], 16, params=params, seed=3)
    assert got.tokens == want.tokens  # the same computation on the same CPU underneath, the same generator stream
    assert len(plain.tokens) == 16
    assert all(0 <= t < target.vocab_size for t in got.tokens + plain.tokens)


@pytest.mark.parametrize("family", ["peagle", "dflash"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_parallel_families_serve_with_the_model_on_another_device(monkeypatch: pytest.MonkeyPatch, family: str,
                                                                     temperature: float) -> None:
    target = make_target()
    draft = peagle_for(target) if family == "peagle" else dflash_for(target)
    config, params = SpecConfig("chain", k=3), SamplingConfig(temperature=temperature)
    want = SpeculativeDecoder(target, draft, config).generate(PROMPTS[1], 16, params=params, seed=3)
    with other_device(monkeypatch) as dev:
        target.model.to(dev)
        draft.to(dev)
        got = SpeculativeDecoder(target, draft, config).generate(PROMPTS[1], 16, params=params, seed=3)
    assert got.tokens == want.tokens


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Target, Path]:
    """A lively tiny target and an fp32 store of 8 short conversations, harvested on the CPU."""
    root = tmp_path_factory.mktemp("device")
    target = lively_target()
    harvest(HarvestConfig(data=str(regenerated_data(root / "data.jsonl", 8, turns=2)), out_dir=str(root / "store"),
                          dtype="float32"), TargetConfig(name_or_path="lively"), target=target, progress=False)
    return target, root / "store"


@pytest.fixture(scope="module")
def topk_store(store: tuple[Target, Path]) -> Path:
    """The same conversations harvested as the target's top-16 log-probs (``store=topk``)."""
    target, folder = store
    harvest(HarvestConfig(data=str(folder.parent / "data.jsonl"), out_dir=str(folder.parent / "topk"),
                          dtype="float32", store="topk", topk=16), TargetConfig(name_or_path="lively"), target=target,
            progress=False)
    return folder.parent / "topk"


def _draft_for(target: Target, vocab: DraftVocab, family: str = "eagle3") -> Eagle3Draft:
    torch.manual_seed(0)
    extra = {"eagle3": {}, "peagle": {"mask_token_id": 3}, "dflash": {"mask_token_id": 3, "block_size": 4}}[family]
    config = DraftConfig.from_target_config(target.config, draft_vocab_size=vocab.size, **extra)
    draft = family_of(config).build(config, target.embed_tokens.weight.detach().float())
    draft.set_draft_vocab(vocab.d2t, vocab.t2d)
    return draft


@pytest.mark.parametrize("loss_positions,family,kind", [("replies", "eagle3", "last"), ("all", "eagle3", "last"),
                                                        ("replies", "peagle", "last"), ("replies", "dflash", "last"),
                                                        ("replies", "eagle3", "topk")])
def test_a_training_step_and_the_eval_tally_run_with_the_model_on_another_device(
        monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, store: tuple[Target, Path],
        loss_positions: str, family: str, kind: str) -> None:
    """The trainer's micro-batch (host batch in, engine on the device), its backward, the
    acceptance tally and its summary: the code that crashed at step 1 on CUDA."""
    target, folder = store
    data = HarvestStore(folder if kind == "last" else request.getfixturevalue("topk_store"))
    batch = load_batch(data, [0, 1, 2], "pack")  # what the loader builds: host tensors
    vocab = DraftVocab.from_target_ids(torch.arange(0, target.vocab_size, 2), target.vocab_size)
    model = TTTModel(_draft_for(target, vocab, family), num_steps=3, step_decay=0.8)
    head = TargetHead.of_target(target)
    want, want_sums = train_forward(model, head, batch, vocab.t2d, torch.float32, torch.device("cpu"),
                                    loss_positions)
    with other_device(monkeypatch) as dev:
        model.to(dev)
        head.to(dev)
        t2d = vocab.t2d.to(dev)  # one tensor for the run, as the trainer holds it
        out, sums = train_forward(model, head, batch, t2d, torch.float32, dev, loss_positions)
        out.loss.backward()
        tally = AcceptanceTally(3, dev)
        tally.add(out)
        metrics = tally.all_reduce().summary(step_weights(3), "train")
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and g.device == dev for g in grads)
        assert sums.device == dev
        got_sums = sums.cpu()
        # the next micro-batch (the draft vocab read once already): nothing makes the host wait
        with host_syncs() as syncs:
            again, _ = train_forward(model, head, batch, t2d, torch.float32, dev, loss_positions)
            again.loss.backward()
            AcceptanceTally(3, dev).add(again)
        assert syncs == []
        assert again.loss.cpu() == out.loss.cpu()
    assert torch.allclose(got_sums, want_sums, rtol=1e-5)
    assert metrics["train/loss"] == pytest.approx(float(want.loss), rel=1e-5)
    assert int(got_sums[1]) == sum(len(data[i].input_ids) for i in range(3))


def test_mining_scores_a_host_store_with_the_draft_on_another_device(monkeypatch: pytest.MonkeyPatch,
                                                                     store: tuple[Target, Path]) -> None:
    _, folder = store
    target = lively_target()  # the store's target, a copy of our own to move
    data = HarvestStore(folder)
    vocab = DraftVocab.from_target_ids(torch.arange(0, target.vocab_size, 2), target.vocab_size)
    draft = _draft_for(target, vocab)
    want = score_store(draft, target_head(target), data, {}, ttt_steps=3)
    with other_device(monkeypatch) as dev:
        target.model.to(dev)
        draft.to(dev)
        got = score_store(draft, target_head(target), data, {}, ttt_steps=3)
    assert [s.accepted for s in got] == [s.accepted for s in want]
    assert [s.loss for s in got] == pytest.approx([s.loss for s in want], rel=1e-5)


def test_evaluation_and_its_divergence_margin_run_with_the_model_on_another_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """serve_eval.evaluate end to end (cost model, plain and speculative loops, report) and
    top2_margin, the line a bf16 divergence reaches first."""
    target = make_target()
    draft = make_draft(target)
    want = top2_margin(target, PROMPTS[1])
    with other_device(monkeypatch) as dev:
        target.model.to(dev)
        draft.to(dev)
        report = evaluate(target, draft, {"a": PROMPTS}, config=SpecConfig("chain", k=2), params=SamplingConfig(),
                          max_new_tokens=8, stop_ids=[], progress=False)
        margin = top2_margin(target, PROMPTS[1])
    assert margin == pytest.approx(want, abs=1e-5)  # a difference of two logits ~1e1: fp32 rounding
    assert report["overall"]["equal"] == 2 and report["config"]["device"] == str(dev)
    assert report["overall"]["cost_model"]["t1_ms"] > 0


def test_the_target_heads_draft_vocab_is_read_again_after_an_in_place_change(store: tuple[Target, Path]) -> None:
    """The head reads the draft vocab's ids from the device once per vocab, not per batch; a vocab
    changed in place (set_draft_vocab, load_state_dict copy into the same tensor) is read again."""
    target, _ = store
    head = TargetHead.of_target(target)
    t2d = DraftVocab.from_target_ids(torch.arange(0, target.vocab_size, 2), target.vocab_size).t2d.clone()
    assert head._draft_vocab(t2d)[0] == (target.vocab_size + 1) // 2
    t2d.copy_(DraftVocab.from_target_ids(torch.arange(0, target.vocab_size, 4), target.vocab_size).t2d)
    size, ids = head._draft_vocab(t2d)
    assert size == (target.vocab_size + 3) // 4 and ids.tolist() == list(range(0, target.vocab_size, 4))
    with pytest.raises(TypeError, match="bool mask"):
        head._draft_vocab(ids)


def test_auto_dtype_is_bf16_only_where_the_cpu_has_it(monkeypatch, tmp_path) -> None:
    import eagle3.device as device

    monkeypatch.delenv("EAGLE3_CPU_BF16", raising=False)
    for flags, native in (("fpu avx2 avx512f", False), ("fpu avx512f avx512_bf16", True), ("amx_bf16 amx_tile", True)):
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"processor : 0\nflags : {flags}\n")
        real_path = device.Path
        monkeypatch.setattr(device, "Path", lambda p, real=real_path, f=cpuinfo: f if p == "/proc/cpuinfo" else real(p))
        assert device.cpu_native_bf16() is native
        want = torch.bfloat16 if native else torch.float32
        assert device.resolve_dtype("auto", torch.device("cpu")) == want
        assert device.resolve_dtype("float32", torch.device("cpu")) == torch.float32  # asked for: kept
    monkeypatch.setenv("EAGLE3_CPU_BF16", "1")
    assert device.resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16


def test_a_near_tie_is_judged_at_the_precision_the_target_computes_in() -> None:
    """fp32: a divergence under TIE_MARGIN is a near-tie; bf16 and fp16 round logits to a coarser grid
    (bf16: 0.125 between 16 and 32), so a few units in the last place, where the batched verification
    and plain decoding round apart, are a near-tie there and a wider margin is not."""
    from serve_eval.eval_runs import TIE_MARGIN, TIE_ULPS, tie_margin

    assert tie_margin(torch.float32, 20.0) == TIE_MARGIN
    one_ulp = float(torch.tensor(20.0, dtype=torch.bfloat16).nextafter(torch.tensor(30.0, dtype=torch.bfloat16)) - 20)
    assert one_ulp == 0.125
    assert tie_margin(torch.bfloat16, 20.0) == tie_margin(torch.bfloat16, -20.0) == 0.125 * TIE_ULPS
    assert tie_margin(torch.bfloat16, 40.0) == 0.25 * TIE_ULPS and tie_margin(torch.bfloat16, 0.0) > TIE_MARGIN
    assert tie_margin(torch.float16, 20.0) == pytest.approx(TIE_ULPS * 2**-10 * 16)
    assert not 1.0 < tie_margin(torch.bfloat16, 20.0)  # a whole logit apart is a divergence in bf16 too
