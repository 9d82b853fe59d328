"""The paths that exist for speed on a GPU, checked for their logic on the CPU: attention without
cuDNN's backend (it builds a graph per new sequence length), the batch read ahead on a thread, and
the per-phase step clock."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import eagle3.device
import eagle3.store.batches
import eagle3.target.model
import eagle3.train.loop
from data_gen.config import HarvestConfig
from data_gen.harvest import run as harvest
from eagle3.config import TargetConfig
from eagle3.device import CUDNN_SDPA_ENV, allow_cudnn_sdpa, cudnn_sdpa_allowed, every_head, sdpa, sdpa_backends
from eagle3.draft.ttt import BLOCKED_ATTENTION_MIN_LEN
from eagle3.store.batches import BatchLoader, load_batch
from eagle3.store.shards import HarvestStore, StoreUnion
from eagle3.train.config import train_config
from eagle3.train.log import PhaseClock, read_metrics
from eagle3.train.loop import train
from tests.helpers import lively_target, packed_batch, regenerated_data, tiny_draft, train_briefly

ROOT = Path(__file__).resolve().parents[1]


def _flags() -> tuple[bool, bool, bool, bool]:
    b = torch.backends.cuda
    return b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()


def test_attention_on_cuda_leaves_cudnn_out_unless_asked() -> None:
    before = _flags()
    with sdpa_backends(torch.device("cuda")):
        assert _flags() == (False, True, True, True)
    assert _flags() == before  # restored on the way out
    with sdpa_backends(torch.device("cpu")):  # nothing to choose on a CPU
        assert _flags() == before
    with allow_cudnn_sdpa(), sdpa_backends("cuda:0"):
        assert _flags() == before
    assert not cudnn_sdpa_allowed()
    # the variable sets a process's default, read once (a compiled forward never reads the environment)
    code = "import eagle3.device as d; print(d.cudnn_sdpa_allowed())"
    got = [subprocess.run([sys.executable, "-c", code], env={**os.environ, CUDNN_SDPA_ENV: value}, text=True,
                          capture_output=True, check=True, cwd=ROOT).stdout.strip() for value in ("1", "0")]
    assert got == ["True", "False"]


def test_grouped_keys_repeated_to_every_head_attend_as_grouped_attention() -> None:
    """Where cuDNN is left out, grouped keys are repeated to every query head (memory-efficient
    attention, the masked one, has no grouped heads): the same attention as torch's grouped one."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 8, 5, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g), torch.randn(2, 2, 5, 4,
                                                                                                    generator=g)
    mask = torch.rand(2, 1, 5, 5, generator=g) > 0.3
    mask[..., 0] = True
    kw = {"attn_mask": mask, "enable_gqa": True}
    k2, v2, kw2 = every_head(q, k, v, kw)
    assert k2.shape == (2, 8, 5, 4) and kw2["enable_gqa"] is False
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
    torch.testing.assert_close(torch.nn.functional.scaled_dot_product_attention(q, k2, v2, **kw2), want)
    assert every_head(q, k2, v2, kw2)[0] is k2  # nothing to repeat


def test_every_attention_of_the_draft_and_the_target_goes_through_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft's attention (training unroll, decoding) and the target's forward ask for the backends
    of their data's device, so none of them reaches cuDNN on CUDA by way of torch's default."""
    asked: list[str] = []
    real = eagle3.device.sdpa_backends

    def recording(device):
        asked.append(torch.device(device).type)
        return real(device)

    monkeypatch.setattr(eagle3.device, "sdpa_backends", recording)
    q = torch.randn(1, 2, 3, 4)
    assert torch.equal(sdpa(q, q, q), torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert asked == ["cpu"]
    asked.clear()
    # the TTT unroll: step 0, and the later steps' blocked attention of a long row
    train_briefly(tiny_draft(), packed_batch([[BLOCKED_ATTENTION_MIN_LEN, 16]]), steps=1, num_steps=2)
    assert asked == ["cpu", "cpu"]
    asked.clear()
    monkeypatch.setattr(eagle3.target.model, "sdpa_backends", recording)
    target = lively_target()
    target(torch.tensor([[1, 2, 3]]))
    assert asked == ["cpu"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A lively tiny target and stores of it in bf16 (``store``, as harvests write by default), fp32 and fp8."""
    root = tmp_path_factory.mktemp("paths")
    target = lively_target()
    data = regenerated_data(root / "data.jsonl", 16, turns=2)
    for name, dtype in (("store", "bfloat16"), ("fp32", "float32"), ("fp8", "float8_e4m3fn")):
        harvest(HarvestConfig(data=str(data), out_dir=str(root / name), dtype=dtype),
                TargetConfig(name_or_path="lively"), target=target, progress=False)
    return {"target": target, "store": root / "store", "fp32": root / "fp32", "fp8": root / "fp8"}


