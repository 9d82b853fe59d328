"""hard_mining on tiny models: scores agree with the trainer's eval, grouping and selection by hand,
dedup against eval sets, and one full mining round (regenerate + harvest + continue training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_gen.config import HarvestConfig
from data_gen.harvest import run as harvest
from eagle3.config import TargetConfig
from eagle3.store.shards import HarvestStore
from eagle3.train.config import train_config, updated
from eagle3.train.log import read_metrics
from eagle3.train.loop import train
from hard_mining.config import MineConfig
from hard_mining.rounds import MineError, balanced_pick, run_rounds
from hard_mining.score import (
    GroupScore,
    SampleScore,
    group_by_context,
    group_scores,
    hardest,
    meta_of,
    read_sample_meta,
    score_store,
    target_head,
)
from hard_mining.strategies import (
    code_tasks,
    dedupe,
    domain_weights,
    math_problems,
    parse_variation,
    per_record,
    pick_hardest,
    prompt_record,
    sample_weights,
    split_by_weight,
    variation_requests,
    weak_pick,
)
from tests.helpers import lively_target, record_file

DOMAINS = ["coding", "science", "general", "multilingual"]




@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("mine")
    target = lively_target()
    lively = TargetConfig(name_or_path="lively")
    data, val = record_file(root / "data.jsonl", range(32)), record_file(root / "val.jsonl", range(100, 112), "v")
    harvest(HarvestConfig(data=str(data), out_dir=str(root / "store"), dtype="float32"), lively, target=target,
            progress=False)
    harvest(HarvestConfig(data=str(val), out_dir=str(root / "val"), dtype="float32"), lively, target=target,
            progress=False)
    base = train_config(**{"data.store": str(root / "store"), "data.micro_batch_tokens": 256, "optim.lr": 1e-2,
                           "optim.warmup_steps": 1, "data.eval_store": str(root / "val"), "draft.vocab_size": 64,
                           "log.wandb_mode": "disabled", "log.progress": False}, out_dir=str(root / "train"), steps=8,
                           eval_every=8, save_every=0,
                       ttt_steps=3)
    summary = train(base, lively, target=target)
    return {"root": root, "target": target, "data": data, "val": val, "train": base, "summary": summary}


def test_scores_agree_with_the_trainers_eval(world: dict) -> None:
    from hard_mining.rounds import load_scoring_draft

    target = world["target"]
    draft = load_scoring_draft(world["root"] / "train" / "final", target)
    meta = read_sample_meta(world["val"])
    scores = score_store(draft, target_head(target), HarvestStore(world["root"] / "val"), meta, ttt_steps=3)
    assert len(scores) == 12 and {s.domain for s in scores} == set(DOMAINS)
    assert scores[3].language == "de" and scores[0].language == "en"
    pooled = group_scores(scores, "all")["all"]
    assert pooled.tau_sim == pytest.approx(world["summary"]["eval_last"]["eval/tau_sim"], abs=1e-9)
    from eagle3.train.log import read_metrics

    last_eval = [r for r in read_metrics(world["root"] / "train") if "eval/positions" in r][-1]
    assert pooled.positions == last_eval["eval/positions"]
    for s in scores:
        assert s.tau_sim == pytest.approx(1 + sum(s.accepted) / len(s.accepted))
        assert all(0 <= a <= 3 for a in s.accepted) and s.step_counted[0] == s.positions
        # each start's context: the tokens up to it, increasing along the row and within it
        assert len(s.contexts) == s.positions and s.contexts == sorted(set(s.contexts))
        assert 2 <= s.contexts[0] and s.contexts[-1] <= s.tokens - 1
        # as the loop counts them: row t's first draft token is token t + 2, after t + 2 tokens
        assert s.contexts == [t + 2 for t in s.starts] and len(s.top1) == s.positions
        assert 0.0 < s.entropy <= s.loss and all(0.0 < p <= 1.0 for p in s.top1)
    by_context = group_by_context(scores)
    assert sum(b["starts"] for b in by_context.values()) == pooled.positions
    if len(by_context) == 1:
        assert next(iter(by_context.values()))["tau_sim"] == pytest.approx(pooled.tau_sim, abs=1e-4)
    assert meta_of("v101-t1", meta)["domain"] == "science"  # per-turn ids inherit their record's


def _s(sid: str, domain: str, accepted: list[int], loss: float, language: str = "en") -> SampleScore:
    return SampleScore(sid, domain, language, tokens=50, accepted=accepted, loss=loss)


def test_acceptance_by_context_by_hand() -> None:
    scores = [SampleScore("a", "long", "en", 5000, [0, 3, 1], 1.0, contexts=[10, 1500, 4500]),
              SampleScore("b", "long", "en", 900, [2, 2], 1.0, contexts=[5, 900])]
    got = group_by_context(scores)
    assert list(got) == ["0-1k", "1-2k", "4-8k"] and [g["starts"] for g in got.values()] == [3, 1, 1]
    assert [g["tau_sim"] for g in got.values()] == pytest.approx([1 + 4 / 3, 4.0, 2.0], abs=1e-4)
    assert [g["accept_1"] for g in got.values()] == pytest.approx([2 / 3, 1.0, 1.0], abs=1e-4)
    assert [s.contexts for s in per_record([SampleScore("r-t0", "long", "en", 9, [1], 1.0, [1], [1], [4]),
                                            SampleScore("r-t1", "long", "en", 9, [2], 1.0, [1], [1], [8])])] == [[4, 8]]


def test_grouping_and_selection_by_hand() -> None:
    scores = [_s("a", "coding", [0, 1, 3, 0], 2.0), _s("b", "coding", [2, 2], 1.0),
              _s("c", "multilingual", [0, 0, 0, 1], 4.0, "de"), _s("d", "multilingual", [0, 0, 0, 0, 0, 0], 5.0, "fr"),
              _s("e", "science", [1, 1, 1, 1], 3.0)]
    g = group_scores(scores, "domain", depth=3)
    # coding pools 6 starts with 8 accepted: tau 1 + 8/6; acceptance at depth 1: 4 of 6 starts
    assert g["coding"].tau_sim == pytest.approx(1 + 8 / 6) and g["coding"].positions == 6
    assert g["coding"].acceptance == pytest.approx([4 / 6, 3 / 6, 1 / 6])
    assert g["coding"].loss == pytest.approx((2.0 * 4 + 1.0 * 2) / 6)
    assert g["multilingual"].tau_sim == pytest.approx(1 + 1 / 10)
    assert set(group_scores(scores, "language")) == {"en", "de", "fr"}
    assert [s.sample_id for s in hardest(scores, 2, min_positions=4)] == ["d", "c"]
    assert [s.sample_id for s in hardest(scores, 2, min_positions=5)] == ["d"]
    # the top half by loss within each domain (at least one each); "b" has too few positions
    assert pick_hardest(scores, 0.5, min_positions=4) == ["a", "d", "e"]
    assert pick_hardest(scores, 0.4, per_domain=False, min_positions=4) == ["c", "d"]
    with pytest.raises(ValueError, match="fraction"):
        pick_hardest(scores, 0.0)
    # a conversation harvested one reply at a time counts once: its samples pooled
    split = [_s("r-t0", "coding", [0, 1], 2.0), _s("r-t1", "coding", [3, 0, 0, 0], 5.0), _s("q", "coding", [1], 1.0)]
    pooled = {x.sample_id: x for x in per_record(split)}
    assert set(pooled) == {"r", "q"} and pooled["r"].accepted == [0, 1, 3, 0, 0, 0]
    assert pooled["r"].loss == pytest.approx((2.0 * 2 + 5.0 * 4) / 6) and pooled["q"] is split[2]


def test_learnable_ranks_by_hand() -> None:
    """High loss that is mostly the target's own entropy ranks last under the learnable ranks."""
    noisy = SampleScore("noisy", "general", "en", 50, [0, 0, 0, 0], loss=6.0, entropy=5.8, top1=[0.2, 0.1, 0.3, 0.2])
    learnable = SampleScore("learn", "general", "en", 50, [0, 0, 1, 0], loss=3.0, entropy=1.0,
                            top1=[0.9, 0.8, 0.9, 0.3])
    fitted = SampleScore("fit", "general", "en", 50, [3, 2, 3, 0], loss=1.5, entropy=1.2, top1=[0.9, 0.9, 0.9, 0.6])
    scores = [noisy, learnable, fitted]
    assert learnable.excess == pytest.approx(2.0) and learnable.missed_confident() == pytest.approx(2 / 4)
    assert fitted.missed_confident() == pytest.approx(1 / 4) and noisy.missed_confident() == 0.0
    assert [s.sample_id for s in hardest(scores, 3, min_positions=1, rank="loss")] == ["noisy", "learn", "fit"]
    assert [s.sample_id for s in hardest(scores, 3, min_positions=1, rank="excess")] == ["learn", "fit", "noisy"]
    assert [s.sample_id for s in hardest(scores, 3, min_positions=1, rank="missed_confident")] == [
        "learn", "fit", "noisy"]
    assert [s.sample_id for s in hardest(scores, 3, min_positions=1, rank="missed_confident",
                                         confidence=0.95)][0] == "learn"  # none confident: excess decides
    assert pick_hardest(scores, 0.34, min_positions=1, rank="missed_confident") == ["learn"]
    with pytest.raises(ValueError, match="mine.rank='magic'"):
        MineConfig(rank="magic")
    pooled = per_record([SampleScore("r-t0", "g", "en", 9, [0], 2.0, [0], [1], [3], 1.5, [0.9], [2]),
                         SampleScore("r-t1", "g", "en", 9, [1, 0, 0], 3.0, [1], [3], [4, 5, 6], 1.0,
                                     [0.1, 0.7, 0.2], [3, 4, 5])])[0]
    assert pooled.entropy == pytest.approx((1.5 + 3 * 1.0) / 4) and pooled.top1 == [0.9, 0.1, 0.7, 0.2]
    assert pooled.missed_confident() == pytest.approx(2 / 4)


