"""Traffic shift: a draft trained (nearly) without one domain is served that domain's traffic, logged
by the server; then one round of mining from the traffic against uniform data, at equal compute.

    OMP_NUM_THREADS=1 .venv/bin/python bench/studies/traffic_shift.py --store runs/race/harvest \\
        --records runs/race/regenerate/dataset/regenerated.jsonl --eval-store runs/race/val/harvest \\
        --eval-records runs/race/val/regenerate/dataset/regenerated.jsonl --pool runs/race/pools/train.jsonl \\
        --eval-sets runs/race/pools/eval --out runs/shift [--domain coding] [--requests 48] [--added 16] \\
        [--seeds 0 1]

1. **The shifted draft**: the race's recipe (``target-head``, 3 TTT steps, 2048 tokens a step,
   ``--base-steps``) on the training store with every sample of ``--domain`` weighted 0
   (``train.data.sample_weights``).
2. **Traffic**: ``--requests`` pool prompts of that domain (not harvested, not in an eval set) sent
   to the OpenAI-compatible server (``serve_eval.server``, in this process, over HTTP) serving that
   draft with ``--traffic-log``; greedy, ``--max-tokens`` each.
3. **One round per arm**, each adding ``--added`` prompts and continuing ``--steps`` steps (the
   mining ablation's continued training, the store's ``--domain`` samples still weighted 0: the
   deployment's own data lacks the domain): ``traffic-worst`` (``mine.traffic_pick=lowest_tau``: the
   requests the draft served worst), ``traffic-random`` (the log's uniform mixture) and
   ``pool-uniform`` (random pool prompts, the domain at its pool share).

Printed: one JSON line per (arm, group) with held-out tau_sim per seed and its bootstrap interval,
the shifted domain marked, then each traffic arm against ``pool-uniform`` and ``traffic-worst``
against ``traffic-random``: the paired difference, ``gain_ratio`` (the arm's gain over the shifted
draft / the control's) and ``tau1_ratio`` (the ratio of (tau - 1) after the round).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from mining_ablation import HeldOut, add_data_arguments, bootstrap, paired_diff, pooled_tau  # this folder, as a script

ARMS = {"traffic-worst": {"strategies": ["traffic"], "traffic_pick": "lowest_tau"},
        "traffic-random": {"strategies": ["traffic"], "traffic_pick": "random"},
        "pool-uniform": {"strategies": ["uniform"]}}


def shifted_draft(args: argparse.Namespace, out: Path) -> Path:
    """The race's recipe on the store without ``args.domain`` (its samples weighted 0)."""
    from eagle3.config import TargetConfig
    from eagle3.store.shards import HarvestStore
    from eagle3.train.loop import train
    from hard_mining.rounds import continued_training
    from hard_mining.score import meta_of, read_sample_meta

    meta = read_sample_meta(args.records)
    store = HarvestStore(Path(args.store))
    weights = {sid: 0.0 for sid in store.sample_ids if meta_of(sid, meta)["domain"] == args.domain}
    if not weights:
        raise SystemExit(f"--domain {args.domain}: no sample of the store has it")
    (out / "weights.json").write_text(json.dumps(weights))
    cfg = continued_training("target-head", **{"data.store": args.store, "data.micro_batch_tokens": 2048,
                                               "data.batching": "buckets",
                                               "optim.warmup_steps": max(1, args.base_steps // 50),
                                               "draft.vocab_size": 8192,
                                               "data.sample_weights": str(out / "weights.json"),
                                               "log.wandb_mode": "disabled", "log.progress": False},
                                               out_dir=str(out / "base"), steps=args.base_steps,
                             ttt_steps=3, precision="auto", eval_every=0,
                             save_every=0)
    train(cfg, TargetConfig(name_or_path=args.target))
    return out / "base" / "final"


def serve_traffic(args: argparse.Namespace, draft: Path, prompts: list[dict[str, Any]], log: Path) -> None:
    """The prompts sent to the server serving ``draft`` with a traffic log, one at a time, greedy."""
    import openai
    import uvicorn

    from eagle3.target.chat import ChatFormat
    from serve_eval.config import SpecConfig
    from serve_eval.eval_runs import load_pair_meta
    from serve_eval.server import Engine, build_app
    from serve_eval.spec_decode import SpeculativeDecoder
    from serve_eval.traffic import TrafficLog

    if log.is_file():
        return  # served in an earlier run: the log is the traffic
    target, loaded, _ = load_pair_meta(str(draft), args.target, "float32", "cpu")
    engine = Engine(SpeculativeDecoder(target, loaded, SpecConfig(k=3)),
                    ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config), model_name="shift",
                    max_model_len=4096, traffic=TrafficLog(log.with_suffix(".partial"), 2**30))
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=args.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", max_retries=0, timeout=600)
    try:
        for record in prompts:  # a request: the conversation up to its first user turn
            messages = record["messages"]
            first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
            tools = {"tools": record["tools"]} if record.get("tools") else {}
            client.chat.completions.create(model="shift", messages=messages[:first_user + 1], temperature=0,
                                           max_tokens=args.max_tokens, **tools)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.close()
    log.with_suffix(".partial").rename(log)  # whole, or served again


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_arguments(parser)
    parser.add_argument("--eval-sets", required=True)
    parser.add_argument("--domain", default="coding")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--added", type=int, default=16)
    parser.add_argument("--base-steps", type=int, default=180)
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--bootstrap", type=int, default=2000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from eagle3.config import TargetConfig
    from eagle3.conversations import prompt_key
    from eagle3.store.shards import HarvestStore
    from eagle3.target.model import load_target
    from hard_mining.config import MineConfig
    from hard_mining.rounds import continued_training, read_records, run_rounds

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    draft = shifted_draft(args, out) if not (out / "base" / "final").is_dir() else out / "base" / "final"
    harvested = {prompt_key(r["messages"]) for r in read_records(args.records)}
    evals = {prompt_key(r["messages"]) for p in sorted(Path(args.eval_sets).glob("*.jsonl"))
             for r in read_records([p])}
    domain = [r for r in read_records([args.pool]) if r["domain"] == args.domain
              and prompt_key(r["messages"]) not in harvested | evals]
    traffic = random.Random(1234).sample(domain, min(args.requests, len(domain)))
    log = out / "traffic.jsonl"
    serve_traffic(args, draft, traffic, log)

    target = load_target(args.target, dtype="float32", device="cpu",
                         aux_layer_ids=HarvestStore(Path(args.store)).spec.aux_layer_ids)
    train_cfg = continued_training("none", **{"data.store": args.store, "optim.lr": 1e-3,
                                              "optim.warmup_steps": max(1, args.steps // 20),
                                              "data.micro_batch_tokens": 2048, "data.batching": "buckets",
                                              "log.progress": False}, out_dir=str(out), ttt_steps=3,
                                   precision="auto", eval_every=0, save_every=0)
    common = dict(draft=str(draft), store=args.store, records=args.records, eval_store=args.eval_store,
                  eval_records=args.eval_records, pool=args.pool, eval_sets=args.eval_sets, rounds=1,
                  steps=args.steps, traffic=str(log), traffic_prompts=args.added, uniform=args.added,
                  sample_weights=str(out / "weights.json"), wandb_mode="disabled")
    heldout = HeldOut(args, target, 3)
    after: dict[str, list[list[dict[str, Any]]]] = {}
    before: list[dict[str, Any]] = []
    for seed in args.seeds:
        for arm, mine in ARMS.items():
            manifest = run_rounds(MineConfig(**common, **mine, out_dir=str(out / f"{arm}-{seed}"), seed=seed),
                                  replace(train_cfg, seed=100 * seed), TargetConfig(name_or_path=args.target),
                                  target=target, progress=False)
            print(json.dumps({"figure": "shift_arm", "arm": arm, "seed": seed, "added": manifest["rounds"][0]["added"],
                              "seconds": manifest["rounds"][0]["seconds"]}), flush=True)
            after.setdefault(arm, []).append(heldout.scores(out / f"{arm}-{seed}", "after"))
            before = heldout.scores(out / f"{arm}-{seed}", "before")
    draws = torch.randint(0, len(before), (args.bootstrap, len(before)), generator=torch.Generator().manual_seed(0))
    for group in [None, *sorted({r["domain"] for r in before})]:
        mean = {}
        base = pooled_tau([r for r in before if group is None or r["domain"] == group])
        for arm in after:
            per_seed = [pooled_tau([r for r in s if group is None or r["domain"] == group]) for s in after[arm]]
            mean[arm] = sum(per_seed) / len(per_seed)
            lo, hi = bootstrap(after[arm], group, draws)
            print(json.dumps({"figure": "shift_tau", "group": group or "overall", "shifted": group == args.domain,
                              "arm": arm, "before": round(base, 4), "per_seed": [round(t, 4) for t in per_seed],
                              "mean": round(mean[arm], 4),
                              "ci95": [round(lo, 4), round(hi, 4)]}), flush=True)
        for arm, control in (("traffic-worst", "pool-uniform"), ("traffic-random", "pool-uniform"),
                             ("traffic-worst", "traffic-random")):
            d, lo, hi = paired_diff(after[arm], after[control], group, draws)
            gain = mean[control] - base
            print(json.dumps({"figure": "shift_diff", "group": group or "overall", "shifted": group == args.domain,
                              "arm": arm, "control": control, "minus_control": round(d, 4),
                              "ci95": [round(lo, 4), round(hi, 4)],
                              "gain_ratio": round((mean[arm] - base) / gain, 4) if gain > 0 else None,
                              "tau1_ratio": round((mean[arm] - 1) / (mean[control] - 1), 4)
                              if mean[control] > 1 else None}), flush=True)


if __name__ == "__main__":
    main()
