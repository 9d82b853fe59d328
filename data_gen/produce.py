"""Online training's producers: the harvest, shard by shard, into a bounded spool that trainers read.

    python -m data_gen.produce --data runs/regen/dataset/regenerated.jsonl --out runs/online/spool \\
        [--shard i/n] [--seed 0] [--spool-budget-mb 1024] [--target smollm2-135m] [harvest settings]

A producer plans the data exactly as the offline harvest does (:func:`data_gen.harvest.plan_harvest`:
the same tokenisation, shard plan and ``plan.json``), writes every sample's tokens once
(``index.safetensors``: what the trainer plans its epochs from), then makes the states of the
plan's shards epoch after epoch in the trainer's order (:func:`eagle3.store.batches.shard_sequence`
with the run's seed), each shard with the same batches as the offline harvest
(:func:`eagle3.store.capture.capture_shard`), so the states are the same bytes. Worker ``i/n`` makes
the shards at positions ``seq % n == i``. A shard waits while the spool is at its budget; one a
trainer has already consumed is skipped; when the trainer writes ``done`` the producers stop. With
``--max-epochs N`` a producer stops once its shards of those epochs are consumed or every reader has
moved past them (until then a shard evicted for a more urgent one is made again); ``--max-epochs 0``
writes the plan and the tokens only (what co-located training reads).
Killed at any moment and restarted, a producer goes on from what the spool holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data_gen.config import HarvestConfig
from data_gen.harvest import build_parser as harvest_parser
from data_gen.harvest import configs_from_args, plan_harvest
from eagle3.config import TargetConfig
from eagle3.errors import run_cli
from eagle3.store.batches import shard_sequence
from eagle3.store.capture import capture_shard
from eagle3.store.planned import plan_digest, write_index
from eagle3.store.spool import Heartbeat, Spool, shard_key
from eagle3.target.model import Target


def produce(cfg: HarvestConfig, target_cfg: TargetConfig, *, seed: int = 0, target: Target | None = None,
            max_epochs: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Fill the spool ``cfg.out_dir`` as worker ``cfg.shard`` until the trainer is done (or
    ``max_epochs`` epochs are made); returns what this producer made."""
    started = time.perf_counter()
    root = Path(cfg.out_dir)
    worker, workers = cfg.worker
    root.mkdir(parents=True, exist_ok=True)
    beat = Heartbeat(root, worker, workers)
    beat.beat(state="running")  # first: a reader waiting on this worker's restart sees it alive
    try:
        return _produce(cfg, target_cfg, seed, target, max_epochs, progress, beat, started)
    except BaseException as err:
        beat.beat(state=f"failed: {type(err).__name__}: {err}"[:300])
        raise


def _produce(cfg: HarvestConfig, target_cfg: TargetConfig, seed: int, target: Target | None,
             max_epochs: int | None, progress: bool, beat: Heartbeat, started: float) -> dict[str, Any]:
    hp = plan_harvest(cfg, target_cfg, target)
    root = Path(cfg.out_dir)
    write_index(root, hp.samples)
    spool = Spool(root, hp.spec, budget_bytes=int(cfg.spool_budget_mb * 2**20), plan_sha256=plan_digest(root),
                  seed=seed)
    spool.started = time.time() - (time.perf_counter() - started)  # a failed trainer's older `done`: not ours
    worker, workers = cfg.worker
    shards = len(hp.plan)
    end = None if max_epochs is None else max_epochs * shards
    orders: dict[int, list[int]] = {}

    def key(seq: int) -> str:
        epoch = seq // shards
        order = orders.setdefault(epoch, shard_sequence(shards, seed, epoch))
        return shard_key(epoch, order[seq % shards])

    def next_seq() -> int | None:
        """This worker's first seq not in the spool, from the readers' floor (a shard evicted to make
        room for one a reader waited for is made again)."""
        seq = spool.released_below()
        seq += (worker - seq) % workers
        while end is None or seq < end:
            if not spool.is_committed(key(seq)):
                return seq
            seq += workers
        return None

    def urgent(seq: int) -> bool:
        """A reader waits for an earlier shard of this worker's that is not there: make that first."""
        floor = spool.released_below()
        return any(w < seq and w % workers == worker and w >= floor for w in spool.waiting())

    made = tokens = 0
    capture_s = 0.0
    while True:
        if spool.done():
            return _summary(cfg, made, tokens, capture_s, started, spool.done_why(), beat)
        if (seq := next_seq()) is None:  # every shard of the epochs asked for is in the spool
            if end is not None and (spool.released_below() >= end or spool.readers_past(end)):
                return _summary(cfg, made, tokens, capture_s, started, f"{max_epochs} epochs made", beat)
            beat.beat()  # one may still be evicted for a shard a reader waits for, and be needed again
            time.sleep(spool.poll_s)
            continue
        k = int(key(seq).rsplit("-", 1)[1])
        t0 = time.perf_counter()
        samples = capture_shard(hp.backend, hp.samples, hp.plan[k], cfg.batch_size, on_batch=lambda _: beat.beat())
        capture_s += time.perf_counter() - t0

        def waiting(s: int = seq) -> bool:
            beat.beat()
            return not spool.done() and not urgent(s)

        if not spool.put(key(seq), seq, samples, alive=waiting):
            continue  # done, consumed meanwhile, or another shard is needed first
        made += 1
        beat.beat(made=made)
        tokens += sum(len(x) for x in samples)
        if progress:
            print(f"produce {cfg.shard}: {key(seq)} (seq {seq}), {tokens / max(capture_s, 1e-9):.0f} tok/s",
                  file=sys.stderr)


def _summary(cfg: HarvestConfig, made: int, tokens: int, capture_s: float, started: float,
             why: str, beat: Heartbeat) -> dict[str, Any]:
    beat.beat(state=f"stopped: {why}")
    return {"stage": "produce", "spool": cfg.out_dir, "worker": cfg.shard, "shards": made, "tokens": tokens,
            "capture_tokens_per_s": round(tokens / capture_s, 1) if capture_s else None,
            "wall_seconds": round(time.perf_counter() - started, 2), "stopped": why}


def build_parser() -> argparse.ArgumentParser:
    """The harvest's flags (the spool is its --out) and the online run's own."""
    parser = harvest_parser()
    parser.prog = "python -m data_gen.produce"
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("--seed", type=int, default=0, help="the training run's seed (the shard order follows it)")
    parser.add_argument("--max-epochs", type=int, default=None,
                        help="stop once this many epochs are made and read (0: plan only; default: when "
                        "the trainer is done)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("produce", _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg, target_cfg = configs_from_args(parser, args)
    summary = produce(cfg, target_cfg, seed=args.seed, max_epochs=args.max_epochs, progress=not args.no_progress)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