def test_domain_weights_by_hand() -> None:
    groups = {"coding": GroupScore("coding", 2, 10, 5, 1.0, []),  # tau 1.5
              "multilingual": GroupScore("multilingual", 2, 10, 2, 1.0, [])}  # tau 1.2
    w = domain_weights(groups, power=1.0)
    # raw 1.0 and 1.5/1.2 = 1.25; scaled to a mean of 1 over the 4 samples: / 1.125
    assert w == pytest.approx({"coding": 1 / 1.125, "multilingual": 1.25 / 1.125})
    w4 = domain_weights(groups, power=20.0)  # 1.25**20 = 86.7 -> capped at 4
    assert w4["multilingual"] / w4["coding"] == pytest.approx(4.0)
    # normalised over the samples the weights apply to; an unscored domain's raw weight is 1
    wt = domain_weights(groups, power=1.0, counts={"coding": 6, "multilingual": 2, "science": 2})
    assert wt == pytest.approx({"coding": 1 / 1.05, "multilingual": 1.25 / 1.05, "science": 1 / 1.05})
    per = sample_weights([_s("a", "coding", [0], 1.0), _s("c", "multilingual", [0], 1.0)], w)
    assert per == {"a": pytest.approx(0.888889), "c": pytest.approx(1.111111)}


