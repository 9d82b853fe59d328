"""The trainer's host-side cost of one micro-batch at a target's real size, old read against new.

    OMP_NUM_THREADS=1 .venv/bin/python bench/speed/loader_cost.py [--hidden 4096] [--tokens 4096]

A bf16 store of random states shaped like Llama-3.1-8B's (hidden 4096, 3 aux layers + the last
state: 16,384 values a token) is written to a temporary folder; each variant then reads the same
packed micro-batches of ``--tokens`` tokens as the trainer does and pins them (what a copy to CUDA
without blocking needs; pinning works without a GPU where torch can reach a driver, else it is
skipped and said so). Variants, each in the same run:

- ``fp32``: the states converted to fp32 on the host (the trainer's read before commit 73aacc2);
- ``stored``: the states in the store's dtype (``load_batch(stored=True)``, the trainer's read now).

One JSON line per variant (median milliseconds per micro-batch, tokens/s, MB per batch) and the
ratio. On a GPU this host time is hidden behind the device's step only if it is shorter than it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eagle3.store.batches import load_batch
from eagle3.store.shards import HarvestSpec, HarvestStore, Sample, shard_entry, write_manifest, write_shard


def write_store(root: Path, hidden: int, aux: int, samples: int, length: int, per_shard: int) -> None:
    spec = HarvestSpec(target="bench", weights_fingerprint="bench", tokenizer_sha256="bench",
                       chat_template_sha256="bench", num_layers=32, hidden_size=hidden, vocab_size=128256,
                       aux_layer_ids=(1, 15, 28), dtype="bfloat16", store="last", max_seq_len=length)
    gen = torch.Generator().manual_seed(0)
    shards = []
    for s in range(0, samples, per_shard):
        batch = [Sample(id=f"s{i}", input_ids=torch.randint(0, 1000, (length,), generator=gen),
                        loss_mask=torch.ones(length, dtype=torch.bool),
                        aux=torch.randn(length, aux, hidden, generator=gen, dtype=torch.bfloat16),
                        last=torch.randn(length, hidden, generator=gen, dtype=torch.bfloat16))
                 for i in range(s, min(s + per_shard, samples))]
        path = root / f"shard-{len(shards):05d}.safetensors"
        tokens = write_shard(path, batch, spec)
        shards.append(shard_entry(path, len(batch), tokens, tokens))
    write_manifest(root, spec, shards, {"samples": samples}, {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--aux", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per packed micro-batch")
    parser.add_argument("--length", type=int, default=512, help="tokens per sample")
    parser.add_argument("--batches", type=int, default=4, help="distinct micro-batches, each read per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    per_batch = max(1, args.tokens // args.length)
    pin = True
    try:
        torch.empty(1).pin_memory()
    except RuntimeError:
        pin = False
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_store(root, args.hidden, args.aux, per_batch * args.batches, args.length, per_batch)
        store = HarvestStore(root)
        plan = [list(range(b * per_batch, (b + 1) * per_batch)) for b in range(args.batches)]
        times: dict[str, list[float]] = {"fp32": [], "stored": []}
        sizes: dict[str, float] = {}
        for r in range(args.rounds):
            for name in (list(times) if r % 2 == 0 else list(times)[::-1]):  # alternated: drift and first reads
                # hit both
                for idx in plan:
                    t0 = time.perf_counter()
                    batch = load_batch(store, idx, "pack", stored=name == "stored")
                    if pin:
                        batch = {k: v.pin_memory() for k, v in batch.items()}
                    times[name].append(time.perf_counter() - t0)
                    sizes[name] = sum(v.numel() * v.element_size() for v in batch.values()) / 1e6
        tokens = per_batch * args.length
        ms = {name: statistics.median(t) * 1000 for name, t in times.items()}
        for name in times:
            print(json.dumps({"figure": f"loader.{name}", "ms_per_batch": round(ms[name], 1),
                              "tokens_per_s": round(tokens / ms[name] * 1000), "mb_per_batch": round(sizes[name], 1),
                              "tokens": tokens, "hidden": args.hidden, "pinned": pin,
                              "torch_threads": torch.get_num_threads()}))
        print(json.dumps({"figure": "loader.stored_over_fp32_speed", "ratio": round(ms["fp32"] / ms["stored"], 2)}))


if __name__ == "__main__":
    main()
