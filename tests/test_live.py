"""Learning from served traffic: captured requests -> a round of continued training -> a judged
candidate -> promoted, followed by the server between requests, rolled back on a drop."""

from __future__ import annotations

import json
import random
import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from data_gen.config import HarvestConfig
from data_gen.harvest import run as harvest
from eagle3.config import TargetConfig
from eagle3.distributed import free_port
from eagle3.train.config import train_config, updated
from eagle3.train.loop import train
from hard_mining.config import LiveConfig
from hard_mining.live import LiveTrainer, paired, served_taus
from hard_mining.rounds import load_scoring_draft
from hard_mining.score import target_head
from serve_eval.capture import CaptureWriter, committed
from serve_eval.config import SpecConfig
from serve_eval.promoted import DraftFollower, publish, read_serving
from serve_eval.spec_decode import SpeculativeDecoder
from tests.helpers import TINY_VOCAB, lively_target, record_file

LIVELY = TargetConfig(name_or_path="lively")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A lively target, a draft trained briefly on a small store, and 20 requests it served, captured."""
    root = tmp_path_factory.mktemp("live")
    target = lively_target()
    data = record_file(root / "data.jsonl", range(24))
    harvest(HarvestConfig(data=str(data), out_dir=str(root / "store"), dtype="float32"), LIVELY, target=target,
            progress=False)
    base = train_config(**{"data.store": str(root / "store"), "data.micro_batch_tokens": 256, "optim.lr": 1e-2,
                           "optim.warmup_steps": 1, "draft.vocab_size": 64, "log.wandb_mode": "disabled",
                           "log.progress": False}, out_dir=str(root / "train"), steps=8, eval_every=0, save_every=0,
                           ttt_steps=3)
    train(base, LIVELY, target=target)
    draft = root / "train" / "final"
    decoder = SpeculativeDecoder(target, load_scoring_draft(draft, target), SpecConfig("chain", k=3))
    from eagle3.target.chat import ChatFormat
    from serve_eval.capture import serving_spec

    spec = serving_spec(target, "lively", ChatFormat.for_tokenizer(target.tokenizer, None), "float32", 512)
    writer = CaptureWriter(root / "live" / "capture", spec, 2**30)
    rng = random.Random(0)
    served = {}
    for i in range(20):
        prompt = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(6, 14))]
        gen = decoder.generate(prompt, 24, capture=True)
        assert writer.write(prompt, gen.tokens, gen.states, {"draft_version": 0, "k": 3, "greedy": True, "rounds": [
            [c, d, a, a, 0, 0] for c, d, a in zip(gen.stats.contexts, gen.stats.depths, gen.stats.accepted,
                                                  strict=True)]})
        served[i] = gen.stats.tau
    writer.close()
    return {"root": root, "target": target, "draft": draft, "base": base, "served": served}


def _trainer(world: dict, live: Path, **kw) -> LiveTrainer:
    cfg = LiveConfig(live=str(live), draft=str(world["draft"]), round_requests=8, holdout=6, steps=6, lr=1e-2, k=3,
                     max_rounds=1, **kw)
    train_cfg = updated(world["base"], {"data.store": "", "out_dir": "", "save_every": 3})
    return LiveTrainer(cfg, train_cfg, LIVELY, target=world["target"])


def test_the_judge_scores_each_request_as_the_loop_served_it(world: dict) -> None:
    """Teacher-forced on the captured states, the serving draft's tau per request is the loop's."""
    from hard_mining.live import link_store
    from serve_eval.capture import read_spec

    capture = world["root"] / "live" / "capture"
    items = committed(capture)
    store = link_store(world["root"] / "judge-store", items, read_spec(capture))
    taus = served_taus(load_scoring_draft(world["draft"], world["target"]), target_head(world["target"]), store, 3)
    assert taus == pytest.approx([world["served"][c.seq] for c in items], abs=1e-9)


def test_a_round_trains_judges_and_promotes_or_refuses_with_its_figures(world: dict, tmp_path: Path) -> None:
    live = tmp_path / "live"
    shutil.copytree(world["root"] / "live", live)
    (verdict,) = _trainer(world, live, release=False).run()
    plan = json.loads((live / "rounds" / "r0001" / "plan.json").read_text())
    assert len(plan["holdout"]) == 6 and len(plan["train"]) == 14 and not set(plan["holdout"]) & set(plan["train"])
    events = [json.loads(line) for line in (live / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] in ("promoted", "refused") and events[-1]["round"] == 1
    assert (verdict["promoted"] is not None) == (verdict["difference"] > 0 and verdict["interval"][0] > 0)
    if verdict["promoted"] is not None:
        assert read_serving(live)["version"] == verdict["promoted"]
    # a rerun after a kill: the round has its verdict; nothing is trained or published twice
    assert _trainer(world, live, release=False).run() == []
    assert sum(e["event"] == "promoted" for e in map(json.loads, (live / "events.jsonl").read_text().splitlines())) \
        == (verdict["promoted"] is not None)


def test_a_damaged_candidate_is_refused_by_the_judge(world: dict, tmp_path: Path) -> None:
    """Negative control: the serving draft with its fc scrambled loses on the held-out requests."""
    from hard_mining.live import link_store
    from serve_eval.capture import read_spec

    bad = tmp_path / "bad"
    shutil.copytree(world["draft"], bad)
    tensors = load_file(bad / "model.safetensors")
    name = next(k for k in tensors if k.endswith("fc.weight"))
    tensors[name] = tensors[name][torch.randperm(tensors[name].shape[0], generator=torch.Generator().manual_seed(0))]
    save_file(tensors, bad / "model.safetensors")
    capture = world["root"] / "live" / "capture"
    store = link_store(tmp_path / "held", committed(capture)[-12:], read_spec(capture))
    head, target = target_head(world["target"]), world["target"]
    diff = paired(served_taus(load_scoring_draft(bad, target), head, store, 3),
                  served_taus(load_scoring_draft(world["draft"], target), head, store, 3))
    assert diff["mean"] < 0 and not diff["low"] > 0
    same = paired(*[served_taus(load_scoring_draft(world["draft"], target), head, store, 3)] * 2)
    assert same["mean"] == 0 and not same["low"] > 0  # no better: refused as well


def test_the_server_follows_promotions_and_refuses_damaged_drafts(world: dict, tmp_path: Path) -> None:
    from serve_eval.promoted import rollback

    target = world["target"]
    live = tmp_path / "live"
    follower = DraftFollower(live, lambda folder: load_scoring_draft(folder or world["draft"], target))
    swapped: list = []
    assert not follower.follow(swapped.append) and follower.version == 0
    v1 = publish(live, world["draft"], {"why": "test"})
    assert follower.follow(swapped.append) and follower.version == v1 == 1 and len(swapped) == 1
    # a promoted folder damaged afterwards: its checksum refuses it, and the pointer goes back
    v2 = publish(live, world["draft"], {})
    (live / "drafts" / f"v{v2:04d}" / "config.json").write_text("{}")
    assert not follower.follow(swapped.append) and follower.version == 1 and follower.counts["refused"] == 1
    assert read_serving(live)["version"] == 1 and read_serving(live)["rolled_back"] == [v2]
    refused = [json.loads(line) for line in (live / "events.jsonl").read_text().splitlines()
               if '"refused_by_server"' in line]
    assert "sha256" in refused[0]["why"]
    # a swap that fails (the decoder refuses the draft): the version does not move, the pointer goes back
    v3 = publish(live, world["draft"], {})

    def failing(draft: object) -> None:
        raise ValueError("does not fit")

    assert not follower.follow(failing) and follower.version == 1 and read_serving(live)["version"] == 1
    v4 = publish(live, world["draft"], {})
    assert v4 == v3 + 1 and follower.follow(swapped.append) and follower.version == v4
    # a rollback is a pointer change the follower follows like a promotion
    assert rollback(live, v4, to=1) is not None
    assert follower.follow(swapped.append) and follower.version == 1
    assert not follower.follow(swapped.append) and follower.version == 1  # and stays there
    (live / "serving.json").write_text("{not json")  # a hand edit gone wrong: said, serving goes on
    assert not follower.follow(swapped.append) and follower.version == 1
    assert "serving.json" in (live / "events.jsonl").read_text().splitlines()[-1]


def test_a_promoted_version_worse_on_the_requests_it_served_is_rolled_back(world: dict, tmp_path: Path) -> None:
    """The trainer's watch: the requests version 1 served, its served tau against version 0's
    teacher-forced on the same requests. Served by a damaged draft (its rounds rewritten as all
    rejected), version 1 goes back; served as version 0 would have, it is kept."""
    for damaged, expect in ((True, True), (False, False)):
        live = tmp_path / f"live-{damaged}"
        shutil.copytree(world["root"] / "live", live)
        publish(live, world["draft"], {})
        for c in committed(live / "capture")[-8:]:  # pretend version 1 served the last 8
            record = {**c.record, "draft_version": 1}
            if damaged:
                record["rounds"] = [[r[0], r[1], 0, 0, 0, 0] for r in record["rounds"]]
            c.path.with_suffix(".json").write_text(json.dumps(record))
        verdict = _trainer(world, live, rollback_requests=8).watch(committed(live / "capture"))
        assert verdict["rolled_back"] is expect and verdict["requests"] == 8
        assert read_serving(live)["version"] == (0 if expect else 1)


@pytest.mark.slow
def test_a_trainer_killed_mid_round_reruns_it_once_and_one_command_serves(world: dict, tmp_path: Path) -> None:
    """kill -9 during a round's training: the rerun finishes that round from its plan, one verdict,
    one event; and --serve starts the server beside the trainer and stops it after."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import save_lively

    live = tmp_path / "live"
    shutil.copytree(world["root"] / "live", live)
    model = save_lively(tmp_path / "model")
    command = [sys.executable, "-m", "hard_mining.live", "--live", str(live), "--draft", str(world["draft"]),
               "--target", str(model), "--device", "cpu", "--round-requests", "8", "--holdout", "6", "--steps", "30",
               "--lr", "1e-2", "--k", "3", "--max-rounds", "1", "--recipe", "none", "--ttt-steps", "3",
               "--micro-batch-tokens", "256", "--no-progress"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not list((live / "rounds" / "r0001" / "train").glob("checkpoints/*")) and time.time() < deadline:
        assert proc.poll() is None, "the trainer ended before it could be killed"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (live / "rounds" / "r0001" / "verdict.json").exists()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert line["round"] == 1 and line["trained_on"] == 14
    events = [json.loads(x) for x in (live / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e.get("round") == 1] in (["promoted"], ["refused"])
    # one command: --serve starts the server on a fresh folder (the same target and draft) and stops it
    fresh = tmp_path / "fresh"
    port = free_port()
    served = subprocess.run([*command[:4], str(fresh), *command[5:], "--idle-exit-s", "3", "--serve", "--server-args",
                             f"--port {port} --device cpu"], capture_output=True, text=True, timeout=600)
    assert served.returncode == 0, served.stderr[-2000:]
    assert (fresh / "capture" / "capture.json").is_file() and not list((fresh / "rounds").glob("r*"))
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # the server is gone


def test_a_candidate_of_another_target_is_not_promoted_and_the_key_is_named(world: dict, tmp_path: Path) -> None:
    from serve_eval.promoted import PromotionError

    live = tmp_path / "live"
    shutil.copytree(world["root"] / "live", live)
    for key, value, named in (("eagle_aux_hidden_state_layer_ids", [0, 1, 2], "aux layer ids"),
                              ("vocab_size", TINY_VOCAB + 6, "vocab")):
        foreign = tmp_path / f"foreign-{key}"
        shutil.copytree(world["draft"], foreign)
        config = json.loads((foreign / "config.json").read_text())
        config[key] = value
        for section in ("eagle_config", "eagle3_forge"):
            if key == "eagle_aux_hidden_state_layer_ids" and section in config:
                config[section]["eagle_aux_hidden_state_layer_ids" if section == "eagle_config" else "aux_layer_ids"] \
                    = value
        (foreign / "config.json").write_text(json.dumps(config))
        with pytest.raises(PromotionError, match=named):
            publish(live, foreign, {})
    assert read_serving(live) is None and not (live / "drafts").exists()
