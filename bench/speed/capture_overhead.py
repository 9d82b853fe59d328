"""Cost of the aux-layer capture: Target.forward vs the bare decoder forward, same run.

Prints one JSON line per figure and the ratio (goal >= 0.9 for harvesting).

    OMP_NUM_THREADS=1 .venv/bin/python bench/speed/capture_overhead.py [--target smollm2-135m] [--seq 256]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eagle3.config import DEFAULT_TARGET
from eagle3.target.model import load_target


def _tokens_per_s(fn, tokens: int, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return tokens / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    target = load_target(args.target, dtype=args.dtype)
    torch.manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (args.batch, args.seq), device=target.device)
    tokens = args.batch * args.seq
    with torch.no_grad():
        # Interleave so that machine noise hits both alike.
        bare, capture = [], []
        for _ in range(3):
            bare.append(_tokens_per_s(lambda: target.decoder(input_ids=ids), tokens, args.repeats))
            capture.append(_tokens_per_s(lambda: target(ids, return_logits=False), tokens, args.repeats))
    common = {"target": args.target, "dtype": args.dtype, "batch": args.batch, "seq": args.seq,
              "threads": torch.get_num_threads()}
    print(json.dumps({"figure": "bare_forward_tokens_per_s", "value": round(max(bare), 1), **common}))
    print(json.dumps({"figure": "capture_forward_tokens_per_s", "value": round(max(capture), 1), **common}))
    print(json.dumps({"figure": "capture_over_bare_ratio", "value": round(max(capture) / max(bare), 3), **common}))


if __name__ == "__main__":
    main()
