"""Does mining help at equal compute? Arms of mining strategies against the uniform mixture, >= 2
seeds, held-out tau per domain with bootstrap confidence intervals.

    OMP_NUM_THREADS=1 .venv/bin/python bench/studies/mining_ablation.py --draft runs/race/bench/ours/final \\
        --store runs/race/harvest --records runs/race/regenerate/dataset/regenerated.jsonl \\
        --eval-store runs/race/val/harvest --eval-records runs/race/val/regenerate/dataset/regenerated.jsonl \\
        --pool runs/race/pools/train.jsonl --eval-sets runs/race/pools/eval --out runs/ablation \\
        [--seeds 0 1] [--steps 90] [--added 16] [--arms uniform learnable replay hard-tokens ...]

Every arm starts from the same draft and continues training for the same number of steps at the same
tokens per step on the base store plus the ``--added`` prompts it chose (regenerated in full and
harvested), so every arm trains at the same compute; what differs is which prompts, and how the loss
weighs their tokens (:data:`ARMS`): ``uniform`` random pool prompts (the control); ``loss``,
``excess``, ``learnable`` the top quarter of 4x as many candidates by raw loss, by the loss above the
target's entropy, by confident misses (``mine.rank``); ``replay`` random prompts whose rejected tokens
are weighted up (error replay); ``hard-tokens`` uniform prompts with high-entropy positions
down-weighted in the loss (``train.loss.hard_tokens``); ``learnable-replay`` and ``all`` combine them;
``mined`` the old default (reweight + hardest by loss + synthesize; it adds its own count, so it
gets its own matched uniform control, ``uniform-matched``). Every (arm, seed) is a separate
``hard_mining.rounds`` run (resumable).

One JSON line per (arm, group): held-out tau_sim (K = the TTT steps) per seed, their mean, and a
95% bootstrap interval (samples resampled with replacement, the same draws for every arm and
seed; the statistic is the mean over seeds of the pooled tau); then per arm against its control
the paired difference with its interval and the ratio of (tau - 1). The goal: the best
arm's (tau - 1) >= 1.10x uniform's overall and >= 1.15x on the weakest domain (the lowest before
the round), the difference's interval above 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from eagle3.config import DEFAULT_TARGET
from eagle3.train.config import updated

ROOT = Path(__file__).resolve().parents[2]


def load_scores(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pooled_tau(rows: list[dict[str, Any]]) -> float:
    starts = sum(r["positions"] for r in rows)
    return 1.0 + sum(sum(r["accepted"]) for r in rows) / starts if starts else float("nan")


def bootstrap(per_seed: list[list[dict[str, Any]]], group: str | None, draws: torch.Tensor) -> tuple[float, float]:
    """95% interval of the mean over seeds of the pooled tau of ``group`` (None: all samples);
    ``draws`` [B, N] indices into the held-out samples (shared, so arms are paired)."""
    stats = []
    for row in draws.tolist():
        taus = []
        for scores in per_seed:
            picked = [scores[i] for i in row if group is None or scores[i]["domain"] == group]
            taus.append(pooled_tau(picked))
        stats.append(sum(taus) / len(taus))
    t = torch.tensor(stats).nan_to_num(nan=0.0)
    return float(t.quantile(0.025)), float(t.quantile(0.975))


def paired_diff(a: list[list[dict]], b: list[list[dict]], group: str | None,
                draws: torch.Tensor) -> tuple[float, float, float]:
    def stat(rows_a: list[list[dict]], rows_b: list[list[dict]], idx: list[int]) -> float:
        ta = [pooled_tau([s[i] for i in idx if group is None or s[i]["domain"] == group]) for s in rows_a]
        tb = [pooled_tau([s[i] for i in idx if group is None or s[i]["domain"] == group]) for s in rows_b]
        return sum(ta) / len(ta) - sum(tb) / len(tb)

    n = len(a[0])
    point = stat(a, b, list(range(n)))
    t = torch.tensor([stat(a, b, row) for row in draws.tolist()]).nan_to_num(nan=0.0)
    return point, float(t.quantile(0.025)), float(t.quantile(0.975))


ARMS = ("uniform", "weak", "loss", "excess", "learnable", "replay", "hard-tokens", "learnable-replay", "all",
        "mined", "uniform-matched")
CONTROL = {"mined": "uniform-matched"}
"""An arm's control where it is not ``uniform``."""


