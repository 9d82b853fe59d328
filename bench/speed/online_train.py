"""Online training against offline training over the same conversations, in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/speed/online_train.py \\
        [--data runs/quickstart/regenerate/dataset/regenerated.jsonl] [--target smollm2-135m] \\
        [--steps 100] [--max-shard-mb 4] [--budget-mb 20]

Offline: the harvest writes a store (timed), then the trainer trains on it. Online: one producer
process (`python -m data_gen.produce`, one thread) fills a spool of ``--budget-mb`` while the
trainer (this process, one thread) reads it. Both trainers use the quickstart's batching with
``shard_window=1`` (the order online training needs), so they train on the same samples in the
same order. Figures (one JSON line each): producer and harvest tokens/s; trainer tokens/s offline
and online and their ratio (loop rate, and end to end with setup and checkpoints); the online
trainer's stall fraction (time waiting for shards over its wall time); peak disk of the spool
against the offline store; whether the two runs' losses and weights are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from data_gen.config import HarvestConfig
from data_gen.harvest import run as harvest
from eagle3.config import DEFAULT_TARGET, TargetConfig
from eagle3.target.model import load_target
from eagle3.train.config import TrainConfig, train_config
from eagle3.train.loop import train


def folder_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:  # deleted while listed
                pass
    return total


def end_to_end(summary: dict) -> float:
    """Tokens trained over the trainer's whole wall time (setup and checkpoints included)."""
    return summary["tokens"] / summary["wall_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="runs/quickstart/regenerate/dataset/regenerated.jsonl")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--max-shard-mb", type=float, default=4.0)
    parser.add_argument("--budget-mb", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not Path(args.data).is_file():
        raise SystemExit(f"{args.data}: no regenerated data; run `bash scripts/quickstart.sh` first or pass --data")

    import torch

    torch.set_num_threads(1)
    target_cfg = TargetConfig(name_or_path=args.target)
    target = load_target(args.target, dtype="float32", device="cpu")
    repo = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        harvest_cfg = HarvestConfig(data=args.data, out_dir=str(root / "store"), dtype="bfloat16",
                                    max_shard_mb=args.max_shard_mb)
        t0 = time.perf_counter()
        harvested = harvest(harvest_cfg, target_cfg, target=target, progress=False)
        harvest_s = time.perf_counter() - t0
        largest = max(e["bytes"] for e in json.loads((root / "store" / "manifest.json").read_text())["shards"])
        if args.budget_mb * 2**20 < 2 * largest:  # a window of one shard and the next
            raise SystemExit(f"--budget-mb {args.budget_mb}: the largest shard is {largest / 2**20:.1f} MiB (one long "
                             f"sample); the spool needs at least {2 * largest / 2**20:.1f}")

        def train_cfg(store: Path, out: str, data: str) -> TrainConfig:
            return train_config(**{"data.store": str(store), "data.mode": data, "data.batching": "buckets",
                                   "data.micro_batch_tokens": 1024, "draft.vocab_size": 4096, "loss.positions": "all",
                                   "optim.warmup_steps": 5, "data.eval_fraction": 0.0, "data.shard_window": 1,
                                   "log.wandb_mode": "disabled", "log.progress": False, "data.spool_wait_s": 600},
                                   out_dir=str(root / out), steps=args.steps, eval_every=0,
                               save_every=50, seed=args.seed, device="cpu")

        offline = train(train_cfg(root / "store", "offline", "offline"), target_cfg, target=target)
        store_bytes = folder_bytes(root / "store")

        spool = root / "spool"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
        producer = subprocess.Popen(
            [sys.executable, "-m", "data_gen.produce", "--data", args.data, "--out", str(spool), "--target",
             args.target, "--dtype", "bfloat16", "--max-shard-mb", str(args.max_shard_mb), "--spool-budget-mb",
             str(args.budget_mb), "--seed", str(args.seed), "--no-progress"],
            cwd=repo, env=env, stdout=subprocess.PIPE, text=True)
        peak, stop = [0], threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], folder_bytes(spool))
                stop.wait(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        online = train(train_cfg(spool, "online", "online"), target_cfg, target=target)
        out, _ = producer.communicate(timeout=600)
        stop.set()
        watcher.join()
        produced = json.loads(out.strip().splitlines()[-1])
        same_weights = ((root / "online" / "final" / "model.safetensors").read_bytes()
                        == (root / "offline" / "final" / "model.safetensors").read_bytes())

    common = {"target": args.target, "steps": args.steps, "max_shard_mb": args.max_shard_mb,
              "budget_mb": args.budget_mb, "threads": 1}
    rows = [
        {"figure": "harvest_tokens_per_s", "value": round(harvested["tokens_this_run"] / harvest_s, 1)},
        {"figure": "producer_tokens_per_s", "value": produced["capture_tokens_per_s"],
         "shards_made": produced["shards"], "tokens_made": produced["tokens"]},
        {"figure": "trainer_tokens_per_s", "offline": offline["tokens_per_s"], "online": online["tokens_per_s"],
         "ratio": round(online["tokens_per_s"] / offline["tokens_per_s"], 3)},
        {"figure": "trainer_end_to_end_tokens_per_s", "offline": round(end_to_end(offline), 1),
         "online": round(end_to_end(online), 1), "ratio": round(end_to_end(online) / end_to_end(offline), 3)},
        {"figure": "online_stall_fraction", "value": round(online["spool_wait_seconds"] / online["wall_seconds"], 4),
         "wait_seconds": online["spool_wait_seconds"], "wall_seconds": online["wall_seconds"]},
        {"figure": "peak_disk_bytes", "online_spool": peak[0], "offline_store": store_bytes,
         "ratio": round(peak[0] / store_bytes, 4)},
        {"figure": "online_equals_offline", "same_last_loss": online["last_loss"] == offline["last_loss"],
         "same_weights": same_weights},
    ]
    for row in rows:
        print(json.dumps({**row, **common}))


if __name__ == "__main__":
    main()