def test_weak_domains_get_the_added_prompts_by_hand() -> None:
    # proportional to the weights: 3 : 1 of 8 -> 6 and 2; an unweighted domain counts 1
    assert split_by_weight(8, {"coding": 3.0, "general": 1.0}, {"coding": 50, "general": 50}) == {
        "coding": 6, "general": 2}
    assert split_by_weight(4, {"coding": 3.0}, {"coding": 9, "science": 9}) == {"coding": 3, "science": 1}
    # a domain with too few prompts is filled, the rest goes to the others; never more than the pool
    assert split_by_weight(8, {"coding": 10.0, "general": 1.0}, {"coding": 2, "general": 50}) == {
        "coding": 2, "general": 6}
    assert split_by_weight(9, {"coding": 1.0}, {"coding": 3, "general": 2}) == {"coding": 3, "general": 2}
    pool = [{"id": f"p{i}", "domain": DOMAINS[i % 4]} for i in range(40)]
    picked, split = weak_pick(pool, 8, {"coding": 4.0, "science": 2.0, "general": 1.0, "multilingual": 1.0}, seed=3)
    assert split == {"coding": 4, "science": 2, "general": 1, "multilingual": 1}
    assert sorted(p["domain"] for p in picked) == sorted(d for d, c in split.items() for _ in range(c))
    assert len({p["id"] for p in picked}) == 8
    assert weak_pick(pool, 8, {"coding": 4.0}, seed=3) == weak_pick(pool, 8, {"coding": 4.0}, seed=3)
    assert weak_pick(pool, 8, {"coding": 4.0}, seed=3)[0] != weak_pick(pool, 8, {"coding": 4.0}, seed=4)[0]


