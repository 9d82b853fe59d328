"""Mining rounds: score -> mine -> regenerate + harvest -> continue training, recorded per round.

    python -m hard_mining.rounds --draft runs/train/best --store runs/harvest \\
        --records runs/regen/dataset/regenerated.jsonl \\
        --eval-store runs/val-harvest --eval-records runs/val-regen/dataset/regenerated.jsonl \\
        --pool runs/pools/train.jsonl --eval-sets runs/pools/eval --out runs/mine [--rounds 1] [--steps 60] \\
        [--strategies reweight hardest synthesize]

Each round (``OUT/round-<r>/``):

1. score the current draft on the held-out store (per domain and language: ``before``) and on
   the training stores (what reweighting and synthesis start from);
2. mine, with each strategy of ``mine.strategies``: ``reweight`` writes per-sample weights that
   oversample the domains weak on the held-out store; ``hardest`` regenerates and harvests a short prefix of
   ``candidates`` not-yet-harvested pool prompts, scores them with the draft and keeps the top
   ``keep_fraction`` by ``mine.rank``; ``synthesize`` has the target write variations of the hardest
   training prompts and adds procedural math and code prompts; ``replay`` adds pool prompts to run
   the draft against; ``traffic`` adds the requests of a server's traffic log the deployed draft
   served worst; ``weak`` adds pool prompts split over the domains by their held-out deficit;
   ``uniform`` adds random pool prompts (the control arm of the ablation). New
   prompts are deduplicated against every eval set, the held-out conversations and everything
   harvested so far;
3. regenerate the new prompts fully and harvest them into a store of the round; with ``replay``,
   weigh up the tokens the draft's served rounds rejected in them (``train.loss.token_weights``);
4. continue training from the current draft (its draft vocab frozen) on the base store plus every
   appended store, with the weights, for ``mine.steps`` steps; score the held-out store again
   (``after``).

``OUT/manifest.json`` lists the finished rounds (per-domain and per-language tau before and
after, what each strategy added, the training summary); a rerun skips finished rounds (each
library call resumes its own work). A wandb run (offline by default) gets per-domain tau per
round and a table of the hardest samples.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from data_gen.config import HarvestConfig, RegenerateConfig
from eagle3.atomic import atomic_write_text, output_dir
from eagle3.cli import add_dataclass_arguments, dataclass_from_args
from eagle3.config import TargetConfig, add_target_arguments
from eagle3.conversations import iter_jsonl, take_in_turn
from eagle3.errors import Eagle3Error, run_cli
from eagle3.store.shards import HarvestStore, open_stores
from eagle3.train.config import LossSpec, TrainConfig, updated
from hard_mining.config import MineConfig
from hard_mining.replay import replay_weights, reply_spans, served_rounds
from hard_mining.score import (
    SampleScore,
    group_scores,
    hardest,
    read_sample_meta,
    record_of,
    score_store,
    target_head,
    write_scores,
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
    variation_requests,
    weak_pick,
)

MANIFEST = "manifest.json"


class MineError(Eagle3Error, RuntimeError):
    pass


def read_records(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        for where, record in iter_jsonl(Path(path)):
            if isinstance(record, Exception):
                raise MineError(f"{where}: {record}")
            if not isinstance(record, dict) or "id" not in record:
                raise MineError(f"{where}: a record must be a JSON object with an \"id\"")
            out.append(record)
    return out


def check_records_describe(store: HarvestStore, ids: set[str], key: str) -> None:
    """Every sample of ``store`` must have its record (per-turn samples ``<id>-t<k>``, their
    record's): else its domain is unknown and the per-domain figures mean nothing."""
    missing = [i for i in store.sample_ids if i not in ids and record_of(i) not in ids]
    if missing:
        raise MineError(f"{key}: {len(missing)} of {len(store)} samples of {store.root} have no record there "
                        f"(e.g. {missing[0]!r}); give the regenerated records that store was harvested from")


def write_records(path: Path, records: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def balanced_pick(records: Sequence[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` records, round-robin over domains, each domain in a seeded random order."""
    by_domain: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_domain.setdefault(str(r.get("domain")), []).append(r)
    rng = random.Random(seed)
    queues = []
    for name in sorted(by_domain):
        items = list(by_domain[name])
        rng.shuffle(items)
        queues.append(reversed(items))  # taken from the end, as the seeded order always was
    return take_in_turn(queues, n)


def load_scoring_draft(folder: str | Path, target: Any) -> Any:
    """A draft folder checked against ``target`` (with its embedding), in fp32 on the target's device, for scoring."""
    from eagle3.export import fit_to_target, load_draft

    loaded = load_draft(folder)
    fit_to_target(loaded, target)
    return loaded.draft.to(device=target.device, dtype=torch.float32).eval()


class Harvester:
    """Regenerate + harvest prompt records with the library, into folders under ``root``."""

    def __init__(self, root: Path, target: Any, target_cfg: TargetConfig, like: HarvestStore, seed: int,
                 progress: bool, workers: int = 1, thinking: tuple[str, float] = ("template", 0.5)) -> None:
        self.root, self.target, self.target_cfg, self.seed, self.progress = root, target, target_cfg, seed, progress
        self.workers, self.thinking = workers, thinking
        self.dtype, self.max_seq_len = like.spec.dtype, like.spec.max_seq_len

    def __call__(self, name: str, records: Sequence[dict[str, Any]], max_new_tokens: int,
                 temperature: float = 0.0) -> tuple[Path, Path] | None:
        """-> (store folder, regenerated records file), or None when there is nothing to harvest."""
        from data_gen.harvest import NothingToHarvestError
        from data_gen.harvest import run as harvest
        from data_gen.regenerate import run as regenerate

        if not records:
            return None
        work = self.root / name
        write_records(work / "prompts.jsonl", records)
        regenerate(RegenerateConfig(pool=str(work / "prompts.jsonl"), out_dir=str(work / "regen"),
                                    max_new_tokens=max_new_tokens, temperature=temperature, seed=self.seed,
                                    workers=self.workers, thinking=self.thinking[0],
                                    thinking_on_fraction=self.thinking[1], capture=True,
                                    capture_dtype="bfloat16" if self.dtype == "bfloat16" else "float32"),
                   self.target_cfg, target=self.target, progress=self.progress)
        data = work / "regen" / "dataset" / "regenerated.jsonl"
        if not any(True for _ in iter_jsonl(data)):
            return None
        try:
            harvest(HarvestConfig(data=str(data), out_dir=str(work / "store"), dtype=self.dtype,
                                  max_seq_len=self.max_seq_len), self.target_cfg, target=self.target,
                    progress=self.progress)
        except NothingToHarvestError:  # every reply cut off by max_seq_len: nothing mined this time
            return None
        return work / "store", data


def _groups(scores: Sequence[SampleScore]) -> dict[str, dict[str, Any]]:
    out = {}
    for key in ("all", "domain", "language"):
        out[key] = {name: g.as_dict() for name, g in group_scores(scores, key).items()}
    return out


def _read_traffic(path: str) -> list[dict[str, Any]]:
    """A server's traffic log as prompt records (serve_eval.traffic); a bad log fails naming its line."""
    from serve_eval.traffic import TrafficError, read_traffic

    try:
        return read_traffic(path, min_rounds=4)
    except TrafficError as err:
        raise MineError(f"mine.traffic: {err}") from None


def _eval_set_files(folder: str) -> list[Path]:
    """The eval sets' prompt files that mined prompts are decontaminated against: a folder that is
    missing or holds none would silently let eval prompts into training, so it fails instead."""
    path = Path(folder)
    if not path.is_dir():
        raise MineError(f"mine.eval_sets={folder}: no such folder (the eval sets' *.jsonl, e.g. <pools>/eval); "
                        "mined prompts are checked against them")
    files = sorted(path.glob("*.jsonl"))
    if not files:
        raise MineError(f"mine.eval_sets={folder}: no *.jsonl files in it; mined prompts are checked against them")
    return files


def run_rounds(cfg: MineConfig, train_cfg: TrainConfig, target_cfg: TargetConfig, *, target: Any = None,
               progress: bool = True) -> dict[str, Any]:
    """Run (or resume) ``cfg.rounds`` mining rounds; returns the manifest."""
    for name in ("draft", "store", "eval_store", "out_dir"):
        if not getattr(cfg, name):
            raise MineError(f"mine.{name} must be set")
    needs_pool = {"hardest", "uniform", "weak"} & set(cfg.strategies)
    if needs_pool and not cfg.pool:
        raise MineError(f"mine.pool must be set for strategies {sorted(needs_pool)}")
    with output_dir(cfg.out_dir) as out:  # bad inputs found below leave no empty out_dir
        return _run_rounds(cfg, train_cfg, target_cfg, out, target, progress)


def _read_manifest(cfg: MineConfig, path: Path) -> dict[str, Any]:
    """The run's manifest (a new one if none), refused when written with other settings."""
    manifest: dict[str, Any] = (json.loads(path.read_text()) if path.is_file()
                                else {"config": asdict(cfg), "rounds": []})
    loose = ("rounds", "workers", "wandb_mode", "wandb_project")  # more rounds extend a finished run
    # settings an earlier version did not write are not compared: its runs resume
    pinned = {k: v for k, v in asdict(cfg).items() if k not in loose and k in manifest["config"]}
    changed = sorted(k for k in pinned if manifest["config"][k] != pinned[k])
    if changed:
        raise MineError(f"{path}: written with other settings ({', '.join('mine.' + k for k in changed)}); "
                        "use a new out_dir")
    return manifest


def _run_rounds(cfg: MineConfig, train_cfg: TrainConfig, target_cfg: TargetConfig, out: Path, target: Any,
                progress: bool) -> dict[str, Any]:
    from eagle3.target.model import load_target
    from eagle3.train.data import read_sample_weights
    from eagle3.train.loop import train

    manifest_path = out / MANIFEST
    manifest = _read_manifest(cfg, manifest_path)
    base = HarvestStore(Path(cfg.store))
    eval_store = HarvestStore(Path(cfg.eval_store))
    if target is None:
        target = load_target(target_cfg.name_or_path, dtype=target_cfg.dtype, device=target_cfg.device,
                             aux_layer_ids=base.spec.aux_layer_ids, nvfp4_mode=target_cfg.nvfp4_mode)
    base.check_target(target)
    eval_store.check_target(target)
    head = target_head(target)
    records = read_records(cfg.records)
    eval_records = read_records(cfg.eval_records)
    check_records_describe(base, {str(x["id"]) for x in records}, "mine.records")
    check_records_describe(eval_store, {str(x["id"]) for x in eval_records}, "mine.eval_records")
    eval_sets = read_records(_eval_set_files(cfg.eval_sets)) if cfg.eval_sets else []
    pool = read_records([cfg.pool]) if cfg.pool else []
    traffic = _read_traffic(cfg.traffic) if "traffic" in cfg.strategies else []
    run = _wandb(cfg, out)

    draft_dir = Path(cfg.draft)
    stores: list[str] = []  # appended by earlier rounds
    weights_file: str | None = cfg.sample_weights or None  # the base weights until reweight writes its own
    base_weights = read_sample_weights(cfg.sample_weights, "mine.sample_weights", MineError)
    token_weights: str | None = None  # error replay's, carried from round to round
    harvested_ids = {str(r["id"]) for r in records}
    for done in manifest["rounds"]:
        draft_dir, stores, weights_file = Path(done["draft"]), done["stores"], done["sample_weights"]
        token_weights = done.get("token_weights")
        harvested_ids |= set(done["added_ids"])
        records += read_records(done["added_records"])

    for r in range(len(manifest["rounds"]) + 1, cfg.rounds + 1):
        started = time.perf_counter()
        rdir = out / f"round-{r}"
        seed = cfg.seed * 1000 + r
        meta = read_sample_meta([*cfg.records, *cfg.eval_records]) | {
            str(x["id"]): {"domain": str(x.get("domain")), "language": str(x.get("language"))} for x in records}
        draft = load_scoring_draft(draft_dir, target)
        before = score_store(draft, head, eval_store, meta, ttt_steps=train_cfg.ttt_steps, progress=progress)
        train_store = open_stores([cfg.store, *stores])
        train_scores = score_store(draft, head, train_store, meta, ttt_steps=train_cfg.ttt_steps, progress=progress)
        write_scores(rdir / "scores_eval_before.jsonl", before)
        write_scores(rdir / "scores_train.jsonl", train_scores)

        rd = _Round(cfg=cfg, dir=rdir, seed=seed, draft=draft, head=head, ttt_steps=train_cfg.ttt_steps,
                    train_scores=train_scores, before=before, records=records,
                    known=[*eval_sets, *eval_records, *records],
                    fresh=[p for p in pool if str(p.get("id")) not in harvested_ids],
                    traffic=[t for t in traffic if str(t["id"]) not in harvested_ids],
                    harvester=Harvester(rdir, target, target_cfg, base, seed, progress, cfg.workers, cfg.mode),
                    base_weights=base_weights)
        new_records, added, weights_file = _mine(rd, weights_file)
        round_stores, added_records, token_weights = _harvest_mined(rd, new_records, stores, added, token_weights)
        records += read_records(added_records)

        summary = train(updated(train_cfg, {
            "data.mode": "offline", "data.store": cfg.store, "data.extra_stores": round_stores,
            "data.sample_weights": weights_file, "loss.token_weights": token_weights, "init.draft": str(draft_dir),
            "steps": cfg.steps, "optim.lr": cfg.lr if cfg.lr is not None else train_cfg.optim.lr / 4,
            "out_dir": str(rdir / "train"), "data.eval_store": cfg.eval_store, "data.eval_fraction": 0.0,
            "seed": train_cfg.seed + r, "resume": True, "log.wandb_mode": "disabled"}), target_cfg, target=target)
        new_draft = rdir / "train" / "final"
        after = score_store(load_scoring_draft(new_draft, target), head, eval_store, meta,
                            ttt_steps=train_cfg.ttt_steps, progress=progress)
        write_scores(rdir / "scores_eval_after.jsonl", after)
        entry = {
            "round": r, "draft_before": str(draft_dir), "draft": str(new_draft), "stores": round_stores,
            "sample_weights": weights_file, "token_weights": token_weights, "added": added,
            "added_records": added_records,
            "added_ids": [str(x["id"]) for x in new_records],
            "before": _groups(before), "after": _groups(after),
            "train": {k: summary.get(k) for k in ("steps", "tokens_per_s", "train_samples", "eval_last")},
            "hardest_train": [s.as_dict() | {"accepted": None}
                              for s in hardest(train_scores, 10, rank=cfg.rank, confidence=cfg.confidence)],
            "seconds": round(time.perf_counter() - started, 1),
        }
        manifest["rounds"].append(entry)
        atomic_write_text(manifest_path, json.dumps(manifest, indent=1) + "\n")
        _log_round(run, entry, {str(x["id"]): x for x in records})
        draft_dir, stores = new_draft, round_stores
        harvested_ids |= set(entry["added_ids"])
        if progress:
            b, a = entry["before"]["all"]["all"]["tau_sim"], entry["after"]["all"]["all"]["tau_sim"]
            print(f"mine: round {r}: held-out tau_sim {b} -> {a}; added {len(new_records)} prompts", file=sys.stderr)
    if run is not None:
        run.finish()
    return manifest


@dataclass
class _Round:
    """What one round's strategies read: its settings, folder and seed, the draft it scores with,
    the scores before mining, the records so far, what new prompts must not repeat, the unmined pool."""

    cfg: MineConfig
    dir: Path
    seed: int
    draft: Any
    head: Any
    ttt_steps: int
    train_scores: list[SampleScore]
    before: list[SampleScore]
    records: list[dict[str, Any]]
    known: list[dict[str, Any]]
    fresh: list[dict[str, Any]]
    traffic: list[dict[str, Any]]
    harvester: Harvester
    base_weights: dict[str, float]


def _mine(rd: _Round, weights_file: str | None) -> tuple[list[dict[str, Any]], dict[str, Any], str | None]:
    """Each strategy of the round in turn -> (new prompt records, what each added, the sample weights file)."""
    cfg = rd.cfg
    added: dict[str, Any] = {}
    new_records: list[dict[str, Any]] = []
    if "reweight" in cfg.strategies:
        weights_file, added["reweight"] = _reweight(rd)
    if "hardest" in cfg.strategies and cfg.candidates:
        keep, added["hardest"] = _hardest(rd)
        new_records += keep
    if "synthesize" in cfg.strategies:
        kept, added["synthesize"] = _synthesize(rd, new_records)
        new_records += kept
    if "replay" in cfg.strategies and cfg.replay_prompts:
        picked = balanced_pick(_not_taken(rd.fresh, new_records), cfg.replay_prompts, rd.seed + 500_000)
        added["replay"] = _add(rd, new_records, picked)[1]
    if "traffic" in cfg.strategies and cfg.traffic_prompts:
        n = min(cfg.traffic_prompts, len(rd.traffic))
        picked = (sorted(rd.traffic, key=lambda t: (t["meta"]["served_tau"], t["id"]))[:n]
                  if cfg.traffic_pick == "lowest_tau" else random.Random(rd.seed).sample(rd.traffic, n))
        kept, info = _add(rd, new_records, picked)
        added["traffic"] = {"logged": len(rd.traffic), **info, "served_tau": [t["meta"]["served_tau"] for t in kept]}
    if "weak" in cfg.strategies and cfg.weak:
        w = domain_weights(group_scores(rd.before, "domain"), power=cfg.weight_power)
        picked, split = weak_pick(_not_taken(rd.fresh, new_records), cfg.weak, w, rd.seed + 700_000)
        added["weak"] = {**_add(rd, new_records, picked)[1], "per_domain": split}
    if "uniform" in cfg.strategies and cfg.uniform:
        picked = random.Random(rd.seed).sample(rd.fresh, min(cfg.uniform, len(rd.fresh)))
        added["uniform"] = _add(rd, new_records, picked)[1]
    return new_records, added, weights_file


def _not_taken(pool: list[dict[str, Any]], new_records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prompts of ``pool`` that an earlier strategy of the round has not added already."""
    taken = {str(x["id"]) for x in new_records}
    return [p for p in pool if str(p.get("id")) not in taken]


def _add(rd: _Round, new_records: list[dict[str, Any]],
         picked: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``picked`` prompts deduplicated against what is known and this round's new ones, the kept
    appended to ``new_records`` -> (the kept, what was picked, kept and dropped)."""
    kept, dropped = dedupe(picked, [*rd.known, *new_records])
    new_records += kept
    return kept, {"picked": len(picked), "kept": len(kept), "dropped": dropped}


def _reweight(rd: _Round) -> tuple[str, dict[str, Any]]:
    """Weak where it matters: domain weights from the held-out acceptance (the training set is already fitted)."""
    counts: dict[str, int] = {}
    for sc in rd.train_scores:
        counts[sc.domain] = counts.get(sc.domain, 0) + 1
    w = domain_weights(group_scores(rd.before, "domain"), power=rd.cfg.weight_power, counts=counts)
    weights = {k: round(v * rd.base_weights.get(k, 1.0), 6) for k, v in sample_weights(rd.train_scores, w).items()}
    weights_file = str(rd.dir / "sample_weights.json")
    atomic_write_text(Path(weights_file), json.dumps(weights, indent=0))
    return weights_file, {"domain_weights": {k: round(v, 4) for k, v in w.items()}}


def _hardest(rd: _Round) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Pool prompts scored cheaply (short regenerations), the hardest fraction per domain kept."""
    cfg = rd.cfg
    cands, dropped = dedupe(balanced_pick(rd.fresh, cfg.candidates, rd.seed), rd.known)
    got = rd.harvester("candidates", cands, cfg.candidate_tokens)
    keep: list[dict[str, Any]] = []
    if got is not None:
        cand_meta = {str(x["id"]): {"domain": str(x.get("domain")), "language": str(x.get("language"))}
                     for x in cands}
        cand_scores = score_store(rd.draft, rd.head, HarvestStore(got[0]), cand_meta, ttt_steps=rd.ttt_steps)
        write_scores(rd.dir / "scores_candidates.jsonl", cand_scores)
        ids = set(pick_hardest(per_record(cand_scores), cfg.keep_fraction, rank=cfg.rank,
                               confidence=cfg.confidence))  # a fraction of the records
        keep = [x for x in cands if str(x["id"]) in ids]
    return keep, {"candidates": len(cands), "kept": len(keep), "dropped": dropped}


def _harvest_mined(rd: _Round, new_records: list[dict[str, Any]], stores: list[str], added: dict[str, Any],
                   token_weights: str | None) -> tuple[list[str], list[str], str | None]:
    """The round's new prompts regenerated in full and harvested into its store -> (the stores to train
    on, the regenerated records added, the token weights file: error replay's where it runs)."""
    new_store = rd.harvester("mined", new_records, rd.cfg.max_new_tokens)
    if new_store is None:
        return list(stores), [], token_weights
    if "replay" in rd.cfg.strategies:
        token_weights, added["replay_tokens"] = _replay_weights(rd, HarvestStore(new_store[0]), token_weights)
    return [*stores, str(new_store[0])], [str(new_store[1])], token_weights


def _replay_weights(rd: _Round, store: HarvestStore, carried: str | None) -> tuple[str, dict[str, Any]]:
    """Error replay: the round's new conversations scored by the draft they were mined for; the tokens
    its served rounds rejected weighted ``replay_weight`` (hard_mining.replay), merged with the
    earlier rounds' weights into the round's ``token_weights.json``."""
    scores = score_store(rd.draft, rd.head, store, {}, ttt_steps=rd.ttt_steps)
    spans = {sid: reply_spans(store[i].loss_mask) for i, sid in enumerate(store.sample_ids)}
    weights = json.loads(Path(carried).read_text()) if carried else {}
    rounds = {s.sample_id: served_rounds(s, spans[s.sample_id], rd.ttt_steps) for s in scores}
    new = replay_weights(rounds, rd.cfg.replay_weight)
    weights.update(new)
    path = rd.dir / "token_weights.json"
    atomic_write_text(path, json.dumps(weights))
    return str(path), {"samples": len(new), "rounds": sum(len(r) for r in rounds.values()),
                       "rejected": sum(len(v) for v in new.values()), "weight": rd.cfg.replay_weight}


def _synthesize(rd: _Round, so_far: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Variations of the hardest training prompts written by the target, plus procedural math and code."""
    cfg = rd.cfg
    by_id = {str(x["id"]): x for x in rd.records}
    worst = hardest(rd.train_scores, 4 * cfg.hard_examples, rank=cfg.rank, confidence=cfg.confidence)
    parent_ids = dict.fromkeys(record_of(s.sample_id) for s in worst)
    parents = [by_id[i] for i in parent_ids if i in by_id][: cfg.hard_examples]  # one per record
    made: list[dict[str, Any]] = []
    asked = variation_requests(parents, cfg.variations)
    got = rd.harvester("variations", asked, cfg.variation_tokens, temperature=0.8) if asked else None
    if got is not None:
        for rec in read_records([got[1]]):
            text = parse_variation(next(m["content"] for m in rec["messages"] if m["role"] == "assistant"))
            if text:
                made.append(prompt_record(text, str(rec.get("domain")), str(rec.get("language")),
                                          "mined-variation", {"parent": rec["meta"]["parent"]}))
    made += math_problems(cfg.procedural, rd.seed) + code_tasks(cfg.procedural, rd.seed)
    kept, dropped = dedupe(made, [*rd.known, *so_far])
    return kept, {"hard_parents": len(parents), "variations_asked": len(asked), "made": len(made),
                  "kept": len(kept), "dropped": dropped}


def _wandb(cfg: MineConfig, out: Path) -> Any:
    if cfg.wandb_mode == "disabled":
        return None
    import wandb

    from eagle3.dashboards import define_metrics

    (out / "wandb").mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=cfg.wandb_project, name=f"mine-{out.name}", dir=str(out), mode=cfg.wandb_mode,
                     job_type="mine", config=asdict(cfg), settings=wandb.Settings(console="off", silent=True))
    define_metrics(run, "mine")
    return run


def _log_round(run: Any, entry: dict[str, Any], records: dict[str, dict[str, Any]]) -> None:
    if run is None:
        return
    import wandb

    metrics: dict[str, Any] = {"mine/round": entry["round"]}
    for when in ("before", "after"):
        for key in ("all", "domain", "language"):
            for name, g in entry[when][key].items():
                metrics[f"mine/{when}/{key}/{name}/tau_sim"] = g["tau_sim"]
    columns = ["round", "sample_id", "domain", "language", "tau_sim", "loss", "positions", "prompt"]
    rows = []
    for s in entry["hardest_train"]:
        rec = records.get(record_of(s["sample_id"]), {})
        prompt = next((m["content"] for m in rec.get("messages", []) if m["role"] == "user"), "")
        rows.append([entry["round"], s["sample_id"], s["domain"], s["language"], s["tau_sim"], round(s["loss"], 4),
                     s["positions"], prompt[:300]])
    metrics["mine/hardest"] = wandb.Table(columns=columns, data=rows)
    run.log(metrics)


def continued_training(recipe: str, **settings: Any) -> TrainConfig:
    """The train settings of the rounds' continued training outside the pipeline: a draft recipe
    (:func:`eagle3.train.config.draft_recipe`, ``none`` for the library's defaults), then ``settings``
    (dotted keys: ``**{"optim.lr": 1e-3}``)."""
    from eagle3.train.config import draft_recipe, train_config

    return train_config({**draft_recipe(recipe), **settings})


def build_parser() -> argparse.ArgumentParser:
    """Every MineConfig field a flag (its docstring the help), the target's, and the continued training's."""
    parser = argparse.ArgumentParser(prog="python -m hard_mining.rounds", description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    add_dataclass_arguments(parser, MineConfig, aliases={"out_dir": "--out"}, required=(
        "draft", "store", "records", "eval_store", "eval_records", "eval_sets", "out_dir"))
    # the continued training's settings: a draft recipe, as the pipeline's draft=<name>
    parser.add_argument("--recipe", default="target-head",
                        help="recipes/draft/NAME.yaml (optimizer, step weights, lr...; default the pipeline's), "
                             "or none for the library's defaults")
    parser.add_argument("--ttt-steps", type=int, default=TrainConfig.ttt_steps)
    parser.add_argument("--loss-positions", default=LossSpec.positions, help="assistant or all")
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--precision", default="auto", help="fp32, bf16 or auto (bf16 where it is the faster)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("hard_mining", _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = dataclass_from_args(MineConfig, args)
    train_cfg = continued_training(args.recipe, **{
        "data.store": args.store, "out_dir": args.out_dir, "ttt_steps": args.ttt_steps,
        "loss.positions": args.loss_positions, "optim.warmup_steps": max(1, args.steps // 20),
        "data.micro_batch_tokens": args.micro_batch_tokens, "data.batching": "buckets", "precision": args.precision,
        "eval_every": 0, "save_every": 0, "log.progress": not args.no_progress, "threads": args.threads})
    target_cfg = TargetConfig(name_or_path=args.target, dtype=args.target_dtype, device=args.device)
    manifest = run_rounds(cfg, train_cfg, target_cfg, progress=not args.no_progress)
    for entry in manifest["rounds"]:
        print(json.dumps({"stage": "mine", "round": entry["round"],
                          "tau_before": entry["before"]["all"]["all"]["tau_sim"],
                          "tau_after": entry["after"]["all"]["all"]["tau_sim"],
                          "domain_before": {k: v["tau_sim"] for k, v in entry["before"]["domain"].items()},
                          "domain_after": {k: v["tau_sim"] for k, v in entry["after"]["domain"].items()},
                          "added": entry["added"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
