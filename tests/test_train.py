"""The trainer on a tiny random target and a tiny harvest store written here: the loss goes
down, kill -9 and resume gives the same losses, two gloo processes under DeepSpeed match one,
eval picks the best draft by tau_sim, and bad settings fail naming the key."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from data_gen.config import HarvestConfig
from data_gen.harvest import run as harvest
from eagle3.atomic import atomic_dir, remove_leftovers
from eagle3.config import TargetConfig
from eagle3.distributed import free_port
from eagle3.draft.metrics import AcceptanceTally
from eagle3.draft.model import DraftConfig, Eagle3Draft
from eagle3.draft.target_head import TargetHead
from eagle3.draft.ttt import TTTOutput, prepare_targets, ttt_forward
from eagle3.draft.vocab import DraftVocab
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.export import read_draft_vocab
from eagle3.store.batches import (
    collate,
    epoch_batches,
    eval_batches_for_rank,
    rank_batch_index,
    shard_sequence,
    split_by_id,
    steps_per_epoch,
)
from eagle3.store.shards import HarvestStore, verify_store
from eagle3.target.model import Target
from eagle3.train.checkpoint import LATEST, CheckpointError, check_pinned, load_exported_draft, tag_of
from eagle3.train.config import TrainConfig, train_config
from eagle3.train.log import read_metrics
from eagle3.train.loop import TrainError, main, train
from eagle3.train.optim import muon_ns_in_fp32_where_bf16_is_slow, muon_ns_method, resolve_precision, warmup_decay
from eagle3.train.start import choose_draft_vocab
from eagle3.train.step import TTTModel, add_feature_noise
from tests.helpers import (
    TINY_VOCAB,
    conditional_acceptance,
    lively_target,
    packed_batch,
    regenerated_data,
    save_lively,
    simulated_tau,
    step_accuracy,
    tiny_draft,
    tiny_kimi_k25,
    tiny_tokenizer,
)

REPO = Path(__file__).resolve().parents[1]
# A run in this process leaves its rendezvous variables behind; subprocesses must not join it.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}




@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A lively tiny target (in memory and saved as a folder) and two fp32 stores of it: 40
    conversations with 'last' states, 12 with top-16 log-probs."""
    root = tmp_path_factory.mktemp("train")
    target = lively_target()
    data = regenerated_data(root / "data.jsonl", 40, turns=3)
    lively = TargetConfig(name_or_path="lively")
    harvest(HarvestConfig(data=str(data), out_dir=str(root / "store"), dtype="float32"), lively,
            target=target, progress=False)
    harvest(HarvestConfig(data=str(regenerated_data(root / "few.jsonl", 12, turns=2)), out_dir=str(root / "topk"),
                          dtype="float32", store="topk", topk=16), lively, target=target, progress=False)
    return {"target": target, "store": root / "store", "topk": root / "topk", "model": save_lively(root / "model")}


# These tests compare runs bit for bit (resume, two ranks against one), which CUDA kernels do not
# promise: they run on the CPU on every machine. On a GPU, tools/gpu_check.py trains on the device.
def _cfg(tiny: dict, out: Path, **kw) -> TrainConfig:
    base = {"data.store": str(tiny["store"]), "out_dir": str(out), "steps": 12, "data.micro_batch_tokens": 256,
            "optim.lr": 3e-3, "optim.warmup_steps": 2, "data.eval_fraction": 0.2, "eval_every": 4, "save_every": 4,
            "draft.vocab_size": 64, "log.wandb_mode": "disabled", "log.progress": False, "device": "cpu"}
    return train_config({**base, **kw})


def _precision(cfg: TrainConfig, device: torch.device) -> str:
    return resolve_precision(cfg.precision, cfg.optim, cfg.zero_stage, device)


def _cli(tiny: dict, out: Path, *extra: str) -> list[str]:
    return ["--store", str(tiny["store"]), "--target", str(tiny["model"]), "--out", str(out),
            "--data.micro-batch-tokens", "256", "--draft.vocab-size", "64", "--optim.lr", "3e-3",
            "--optim.warmup-steps", "2",
            "--data.eval-fraction", "0.2", "--log.wandb-mode", "disabled", "--no-log.progress", "--device", "cpu",
            *extra]


def _losses(out: Path) -> list[tuple[int, str, float]]:
    """Every logged loss/accuracy/tau figure (timings left out), in order."""
    keep = ("loss", "acc", "tau_sim", "grad_norm", "lr")
    return [(r["step"], k, v) for r in read_metrics(out) for k, v in r.items()
            if k != "step" and any(w in k for w in keep)]


# ---------------------------------------------------------------- pure pieces


def test_a_draft_vocab_that_cannot_be_read_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    save_file({"fc.weight": torch.zeros(2, 2)}, str(tmp_path / "weights.safetensors"))
    good = DraftVocab.from_target_ids(torch.tensor([0, 5, 9]), 262)
    save_file({"d2t": good.d2t, "t2d": good.t2d[:200]}, str(tmp_path / "short.safetensors"))
    wrong_mask = good.t2d.clone()
    wrong_mask[7] = True
    save_file({"d2t": good.d2t, "t2d": wrong_mask}, str(tmp_path / "mask.safetensors"))
    save_file({"d2t": torch.tensor([0, 300]), "t2d": good.t2d}, str(tmp_path / "range.safetensors"))
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00")
    for where, says in ((tmp_path / "empty", "config.json"), (tmp_path / "none", "no draft vocab here"),
                        (tmp_path / "weights.safetensors", r"missing tensor\(s\) \['d2t', 't2d'\]"),
                        (tmp_path / "short.safetensors", "over \\[200\\] target tokens, the target has 262"),
                        (tmp_path / "mask.safetensors", "t2d does not mark exactly"),
                        (tmp_path / "range.safetensors", "d2t does not map to valid target ids"),
                        (tmp_path / "cut.safetensors", "not a readable safetensors file")):
        cfg = train_config(**{"data.store": "s", "draft.vocab": str(where)}, out_dir="o")
        with pytest.raises(TrainError, match=f"train.draft.vocab: .*{says}"):
            choose_draft_vocab(cfg.draft, None, [], 262, [])


