"""Does mining help at equal compute? Mined rounds vs the uniform mixture, >= 2 seeds, held-out tau
per domain with bootstrap confidence intervals.

    OMP_NUM_THREADS=1 .venv/bin/python bench/studies/mining_ablation.py --draft runs/race/bench/ours/final \\
        --store runs/race/harvest --records runs/race/regenerate/dataset/regenerated.jsonl \\
        --eval-store runs/race/val/harvest --eval-records runs/race/val/regenerate/dataset/regenerated.jsonl \\
        --pool runs/race/pools/train.jsonl --eval-sets runs/race/pools/eval --out runs/ablation \\
        [--seeds 0 1] [--steps 90]

Both arms start from the same draft and continue training for the same number of steps at the
same tokens per step (the tokens actually trained are printed), on the base store plus what the
arm added: ``mined`` = reweight + hardest candidates + synthesised prompts (``hard_mining``
defaults), ``uniform`` = as many random pool prompts as the mined arm of the same seed added,
no weights. Every (arm, seed) is a separate ``hard_mining.rounds`` run (resumable).

One JSON line per (arm, group): held-out tau_sim (K = the TTT steps) per seed, their mean, and a
95% bootstrap interval (samples resampled with replacement, the same draws for both arms and
every seed; the statistic is the mean over seeds of the pooled tau); then the paired difference
mined - uniform with its interval. Goal of the issue: the weakest domain +10% tau, overall not
worse.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from eagle3.config import DEFAULT_TARGET

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("--draft", "--store", "--eval-store", "--pool", "--out"):
        parser.add_argument(name, required=True)
    parser.add_argument("--records", nargs="+", required=True)
    parser.add_argument("--eval-records", nargs="+", required=True)
    parser.add_argument("--eval-sets", default="")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--candidates", type=int, default=64)
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
    train_cfg = continued_training(args.recipe, store=args.store, out_dir=str(out), ttt_steps=args.ttt_steps,
                                   lr=args.lr, warmup_steps=max(1, args.steps // 20), micro_batch_tokens=2048,
                                   batching="buckets", precision="auto", eval_every=0, save_every=0, progress=False)
    common = dict(draft=args.draft, store=args.store, records=args.records, eval_store=args.eval_store,
                  eval_records=args.eval_records, pool=args.pool, eval_sets=args.eval_sets, rounds=1,
                  steps=args.steps, candidates=args.candidates, wandb_mode="offline")
    after: dict[str, list[list[dict[str, Any]]]] = {"mined": [], "uniform": []}
    before: list[dict[str, Any]] = []
    for seed in args.seeds:
        tcfg = replace(train_cfg, seed=100 * seed)
        mined = run_rounds(MineConfig(**common, out_dir=str(out / f"mined-{seed}"), seed=seed), tcfg, target_cfg,
                           target=target, progress=False)
        added = len(mined["rounds"][0]["added_ids"])
        uniform = run_rounds(MineConfig(**common, out_dir=str(out / f"uniform-{seed}"), seed=seed,
                                        strategies=["uniform"], uniform=added), tcfg, target_cfg, target=target,
                             progress=False)
        for arm, manifest in (("mined", mined), ("uniform", uniform)):
            entry = manifest["rounds"][0]
            print(json.dumps({"figure": "mining_arm", "arm": arm, "seed": seed,
                              "added_prompts": len(entry["added_ids"]), "added": entry["added"],
                              "train": entry["train"], "seconds": entry["seconds"]}), flush=True)
            after[arm].append(load_scores(out / f"{arm}-{seed}" / "round-1" / "scores_eval_after.jsonl"))
        before = load_scores(out / f"mined-{seed}" / "round-1" / "scores_eval_before.jsonl")

    n = len(before)
    g = torch.Generator().manual_seed(0)
    draws = torch.randint(0, n, (args.bootstrap, n), generator=g)
    groups = [None, *sorted({r["domain"] for r in before})]
    for group in groups:
        name = group or "overall"
        base = pooled_tau([r for r in before if group is None or r["domain"] == group])
        for arm in ("mined", "uniform"):
            per_seed = [pooled_tau([r for r in s if group is None or r["domain"] == group]) for s in after[arm]]
            lo, hi = bootstrap(after[arm], group, draws)
            print(json.dumps({"figure": "mining_tau", "group": name, "arm": arm, "before": round(base, 4),
                              "per_seed": [round(t, 4) for t in per_seed],
                              "mean": round(sum(per_seed) / len(per_seed), 4), "ci95": [round(lo, 4), round(hi, 4)],
                              "samples": sum(1 for r in before if group is None or r["domain"] == group)}),
                  flush=True)
        d, lo, hi = paired_diff(after["mined"], after["uniform"], group, draws)
        ref = sum(pooled_tau([r for r in s if group is None or r["domain"] == group]) for s in after["uniform"]) \
            / len(after["uniform"])
        print(json.dumps({"figure": "mining_diff", "group": name, "mined_minus_uniform": round(d, 4),
                          "ci95": [round(lo, 4), round(hi, 4)], "relative": round(d / ref, 4) if ref else None}),
              flush=True)


if __name__ == "__main__":
    main()