def test_a_weak_round_adds_most_prompts_where_the_draft_is_weakest(world: dict, tmp_path: Path) -> None:
    root, target = world["root"], world["target"]
    pool = record_file(tmp_path / "pool.jsonl", range(400, 440), "p")
    lively = TargetConfig(name_or_path="lively")
    cfg = MineConfig(draft=str(root / "train" / "final"), store=str(root / "store"), records=[str(world["data"])],
                     eval_store=str(root / "val"), eval_records=[str(world["val"])], pool=str(pool),
                     strategies=["weak"], weak=8, weight_power=20.0, steps=1, max_new_tokens=8,
                     out_dir=str(tmp_path / "weak"), wandb_mode="disabled")
    (entry,) = run_rounds(cfg, world["train"], lively, target=target, progress=False)["rounds"]
    taus = {d: g["tau_sim"] for d, g in entry["before"]["domain"].items()}
    split = entry["added"]["weak"]["per_domain"]
    assert sum(split.values()) == entry["added"]["weak"]["picked"] == 8
    weakest, best = min(taus, key=taus.get), max(taus, key=taus.get)
    assert split.get(weakest, 0) == max(split.values()) and split.get(weakest, 0) > split.get(best, 0)
    mined = [json.loads(x) for x in Path(entry["added_records"][0]).read_text().splitlines()]
    assert len(mined) == entry["added"]["weak"]["kept"] and mined
    with pytest.raises(MineError, match="mine.pool must be set"):
        run_rounds(MineConfig(**{**cfg.__dict__, "pool": ""}), world["train"], lively, target=target,
                   progress=False)


def test_variations_procedural_prompts_and_dedup() -> None:
    rec = {"id": "x1", "domain": "multilingual", "language": "de",
           "messages": [{"role": "user", "content": "Wie funktioniert ein Kühlschrank?"}]}
    asked = variation_requests([rec], per_record=2)
    assert [a["id"] for a in asked] == ["x1-var0", "x1-var1"] and asked[0]["meta"]["parent"] == "x1"
    assert "Kühlschrank" in asked[0]["messages"][0]["content"] and "Deutsch" in asked[0]["messages"][0]["content"]
    assert parse_variation("Frage: Wie funktioniert eine Waschmaschine?") == "Wie funktioniert eine Waschmaschine?"
    assert parse_variation("ok") is None
    math, code = math_problems(6, seed=1), code_tasks(6, seed=1)
    assert math == math_problems(6, seed=1) and math != math_problems(6, seed=2)
    assert {r["domain"] for r in math} == {"science"} and {r["domain"] for r in code} == {"coding"}
    eval_sets = [{"messages": [{"role": "user", "content": "What is the capital of France?"}]},
                 {"messages": [{"role": "user", "content": "one two three four five six seven eight nine ten"}]}]
    cands = [prompt_record("what is the CAPITAL of   france?", "general", "en", "t"),  # exact after normalising
             prompt_record("one two three four five six seven eight nine ten eleven", "general", "en", "t"),
             prompt_record("A fresh question about rivers and lakes in Europe today", "general", "en", "t"),
             prompt_record("A fresh question about rivers and lakes in Europe today", "general", "en", "t")]
    kept, dropped = dedupe(cands, eval_sets)
    assert [k["messages"][0]["content"] for k in kept] == ["A fresh question about rivers and lakes in Europe today"]
    assert dropped == {"exact": 1, "ngram": 1, "repeat": 1}
    picked = balanced_pick([{"id": i, "domain": DOMAINS[i % 2]} for i in range(10)], 4, seed=0)
    assert sorted(r["domain"] for r in picked) == ["coding", "coding", "science", "science"]