def test_warmup_then_decay() -> None:
    f = warmup_decay(warmup_steps=4, total_steps=14, min_lr_ratio=0.1)  # cosine by default
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0 and abs(f(9) - 0.55) < 1e-12 and abs(f(14) - 0.1) < 1e-12
    lin = warmup_decay(4, 14, 0.1, "linear")  # 1 -> 0.1 in equal steps of 0.09 over steps 4..14
    assert [lin(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lin(4) == 1.0 and abs(lin(6) - 0.82) < 1e-12 and abs(lin(9) - 0.55) < 1e-12 and abs(lin(14) - 0.1) < 1e-12
    assert abs(f(6) - lin(6)) > 0.05  # the two shapes differ between the ends
    const = warmup_decay(4, 14, 0.1, "constant")
    assert const(1) == 0.5 and const(4) == const(14) == 1.0
    with pytest.raises(ValueError, match="'step'"):
        warmup_decay(4, 14, 0.1, "step")


def test_split_and_rank_sharding_cover_every_batch_once() -> None:
    ids = [f"s{i}" for i in range(400)]
    train_idx, eval_idx = split_by_id(ids, 0.1)
    assert split_by_id(ids, 0.1) == (train_idx, eval_idx) and 20 < len(eval_idx) < 60
    assert sorted(train_idx + eval_idx) == list(range(400)) and split_by_id(ids, 0.0)[1] == []

    plan = epoch_batches([5 + i % 37 for i in range(400)], train_idx, "pack", 64, seed=3, epoch=1)
    assert plan == epoch_batches([5 + i % 37 for i in range(400)], train_idx, "pack", 64, seed=3, epoch=1)
    assert plan != epoch_batches([5 + i % 37 for i in range(400)], train_idx, "pack", 64, seed=3, epoch=2)
    world, accum = 2, 3
    for s in range(steps_per_epoch(len(plan), world, accum)):
        taken = sorted(rank_batch_index(s, a, r, world, accum) for r in range(world) for a in range(accum))
        assert taken == list(range(s * world * accum, (s + 1) * world * accum))
    padded = eval_batches_for_rank([[0], [1], [2]], rank=1, world_size=2)
    assert padded == [[1], None] and eval_batches_for_rank([[0], [1], [2]], 0, 2) == [[0], [2]]


@pytest.mark.parametrize("batching", ["pack", "buckets"])
def test_a_shard_window_reads_the_shards_in_order_a_window_at_a_time(batching: str) -> None:
    lengths = [5 + i % 37 for i in range(400)]
    shard_of = [i // 25 for i in range(400)]  # 16 shards of 25 samples
    train_idx, _ = split_by_id([f"s{i}" for i in range(400)], 0.1)
    for window in (1, 3):
        plan = epoch_batches(lengths, train_idx, batching, 64, seed=3, epoch=1, shard_of=shard_of, window=window)
        assert sorted(i for b in plan for i in b) == sorted(train_idx)  # every sample once
        order = shard_sequence(16, seed=3, epoch=1)
        assert sorted(order) == list(range(16)) and order != list(range(16))
        windows = [set(order[w:w + window]) for w in range(0, 16, window)]
        seen = [next(n for n, win in enumerate(windows) if {shard_of[i] for i in b} <= win) for b in plan]
        assert seen == sorted(seen)  # each micro-batch inside one window, the windows in order
        assert plan == epoch_batches(lengths, train_idx, batching, 64, seed=3, epoch=1, shard_of=shard_of,
                                     window=window)
        assert plan != epoch_batches(lengths, train_idx, batching, 64, seed=3, epoch=2, shard_of=shard_of,
                                     window=window)
    # a shard left with nothing to train on is skipped, the others keep their order
    odd = [i for i in train_idx if shard_of[i] != 5]
    plan = epoch_batches(lengths, odd, batching, 64, seed=3, epoch=1, shard_of=shard_of, window=1)
    firsts = list(dict.fromkeys(shard_of[b[0]] for b in plan))
    assert firsts == [k for k in shard_sequence(16, seed=3, epoch=1) if k != 5]
    # window 0 is the whole set shuffled, as before the option existed
    assert epoch_batches(lengths, train_idx, batching, 64, 3, 1, shard_of=shard_of, window=0) == \
        epoch_batches(lengths, train_idx, batching, 64, 3, 1)


def test_buckets_collate_pads_outside_every_document(tiny: dict) -> None:
    store = HarvestStore(tiny["store"])
    batch = collate([store[0], store[1]], "buckets")
    n0, n1 = len(store[0]), len(store[1])
    width = max(n0, n1)
    assert batch["input_ids"].shape == (2, width) and batch["aux"].shape == (2, width, 3, 64)
    short = 0 if n0 < n1 else 1
    assert (batch["document_ids"][short, min(n0, n1):] == -1).all()
    assert not batch["loss_mask"][short, min(n0, n1):].any()


def test_head_on_the_needed_rows_only_changes_nothing_ttt_reads(tiny: dict) -> None:
    target, store = tiny["target"], HarvestStore(tiny["store"])
    batch = collate([store[0], store[1], store[2]], "pack")  # three documents in one row
    vocab = DraftVocab.from_target_ids(torch.arange(0, 262, 3), 262)
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.from_target_config(target.config, draft_vocab_size=vocab.size),
                        target.embed_tokens.weight)
    draft.set_draft_vocab(vocab.d2t, vocab.t2d)
    full = prepare_targets(target.head(batch["last"]), vocab.t2d)
    some = TargetHead(target.norm, target.lm_head).targets(batch, vocab.t2d, chunk_tokens=50)
    assert (some.argmax == -1).float().mean() > 0.3  # prompts and document ends are skipped
    args = (draft, batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"], batch["loss_mask"])
    a, b = ttt_forward(*args, full), ttt_forward(*args, some)
    assert torch.allclose(a.loss, b.loss, rtol=1e-6) and torch.equal(a.counted, b.counted)
    assert torch.equal(a.match & a.counted, b.match & b.counted) and torch.equal(a.valid, b.valid)


def test_tally_equals_the_ttt_metrics() -> None:
    g = torch.Generator().manual_seed(0)
    parts = []
    for n in (30, 50):
        match = torch.rand(5, 2, n, generator=g) < 0.7
        counted = torch.rand(5, 2, n, generator=g) < 0.8
        parts.append(TTTOutput(loss=torch.tensor(0.0), loss_sum=torch.rand(5, generator=g), count=counted.flatten(1)
                               .sum(1), match=match, counted=counted, valid=counted))
    tally = AcceptanceTally(5, torch.device("cpu"))
    for p in parts:
        tally.add(p)
    got = tally.summary(torch.ones(5), "x")
    match = torch.cat([p.match.flatten(1) for p in parts], dim=1)
    counted = torch.cat([p.counted.flatten(1) for p in parts], dim=1)
    for k in range(5):
        assert got[f"x/acc_{k}"] == pytest.approx(float(step_accuracy(match, counted)[k]), abs=1e-6)
        assert got[f"x/cond_acc_{k}"] == pytest.approx(float(conditional_acceptance(match, counted)[k]), abs=1e-6)
    assert got["x/tau_sim"] == pytest.approx(float(simulated_tau(match, counted)), abs=1e-6)


def test_config_errors_name_the_key(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for kw, key in [({"steps": 0}, "train.steps=0"), ({"zero_stage": 4}, "train.zero_stage=4"),
                    ({"precision": "fp16"}, "train.precision='fp16'"), ({"data.batching": "rows"},
                                                                        "train.data.batching='rows'"),
                    ({"data.eval_fraction": 1.0}, "train.data.eval_fraction=1.0"), ({"loss.step_decay": 0.0},
                                                                                    "train.loss.step_decay=0.0"),
                    ({"data.eval_store": "x", "data.eval_fraction": 0.1}, "train.data.eval_fraction=0.1"),
                    ({"log.wandb_mode": "cloud"}, "train.log.wandb_mode='cloud'"), ({"device": "tpu"},
                                                                                    "train.device='tpu'"),
                    ({"init.layers": "target"}, "train.init.layers='target'"),
                    ({"draft.sliding_window": 3, "ttt_steps": 3}, "train.draft.sliding_window=3: must exceed"),
                    ({"draft.full_attention_layers": [0]}, "train.draft.full_attention_layers=\\[0\\]: set"),
                    ({"draft.sliding_window": 9, "draft.full_attention_layers": [1]},
                     "train.draft.full_attention_layers: \\[1\\] not among")]:
        with pytest.raises(ValueError, match=key.replace("(", r"\(").replace(".", r"\.")):
            train_config(kw)
    with pytest.raises(ValueError, match="freeze_lm_head=true needs train.init.lm_head=target"):
        train_config(**{"init.freeze_lm_head": True})
    with pytest.raises(SystemExit):
        main(["--store", "s", "--out", str(tmp_path), "--zero-stage", "5"])
    assert "train.zero_stage=5: expected 0, 1, 2 or 3" in capsys.readouterr().err


# ---------------------------------------------------------------- in this process (DeepSpeed, one rank)


def test_a_few_steps_reduce_the_loss_and_export_the_draft(tiny: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    summary = train(_cfg(tiny, out, steps=24, eval_every=8, **{"optim.lr": 1e-2}), target=tiny["target"])
    # The random target's own entropy (~3.9 nats per step of a uniform 64-token draft vocab) is
    # most of the loss, so the learnable part is small: ask for 0.5 nats (weighted over 7 steps).
    losses = [r["train/loss"] for r in read_metrics(out) if "train/loss" in r]
    assert len(losses) == 24 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5
    evals = [r for r in read_metrics(out) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 8, 16, 24]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"] - 0.5 and evals[-1]["eval/tau_sim"] > evals[0]["eval/tau_sim"]
    assert summary["steps"] == 24 and summary["eval_samples"] > 0 and summary["tokens_per_s"] > 0
    record = read_metrics(out)[1]
    for key in ("train/lr", "train/grad_norm", "train/tokens_per_s", "train/tau_sim", "train/acc_6"):
        assert key in record, key

    final = load_file(str(out / "final" / "model.safetensors"))
    assert "embed_tokens.weight" not in final and {"fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight",
                                                   "d2t", "t2d"} <= set(final)
    draft, meta = load_exported_draft(out / "final")
    assert meta["step"] == 24 and meta["aux_layer_ids"] == [2, 4, 5] and draft.config.draft_vocab_size == 64
    vocab = read_draft_vocab(out / "draft_vocab.safetensors", 262)
    assert torch.equal(draft.d2t, vocab.d2t) and torch.equal(draft.t2d, vocab.t2d)


def test_a_sliding_window_draft_trains_and_exports_its_window(tiny: dict, tmp_path: Path) -> None:
    longest = max(HarvestStore(tiny["store"]).lengths)
    with pytest.raises(TrainError,
                       match=f"train.draft.sliding_window={longest}: not shorter than the store's longest row "
                                         f"\\({longest} tokens\\)"):
        train(_cfg(tiny, tmp_path / "long", **{"draft.sliding_window": longest}), target=tiny["target"])
    assert not (tmp_path / "long").exists()  # refused before anything is written
    out = tmp_path / "run"
    train(_cfg(tiny, out, steps=4, eval_every=0, save_every=0, **{"draft.sliding_window": 12}), target=tiny["target"])
    draft, _ = load_exported_draft(out / "final")
    assert draft.config.sliding_window == 12 and draft.config.full_attention_layers == []
    assert json.loads((out / "final" / "config.json").read_text())["layer_types"] == ["sliding_attention"]


def _assert_it_learned(out: Path) -> None:
    """The logged loss fell (last 4 steps against the first 4) and held-out tau_sim rose."""
    losses = [r["train/loss"] for r in read_metrics(out) if "train/loss" in r]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4
    evals = [r for r in read_metrics(out) if "eval/tau_sim" in r]
    assert evals[-1]["eval/tau_sim"] > evals[0]["eval/tau_sim"]


@pytest.mark.parametrize("loss", ["tv", "lk_hybrid"])
def test_the_acceptance_losses_train_the_draft_too(tiny: dict, tmp_path: Path, loss: str) -> None:
    """train.loss.kind=tv / lk_hybrid: the objective falls and held-out acceptance rises, as with soft CE."""
    out = tmp_path / loss
    train(_cfg(tiny, out, steps=24, eval_every=24, **{"optim.lr": 1e-2, "loss.kind": loss}), target=tiny["target"])
    _assert_it_learned(out)


@pytest.mark.parametrize("family", ["peagle", "dflash"])
def test_the_parallel_families_train_export_and_serve_losslessly(tiny: dict, tmp_path: Path, family: str) -> None:
    """train.draft.family=peagle / dflash through the trainer: the loss falls, held-out acceptance
    rises, the export reads back as that family and serves greedy output equal to plain decoding."""
    from eagle3.export import load_draft
    from serve_eval.config import SpecConfig
    from serve_eval.spec_decode import SpeculativeDecoder

    out = tmp_path / family
    train(_cfg(tiny, out, steps=24, eval_every=24, **{"optim.lr": 1e-2, "draft.family": family}), target=tiny["target"])
    _assert_it_learned(out)
    target = tiny["target"]
    loaded = load_draft(out / "final", embed_tokens_weight=target.embed_tokens.weight.detach())
    assert loaded.draft.config.family == family and loaded.aux_layer_ids == (2, 4, 5)
    speculative = SpeculativeDecoder(target, loaded.draft.eval(), SpecConfig("chain", k=3))
    for prompt in ([1, 5, 9, 3], [1, 17, 40, 9, 3, 2, 2]):
        assert speculative.generate(prompt, 16).tokens == SpeculativeDecoder(target, None).generate(prompt, 16).tokens


def test_a_dflash_block_larger_than_the_steps_trains_exports_and_serves_whole(tiny: dict, tmp_path: Path) -> None:
    """train.draft.block_size=6 with train.ttt_steps=3: the block trains whole (its first 3 proposals
    scored), exports as a block of 6, serves up to 5 tokens a round losslessly; a resume with another
    block size is refused naming the key, and so is continuing it as another block."""
    from eagle3.export import load_draft
    from serve_eval.config import SpecConfig
    from serve_eval.spec_decode import SpeculativeDecoder

    out = tmp_path / "block"
    settings = {"optim.lr": 1e-2, "draft.family": "dflash", "draft.block_size": 6, "ttt_steps": 3}
    train(_cfg(tiny, out, steps=24, eval_every=24, **settings), target=tiny["target"])
    _assert_it_learned(out)
    target = tiny["target"]
    loaded = load_draft(out / "final", embed_tokens_weight=target.embed_tokens.weight.detach())
    assert loaded.draft.config.block_size == 6
    assert json.loads((out / "final" / "config.json").read_text())["block_size"] == 6
    plain = SpeculativeDecoder(target, None).generate([1, 5, 9, 3], 16).tokens
    assert SpeculativeDecoder(target, loaded.draft.eval(), SpecConfig("chain", k=5)).generate([1, 5, 9, 3], 16
                                                                                            ).tokens == plain
    with pytest.raises(TrainError, match=r"train\.draft\.block_size=6, this run has 8"):
        train(_cfg(tiny, out, steps=30, eval_every=24, **{**settings, "draft.block_size": 8}),
              target=tiny["target"])
    with pytest.raises(TrainError, match=r"train\.draft\.block_size=8: .* was trained with block_size=6; a "
                                         r"continued draft keeps its shape"):
        train(_cfg(tiny, tmp_path / "more", steps=2, **{**settings, "draft.block_size": 8,
                                                        "init.draft": str(out / "final")}), target=tiny["target"])


def test_eval_keeps_the_best_tau_and_a_vocab_is_reused(tiny: dict, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    train(_cfg(tiny, out, steps=12, eval_every=2, **{"optim.lr": 2e-2, "data.batching": "buckets"}, save_every=0),
          target=tiny["target"])
    taus = [(r["eval/tau_sim"], r["step"]) for r in read_metrics(out) if "eval/tau_sim" in r and r["step"] > 0]
    assert len(taus) == 6 and len({t for t, _ in taus}) > 1
    best_tau = max(t for t, _ in taus)
    best_step = next(s for t, s in taus if t == best_tau)  # the first to reach it
    meta = json.loads((out / "best" / "draft.json").read_text())
    assert (meta["step"], meta["eval"]["eval/tau_sim"]) == (best_step, best_tau)
    assert json.loads((out / "summary.json").read_text())["best_step"] == best_step

    # Another run reuses the vocab of the exported draft, whatever its own draft_vocab_size.
    again = tmp_path / "again"
    summary = train(_cfg(tiny, again, steps=1, **{"draft.vocab": str(out / "best"), "draft.vocab_size": 32},
                         save_every=0),
                    target=tiny["target"])
    assert summary["draft_vocab_size"] == 64
    assert "holds 64 tokens; they replace train.draft.vocab_size=32" in capsys.readouterr().out
    assert (again / "draft_vocab.safetensors").read_bytes() == (out / "draft_vocab.safetensors").read_bytes()


def test_rerun_resumes_and_other_settings_fail_naming_the_key(tiny: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = _cfg(tiny, out, steps=2, eval_every=1)
    first = train(cfg, target=tiny["target"])
    final = (out / "final" / "model.safetensors").read_bytes()
    again = train(cfg, target=tiny["target"])  # finished: nothing left to do, the first run's record stands
    assert again["first_loss"] == first["first_loss"] and again["tokens_per_s"] == first["tokens_per_s"]
    assert again == json.loads((out / "summary.json").read_text()) and again["eval_last"] is not None
    assert (out / "final" / "model.safetensors").read_bytes() == final
    assert json.loads((out / "final" / "draft.json").read_text())["eval"]["eval/tau_sim"] >= 1.0
    with pytest.raises(TrainError, match="trained with train.data.micro_batch_tokens=256, this run has 128"):
        train(_cfg(tiny, out, steps=4, **{"data.micro_batch_tokens": 128}), target=tiny["target"])
    # the checkpoint restores the optimizer's own lr: a changed one would only have been logged
    with pytest.raises(TrainError, match="trained with train.optim.lr=0.003, this run has 0.03"):
        train(_cfg(tiny, out, steps=4, eval_every=1, **{"optim.lr": 3e-2}), target=tiny["target"])
    # the best draft was picked on the held-out samples: another held-out set cannot continue that choice
    with pytest.raises(TrainError, match="trained with eval_store.shards=None"):
        train(_cfg(tiny, out, steps=4, eval_every=1, **{"data.eval_fraction": 0.0,
                                                        "data.eval_store": str(tiny["topk"])}),
              target=tiny["target"])
    assert train(_cfg(tiny, out, steps=1, **{"data.micro_batch_tokens": 128}, resume=False),
                 target=tiny["target"])["resumed_from_step"] is None


def test_a_run_in_shard_windows_resumes_bit_for_bit(tiny: dict, tmp_path: Path) -> None:
    store = tmp_path / "small-shards"
    harvest(HarvestConfig(data=str(regenerated_data(tmp_path / "d.jsonl", 24, turns=2)), out_dir=str(store),
                          dtype="float32", max_shard_mb=0.03), TargetConfig(name_or_path="lively"),
            target=tiny["target"], progress=False)
    assert max(HarvestStore(store).shard_of) >= 3  # several shards

    def run(out: Path, **kw) -> dict:
        return train(_cfg(tiny, out, **{"data.store": str(store), "steps": 6, "data.shard_window": 1, "eval_every": 0,
                                 "save_every": 3, "data.micro_batch_tokens": 128, **kw}), target=tiny["target"])

    whole = run(tmp_path / "whole")
    cut = tmp_path / "cut"  # the same run stopped after its step-3 checkpoint
    shutil.copytree(tmp_path / "whole", cut)
    for gone in ("final", "best", f"checkpoints/{tag_of(6)}"):
        shutil.rmtree(cut / gone, ignore_errors=True)
    (cut / "summary.json").unlink()
    (cut / "checkpoints" / LATEST).write_text(tag_of(3))
    resumed = run(cut)
    assert resumed["resumed_from_step"] == 3 and resumed["last_loss"] == whole["last_loss"]
    assert (cut / "final" / "model.safetensors").read_bytes() == (tmp_path / "whole" / "final" /
                                                                  "model.safetensors").read_bytes()
    with pytest.raises(TrainError, match="trained with train.data.shard_window=1, this run has 0"):
        run(cut, **{"data.shard_window": 0})
    assert run(tmp_path / "global",
               **{"data.shard_window": 0})["last_loss"] != whole["last_loss"]  # the order is another


def test_settings_pinned_by_one_version_only_are_not_compared(tmp_path: Path) -> None:
    check_pinned({"train.seed": 0}, {"train.seed": 0, "train.draft.vocab_size": 64}, tmp_path)  # an earlier run's
    with pytest.raises(TrainError, match="train.seed=0, this run has 1"):
        check_pinned({"train.seed": 0}, {"train.seed": 1, "train.draft.vocab_size": 64}, tmp_path)


def test_inputs_that_do_not_fit_the_run_fail_naming_the_key_or_file(tiny: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(_cfg(tiny, out, steps=2, eval_every=0, save_every=2), target=tiny["target"])
    with pytest.raises(TrainError, match="trained with train.draft.vocab_size=64, this run has 32"):
        train(_cfg(tiny, out, steps=4, **{"draft.vocab_size": 32}), target=tiny["target"])
    saved = out / "checkpoints" / "step-00000002"
    listed = json.loads((saved / "trainer.json").read_text())["files"]
    assert "rng-rank00000.pt" in listed and any(name.endswith("model_states.pt") for name in listed)
    cut = next(saved.rglob("*_states.pt"))  # a DeepSpeed file cut short: refused before DeepSpeed reads it
    size = listed[cut.relative_to(saved).as_posix()]
    cut.write_bytes(cut.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{cut.name}: 100 bytes, saved with {size}"):
        train(_cfg(tiny, out, steps=4, eval_every=0, save_every=2), target=tiny["target"])
    trainer = json.loads((saved / "trainer.json").read_text())
    (saved / "trainer.json").write_text(json.dumps({k: v for k, v in trainer.items() if k != "files"}))
    (saved / "rng-rank00000.pt").unlink()  # a checkpoint of the earlier version, listing no files
    with pytest.raises(CheckpointError, match="rng-rank00000.pt: missing"):  # the resume would not be exact
        train(_cfg(tiny, out, steps=4, eval_every=0, save_every=2), target=tiny["target"])

    weights = tmp_path / "weights.json"
    weights.write_text('{"nosuchid": 2.0}')
    with pytest.raises(TrainError, match="sample_weights=.*none of its ids"):
        train(_cfg(tiny, tmp_path / "w", **{"data.sample_weights": str(weights)}), target=tiny["target"])
    with pytest.raises(TrainError, match="named twice"):
        train(_cfg(tiny, tmp_path / "twice", **{"data.extra_stores": [str(tiny["store"]) + "/"]}),
              target=tiny["target"])
    with pytest.raises(TrainError, match="train.data.store: .*nowhere: no such store"):
        train(_cfg(tiny, tmp_path / "none", **{"data.store": str(tmp_path / "nowhere")}), target=tiny["target"])

    # a sibling checkpoint (same tokenizer and shapes, other weights) is not the target the store came from
    model, sibling = tiny["model"], save_lively(tmp_path / "sibling", seed=1)
    store = tmp_path / "from-folder"
    harvest(HarvestConfig(data=str(regenerated_data(tmp_path / "d.jsonl", 4)), out_dir=str(store), dtype="float32"),
            TargetConfig(name_or_path=str(model)), progress=False)
    cfg = _cfg(tiny, tmp_path / "sib", **{"data.store": str(store), "data.eval_fraction": 0.0}, steps=1, eval_every=0,
               save_every=0)
    with pytest.raises(TrainError, match="not the weights the store was harvested from"):
        train(cfg, TargetConfig(name_or_path=str(sibling)))
    assert train(cfg, TargetConfig(name_or_path=str(model)))["steps"] == 1


def test_a_store_that_verify_rejects_is_not_trained_on(tiny: dict, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """One byte flipped inside a shard (size unchanged), or a shard's sha256 edited in the manifest:
    refused naming the shard, before any step, by the API and the CLI; a store verified once is not
    hashed again on a rerun, and one changed since is."""
    store = tmp_path / "store"
    shutil.copytree(tiny["store"], store)
    shard = sorted(store.glob("*.safetensors"))[0]
    good = shard.read_bytes()
    out = tmp_path / "run"
    with open(shard, "r+b") as f:  # inside the tensor data, past the safetensors header
        f.seek(len(good) - 100)
        byte = f.read(1)
        f.seek(len(good) - 100)
        f.write(bytes([byte[0] ^ 255]))
    with pytest.raises(TrainError, match=f"{shard}: sha256 differs from the manifest .*nothing was trained"):
        train(_cfg(tiny, out, **{"data.store": str(store)}, steps=1), target=tiny["target"])
    assert not (out / "final").exists() and not (out / "checkpoints").exists()
    cli = _cli(tiny, tmp_path / "cli")
    cli[cli.index("--store") + 1] = str(store)
    code = main(["--steps", "1", *cli])
    assert code != 0 and f"{shard}: sha256 differs" in capsys.readouterr().err
    assert not (tmp_path / "cli" / "final").exists()

    shard.write_bytes(good)
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["shards"][-1]["sha256"] = "0" * 64
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TrainError, match="sha256 differs from the manifest"):
        train(_cfg(tiny, out, **{"data.store": str(store)}, steps=1), target=tiny["target"])

    shutil.rmtree(store)
    shutil.copytree(tiny["store"], store)
    assert train(_cfg(tiny, out, **{"data.store": str(store)}, steps=2, save_every=1),
                 target=tiny["target"])["steps"] == 2
    record = json.loads((out / "verified_stores.json").read_text())
    assert set(record) == {os.path.realpath(store)}
    hashed = []

    def counting(root, part=(0, 1)):
        hashed.append(str(root))
        return verify_store(root, part)

    monkeypatch.setattr("eagle3.store.shards.verify_store", counting)
    assert train(_cfg(tiny, out, **{"data.store": str(store)}, steps=3, save_every=1),
                 target=tiny["target"])["steps"] == 3
    assert hashed == []  # resumed: verified by this run already, unchanged
    with open(shard, "r+b") as f:  # changed since: hashed again, and refused
        f.seek(len(good) - 100)
        f.write(bytes([good[-100] ^ 1]))
    with pytest.raises(TrainError, match="sha256 differs"):
        train(_cfg(tiny, out, **{"data.store": str(store)}, steps=4, save_every=1), target=tiny["target"])
    assert hashed == [str(store)]


def test_bf16_and_gradient_checkpointing_track_fp32(tiny: dict, tmp_path: Path) -> None:
    def losses(name: str, **kw) -> list[float]:
        train(_cfg(tiny, tmp_path / name, steps=4, eval_every=0, save_every=0, **kw), target=tiny["target"])
        return [r["train/loss"] for r in read_metrics(tmp_path / name) if "train/loss" in r]

    fp32 = losses("fp32")
    assert losses("ckpt", gradient_checkpointing=True) == pytest.approx(fp32, rel=1e-5)
    assert losses("bf16", precision="bf16") == pytest.approx(fp32, rel=2e-2)
    assert load_file(str(tmp_path / "bf16" / "final" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16


def test_auto_precision_is_bf16_only_where_bf16_is_faster(tiny: dict, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    auto = _cfg(tiny, tmp_path / "a", precision="auto")
    assert _precision(auto, torch.device("cuda")) == "bf16"
    assert _precision(_cfg(tiny, tmp_path / "a", precision="fp32"), torch.device("cuda")) == "fp32"
    muon0 = _cfg(tiny, tmp_path / "a", precision="auto", **{"optim.name": "muon"}, zero_stage=0)
    assert _precision(muon0, torch.device("cuda")) == "fp32"  # DeepSpeed's Muon needs ZeRO for bf16
    monkeypatch.setattr("eagle3.train.optim.bf16_matmul_speedup", lambda device_type: 0.01)  # an AVX2-only CPU
    assert _precision(auto, torch.device("cpu")) == "fp32"
    assert _precision(_cfg(tiny, tmp_path / "a", precision="bf16"), torch.device("cpu")) == "bf16"
    summary = train(_cfg(tiny, tmp_path / "run", precision="auto", steps=2, eval_every=0, save_every=0),
                    target=tiny["target"])
    assert summary["precision"] == "fp32"
    monkeypatch.setattr("eagle3.train.optim.bf16_matmul_speedup", lambda device_type: 3.0)  # a CPU with AMX
    assert _precision(auto, torch.device("cpu")) == "bf16"


def test_muon_orthogonalises_the_hidden_matrices_and_learns(tiny: dict, tmp_path: Path) -> None:
    def first_step(name: str, lr: float, **kw) -> dict[str, torch.Tensor]:
        train(_cfg(tiny, tmp_path / name, steps=1, eval_every=0, save_every=0, **{"optim.lr": lr}, **kw),
              target=tiny["target"])
        return load_file(str(tmp_path / name / "final" / "model.safetensors"))

    def spread(delta: torch.Tensor) -> float:  # ratio of the largest to the smallest singular value
        s = torch.linalg.svdvals(delta.double())
        return float(s.max() / s.min())

    # two first steps at lr and 2 lr from the same init: their difference is lr x the update direction
    # muon: on CPU "auto" picks the original bf16 Newton-Schulz; muon-gram: DeepSpeed's Gram variant
    for opt, kw in (("muon", {"optim.name": "muon"}), ("muon-gram", {"optim.name": "muon",
                                                                     "optim.muon_ns_method": "gram"}),
                    ("adamw", {})):
        a, b = first_step(f"{opt}-a", 1e-3, **kw), first_step(f"{opt}-b", 2e-3, **kw)
        fc, q = spread(b["fc.weight"] - a["fc.weight"]), spread(b["midlayer.self_attn.q_proj.weight"] -
                                                                  a["midlayer.self_attn.q_proj.weight"])
        if opt != "adamw":  # Newton-Schulz (5 steps): the spectrum flattened (measured 5.0 and 7.0)
            assert fc < 10 and q < 10, (fc, q)
        else:  # AdamW's first step is a sign matrix: a wide spectrum (measured 28 and 26)
            assert fc > 15 and q > 15, (fc, q)
        # lm_head goes to the auxiliary AdamW either way: a first Adam step moves each entry by ~lr
        moved = (b["lm_head.weight"] - a["lm_head.weight"]).abs()
        assert moved.max() == pytest.approx(0.5e-3, rel=0.05)  # warmup step 1 of 2: half the lr

    out = tmp_path / "muon-bf16"
    train(_cfg(tiny, out, steps=24, eval_every=0, save_every=0, **{"optim.lr": 1e-2, "optim.name": "muon",
                                                                   "optim.schedule": "linear"}, precision="bf16",
               zero_stage=1), target=tiny["target"])
    losses = [r["train/loss"] for r in read_metrics(out) if "train/loss" in r]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5
    lrs = [r["train/lr"] for r in read_metrics(out) if "train/lr" in r]  # after warmup: equal linear steps down
    drops = {round(a - b, 12) for a, b in zip(lrs[2:], lrs[3:], strict=False)}
    assert len(lrs) == 24 and lrs[2] == 1e-2 and drops == {round(1e-2 / 22, 12)}, (lrs, drops)
    with pytest.raises(ValueError, match="optim.schedule"):
        _cfg(tiny, out, **{"optim.schedule": "step"})
    with pytest.raises(ValueError, match="zero_stage >= 1"):
        _cfg(tiny, out, **{"optim.name": "muon"}, precision="bf16")
    with pytest.raises(ValueError, match="muon_ns_method"):
        _cfg(tiny, out, **{"optim.name": "muon", "optim.muon_ns_method": "fast"})
    assert muon_ns_method("auto", "cpu") == "standard" and muon_ns_method("auto", "cuda:0") == "gram"
    assert muon_ns_method("gram", "cpu") == "gram"


def test_muon_iterates_in_fp32_on_a_cpu_without_bf16_units(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.runtime.zero.muon import original_muon

    # DeepSpeed's choice on CPUs (an earlier training test in this process may have replaced it already)
    monkeypatch.setattr(original_muon, "ns_compute_dtype", lambda ns_method="gram": torch.bfloat16)
    monkeypatch.setattr("eagle3.train.optim.bf16_matmul_speedup", lambda device_type: 3.0)
    assert not muon_ns_in_fp32_where_bf16_is_slow("cpu")
    assert original_muon.ns_compute_dtype("standard") == torch.bfloat16
    monkeypatch.setattr("eagle3.train.optim.bf16_matmul_speedup", lambda device_type: 0.01)
    assert not muon_ns_in_fp32_where_bf16_is_slow("cuda:0")
    assert muon_ns_in_fp32_where_bf16_is_slow("cpu")
    assert original_muon.ns_compute_dtype("standard") == original_muon.ns_compute_dtype("gram") == torch.float32
    g = torch.randn(24, 40)
    x = original_muon.zeropower_via_newtonschulz5(g, 5)
    assert x.dtype == torch.float32 and torch.linalg.matrix_norm(x, ord=2) < 1.6  # orthogonalised, as in bf16


def test_bf16_matmul_speedup_is_measured_on_cpus() -> None:
    from eagle3.device import bf16_matmul_speedup

    assert bf16_matmul_speedup("cuda") == 2.0
    speedup = bf16_matmul_speedup("cpu")
    assert speedup > 0 and bf16_matmul_speedup("cpu") == speedup  # measured once per process


def test_weighted_indices_by_hand() -> None:
    from eagle3.store.batches import weighted_indices

    ids = [f"s{i}" for i in range(400)]
    weights = {"s0": 2.0, "s1": 0.0, "s2": 3.0}
    got = weighted_indices([0, 1, 2, 3], ids, weights, seed=0, epoch=0)
    assert got == [0, 0, 2, 2, 2, 3]
    half = {f"s{i}": 1.5 for i in range(400)}
    draws = weighted_indices(list(range(400)), ids, half, seed=0, epoch=0)
    assert 540 < len(draws) < 660 and set(draws) == set(range(400))  # 600 expected
    assert draws != weighted_indices(list(range(400)), ids, half, seed=0, epoch=1)
    assert draws == weighted_indices(list(range(400)), ids, half, seed=0, epoch=0)


def test_extra_stores_and_sample_weights(tiny: dict, tmp_path: Path) -> None:
    from eagle3.store.shards import StoreError, StoreUnion

    union = StoreUnion([tiny["store"], tiny["store"]])
    single = HarvestStore(tiny["store"])
    assert len(union) == 2 * len(single) and union.lengths == single.lengths * 2
    assert torch.equal(union[len(single)].aux, single[0].aux)
    with pytest.raises(StoreError, match="spec.store='topk' differs"):
        StoreUnion([tiny["store"], tiny["topk"]])

    def relabel(name: str, target: str, fingerprint: str) -> Path:  # a copy naming the target otherwise
        root = shutil.copytree(tiny["store"], tmp_path / name)
        manifest = json.loads((root / "manifest.json").read_text())
        manifest["spec"] |= {"target": target, "weights_fingerprint": fingerprint}
        (root / "manifest.json").write_text(json.dumps(manifest))
        return root

    # the weights' fingerprint names the target: "model" and "/abs/model" are one target
    assert len(StoreUnion([relabel("rel", "model", "f" * 64), relabel("abs", "/abs/model", "f" * 64)])) == 80
    with pytest.raises(StoreError, match="spec.weights_fingerprint='eeee"):
        StoreUnion([relabel("one", "model", "f" * 64), relabel("other", "model", "e" * 64)])
    with pytest.raises(StoreError, match="spec.target='b' differs"):  # no fingerprint: the name decides
        StoreUnion([relabel("a", "a", "in-memory"), relabel("b", "b", "in-memory")])
    weights = tmp_path / "weights.json"
    weights.write_text(json.dumps({sid: 3.0 for sid in single.sample_ids[:5]}))
    copy = shutil.copytree(tiny["store"], tmp_path / "copy")  # the same store twice in the trainer is refused
    summary = train(_cfg(tiny, tmp_path / "run", steps=3, eval_every=0, save_every=0,
                         **{"data.extra_stores": [str(copy)], "data.sample_weights": str(weights)}),
                         target=tiny["target"])
    assert summary["train_samples"] + summary["eval_samples"] == 2 * len(single)
    weights.write_text("[1, 2]")
    with pytest.raises(TrainError, match="sample id -> finite weight"):
        train(_cfg(tiny, tmp_path / "bad", steps=1, **{"data.sample_weights": str(weights)}), target=tiny["target"])


def test_token_weights_and_hard_tokens_train_and_are_pinned(tiny: dict, tmp_path: Path) -> None:
    store = HarvestStore(tiny["store"])
    listed = tmp_path / "tokens.json"
    listed.write_text(json.dumps({sid: [[j, 4.0] for j in range(2, 40, 3)] for sid in store.sample_ids}))
    base = {"steps": 4, "eval_every": 0, "save_every": 2, "data.eval_fraction": 0.0}
    plain = train(_cfg(tiny, tmp_path / "plain", **base), target=tiny["target"])
    weighted = train(_cfg(tiny, tmp_path / "w", **base, **{"loss.token_weights": str(listed),
                                                           "loss.hard_tokens": "downweight",
                                                           "loss.hard_token_entropy": 0.5,
                                                           "loss.hard_token_weight": 0.1}), target=tiny["target"])
    assert weighted["last_loss"] != plain["last_loss"]  # the weights reached the loss
    listed.write_text(json.dumps({sid: [[5, 2.0]] for sid in store.sample_ids[:10]}))
    with pytest.raises(TrainError, match="token_weights="):  # another file: a resume refuses it
        train(_cfg(tiny, tmp_path / "w", **{**base, "steps": 6}, **{"loss.token_weights": str(listed),
                                                                    "loss.hard_tokens": "downweight",
                                                                    "loss.hard_token_entropy": 0.5,
                                                                    "loss.hard_token_weight": 0.1}),
                                                                    target=tiny["target"])
    listed.write_text(json.dumps({sid: [[j, 4.0] for j in range(2, 40, 3)] for sid in store.sample_ids}))
    with pytest.raises(TrainError, match="was trained with train.loss.hard_token"):  # the same file, no filter
        train(_cfg(tiny, tmp_path / "w", **{**base, "steps": 6}, **{"loss.token_weights": str(listed)}),
              target=tiny["target"])
    with pytest.raises(ConfigError, match="train.loss.hard_tokens='drop'"):
        train_config(**{"loss.hard_tokens": "drop"})


def test_a_frozen_target_lm_head_stays_the_targets(tiny: dict, tmp_path: Path) -> None:
    out = tmp_path / "frozen"
    summary = train(_cfg(tiny, out, steps=3, eval_every=0, save_every=0, **{"init.lm_head": "target",
                                                                            "init.freeze_lm_head": True}),
                                                                            target=tiny["target"])
    final = load_file(str(out / "final" / "model.safetensors"))
    rows = tiny["target"].lm_head.weight.detach()[torch.arange(64) + final["d2t"]]
    assert torch.equal(final["lm_head.weight"], rows)
    trainable = sum(v.numel() for k, v in final.items() if k not in ("d2t", "t2d", "lm_head.weight"))
    assert summary["trainable_parameters"] == trainable  # the frozen head is not counted


def _gemma3(final_norm_offsets: torch.Tensor | None = None) -> Target:
    """A tiny random Gemma-3 text target: tied and scaled embeddings, norms stored as offsets."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)).eval()
    if final_norm_offsets is not None:
        with torch.no_grad():
            model.model.norm.weight.copy_(final_norm_offsets)
    return Target(model, tiny_tokenizer(), aux_layer_ids=(1, 2, 4))


def test_the_target_head_init_reproduces_the_targets_head_whatever_its_norm_convention() -> None:
    """Gemma computes x / rms(x) * (1 + weight): its stored weight copied into the draft's norm
    (x / rms(x) * weight) was off by one in every channel (as initialised, offsets 0: a head of zeros
    whose training stalled; bench/studies/init_check.py). The probed scale reproduces the target's head."""
    offsets = torch.linspace(-0.5, 1.5, 64)
    gemma = _gemma3(offsets)
    assert torch.allclose(gemma.final_norm_scale(), 1 + offsets)
    llama = lively_target()
    assert torch.equal(llama.final_norm_scale(), llama.norm.weight.detach().float())  # the stored weight, exactly
    for target in (gemma, llama):
        vocab = DraftVocab.from_target_ids(torch.arange(0, target.vocab_size, 3), target.vocab_size)
        draft = Eagle3Draft(DraftConfig.from_target_config(target.config, draft_vocab_size=vocab.size),
                            target.embed_tokens.weight.detach().float())
        draft.set_draft_vocab(vocab.d2t, vocab.t2d)
        draft.init_lm_head_from_target(target.lm_head.weight.detach().float(), vocab.d2t, target.final_norm_scale())
        last = torch.randn(5, target.hidden_size) * 30  # pre-norm states
        with torch.no_grad():
            assert torch.allclose(draft.lm_head(draft.norm(last)), target.head(last)[:, ::3], atol=1e-4)
    layer_norm = lively_target()
    layer_norm.norm = nn.LayerNorm(layer_norm.hidden_size)  # subtracts the mean: no RMSNorm weight equals it
    assert layer_norm.final_norm_scale() is None


def test_readout_init_is_what_training_starts_from(tiny: dict, tmp_path: Path) -> None:
    """layer_init=readout reaches the draft: after one step at a tiny lr, fc still passes the deepest
    aux state through and the layer's output projections are still ~zero (the random init's are not)."""
    for init in ("random", "readout"):
        out = tmp_path / init
        train(_cfg(tiny, out, steps=1, **{"optim.lr": 1e-7, "init.lm_head": "target", "init.layers": init},
                   eval_every=0, save_every=0),
              target=tiny["target"])
        final = load_file(str(out / "final" / "model.safetensors"))
        passes = torch.cat([torch.zeros(64, 128), torch.eye(64)], dim=1)
        readout = torch.allclose(final["fc.weight"], passes, atol=1e-4) and all(
            final[f"midlayer.{name}.weight"].abs().max() < 1e-4 for name in ("self_attn.o_proj", "mlp.down_proj"))
        assert readout == (init == "readout")


def test_muon_under_zero_steps_as_at_zero_0_unclipped(tiny: dict, tmp_path: Path) -> None:
    """DeepSpeed's ZeRO optimizer orthogonalises Muon's gradients while reducing them, then clipped
    by the norm of those updates (~40x max_grad_norm here, so every step shrank): ZeRO 1-3 must now
    step as ZeRO 0 does without clipping (ZeRO 0 itself clips the gradients, so differs). ZeRO 3
    also needs reduce_scatter off, which DeepSpeed's Muon refuses."""
    losses = {}
    for name, kw in {"zero0": {"zero_stage": 0, "optim.max_grad_norm": 0.0}, "zero0_clip": {"zero_stage": 0},
                     "zero1": {"zero_stage": 1}, "zero2": {"zero_stage": 2}, "zero3": {"zero_stage": 3}}.items():
        out = tmp_path / name
        train(_cfg(tiny, out, **{"steps": 4, "eval_every": 0, "save_every": 0, "optim.name": "muon",
                                 "optim.max_grad_norm": 0.5, **kw}), target=tiny["target"])
        losses[name] = [json.loads(line)["train/loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
                        if "train/loss" in line]
    for name in ("zero1", "zero2", "zero3"):
        assert losses[name] == pytest.approx(losses["zero0"], rel=1e-5), name
    assert losses["zero0_clip"] != pytest.approx(losses["zero0"], rel=1e-5)  # the clip was active


def test_a_diverged_run_stops_before_saving_a_non_finite_draft(tiny: dict, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "diverged"
    with pytest.raises(TrainError, match=r"step \d+: the loss is (nan|inf)"):
        train(_cfg(tiny, out, steps=6, **{"optim.lr": 1e30, "optim.warmup_steps": 0}, eval_every=0, save_every=1),
              target=tiny["target"])
    assert not (out / "final").exists() and not (out / "summary.json").exists()
    # weights gone non-finite in the step just taken (the loss before it was finite): caught before the
    # export of that step's eval
    import eagle3.train.checkpoint as checkpoint_module

    real = checkpoint_module.draft_weights

    def poisoned(draft, zero_stage):
        state = real(draft, zero_stage)
        state["fc.weight"][0, 0] = float("inf")
        return state

    monkeypatch.setattr(checkpoint_module, "draft_weights", poisoned)
    with pytest.raises(TrainError, match=r"step 1: NaN/Inf in fc.weight"):
        train(_cfg(tiny, tmp_path / "at-eval", steps=6, eval_every=1, save_every=0, eval_at_start=False),
              target=tiny["target"])
    assert not (tmp_path / "at-eval" / "best").exists()


def test_topk_store_and_a_held_out_store(tiny: dict, tmp_path: Path) -> None:
    summary = train(_cfg(tiny, tmp_path / "topk", **{"data.store": str(tiny["topk"]), "data.eval_fraction": 0.0,
                                                     "data.eval_store": str(tiny["store"]), "init.lm_head": "target"},
                                                     steps=3, eval_every=0),
                    target=tiny["target"])
    # the eval store's conversations that the topk store also holds are not held out: they are left out
    train_rows = {tuple(HarvestStore(tiny["topk"]).token_columns(i)[0].tolist()) for i in range(12)}
    held = HarvestStore(tiny["store"])
    unseen = sum(tuple(held.token_columns(i)[0].tolist()) not in train_rows for i in range(len(held)))
    assert 0 < unseen < len(held) == 40
    assert summary["eval_samples"] == unseen and summary["eval_last"]["eval/tau_sim"] >= 1.0
    with pytest.raises(TrainError, match="every one of its 12 samples is also a training sample"):
        train(_cfg(tiny, tmp_path / "same", **{"data.store": str(tiny["topk"]), "data.eval_fraction": 0.0,
                                               "data.eval_store": str(tiny["topk"])}, steps=1), target=tiny["target"])


# ---------------------------------------------------------------- subprocesses: kill -9, two processes


@pytest.mark.slow
def test_kill_9_mid_training_then_resume_gives_the_same_losses(tiny: dict, tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "eagle3.train", "--steps", "40", "--save-every", "3", "--eval-every", "5"]
    straight = tmp_path / "straight"  # in this process: bitwise the same as the CLI (checked), and faster
    train(_cfg(tiny, straight, steps=40, save_every=3, eval_every=5), target=tiny["target"])

    killed = tmp_path / "killed"
    rng = random.Random(0)
    for goal in (7, 22):  # two kills, each a random moment after the goal step's checkpoint
        errors = tmp_path / f"stderr-{goal}.txt"
        with open(errors, "w") as err:
            proc = subprocess.Popen([*cli, *_cli(tiny, killed)], cwd=REPO, env=_env(),
                                    stdout=subprocess.DEVNULL, stderr=err)
        latest = killed / "checkpoints" / LATEST
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if latest.is_file() and int(latest.read_text().strip().split("-")[1] or 0) >= goal:
                break
            time.sleep(0.005)
        time.sleep(rng.random() * 0.3)
        assert proc.poll() is None, f"the run ended before it was killed:\n{errors.read_text()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (killed / "summary.json").exists(), "the run finished before it was killed"
    (killed / "checkpoints" / ".step-00000099.tmp").mkdir()  # what a kill during a save leaves
    (killed / "checkpoints" / f".{LATEST}.x1y2z3.tmp").write_text("step-")  # ... or during `latest`'s rewrite
    (killed / ".best.q1w2e3.tmp").mkdir()  # ... or during an export of the best draft
    done = subprocess.run([*cli, *_cli(tiny, killed)], cwd=REPO, env=_env(), check=True, capture_output=True,
                          text=True)
    resumed = json.loads(done.stdout.strip().splitlines()[-1])["resumed_from_step"]
    assert resumed is not None and resumed >= 22
    assert _losses(killed) == _losses(straight)  # exactly, every logged figure of every step
    _assert_same_run(killed, straight)
    assert not list((killed / "checkpoints").glob(".*tmp")) and not list(killed.glob(".*tmp"))
    assert len(list((killed / "checkpoints").glob("step-*"))) == 2  # keep_checkpoints


# What differs between two runs that trained the same: timings, the folder's name, and whether
# (and from where) the run was resumed.
_VOLATILE_METRICS = {"train/tokens_per_s"}
_VOLATILE_SUMMARY = {"out", "tokens_per_s", "wall_seconds", "resumed_from_step"}  # tokens/s: this process's


def _assert_same_run(got: Path, want: Path) -> None:
    """The whole output folder: every file byte for byte (checkpoints, RNG states, exports,
    vocab), metrics.jsonl and summary.json field by field, volatile fields aside."""
    files = sorted(p.relative_to(want) for p in want.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(got) for p in got.rglob("*") if p.is_file())
    for name in files:
        if name.name == "metrics.jsonl":
            a, b = ([{k: v for k, v in row.items() if k not in _VOLATILE_METRICS} for row in read_metrics(d)]
                    for d in (got, want))
            assert a == b
        elif name.name == "summary.json":
            a, b = ({k: v for k, v in json.loads((d / name).read_text()).items() if k not in _VOLATILE_SUMMARY}
                    for d in (got, want))
            assert a == b
        elif name.suffix == ".pt":  # pickles: equal objects may differ in bytes (pickle's memo keys on
            # identity: a resumed run's state dict has the keys it read back, the other its own literals)
            a, b = (torch.load(d / name, weights_only=True, map_location="cpu") for d in (got, want))
            _assert_same_objects(a, b, str(name))
        else:
            assert (got / name).read_bytes() == (want / name).read_bytes(), name


def _assert_same_objects(a: object, b: object, where: str) -> None:
    """Equal structure (dict keys in order), values and tensors (dtype, shape, every element)."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same_objects(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same_objects(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, where


def test_leftovers_of_a_kill_are_removed_and_a_half_replaced_folder_gets_its_old_version(tmp_path: Path) -> None:
    for name in ("best", "final"):
        with atomic_dir(tmp_path / name) as tmp:
            (tmp / "w").write_text(f"old {name}")
    # killed inside a second atomic_dir: `best` between its two renames, `final` after both
    (tmp_path / "best").rename(tmp_path / ".best.old")
    (tmp_path / ".final.old").mkdir()
    for leftover in (".best.a1.tmp", ".final.b2.tmp"):
        (tmp_path / leftover).mkdir()
    (tmp_path / ".summary.json.c3.tmp").write_text("{")
    (tmp_path / ".unrelated.d4.tmp").write_text("not ours")
    touched = remove_leftovers(tmp_path, ["best", "final", "summary.json"])
    assert sorted(touched) == [".best.a1.tmp", ".best.old", ".final.b2.tmp", ".final.old", ".summary.json.c3.tmp"]
    assert (tmp_path / "best" / "w").read_text() == "old best"
    assert (tmp_path / "final" / "w").read_text() == "old final"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".unrelated.d4.tmp", "best", "final"]


def test_starting_over_keeps_nothing_of_an_export_killed_midway(tiny: dict, tmp_path: Path) -> None:
    """A kill between an export's two renames leaves the old draft under a hidden name; a run that starts
    over must not bring it back as its own, and a refused run touches nothing."""
    out = tmp_path / "run"
    (out / ".best.old").mkdir(parents=True)
    (out / ".best.old" / "marker").write_text("the previous run's")
    with pytest.raises(TrainError, match="train.draft.mask_token_id=1000000: not a token id"):  # nothing cleared
        train(_cfg(tiny, out, steps=1, eval_every=0, resume=False, **{"draft.family": "peagle",
                                                                      "draft.mask_token_id": 10**6}),
              target=tiny["target"])
    assert (out / ".best.old" / "marker").is_file()
    train(_cfg(tiny, out, steps=1, eval_every=0, save_every=0, resume=False), target=tiny["target"])
    assert not (out / "best" / "marker").exists() and not (out / ".best.old").exists()


def _two_processes(tiny: dict, out: Path, *extra: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "eagle3.train", *_cli(tiny, out, "--steps", "6", "--eval-every", "3", *extra)]
    done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["world_size"] == 2 and summary["steps"] == 6


@pytest.mark.slow
def test_deepspeed_two_gloo_processes_match_one_process(tiny: dict, tmp_path: Path) -> None:
    """Two ranks with one micro-batch each = one rank accumulating two (the same global batches):
    bitwise equal under ZeRO 0. ZeRO 3 shards parameters, gradients and optimizer states, so sums
    run in another order and agree within fp32 rounding (ZeRO 1 and 2 behave alike; checked by
    hand). Then a two-rank ZeRO 3 resume."""
    one = tmp_path / "one"  # in this process
    train(_cfg(tiny, one, steps=6, eval_every=3, save_every=0, gradient_accumulation=2), target=tiny["target"])
    _two_processes(tiny, tmp_path / "z0")
    _two_processes(tiny, tmp_path / "z3", "--zero-stage", "3", "--save-every", "3")
    reference = _losses(one)
    assert len(reference) > 6 * 10 and _losses(tmp_path / "z0") == reference
    got = _losses(tmp_path / "z3")
    assert [(s, k) for s, k, _ in got] == [(s, k) for s, k, _ in reference]
    for (_, key, a), (_, _, b) in zip(got, reference, strict=True):
        tolerance = 0.02 if "acc" in key or "tau" in key else 1e-5  # an argmax may flip on a near-tie
        assert abs(a - b) <= tolerance * max(1.0, abs(b)), (key, a, b)

    # Each rank keeps its share of the weights and Adam moments in its own files: resumed from the
    # step-3 checkpoint (as a kill after it leaves things), both ranks replay steps 4-6 exactly.
    z3 = tmp_path / "z3"
    assert len(list((z3 / "checkpoints" / "step-00000003").glob("*optim_states.pt"))) == 2
    straight = _losses(z3)
    (z3 / "checkpoints" / LATEST).write_text("step-00000003\n")
    _two_processes(tiny, z3, "--zero-stage", "3", "--save-every", "3")
    assert _losses(z3) == straight


@pytest.mark.slow
def test_a_row_split_over_two_ranks_trains_the_one_rank_draft(tiny: dict, tmp_path: Path) -> None:
    """train.context_parallel=2: two ranks share each 256-token row (each holds 128 rows and 8 of the
    next rank's, :mod:`eagle3.draft.context`) and train the one-rank draft: the same batches, losses
    and metrics within fp32 round-off, the same final weights; both ranks' peak memory reported."""
    settings = dict(steps=6, eval_every=3, save_every=0, ttt_steps=4, gradient_checkpointing=True)
    one = train(_cfg(tiny, tmp_path / "one", **settings), target=tiny["target"])
    reference = _losses(tmp_path / "one")
    want = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    assert len(reference) > 6 * 10
    for name, zero in (("cp", "0"), ("cp-zero2", "2")):  # ZeRO 2 shards gradients over both ranks of the group
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "eagle3.train",
               *_cli(tiny, tmp_path / name, "--steps", "6", "--eval-every", "3", "--save-every", "0", "--ttt-steps",
                     "4", "--gradient-checkpointing", "--context-parallel", "2", "--zero-stage", zero)]
        done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        two = json.loads(done.stdout.strip().splitlines()[-1])
        assert two["context_parallel"] == 2 and two["world_size"] == 2 and two["tokens"] == one["tokens"]
        assert len(two["peak_rss_gib_per_rank"]) == 2 and min(two["peak_rss_gib_per_rank"]) > 0
        got = _losses(tmp_path / name)
        assert [(s, k) for s, k, _ in got] == [(s, k) for s, k, _ in reference]
        for (_, key, a), (_, _, b) in zip(got, reference, strict=True):
            tolerance = 0.02 if "acc" in key or "tau" in key else 1e-5  # an argmax may flip on a near-tie
            assert abs(a - b) <= tolerance * max(1.0, abs(b)), (name, key, a, b)
        for key, tensor in load_file(str(tmp_path / name / "final" / "model.safetensors")).items():
            torch.testing.assert_close(tensor, want[key], rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")


def test_one_process_asked_to_split_rows_starts_the_ranks_here(tiny: dict, tmp_path: Path) -> None:
    """train.context_parallel=2 called as one process (no launcher): two ranks spawned on this machine
    train the one-process run's steps (the same tokens, losses within round-off), rank 0's summary
    returned; a rank's user error comes back as itself, in one line."""
    from eagle3.train.local_ranks import ranks_that_fit

    if ranks_that_fit(_cfg(tiny, tmp_path / "probe", threads=1))[0] < 2:
        pytest.skip("one core: the split runs in this process")
    target = TargetConfig(name_or_path=str(tiny["model"]))
    settings = dict(steps=3, eval_every=0, save_every=0, threads=1)
    one = train(_cfg(tiny, tmp_path / "one", **settings), target=tiny["target"])
    two = train(_cfg(tiny, tmp_path / "two", context_parallel=2, **settings), target)
    assert two["world_size"] == 2 and two["context_parallel"] == 2 and two["tokens"] == one["tokens"]
    assert abs(two["first_loss"] - one["first_loss"]) <= 1e-5 * abs(one["first_loss"])
    assert (tmp_path / "two" / "final" / "model.safetensors").is_file()
    missing = {"data.store": str(tmp_path / "no-store"), **settings}
    with pytest.raises(Eagle3Error, match=re.escape(str(tmp_path / "no-store"))) as alone:
        train(_cfg(tiny, tmp_path / "bad", **missing), target)
    with pytest.raises(Eagle3Error) as split:
        train(_cfg(tiny, tmp_path / "bad", context_parallel=2, **missing), target)
    assert (type(split.value), str(split.value)) == (type(alone.value), str(alone.value))  # a rank's own, as is
    with pytest.raises(TrainError, match="pass its TargetConfig"):
        train(_cfg(tiny, tmp_path / "three", context_parallel=2, **settings), target=tiny["target"])


def test_a_resumed_run_keeps_the_split_it_was_made_with(tiny: dict, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A run saved by one process, resumed with train.context_parallel=2 and no launcher, continues
    in one process (its checkpoint's split) and says so, rather than failing on the pinned setting."""
    train(_cfg(tiny, tmp_path / "run", steps=3, eval_every=0, save_every=3), target=tiny["target"])
    more = train(_cfg(tiny, tmp_path / "run", steps=5, eval_every=0, save_every=0, context_parallel=2),
                 target=tiny["target"])
    assert more["resumed_from_step"] == 3 and more["context_parallel"] == 1 and more["world_size"] == 1
    assert "resumes a run made with 1; continuing with 1" in capsys.readouterr().err


def test_a_context_parallel_size_that_does_not_fit_a_launched_world_is_named(
        tiny: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a launcher (its rendezvous variables, not this process's own group) no ranks are started here:
    a split that does not divide its world is named."""
    from eagle3.distributed import OWN_GROUP

    monkeypatch.delenv(OWN_GROUP, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(ConfigError, match="train.context_parallel=2 does not divide the world size"):
        train(_cfg(tiny, tmp_path / "odd", context_parallel=2), target=tiny["target"])


def test_a_context_parallel_size_that_does_not_fit_is_named(tiny: dict, tmp_path: Path) -> None:
    with pytest.raises(ConfigError,
                       match="train.context_parallel=2: must be >= 1, and 1 unless train.data.mode=offline"):
        _cfg(tiny, tmp_path / "online", context_parallel=2, **{"data.mode": "online", "data.eval_fraction": 0.0,
                                                               "data.shard_window": 2})
    with pytest.raises(ConfigError, match="train.context_parallel=2: a dflash draft"):
        _cfg(tiny, tmp_path / "dflash", context_parallel=2, **{"draft.family": "dflash"})


def test_training_continues_from_an_exported_draft_in_another_format(tiny: dict, tmp_path: Path) -> None:
    from eagle3.export import export_draft_folder, load_draft
    from eagle3.export import main as export_main

    first = tmp_path / "first"
    train(_cfg(tiny, first, steps=12, eval_every=0, save_every=0, **{"optim.lr": 1e-2}), target=tiny["target"])
    assert export_main(["--draft", str(first / "final"), "--out", str(tmp_path / "spec"), "--format", "speculators",
                        "--dtype", "float32"]) == 0
    again = tmp_path / "again"
    summary = train(_cfg(tiny, again, steps=2, eval_every=0, save_every=0, **{"optim.lr": 1e-9,
                                                                              "optim.warmup_steps": 0,
                                                                              "init.draft": str(tmp_path / "spec"),
                                                                              "draft.vocab_size": 32}),
                                                                              target=tiny["target"])
    fresh = train(_cfg(tiny, tmp_path / "fresh", steps=2, eval_every=0, save_every=0, **{"optim.lr": 1e-9,
                                                                                         "optim.warmup_steps": 0}),
                  target=tiny["target"])
    # the continued run starts from the trained weights (and keeps their 64-token vocab)
    assert summary["draft_vocab_size"] == 64 and summary["first_loss"] < fresh["first_loss"] - 0.3
    trained = load_file(str(first / "final" / "model.safetensors"))
    continued = load_file(str(again / "final" / "model.safetensors"))
    torch.testing.assert_close(continued["fc.weight"], trained["fc.weight"], rtol=0, atol=1e-6)
    loaded = load_draft(first / "final")  # the same draft, said to read other layers
    bad = export_draft_folder(tmp_path / "bad", loaded.draft.state_dict(), loaded.draft.config, (1, 3, 5))
    with pytest.raises(TrainError, match="aux layer ids"):
        train(_cfg(tiny, tmp_path / "x", steps=1, **{"init.draft": str(bad)}), target=tiny["target"])
    from dataclasses import replace

    from eagle3.draft.model import Eagle3Draft

    c = loaded.draft.config  # a draft of another width: it cannot take the target's embedding
    narrow = Eagle3Draft(replace(c, hidden_size=c.hidden_size // 2, head_dim=c.head_dim // 2))
    folder = export_draft_folder(tmp_path / "narrow", narrow.state_dict(), narrow.config, loaded.aux_layer_ids)
    with pytest.raises(TrainError, match=f"train.init.draft: {folder}: hidden_size={c.hidden_size // 2} cannot take"):
        train(_cfg(tiny, tmp_path / "y", steps=1, **{"init.draft": str(folder)}), target=tiny["target"])
    assert not (tmp_path / "y" / "final").exists()


def test_a_draft_with_its_own_embedding_trains_with_the_targets_and_says_so(tiny: dict, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    from eagle3.export import export_draft_folder, load_draft

    first = tmp_path / "first"
    train(_cfg(tiny, first, steps=2, eval_every=0, save_every=0), target=tiny["target"])
    loaded = load_draft(first / "final")
    own = export_draft_folder(tmp_path / "own", loaded.draft.state_dict(), loaded.draft.config, loaded.aux_layer_ids)
    tensors = load_file(str(own / "model.safetensors"))
    embedding = tiny["target"].embed_tokens.weight.detach().float()
    for name, weight, noted in (("same", embedding, False), ("other", embedding + 0.5, True)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text((own / "config.json").read_text())
        save_file({**tensors, "embed_tokens.weight": weight.to(tensors["fc.weight"].dtype).contiguous()},
                  str(folder / "model.safetensors"))
        capsys.readouterr()
        train(_cfg(tiny, tmp_path / f"run-{name}", steps=1, eval_every=0, save_every=0, **{"init.draft": str(folder)}),
              target=tiny["target"])
        assert ("carries its own embedding, which differs from the target's" in capsys.readouterr().out) == noted


def test_a_draft_without_lm_head_continues_from_the_targets(tiny: dict, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    """A full-vocab draft shipped without lm_head (engines serve it with the target's) starts
    training from the target's lm_head, as it is served."""
    target = tiny["target"]
    first = tmp_path / "first"
    train(_cfg(tiny, first, steps=2, eval_every=0, save_every=0, **{"draft.vocab_size": target.vocab_size}),
          target=target)
    folder = tmp_path / "headless"
    folder.mkdir()
    tensors = load_file(str(first / "final" / "model.safetensors"))
    assert "d2t" not in tensors  # a full-vocab draft carries no mapping
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text((first / "final" / "config.json").read_text())
    capsys.readouterr()
    train(_cfg(tiny, tmp_path / "again", steps=1, eval_every=0, save_every=0, **{"optim.lr": 1e-12,
                                                                                 "optim.warmup_steps": 0,
                                                                                 "init.draft": str(folder)}),
                                                                                 target=target)
    assert "has no lm_head; it starts from the target's" in capsys.readouterr().out
    continued = load_file(str(tmp_path / "again" / "final" / "model.safetensors"))
    served = target.lm_head.weight.detach().float().to(continued["lm_head.weight"].dtype)
    torch.testing.assert_close(continued["lm_head.weight"], served, rtol=0, atol=1e-6)


def test_split_head_equals_the_full_product_ties_included(monkeypatch: pytest.MonkeyPatch) -> None:
    """TargetHead's fp32 path computes the outside-vocab logits in bf16 under an error bound;
    its targets must equal prepare_targets on the full product, including rows where an outside
    token wins by less than bf16 can resolve and exact ties (the lower id wins)."""
    g = torch.Generator().manual_seed(0)
    v, h = 300, 48
    lm_head = nn.Linear(h, v, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(v, h, generator=g) * torch.rand(v, 1, generator=g) * 2)
    norm = nn.RMSNorm(h)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[torch.randperm(v, generator=g)[:100]] = True
    t2d[200], t2d[7] = True, False
    x = torch.randn(1, 400, h, generator=g)
    inside_ids = [i for i in t2d.nonzero().squeeze(1).tolist() if i != 200]
    outside_ids = [i for i in (~t2d).nonzero().squeeze(1).tolist() if i != 7]
    with torch.no_grad():
        # near-ties: an outside row a hair (far below bf16's resolution) above or below an inside one
        for r in range(1, 40):
            a, b = inside_ids[r], outside_ids[r]
            lm_head.weight[b] = lm_head.weight[a] * (1 + (r - 20) * 1e-6)
            x[0, r] = lm_head.weight[a] * 3
        e = torch.randn(h, generator=g)
        lm_head.weight[7] = lm_head.weight[200] = e / e.norm() * 50  # an exact tie: outside 7, inside 200
        x[0, 0] = e
    batch = {"last": x, "loss_mask": torch.ones(1, 400, dtype=torch.long), "document_ids": torch.zeros(1, 400)}
    ref = prepare_targets(lm_head(norm(x[:, :-1])), t2d)
    # where bf16 is slower than fp32 (a CPU without bf16 units) the head takes the full fp32 product
    monkeypatch.setattr("eagle3.draft.target_head.bf16_matmul_speedup", lambda device_type: 0.01)
    full = TargetHead(norm, lm_head)
    got = full.targets(batch, t2d)
    assert full._split is None
    assert torch.equal(got.argmax[:, :-1], ref.argmax) and torch.allclose(got.probs[:, :-1], ref.probs, atol=1e-6)
    monkeypatch.setattr("eagle3.draft.target_head.bf16_matmul_speedup", lambda device_type: 2.0)
    head = TargetHead(norm, lm_head)
    got = head.targets(batch, t2d)
    assert head._split is not None  # the split path ran
    assert torch.equal(got.argmax[:, :-1], ref.argmax)
    assert torch.allclose(got.probs[:, :-1], ref.probs, atol=1e-6)
    outside_wins = ~t2d[ref.argmax]
    assert outside_wins[0, 1:40].any() and (~outside_wins[0, 1:40]).any() and ref.argmax[0, 0] == 7


def test_a_multimodal_target_harvests_and_trains_from_its_head(tmp_path: Path) -> None:
    """Kimi-K2.5's layout end to end: the harvest runs its text path (full load, checked at load),
    the trainer reads only its embedding, final norm and lm_head, and the draft fits it."""

    folder = tiny_kimi_k25(tmp_path / "kimi")
    store = tmp_path / "store"
    data = regenerated_data(tmp_path / "data.jsonl", 8, turns=2)
    harvest(HarvestConfig(data=str(data), out_dir=str(store), dtype="float32"),
            TargetConfig(name_or_path=str(folder)), progress=False)
    spec = HarvestStore(store).spec
    assert (spec.num_layers, spec.hidden_size, spec.aux_layer_ids) == (8, 64, (2, 4, 5))
    out = tmp_path / "run"
    main(["--store", str(store), "--target", str(folder), "--out", str(out), "--steps", "3",
          "--data.micro-batch-tokens", "256", "--draft.vocab-size", "64", "--data.eval-fraction", "0",
          "--log.wandb-mode", "disabled", "--no-log.progress", "--init.lm-head", "target"])
    draft, meta = load_exported_draft(out / "final")
    assert meta["step"] == 3 and meta["aux_layer_ids"] == [2, 4, 5] and draft.config.hidden_size == 64


def test_feature_noise_scales_with_each_state_and_only_trains() -> None:

    torch.manual_seed(0)
    aux = torch.randn(4, 500, 3, 64) * torch.tensor([0.01, 1.0, 300.0]).view(1, 1, 3, 1)  # layers far apart in scale
    noise = add_feature_noise(aux, 0.1) - aux
    rel = noise.pow(2).mean(-1).sqrt() / aux.pow(2).mean(-1).sqrt()  # [B, S, A]
    torch.testing.assert_close(rel.mean((0, 1)), torch.full((3,), 0.1), rtol=0.03, atol=0)
    assert (noise.mean((0, 1, 3)).abs() / aux.abs().mean((0, 1, 3)) < 0.01).all()
    assert add_feature_noise(aux.bfloat16(), 0.1).dtype == torch.bfloat16
    draft = tiny_draft()
    batch = packed_batch([[24]], t2d=draft.t2d)
    targets = prepare_targets(batch["target_logits"], draft.t2d)
    args = (batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"], batch["loss_mask"],
            targets.probs, targets.argmax)
    plain, noisy = TTTModel(draft, 2, 0.8), TTTModel(draft, 2, 0.8, feature_noise=0.1)
    with torch.no_grad():
        assert torch.equal(noisy.eval()(*args)[0], plain.eval()(*args)[0])  # evaluation reads the states as stored
        noisy.train(), plain.train()
        first = noisy(*args)[0]
        assert not torch.equal(first, noisy(*args)[0])  # fresh noise on every call
        assert not torch.equal(first, plain(*args)[0])


def test_gate_steps_reaches_the_loss_not_the_metrics(tiny: dict, tmp_path: Path) -> None:
    runs = {}
    for gate in (False, True):
        train(_cfg(tiny, tmp_path / str(gate), steps=1, eval_every=1, save_every=0, **{"loss.gate_steps": gate}),
              target=tiny["target"])
        runs[gate] = next(r for r in read_metrics(tmp_path / str(gate)) if "train/loss" in r)
    # the same first batch and draft: equal step-0 matches, a smaller loss once later steps only
    # count where the chain reaches them
    assert runs[True]["train/tau_sim"] == runs[False]["train/tau_sim"]
    assert runs[True]["train/loss"] < runs[False]["train/loss"]


def test_loss_positions_all_trains_on_prompts_too_and_still_evaluates_replies(tiny: dict, tmp_path: Path) -> None:
    runs = {}
    for where in ("assistant", "all"):
        train(_cfg(tiny, tmp_path / where, steps=2, eval_every=1, save_every=0, **{"loss.positions": where}),
              target=tiny["target"])
        runs[where] = read_metrics(tmp_path / where)
    first = {where: next(r for r in rows if "train/positions" in r) for where, rows in runs.items()}
    assert first["all"]["train/positions"] > first["assistant"]["train/positions"] > 0
    evals = {where: [r["eval/positions"] for r in rows if "eval/positions" in r] for where, rows in runs.items()}
    assert evals["all"] == evals["assistant"] and len(evals["all"]) == 3  # before step 1, after 1 and 2
    assert runs["all"][0]["eval/tau_sim"] == runs["assistant"][0]["eval/tau_sim"]  # the same untrained draft
    with pytest.raises(ValueError, match="train.loss.positions='prompt'"):
        train_config(**{"loss.positions": "prompt"})