def test_the_trainer_reads_states_in_the_stores_dtype(store: dict) -> None:
    """bf16 stays bf16 on the host (half the bytes to copy, pin and move; converted on the device),
    fp32 stays fp32, fp8 is dequantised as before; the values are the fp32 reader's."""
    for name, want in (("store", torch.bfloat16), ("fp32", torch.float32), ("fp8", torch.float32)):
        s = HarvestStore(store[name])
        got, full = s.read(3, stored=True), s[3]
        assert got.aux.dtype == got.last.dtype == want and full.aux.dtype == torch.float32
        assert torch.equal(got.aux.float(), full.aux) and torch.equal(got.last.float(), full.last)
        assert load_batch(s, [0, 2], "pack", stored=True)["aux"].dtype == want
        union = StoreUnion([store[name], store["fp32"]])  # each sample from its own store; a mix packs as fp32
        batch = load_batch(union, [0, len(s) + 1, 2], "pack", stored=True)
        assert batch["aux"].dtype == torch.promote_types(want, torch.float32)
        assert torch.equal(batch["aux"].float(), load_batch(union, [0, len(s) + 1, 2], "pack")["aux"])


def test_a_batch_read_ahead_is_the_batch_read_in_line(store: dict) -> None:
    s = HarvestStore(store["store"])
    assert BatchLoader(s, "pack", torch.device("cpu"))._pool is None  # on a CPU the cores train: in line
    loader = BatchLoader(s, "pack", torch.device("cpu"), ahead=True)
    try:
        plan = [[0, 1], [2, 3, 4], [5]]
        got = [loader.get(plan[0], plan[1]), loader.get(plan[1], plan[2]),
               loader.get([7], [8]),  # not what was read ahead: read in line
               loader.get([8], None)]  # ... and this one was
        for batch, idx in zip(got, [*plan[:2], [7], [8]], strict=True):
            want = load_batch(s, idx, "pack", stored=True)
            assert batch.keys() == want.keys() and all(torch.equal(batch[k], want[k]) for k in want)
        assert loader._pending is None
    finally:
        loader.close()


def test_stored_dtype_and_reading_ahead_train_the_same_draft_and_the_clock_logs_each_phase(
        store: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run reading fp32 in line against one reading the bf16 store's own dtype, ahead on a thread,
    with the phase clock on: the same weights and held-out figures, bit for bit."""
    cfg = {"data.store": str(store["store"]), "steps": 4, "data.micro_batch_tokens": 128, "gradient_accumulation": 2,
           "optim.warmup_steps": 1, "data.eval_fraction": 0.25, "eval_every": 2, "save_every": 0,
           "draft.vocab_size": 64, "log.wandb_mode": "disabled", "log.progress": False, "device": "cpu"}
    real = eagle3.store.batches.load_batch
    with monkeypatch.context() as m:  # the reading before: fp32 on the host, in line
        m.setattr(eagle3.store.batches, "load_batch", lambda st, idx, b, stored=False: real(st, idx, b))
        m.setattr(eagle3.train.loop, "load_batch", lambda st, idx, b, stored=False: real(st, idx, b))
        train(train_config(cfg, out_dir=str(tmp_path / "inline")), target=store["target"])

    class Ahead(BatchLoader):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw, ahead=True)

    monkeypatch.setattr(eagle3.train.loop, "BatchLoader", Ahead)
    train(train_config(out_dir=str(tmp_path / "ahead"), **{"log.phase_times": True}, **cfg), target=store["target"])
    a, b = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("inline", "ahead"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    evals = [[r for r in read_metrics(tmp_path / d) if "eval/loss" in r] for d in ("inline", "ahead")]
    assert evals[0] == evals[1] and len(evals[0]) == 3
    steps = [r for r in read_metrics(tmp_path / "ahead") if "train/loss" in r]
    assert len(steps) == 4
    for r in steps:
        phases = {k for k in r if k.startswith("time/")}
        assert phases == {f"time/{p}_ms" for p in ("load", "forward", "backward", "optimizer", "metrics")}
        assert all(r[k] >= 0 for k in phases) and r["time/forward_ms"] > 0
    assert not any(k.startswith("time/") for r in read_metrics(tmp_path / "inline") for k in r)


def test_the_phase_clock_is_silent_when_off() -> None:
    clock = PhaseClock(torch.device("cpu"), enabled=False)
    clock.start()
    clock.mark("load")
    assert clock.metrics() == {}
    on = PhaseClock(torch.device("cpu"), enabled=True)
    on.start()
    on.mark("load")
    on.mark("load")  # summed over a step's micro-batches
    on.mark("forward")
    assert set(on.metrics()) == {"time/load_ms", "time/forward_ms"}


def test_no_library_attention_calls_torch_directly() -> None:
    """Every scaled-dot-product attention of the library goes through ``eagle3.device.sdpa`` (or, for
    a whole HF forward, ``sdpa_backends``), so none reaches cuDNN's backend by torch's default."""
    root = Path(__file__).resolve().parents[1]
    direct = [f"{p.relative_to(root)}:{n}" for pkg in ("eagle3", "serve_eval", "data_gen", "hard_mining", "recipes")
              for p in sorted((root / pkg).rglob("*.py")) if p.name != "device.py"
              for n, line in enumerate(p.read_text().splitlines(), 1) if "scaled_dot_product_attention(" in line]
    assert direct == []
