"""Teacher-forced acceptance of several drafts on one harvest store, per domain and language.

    OMP_NUM_THREADS=1 .venv/bin/python tools/score_drafts.py --store runs/mirror/store \\
        --records runs/mirror/regen/dataset/regenerated.jsonl --draft ours=DIR --draft speculators=DIR

Every draft (any format ``eagle3.export.load_draft`` reads: ours, vLLM plain, speculators) runs
the training-time-test unroll over every sample (``hard_mining.score``): tau_sim = 1 + mean
accepted run of K draft tokens per assistant position, against the target's argmax. One JSON
line per draft: overall, per domain, per language, per context length (the tokens before a start's
first draft token, in the serving reports' buckets), and the loss.

Built to rank drafts quickly between vLLM judge runs: a store harvested from the judge's own
prompts, with the target's greedy replies (``data_gen.regenerate --temperature 0`` on those
prompts, then ``data_gen.harvest``), ranks drafts per eval set as the judge does, in about a
minute per draft instead of ten.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from eagle3.export import fit_to_target, load_draft  # noqa: E402
from eagle3.store.shards import HarvestStore  # noqa: E402
from eagle3.target.model import load_target  # noqa: E402
from hard_mining.score import group_by_context, group_scores, read_sample_meta, score_store, target_head  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="harvest store")
    parser.add_argument("--records", nargs="+", required=True,
                        help="the conversation records the store was harvested from (domain, language)")
    parser.add_argument("--draft", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--target", default=None, help="default: the store's target")
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    args = parser.parse_args(argv)
    drafts = []
    for item in args.draft:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            parser.error(f"--draft {item!r}: expected NAME=DIR")
        drafts.append((name, folder))
    store = HarvestStore(args.store)
    target = load_target(args.target or store.spec.target, dtype="float32", device=args.device)
    head, meta = target_head(target), read_sample_meta(args.records)
    for name, folder in drafts:
        loaded = load_draft(folder)
        fit_to_target(loaded, target)
        scores = score_store(loaded.draft.to(device=target.device, dtype=torch.float32), head, store, meta,
                             ttt_steps=args.ttt_steps)
        overall = group_scores(scores, "all")["all"]
        row: dict = {"figure": "tau_sim", "draft": name, "store": args.store, "overall": round(overall.tau_sim, 4)}
        for key in ("domain", "language"):
            row[key] = {k: round(g.tau_sim, 4) for k, g in group_scores(scores, key).items()}
        row["by_context"] = group_by_context(scores)
        row["loss"] = round(overall.loss, 4)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