def test_one_mining_round_end_to_end(world: dict, tmp_path: Path) -> None:
    root, target = world["root"], world["target"]
    pool = record_file(tmp_path / "pool.jsonl", range(200, 216), "p")
    cfg = MineConfig(draft=str(root / "train" / "final"), store=str(root / "store"), records=[str(world["data"])],
                     eval_store=str(root / "val"), eval_records=[str(world["val"])], pool=str(pool),
                     out_dir=str(tmp_path / "mine"), rounds=1, candidates=8, candidate_tokens=6, keep_fraction=0.5,
                     hard_examples=2, procedural=1, steps=2, max_new_tokens=12, wandb_mode="offline")
    lively = TargetConfig(name_or_path="lively")
    manifest = run_rounds(cfg, world["train"], lively, target=target, progress=False)
    (entry,) = manifest["rounds"]
    assert entry["added"]["hardest"]["candidates"] == 8 and entry["added"]["hardest"]["kept"] == 4
    assert entry["added"]["synthesize"]["hard_parents"] == 2
    assert set(entry["added"]["reweight"]["domain_weights"]) == set(DOMAINS)
    assert len(entry["stores"]) == 1 and HarvestStore(Path(entry["stores"][0])).manifest["spec"]["dtype"] == "float32"
    assert len(entry["added_ids"]) >= 4 + 2  # 4 kept candidates + procedural math and code
    assert set(entry["before"]["domain"]) == set(DOMAINS) and entry["after"]["all"]["all"]["positions"] > 0
    assert entry["train"]["steps"] == 2 and (Path(entry["draft"]) / "model.safetensors").is_file()
    lrs = [r["train/lr"] for r in read_metrics(tmp_path / "mine" / "round-1" / "train") if "train/lr" in r]
    assert max(lrs) == pytest.approx(world["train"].optim.lr / 4)  # mine.lr=None: a quarter of the draft's own run
    weights = json.loads(Path(entry["sample_weights"]).read_text())
    assert len(weights) == 32
    assert list((tmp_path / "mine" / "wandb").glob("offline-run-*")), "no offline wandb run"
    # a rerun finds the round done; other settings fail naming the key
    assert run_rounds(cfg, world["train"], lively, target=target, progress=False) == manifest
    path = tmp_path / "mine" / "manifest.json"  # written by the version before mine.lr: still resumes
    path.write_text(json.dumps({**manifest, "config": {k: v for k, v in manifest["config"].items() if k != "lr"}}))
    assert run_rounds(cfg, world["train"], lively, target=target, progress=False)["rounds"] == manifest["rounds"]
    with pytest.raises(MineError, match="mine.steps"):
        run_rounds(MineConfig(**{**cfg.__dict__, "steps": 3}), world["train"], lively, target=target, progress=False)
    with pytest.raises(ValueError, match="mine.strategies"):
        MineConfig(strategies=["magic"])
    # records that are not the eval store's: its per-domain figures would all be "unknown"
    other = MineConfig(**{**cfg.__dict__, "eval_records": [str(world["data"])], "out_dir": str(tmp_path / "m2")})
    with pytest.raises(MineError, match="mine.eval_records: .* have no record there"):
        run_rounds(other, world["train"], lively, target=target, progress=False)
    assert not (tmp_path / "m2").exists(), "a run refused on its inputs left an empty out_dir"
    # a wrong eval-sets folder would let eval prompts into training unchecked: refused
    (tmp_path / "empty").mkdir()
    for name, folder in (("m3", tmp_path / "nowhere"), ("m4", tmp_path / "empty")):
        blind = MineConfig(**{**cfg.__dict__, "eval_sets": str(folder), "out_dir": str(tmp_path / name)})
        with pytest.raises(MineError, match=f"mine.eval_sets={folder}: no"):
            run_rounds(blind, world["train"], lively, target=target, progress=False)
        assert not (tmp_path / name).exists()


def test_dashboard_panels_name_metrics_the_runs_log(world: dict) -> None:
    from eagle3.dashboards import SECTIONS, spec, workspace
    from eagle3.train.log import read_metrics

    logged = set().union(*(r.keys() for r in read_metrics(world["root"] / "train")))
    k = 3  # the world's TTT steps: deeper per-step panels stay empty for this run
    train_panels = dict(SECTIONS)["Acceptance over training"]
    for _, _, x, metrics in train_panels:
        assert x in logged
        for m in metrics:
            tail = m.rsplit("_", 1)[-1]
            depth = int(tail) if tail.isdigit() else 0
            assert m in logged or depth >= k, m
    mine = dict(SECTIONS)["Mining rounds"]
    assert all(m.startswith("mine/") for _, _, _, ms in mine for m in ms)
    assert spec()["version"] == 1 and len(spec()["sections"]) == 3
    pytest.importorskip("wandb_workspaces")
    view = workspace("someone", "eagle3")
    assert [s.name for s in view.sections] == [name for name, _ in SECTIONS]