def arm_settings(arm: str, added: int, matched: int | None, hard_entropy: float,
                 replay_weight: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(mine settings, continued-training settings) of an arm adding ``added`` prompts."""
    hardest = {"candidates": 4 * added, "keep_fraction": 0.25}
    hard_tokens = {"loss.hard_tokens": "downweight", "loss.hard_token_entropy": hard_entropy,
                   "loss.hard_token_weight": 0.0}
    arms: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "uniform": ({"strategies": ["uniform"], "uniform": added}, {}),
        "weak": ({"strategies": ["weak"], "weak": added}, {}),
        "loss": ({"strategies": ["hardest"], "rank": "loss", **hardest}, {}),
        "excess": ({"strategies": ["hardest"], "rank": "excess", **hardest}, {}),
        "learnable": ({"strategies": ["hardest"], "rank": "missed_confident", **hardest}, {}),
        "replay": ({"strategies": ["replay"], "replay_prompts": added, "replay_weight": replay_weight}, {}),
        "hard-tokens": ({"strategies": ["uniform"], "uniform": added}, hard_tokens),
        "learnable-replay": ({"strategies": ["hardest", "replay"], "rank": "missed_confident", "replay_prompts": 0,
                              "replay_weight": replay_weight, **hardest}, {}),
        "all": ({"strategies": ["hardest", "replay"], "rank": "missed_confident", "replay_prompts": 0,
                 "replay_weight": replay_weight, **hardest}, hard_tokens),
        "mined": ({"strategies": ["reweight", "hardest", "synthesize"], "rank": "loss", "candidates": 64}, {}),
    }
    if arm == "uniform-matched":
        if matched is None:
            raise SystemExit("--arms: uniform-matched follows mined (it adds as many prompts as mined did)")
        return {"strategies": ["uniform"], "uniform": matched}, {}
    if arm not in arms:
        raise SystemExit(f"--arms: {arm!r} is not one of {', '.join(ARMS)}")
    return arms[arm]


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a mining study's data (shared with ``traffic_shift.py``): the training store and its
    records, the held-out store and its records, the pool, the output folder, the target, the seeds."""
    for name in ("--store", "--eval-store", "--pool", "--out"):
        parser.add_argument(name, required=True)
    parser.add_argument("--records", nargs="+", required=True)
    parser.add_argument("--eval-records", nargs="+", required=True)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--heldout-store", default="",
                        help="score the drafts (each arm's, and the one they start from) on this held-out store "
                             "instead of the rounds' --eval-store, e.g. a larger one built after the runs; the "
                             "scores are cached beside each run")
    parser.add_argument("--heldout-records", nargs="+", default=[])


