"""Harvest speed against the bare target forward, and disk per token, in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/speed/harvest_throughput.py \\
        [--data runs/quickstart/regenerate/dataset/regenerated.jsonl] [--target smollm2-135m]

Figures (one JSON line each): bare decoder forward tokens/s on the harvest's own batches;
harvest tokens/s end to end (tokenise, capture, encode, write shards, manifest) for bf16
and fp8 stores; their ratio to the bare forward (goal >= 0.9); bytes per token on disk.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from data_gen.config import HarvestConfig
from data_gen.harvest import run, tokenize_records
from data_gen.regenerate import read_pool
from eagle3.config import DEFAULT_TARGET, TargetConfig
from eagle3.target.chat import ChatFormat
from eagle3.target.model import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="runs/quickstart/regenerate/dataset/regenerated.jsonl")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--limit", type=int, default=48, help="conversations to harvest")
    args = parser.parse_args()
    if not Path(args.data).is_file():
        raise SystemExit(f"{args.data}: no regenerated data; run `bash scripts/quickstart.sh` first or pass --data")

    torch.set_num_threads(1)
    target = load_target(args.target, dtype="float32", device="cpu")
    records = read_pool(Path(args.data), limit=args.limit)
    chat = ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)
    samples = tokenize_records(records, chat, 2048, Counter())
    tokens = sum(len(ids) for _, ids, _ in samples)
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i][1]), i))
    batches = [order[k:k + args.batch_size] for k in range(0, len(order), args.batch_size)]

    def bare() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for batch in batches:
                width = max(len(samples[i][1]) for i in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                for r, i in enumerate(batch):
                    n = len(samples[i][1])
                    ids[r, :n], mask[r, :n] = torch.tensor(samples[i][1]), 1
                target.decoder(input_ids=ids, attention_mask=mask)
        return tokens / (time.perf_counter() - t0)

    with tempfile.TemporaryDirectory() as tmp:
        subset = Path(tmp) / "data.jsonl"
        subset.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))

        def harvest(dtype: str, k: int) -> tuple[float, float]:
            cfg = HarvestConfig(data=str(subset), out_dir=f"{tmp}/{dtype}-{k}", dtype=dtype,
                                batch_size=args.batch_size)
            t0 = time.perf_counter()
            summary = run(cfg, TargetConfig(name_or_path=args.target), target=target, progress=False)
            seconds = time.perf_counter() - t0
            manifest = json.loads((Path(cfg.out_dir) / "manifest.json").read_text())
            return summary["tokens_this_run"] / seconds, manifest["bytes"] / manifest["tokens"]

        bare()  # warm-up
        results: dict[str, list[float]] = {"bare": [], "bfloat16": [], "float8_e4m3fn": []}
        size: dict[str, float] = {}
        for k in range(2):  # interleaved, so that machine noise hits all alike
            results["bare"].append(bare())
            for dtype in ("bfloat16", "float8_e4m3fn"):
                speed, size[dtype] = harvest(dtype, k)
                results[dtype].append(speed)

    common = {"target": args.target, "conversations": len(samples), "tokens": tokens, "batch": args.batch_size}
    best = {k: max(v) for k, v in results.items()}
    print(json.dumps({"figure": "bare_forward_tokens_per_s", "value": round(best["bare"], 1), **common}))
    for dtype in ("bfloat16", "float8_e4m3fn"):
        print(json.dumps({"figure": "harvest_tokens_per_s", "dtype": dtype, "value": round(best[dtype], 1), **common}))
        print(json.dumps({"figure": "harvest_over_bare_ratio", "dtype": dtype,
                          "value": round(best[dtype] / best["bare"], 3), **common}))
        print(json.dumps({"figure": "bytes_per_token", "dtype": dtype, "value": round(size[dtype], 1), **common}))
    print(json.dumps({"figure": "fp8_over_bf16_bytes", "value": round(size["float8_e4m3fn"] / size["bfloat16"], 3),
                      **common}))


if __name__ == "__main__":
    main()
