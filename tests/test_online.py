"""Online training: producers fill a bounded spool while the trainer reads it, and the run equals
an offline run over the same conversations, bit for bit."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from data_gen.config import HarvestConfig
from data_gen.harvest import run as harvest
from data_gen.produce import produce
from eagle3.config import TargetConfig
from eagle3.errors import TrainError
from eagle3.store.planned import plan_digest
from eagle3.store.shards import HarvestStore, StoreError
from eagle3.store.spool import Spool
from eagle3.train.config import TrainConfig, train_config
from eagle3.train.loop import train
from tests.helpers import lively_target, regenerated_data

LIVELY = TargetConfig(name_or_path="lively")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("online")
    target = lively_target()
    data = regenerated_data(root / "data.jsonl", 24, turns=2)
    harvest(HarvestConfig(data=str(data), out_dir=str(root / "store"), dtype="float32", max_shard_mb=0.03), LIVELY,
            target=target, progress=False)
    return {"root": root, "target": target, "data": data}


def _train_cfg(store: Path, out: Path, **kw) -> TrainConfig:
    base = {"data.store": str(store), "out_dir": str(out), "steps": 8, "data.micro_batch_tokens": 128,
            "optim.lr": 3e-3, "optim.warmup_steps": 2, "data.eval_fraction": 0.0, "eval_every": 0, "save_every": 3,
            "draft.vocab_size": 64, "data.shard_window": 1, "log.wandb_mode": "disabled", "log.progress": False,
            "device": "cpu"}
    return train_config({**base, **kw})


def _producers(setup: dict, spool: Path, workers: int, budget_mb: float,
               max_epochs: int | None = None) -> list[threading.Thread]:
    threads = []
    for w in range(workers):
        cfg = HarvestConfig(data=str(setup["data"]), out_dir=str(spool), dtype="float32", max_shard_mb=0.03,
                            shard=f"{w}/{workers}", spool_budget_mb=budget_mb)
        # each producer its own target (the same weights), as each producer process loads one
        threads.append(threading.Thread(target=produce, args=(cfg, LIVELY), daemon=True,
                                        kwargs={"target": lively_target(), "progress": False,
                                                "max_epochs": max_epochs}))
    for t in threads:
        t.start()
    return threads


FITTED = {"init.lm_head": "target", "init.head_scale": "fit", "init.aux_scale": "unit"}


@pytest.mark.parametrize(("workers", "start"), [(1, {}), (2, FITTED)], ids=["1-worker", "2-workers-fitted-start"])
def test_online_equals_offline_bit_for_bit(setup: dict, tmp_path: Path, workers: int, start: dict) -> None:
    """Also with a start fitted on the first micro-batch: online reads that batch from the spool first."""
    offline = train(_train_cfg(setup["root"] / "store", tmp_path / "offline", **start), target=setup["target"])
    spool = tmp_path / "spool"
    shard_bytes = max(e["bytes"] for e in HarvestStore(setup["root"] / "store").manifest["shards"])
    producers = _producers(setup, spool, workers, budget_mb=2.5 * shard_bytes / 2**20)
    online = train(_train_cfg(spool, tmp_path / "online", **{"data.mode": "online", "data.spool_wait_s": 60}, **start),
                   target=setup["target"])
    assert online["start"] == offline["start"] and (online["start"] is not None) == bool(start)
    for t in producers:
        t.join(timeout=60)
        assert not t.is_alive()  # the trainer's `done` stopped them
    assert online["first_loss"] == offline["first_loss"] and online["last_loss"] == offline["last_loss"]
    assert ((tmp_path / "online" / "final" / "model.safetensors").read_bytes()
            == (tmp_path / "offline" / "final" / "model.safetensors").read_bytes())
    assert Spool.open(spool, plan_sha256=plan_digest(spool), seed=0).used_bytes() == 0  # the trainer cleared it


def test_hybrid_trains_as_offline_and_leaves_the_offline_harvest_store(setup: dict, tmp_path: Path) -> None:
    """train.data.mode=hybrid: the producers make one epoch; the trainer keeps its shards as a store and
    reads it for the later epochs. The draft equals the offline run's, and the store the offline
    harvest's (manifest and every shard's bytes), which `harvest verify` accepts."""
    from data_gen.harvest import main as harvest_main

    steps = 30  # the 24 conversations make 24 steps an epoch: the second epoch reads the kept store
    offline = train(_train_cfg(setup["root"] / "store", tmp_path / "offline", steps=steps), target=setup["target"])
    spool = tmp_path / "spool"
    shard_bytes = max(e["bytes"] for e in HarvestStore(setup["root"] / "store").manifest["shards"])
    producers = _producers(setup, spool, 2, budget_mb=2.5 * shard_bytes / 2**20, max_epochs=1)
    hybrid = train(_train_cfg(spool, tmp_path / "hybrid", **{"data.mode": "hybrid", "data.spool_wait_s": 60},
                              steps=steps),
                   target=setup["target"])
    for t in producers:
        t.join(timeout=60)
        assert not t.is_alive()
    assert hybrid["last_loss"] == offline["last_loss"]
    assert ((tmp_path / "hybrid" / "final" / "model.safetensors").read_bytes()
            == (tmp_path / "offline" / "final" / "model.safetensors").read_bytes())
    kept, harvested = HarvestStore(spool), HarvestStore(setup["root"] / "store")
    assert kept.manifest == harvested.manifest
    for entry in kept.manifest["shards"]:
        assert (spool / entry["file"]).read_bytes() == (setup["root"] / "store" / entry["file"]).read_bytes()
    assert harvest_main(["verify", str(spool)]) == 0
    assert not list((spool / "shards").glob("*.safetensors"))  # nothing left in the spool itself


def test_a_producer_that_stopped_and_one_of_another_target_are_named(setup: dict, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Online training past the one epoch its producers were told to make: the trainer names the
    producers that stopped, instead of waiting out its limit. A trainer with another target than
    the producers' is refused before it trains."""
    import eagle3.store.spool

    monkeypatch.setattr(eagle3.store.spool, "PRODUCER_GRACE_S", 0.0)
    spool = tmp_path / "spool"
    shard_bytes = max(e["bytes"] for e in HarvestStore(setup["root"] / "store").manifest["shards"])
    producers = _producers(setup, spool, 2, budget_mb=2.5 * shard_bytes / 2**20, max_epochs=1)
    with pytest.raises(StoreError, match=r"e0001-shard-\d+: not produced: producer \d/2 \(pid \d+ on .*\) stopped: "
                                         r"1 epochs made .*restart it"):
        train(_train_cfg(spool, tmp_path / "online", **{"data.mode": "online", "data.spool_wait_s": 60}, steps=30),
              target=setup["target"])
    for t in producers:
        t.join(timeout=60)
        assert not t.is_alive()  # they made their epoch and stopped
    with pytest.raises(StoreError, match=r"plan.json: harvested with num_layers=8, but the target has 12"):
        train(_train_cfg(spool, tmp_path / "other", **{"data.mode": "online", "data.spool_wait_s": 60}),
              target=lively_target(num_layers=12))


