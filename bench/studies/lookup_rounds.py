"""Where the lookup and the draft are right: round by round, on the eval sets, with a hybrid tree.

    .venv/bin/python bench/studies/lookup_rounds.py --draft runs/quickstart/train/final \\
        --pools runs/quickstart/pools --sets mtbench agent long_edit --per-set 6 [--mode chain|tree]

Greedy hybrid generation (the draft's chain or tree with the lookup's branch merged in) of every
prompt; each round records the draft's probability of its first token, whether the target's token
was the draft's first and the lookup's first, and the lookup's match length. Prints JSON lines:

* ``calibration``: the draft's first token, per bin of its probability: rounds, mean probability,
  share right (and the expected calibration error over the bins);
* ``lookup_by_match``: per match length, rounds and the share where the lookup's first token was right;
* ``disagree``: rounds where both proposed and not both were right, per bin of the draft's
  probability: which of the two the target took (what a policy weighing one against the other sees).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

BINS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001)


def bin_of(p: float) -> str:
    for lo, hi in zip(BINS, BINS[1:], strict=False):
        if lo <= p < hi:
            return f"{lo:.1f}-{min(hi, 1.0):.1f}"
    return "1.0"


def main() -> None:
    from eagle3.config import SamplingConfig
    from eagle3.target.chat import ChatFormat
    from serve_eval.config import SpecConfig
    from serve_eval.eval_runs import load_pair
    from serve_eval.evaluate import read_prompts
    from serve_eval.spec_decode import SpeculativeDecoder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--pools", required=True)
    parser.add_argument("--sets", nargs="+", default=["mtbench", "humaneval", "agent", "tool_use"])
    parser.add_argument("--per-set", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--mode", default="chain", choices=["chain", "tree"])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, draft = load_pair(args.draft, args.target, "float32", "cpu")
    chat = ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)
    decoder = SpeculativeDecoder(target, draft, SpecConfig(args.mode, k=args.k, proposer="hybrid"))
    rows = []
    for name in args.sets:
        for prompt in read_prompts(Path(args.pools), name, args.per_set, chat):
            stats = decoder.generate(prompt, args.max_new_tokens, frozenset(chat.stop_ids), SamplingConfig()).stats
            rows += [{"set": name, "p": p, "draft_right": d, "lookup_right": lk, "match": m}
                     for (p, d, lk), m in zip(stats.first, stats.lookup_match, strict=True)]
    for name in [*args.sets, "all"]:
        mine = [r for r in rows if name in ("all", r["set"])]
        bins: dict[str, list[dict]] = defaultdict(list)
        for r in mine:
            if r["p"] is not None:
                bins[bin_of(r["p"])].append(r)
        table = {b: {"rounds": len(v), "mean_p": round(sum(r["p"] for r in v) / len(v), 4),
                     "right": round(sum(bool(r["draft_right"]) for r in v) / len(v), 4)}
                 for b, v in sorted(bins.items())}
        n = sum(t["rounds"] for t in table.values())
        ece = sum(t["rounds"] / n * abs(t["mean_p"] - t["right"]) for t in table.values()) if n else None
        print(json.dumps({"figure": "calibration", "set": name, "mode": args.mode, "rounds": n,
                          "ece": round(ece, 4) if ece is not None else None, "bins": table}))
        by_match: dict[int, list[dict]] = defaultdict(list)
        for r in mine:
            if r["lookup_right"] is not None:
                by_match[min(r["match"], 8)].append(r)
        print(json.dumps({"figure": "lookup_by_match", "set": name, "rounds": len(mine),
                          "by_match": {f"{m}{'+' if m == 8 else ''}": {
                              "rounds": len(v), "right": round(sum(bool(r["lookup_right"]) for r in v) / len(v), 4)}
                              for m, v in sorted(by_match.items())}}))
        split: dict[str, list[dict]] = defaultdict(list)
        for r in mine:
            if r["p"] is not None and r["lookup_right"] is not None and not (r["draft_right"] and r["lookup_right"]):
                split[bin_of(r["p"])].append(r)
        print(json.dumps({"figure": "disagree", "set": name, "bins": {
            b: {"rounds": len(v), "draft": sum(bool(r["draft_right"]) for r in v),
                "lookup": sum(bool(r["lookup_right"]) for r in v)} for b, v in sorted(split.items())}}))


if __name__ == "__main__":
    main()