def test_the_cli_continues_with_the_pipelines_draft_recipe(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """hard_mining.rounds trains with a draft recipe (default the pipeline's target-head) at a quarter
    of its lr, as the mine stage does, and cannot run without eval sets to deduplicate against."""
    import hard_mining.rounds as rounds

    seen = []
    monkeypatch.setattr(rounds, "run_rounds", lambda cfg, train_cfg, target_cfg, progress: seen.append(
        (cfg, train_cfg)) or {"rounds": []})
    base = ["--draft", "d", "--store", "s", "--records", "r.jsonl", "--eval-store", "e", "--eval-records", "e.jsonl",
            "--out", "o", "--no-progress"]
    with pytest.raises(SystemExit):
        rounds.main(base)
    assert "--eval-sets" in capsys.readouterr().err
    assert rounds.main([*base, "--eval-sets", "sets"]) == 0
    assert rounds.main([*base, "--eval-sets", "sets", "--recipe", "eagle3", "--lr", "0.01"]) == 0
    (mine, train), (mine_paper, train_paper) = seen
    assert (train.optim.name, train.loss.step_decay, train.draft.variant, train.optim.lr, mine.lr) == \
        ("muon", 1.0, "speculators", 2e-3, None)  # None: a quarter of train.optim.lr, as the pipeline's mine.lr
    assert (train_paper.optim.name, train_paper.loss.step_decay, mine_paper.lr) == ("adamw", 0.8, 0.01)
    assert rounds.main([*base, "--eval-sets", "sets", "--recipe", "nope"]) == 2
    assert "draft recipe 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["peagle", "dflash"])
def test_mining_scores_and_retrains_each_parallel_family(world: dict, tmp_path: Path, family: str) -> None:
    """A P-EAGLE or DFlash draft: mining's score equals the trainer's eval, and a round (reweight
    only, no generation) continues training the same family."""

    from eagle3.export import load_draft
    from hard_mining.rounds import load_scoring_draft

    root, target = world["root"], world["target"]
    base = updated(world["train"], {"out_dir": str(tmp_path / "train"), "draft.family": family})
    summary = train(base, TargetConfig(name_or_path="lively"), target=target)
    draft = load_scoring_draft(tmp_path / "train" / "final", target)
    assert draft.config.family == family
    scores = score_store(draft, target_head(target), HarvestStore(root / "val"), read_sample_meta(world["val"]),
                         ttt_steps=3)
    assert group_scores(scores, "all")["all"].tau_sim == pytest.approx(summary["eval_last"]["eval/tau_sim"], abs=1e-9)
    cfg = MineConfig(draft=str(tmp_path / "train" / "final"), store=str(root / "store"), records=[str(world["data"])],
                     eval_store=str(root / "val"), eval_records=[str(world["val"])], out_dir=str(tmp_path / "mine"),
                     rounds=1, strategies=["reweight"], steps=2, wandb_mode="disabled")
    (entry,) = run_rounds(cfg, base, TargetConfig(name_or_path="lively"), target=target, progress=False)["rounds"]
    assert entry["train"]["steps"] == 2
    assert load_draft(entry["draft"]).draft.config.family == family


def test_the_replayed_rounds_are_the_ones_the_loop_serves(world: dict, tmp_path: Path) -> None:
    """Rounds worked out from a harvested reply's scores equal the bundled loop's on that prompt: the
    same first-draft-token positions and accepted runs, the replies identical (lossless)."""
    from data_gen.config import RegenerateConfig
    from data_gen.regenerate import run as regenerate
    from hard_mining.replay import replay_weights, reply_spans, served_rounds
    from hard_mining.rounds import load_scoring_draft
    from serve_eval.config import SpecConfig
    from serve_eval.spec_decode import SpeculativeDecoder

    target, lively = world["target"], TargetConfig(name_or_path="lively")
    prompts = record_file(tmp_path / "p.jsonl", range(300, 316, 2), "q")  # single-turn conversations
    regenerate(RegenerateConfig(pool=str(prompts), out_dir=str(tmp_path / "regen"), max_new_tokens=40), lively,
               target=target, progress=False)
    harvest(HarvestConfig(data=str(tmp_path / "regen" / "dataset" / "regenerated.jsonl"),
                          out_dir=str(tmp_path / "store"), dtype="float32"), lively, target=target, progress=False)
    store = HarvestStore(tmp_path / "store")
    draft = load_scoring_draft(world["root"] / "train" / "final", target)
    scores = score_store(draft, target_head(target), store, {}, ttt_steps=3)
    decoder = SpeculativeDecoder(target, draft, SpecConfig(k=3))
    compared, accepted_seen, spans_of = 0, set(), {}
    for i, s in enumerate(scores):
        sample = store[i]
        spans_of[s.sample_id] = spans = reply_spans(sample.loss_mask)
        ((first, last),) = spans
        ids = sample.input_ids.tolist()
        gen = decoder.generate(ids[:first], max_new_tokens=last - first + 1)
        assert gen.tokens == ids[first:last + 1]  # the loop serves the harvested reply, token for token
        mine = [(t + 2, a) for t, a, _ in served_rounds(s, spans, 3)]
        inside = [(c, a) for c, a in mine if c + 3 <= last]  # the loop may draft past the reply's end
        assert list(zip(gen.stats.contexts, gen.stats.accepted, strict=False))[:len(inside)] == inside
        compared += len(inside)
        accepted_seen |= {a for _, a in inside}
    assert compared >= 40 and {0, 1} <= accepted_seen, (compared, accepted_seen)
    weights = replay_weights({s.sample_id: served_rounds(s, spans_of[s.sample_id], 3) for s in scores}, 2.5)
    some = next(iter(weights.items()))
    rounds = served_rounds(next(s for s in scores if s.sample_id == some[0]), spans_of[some[0]], 3)
    assert some[1] == [[j, 2.5] for _, a, j in rounds if j >= 0] and all(a < 3 for _, a, j in rounds if j >= 0)


def test_error_replay_rounds_weigh_the_rejected_tokens(world: dict, tmp_path: Path) -> None:
    root, target = world["root"], world["target"]
    pool = record_file(tmp_path / "pool.jsonl", range(400, 420), "p")
    cfg = MineConfig(draft=str(root / "train" / "final"), store=str(root / "store"), records=[str(world["data"])],
                     eval_store=str(root / "val"), eval_records=[str(world["val"])], pool=str(pool),
                     out_dir=str(tmp_path / "replay"), rounds=2,
                     strategies=["replay"], replay_prompts=4, replay_weight=2.5, steps=2, max_new_tokens=16,
                     wandb_mode="disabled")
    lively = TargetConfig(name_or_path="lively")
    manifest = run_rounds(cfg, world["train"], lively, target=target, progress=False)
    first, second = manifest["rounds"]
    assert first["added"]["replay"]["kept"] == 4 and len(first["added_ids"]) == 4
    assert first["added"]["replay_tokens"]["rejected"] > 0
    w1 = json.loads(Path(first["token_weights"]).read_text())
    mined = HarvestStore(Path(first["stores"][0]))
    assert set(w1) <= set(mined.sample_ids) and all(w == 2.5 for v in w1.values() for _, w in v)
    for sid, pairs in w1.items():  # every weighted token is a reply token of its sample
        mask = mined[mined.sample_ids.index(sid)].loss_mask
        assert all(mask[j] for j, _ in pairs)
    w2 = json.loads(Path(second["token_weights"]).read_text())
    assert set(w1) < set(w2)  # round 2 keeps round 1's weights and adds its own
    assert run_rounds(cfg, world["train"], lively, target=target, progress=False) == manifest  # resumes


def test_traffic_rounds_mine_the_requests_the_draft_served_worst(world: dict, tmp_path: Path) -> None:
    from tests.helpers import conversation

    root, target = world["root"], world["target"]
    log = tmp_path / "traffic.jsonl"
    lines = []
    for i, tau_rounds in enumerate([[1, 1, 1, 1], [0, 0, 0, 1], [2, 2, 2, 2], [0, 0, 0, 0], [1, 0, 1, 0]]):
        prompt = conversation(500 + 2 * i)[:-1]  # the turns the reply answered
        lines.append({"messages": prompt, "prompt_ids": [1, 2], "reply_ids": [3] * 12, "finish_reason": "stop",
                      "k": 3, "rounds": [[10 + j, 3, a] for j, a in enumerate(tau_rounds)], "tau": 0.0})
    lines.append({**lines[1], "rounds": lines[1]["rounds"][:2]})  # too few rounds to say anything: left out
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    lively = TargetConfig(name_or_path="lively")
    base = dict(draft=str(root / "train" / "final"), store=str(root / "store"), records=[str(world["data"])],
                eval_store=str(root / "val"), eval_records=[str(world["val"])], strategies=["traffic"],
                traffic=str(log), traffic_prompts=2, steps=1, max_new_tokens=8, wandb_mode="disabled")
    manifest = run_rounds(MineConfig(**base, out_dir=str(tmp_path / "worst")), world["train"], lively,
                          target=target, progress=False)
    added = manifest["rounds"][0]["added"]["traffic"]
    assert added["kept"] == 2 and added["served_tau"] == [1.0, 1.25]  # the two the draft served worst
    wanted = {json.dumps(lines[i]["messages"]) for i in (3, 1)}
    mined = [json.loads(x) for x in (Path(manifest["rounds"][0]["added_records"][0])).read_text().splitlines()]
    assert {json.dumps(r["messages"][:-1]) for r in mined} == wanted and {r["domain"] for r in mined} == {"traffic"}
    manifest = run_rounds(MineConfig(**base, traffic_pick="random", out_dir=str(tmp_path / "random")),
                          world["train"], lively, target=target, progress=False)
    assert manifest["rounds"][0]["added"]["traffic"]["logged"] == 5
    with pytest.raises(ValueError, match="set mine.traffic"):
        MineConfig(strategies=["traffic"])
    log.write_text(log.read_text() + "[1, 2]\n")
    with pytest.raises(MineError, match=f"mine.traffic: {log}:7: not a traffic log line"):
        run_rounds(MineConfig(**base, out_dir=str(tmp_path / "bad")), world["train"], lively, target=target,
                   progress=False)


def test_the_base_stores_weights_are_kept_in_every_rounds_training(world: dict, tmp_path: Path) -> None:
    root, target = world["root"], world["target"]
    ids = sorted(HarvestStore(root / "store").sample_ids)
    zero = set(ids[::2])
    path = tmp_path / "base_weights.json"
    path.write_text(json.dumps({sid: 0.0 for sid in zero}))
    lively = TargetConfig(name_or_path="lively")
    base = dict(draft=str(root / "train" / "final"), store=str(root / "store"), records=[str(world["data"])],
                eval_store=str(root / "val"), eval_records=[str(world["val"])], steps=1, max_new_tokens=8,
                sample_weights=str(path), wandb_mode="disabled")
    # reweight: its domain weights times the base weights; the zeroed samples stay out
    (entry,) = run_rounds(MineConfig(**base, strategies=["reweight"], out_dir=str(tmp_path / "rw")), world["train"],
                          lively, target=target, progress=False)["rounds"]
    weights = json.loads(Path(entry["sample_weights"]).read_text())
    domain_w = entry["added"]["reweight"]["domain_weights"]
    assert {sid for sid, w in weights.items() if w == 0} == zero
    assert any(w != 1.0 for w in domain_w.values()) and all(weights[sid] > 0 for sid in ids if sid not in zero)
    # a round without reweight trains with the base weights as they are (the trainer pins the file)
    pool = record_file(tmp_path / "pool.jsonl", range(300, 304), "p")
    (entry,) = run_rounds(MineConfig(**base, strategies=["uniform"], uniform=2, pool=str(pool),
                                     out_dir=str(tmp_path / "u")), world["train"], lively, target=target,
                          progress=False)["rounds"]
    assert entry["sample_weights"] == str(path)
    path.write_text('{"a": -1}')
    with pytest.raises(MineError, match=f"mine.sample_weights={path}: expected a JSON object"):
        run_rounds(MineConfig(**base, strategies=["reweight"], out_dir=str(tmp_path / "bad")), world["train"], lively,
                   target=target, progress=False)
    assert not (tmp_path / "bad").exists()