def test_colocated_training_captures_with_its_own_target(setup: dict, tmp_path: Path) -> None:
    """train.data.mode=colocated: a plan without states (produce --max-epochs 0), each micro-batch's
    states computed by the trainer's own target. Its states equal the offline store's up to batch
    composition (how far, measured here), and so does the run."""
    import torch

    from eagle3.store.colocated import ColocatedStore

    plan = tmp_path / "plan"
    produce(HarvestConfig(data=str(setup["data"]), out_dir=str(plan), dtype="float32", max_shard_mb=0.03), LIVELY,
            target=setup["target"], max_epochs=0, progress=False)
    assert not list(plan.glob("shard-*")) and not list((plan / "shards").glob("*.safetensors"))  # no state on disk
    store, offline_store = ColocatedStore(plan), HarvestStore(setup["root"] / "store")
    store.attach(setup["target"])
    assert store.sample_ids == offline_store.sample_ids
    got = store.get_many(range(len(store)))
    worst = max(float((a.aux - b.aux).abs().max()) for a, b in zip(got, offline_store, strict=True))
    assert worst < 1e-4, worst  # fp32 states: batch composition moves them in the last bits at most
    assert all(torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
               for a, b in zip(got, offline_store, strict=True))
    offline = train(_train_cfg(setup["root"] / "store", tmp_path / "offline"), target=setup["target"])
    colocated = train(_train_cfg(plan, tmp_path / "colocated", **{"data.mode": "colocated"}), target=setup["target"])
    assert abs(colocated["last_loss"] - offline["last_loss"]) <= 1e-3 * abs(offline["last_loss"])
    assert colocated["capture_seconds"] > 0
    with pytest.raises(TrainError, match=r"train.data.store: .*plan.json: missing; plan the data first"):
        train(_train_cfg(tmp_path / "none", tmp_path / "o", **{"data.mode": "colocated"}), target=setup["target"])