class HeldOut:
    """Where a study's figures come from: each run's own held-out scores (``--eval-store``, scored by
    the round), or with ``--heldout-store`` the drafts scored again on that store (cached per store)."""

    def __init__(self, args: argparse.Namespace, target: Any, ttt_steps: int) -> None:
        self.store_path, self.target, self.ttt_steps = args.heldout_store, target, ttt_steps
        self.scored: dict[str, list[Any]] = {}
        if not self.store_path:
            return
        from eagle3.store.shards import HarvestStore
        from hard_mining.rounds import check_records_describe
        from hard_mining.score import read_sample_meta

        if not args.heldout_records:
            raise SystemExit("--heldout-store: give --heldout-records (the records it was harvested from)")
        self.store = HarvestStore(Path(self.store_path))
        self.meta = read_sample_meta(args.heldout_records)
        check_records_describe(self.store, set(self.meta), "--heldout-records")
        manifest = (Path(self.store_path) / "manifest.json").read_bytes()
        self.key = hashlib.sha256(str(Path(self.store_path).resolve()).encode() + manifest).hexdigest()[:12]

    def scores(self, run: Path, which: str) -> list[dict[str, Any]]:
        """Run ``run``'s held-out scores, ``which`` "before" (the draft it started from) or "after"."""
        if not self.store_path:
            return load_scores(run / "round-1" / f"scores_eval_{which}.jsonl")
        cached = run / "round-1" / f"scores_heldout_{which}_{self.key}.jsonl"
        if not cached.is_file():
            from hard_mining.rounds import load_scoring_draft
            from hard_mining.score import score_store, target_head, write_scores

            manifest = json.loads((run / "manifest.json").read_text())
            draft = str(Path(manifest["config"]["draft"] if which == "before" else manifest["rounds"][0]["draft"])
                        .resolve())
            if draft not in self.scored:  # the arms share the draft they start from: scored once
                self.scored[draft] = score_store(load_scoring_draft(draft, self.target), target_head(self.target),
                                                 self.store, self.meta, ttt_steps=self.ttt_steps)
            write_scores(cached, self.scored[draft])
        return load_scores(cached)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_arguments(parser)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--eval-sets", default="")
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--added", type=int, default=16, help="prompts every arm adds (mined: its own count)")
    parser.add_argument("--arms", nargs="+", default=["uniform", "learnable", "replay", "hard-tokens"],
                        help=f"of {', '.join(ARMS)}; uniform-matched after mined")
    parser.add_argument("--hard-token-entropy", type=float, default=3.0,
                        help="hard-tokens and all: positions above this target entropy (nats) leave the loss")
    parser.add_argument("--replay-weight", type=float, default=3.0)
    parser.add_argument("--recipe", default="none",
                        help="draft recipe of the continued training (recipes/draft/NAME.yaml; none: the library's "
                             "defaults, which the figures in docs/mining.md used)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--bootstrap", type=int, default=2000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from eagle3.config import TargetConfig
    from eagle3.target.model import load_target
    from hard_mining.config import MineConfig
    from hard_mining.rounds import continued_training, run_rounds

    out = Path(args.out)
    target_cfg = TargetConfig(name_or_path=args.target)
    from eagle3.store.shards import HarvestStore

    target = load_target(args.target, dtype="float32", device="cpu",
                         aux_layer_ids=HarvestStore(Path(args.store)).spec.aux_layer_ids)
    train_cfg = continued_training(args.recipe, **{"data.store": args.store, "optim.lr": args.lr,
                                                   "optim.warmup_steps": max(1, args.steps // 20),
                                                   "data.micro_batch_tokens": 2048, "data.batching": "buckets",
                                                   "log.progress": False}, out_dir=str(out), ttt_steps=args.ttt_steps,
                                                   precision="auto", eval_every=0, save_every=0)
    common = dict(draft=args.draft, store=args.store, records=args.records, eval_store=args.eval_store,
                  eval_records=args.eval_records, pool=args.pool, eval_sets=args.eval_sets, rounds=1,
                  steps=args.steps, wandb_mode="offline")
    heldout = HeldOut(args, target, args.ttt_steps)
    after: dict[str, list[list[dict[str, Any]]]] = {}
    before: list[dict[str, Any]] = []
    for seed in args.seeds:
        tcfg = replace(train_cfg, seed=100 * seed)
        matched = None
        for arm in args.arms:
            mine, train_kw = arm_settings(arm, args.added, matched, args.hard_token_entropy, args.replay_weight)
            manifest = run_rounds(MineConfig(**common, **mine, out_dir=str(out / f"{arm}-{seed}"), seed=seed),
                                  updated(tcfg, train_kw), target_cfg, target=target, progress=False)
            entry = manifest["rounds"][0]
            if arm == "mined":
                matched = len(entry["added_ids"])
            print(json.dumps({"figure": "mining_arm", "arm": arm, "seed": seed,
                              "added_prompts": len(entry["added_ids"]), "added": entry["added"],
                              "train": entry["train"], "seconds": entry["seconds"]}), flush=True)
            after.setdefault(arm, []).append(heldout.scores(out / f"{arm}-{seed}", "after"))
            before = heldout.scores(out / f"{arm}-{seed}", "before")

    n = len(before)
    g = torch.Generator().manual_seed(0)
    draws = torch.randint(0, n, (args.bootstrap, n), generator=g)
    domains = sorted({r["domain"] for r in before})
    weakest = min(domains, key=lambda d: pooled_tau([r for r in before if r["domain"] == d]))
    for group in [None, *domains]:
        name = group or "overall"
        base = pooled_tau([r for r in before if group is None or r["domain"] == group])
        mean = {}
        for arm in after:
            per_seed = [pooled_tau([r for r in s if group is None or r["domain"] == group]) for s in after[arm]]
            mean[arm] = sum(per_seed) / len(per_seed)
            lo, hi = bootstrap(after[arm], group, draws)
            print(json.dumps({"figure": "mining_tau", "group": name, "weakest": group == weakest, "arm": arm,
                              "before": round(base, 4), "per_seed": [round(t, 4) for t in per_seed],
                              "mean": round(mean[arm], 4), "ci95": [round(lo, 4), round(hi, 4)],
                              "samples": sum(1 for r in before if group is None or r["domain"] == group)}),
                  flush=True)
        for arm in after:
            control = CONTROL.get(arm, "uniform")
            if arm == control or control not in after:
                continue
            d, lo, hi = paired_diff(after[arm], after[control], group, draws)
            gain = (mean[arm] - 1) / (mean[control] - 1) if mean[control] > 1 else None
            print(json.dumps({"figure": "mining_diff", "group": name, "weakest": group == weakest, "arm": arm,
                              "control": control, "minus_control": round(d, 4), "ci95": [round(lo, 4), round(hi, 4)],
                              "gain_ratio": round(gain, 4) if gain is not None else None}), flush=True)


if __name__ == "__main__":
    main()