def test_online_settings_that_cannot_work_are_named(setup: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="train.data.mode=online .* needs train.data.shard_window >= 1"):
        _train_cfg(tmp_path / "spool", tmp_path / "o", **{"data.mode": "online", "data.shard_window": 0})
    from recipes.config import PipelineConfig

    online = _train_cfg(tmp_path / "spool", tmp_path / "o", **{"data.mode": "online"})
    with pytest.raises(ValueError, match="train.data.mode=online keeps no store for the mine stage"):
        PipelineConfig(train=online, harvest=HarvestConfig(out_dir=str(tmp_path / "spool")))
    with pytest.raises(ValueError, match="train.data.store=.* must be the spool the producers fill, harvest.out_dir="):
        PipelineConfig(train=online, harvest=HarvestConfig(out_dir=str(tmp_path / "other")), stages=["train"])
    with pytest.raises(TrainError, match=r"train.data.store: .*spool.json: no producer has started on this spool"):
        train(_train_cfg(tmp_path / "nothing", tmp_path / "o", **{"data.mode": "online", "data.spool_wait_s": 0.0}),
              target=setup["target"])


def test_the_spool_stays_within_its_budget_the_trainer_saving_early_to_release(setup: dict, tmp_path: Path) -> None:
    shard_bytes = max(e["bytes"] for e in HarvestStore(setup["root"] / "store").manifest["shards"])
    budget = int(2.2 * shard_bytes)
    spool = tmp_path / "spool"
    producers = _producers(setup, spool, 2, budget_mb=budget / 2**20)
    peak, stop = [0], threading.Event()

    def size(path: Path) -> int:
        try:
            return path.stat().st_size
        except FileNotFoundError:  # released between the listing and the look: not in the spool any more
            return 0

    def watch() -> None:
        while not stop.is_set():
            if (spool / "spool.json").is_file():
                peak[0] = max(peak[0], sum(size(p) for p in (spool / "shards").glob("*.safetensors")
                                           if not p.name.startswith(".")))
            stop.wait(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    online = train(_train_cfg(spool, tmp_path / "online", **{"data.mode": "online", "data.spool_wait_s": 60},
                              save_every=0),
                   target=setup["target"])
    stop.set()
    for t in [*producers, watcher]:
        t.join(timeout=60)
    offline = train(_train_cfg(setup["root"] / "store", tmp_path / "offline", save_every=0), target=setup["target"])
    assert online["last_loss"] == offline["last_loss"]  # the early saves change nothing trained
    assert len(list((tmp_path / "online" / "checkpoints").glob("step-*"))) >= 1  # saved to release shards
    assert peak[0] <= budget + shard_bytes  # never more than one shard over the budget
    with pytest.raises(TrainError, match=r"budget_bytes=\d+ holds fewer than train.data.shard_window \+ 1 = 4 shards"):
        train(_train_cfg(spool, tmp_path / "wide", **{"data.mode": "online", "data.shard_window": 3}),
              target=setup["target"])


@pytest.mark.parametrize(("launcher", "mode"), [("none", "online"),
                                               pytest.param("local", "online", marks=pytest.mark.slow),
                                               ("none", "colocated")])
def test_the_pipeline_trains_online_with_producer_processes(tmp_path: Path, launcher: str, mode: str) -> None:
    """The pipeline's train stage with train.data.mode=online: producer processes (launcher none: beside
    the in-process trainer; local: a submitit array beside a 2-rank training job) fill the spool, and
    the draft equals the offline pipeline's (launched alike). Co-located: the harvest stage writes only the plan, the
    trainer captures, and the run ends where the offline one does."""
    from recipes.config import LauncherConfig, PipelineConfig
    from recipes.launch import submit
    from recipes.pipeline import run_pipeline
    from tests.helpers import save_lively

    model = save_lively(tmp_path / "model")
    data = regenerated_data(tmp_path / "data.jsonl", 24, turns=2)

    def pipeline(name: str, online: str | None) -> PipelineConfig:
        out = tmp_path / name
        return PipelineConfig(
            target=TargetConfig(name_or_path=str(model), dtype="float32", device="cpu"),
            harvest=HarvestConfig(data=str(data), out_dir=str(out / "harvest"), dtype="float32", max_shard_mb=0.03,
                                  spool_budget_mb=0.5),
            train=_train_cfg(out / "harvest", out / "train", **{"data.mode": online or "offline",
                                                                "data.spool_wait_s": 120}, steps=6),
            stages=["harvest", "train"], out_dir=str(out),
            launcher=LauncherConfig(kind=launcher, folder=str(out / "submitit"), harvest_shards=2, timeout_min=10,
                                    tasks_per_node=2 if launcher == "local" else 1))

    offline = pipeline("offline", None)
    if launcher == "none":
        run_pipeline(offline)
    else:
        submit(offline, offline.launcher)
    online = pipeline("online", mode)
    if launcher == "none":
        run_pipeline(online)
    else:
        submit(online, online.launcher)
    assert not (tmp_path / "online" / "harvest" / "manifest.json").exists()  # no store was written
    if mode == "colocated":
        assert not list((tmp_path / "online" / "harvest").rglob("*shard*.safetensors"))
        ours, theirs = (json.loads((tmp_path / name / "train" / "summary.json").read_text())
                        for name in ("online", "offline"))
        assert abs(ours["last_loss"] - theirs["last_loss"]) <= 1e-3 * abs(theirs["last_loss"])
        return
    assert ((tmp_path / "online" / "train" / "final" / "model.safetensors").read_bytes()
            == (tmp_path / "offline" / "train" / "final" / "model.safetensors").read_bytes())
    assert (tmp_path / "online" / "harvest" / "done").is_file()
    summary = json.loads((tmp_path / "online" / "train" / "summary.json").read_text())
    assert summary["world_size"] == online.launcher.tasks_per_node


@pytest.mark.slow
def test_producer_and_trainer_killed_at_random_moments_resume_to_the_same_draft(tmp_path: Path) -> None:
    """kill -9 of the trainer (after a checkpoint, at a random moment) and of the producer (at random
    moments), three times each, every one restarted: the run ends with the draft of a run never
    killed, and each epoch trained its planned samples once (the same losses, step by step)."""
    import os
    import random
    import signal
    import subprocess
    import sys
    import time

    from eagle3.train.checkpoint import LATEST
    from eagle3.train.log import read_metrics
    from tests.helpers import save_lively

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    model = save_lively(tmp_path / "model")
    data = regenerated_data(tmp_path / "data.jsonl", 24, turns=2)

    def producer(spool: Path) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "data_gen.produce", "--data", str(data), "--out", str(spool),
                                 "--target", str(model), "--device", "cpu", "--dtype", "float32",
                                 "--max-shard-mb", "0.03", "--spool-budget-mb", "0.5", "--no-progress"],
                                cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def trainer(spool: Path, out: Path) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "eagle3.train", "--data.mode", "online", "--store", str(spool),
                                 "--target", str(model), "--out", str(out), "--steps", "40", "--save-every", "2",
                                 "--eval-every", "0", "--data.shard-window", "1", "--data.eval-fraction", "0",
                                 "--data.micro-batch-tokens", "128", "--draft.vocab-size", "64", "--optim.lr", "3e-3",
                                 "--optim.warmup-steps", "2", "--log.wandb-mode", "disabled", "--no-log.progress",
                                 "--device", "cpu",
                                 "--data.spool-wait-s", "120"], cwd=repo, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)

    straight = tmp_path / "straight"
    p, t = producer(straight / "spool"), trainer(straight / "spool", straight / "train")
    assert t.wait(timeout=300) == 0, t.stderr.read()[-2000:]
    p.wait(timeout=120)

    rng = random.Random(0)
    spool, out = tmp_path / "killed" / "spool", tmp_path / "killed" / "train"
    p, t = producer(spool), trainer(spool, out)
    for goal in (3, 13, 23):
        deadline = time.monotonic() + 300
        latest = out / "checkpoints" / LATEST
        while time.monotonic() < deadline and t.poll() is None:
            if latest.is_file() and int(latest.read_text().strip().split("-")[1] or 0) >= goal:
                break
            time.sleep(0.005)
        time.sleep(rng.random() * 0.2)
        for proc in (t, p):  # both die; the producer at its own random moment
            assert proc.poll() is None, "a process ended before it was killed"
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            time.sleep(rng.random() * 0.1)
        assert not (out / "summary.json").exists()  # killed mid-run
        p, t = producer(spool), trainer(spool, out)
    assert t.wait(timeout=300) == 0, t.stderr.read()[-2000:]
    p.wait(timeout=120)
    assert ((out / "final" / "model.safetensors").read_bytes()
            == (straight / "train" / "final" / "model.safetensors").read_bytes())
    keep = ("loss", "acc", "tau_sim")
    losses = [[(r["step"], k, v) for r in read_metrics(d) for k, v in r.items() if any(w in k for w in keep)]
              for d in (out, straight / "train")]
    assert losses[0] == losses[1]
