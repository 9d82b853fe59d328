"""A shifted stream served live: the server (``--live``) and the live trainer beside it, a stream
of pool prompts whose domain shifts mid-way; the learning draft's served tau against the static
draft's on the same requests.

    OMP_NUM_THREADS=1 .venv/bin/python bench/studies/live_shift.py --draft runs/quickstart/train/final \\
        --pools runs/quickstart/pools --out runs/live-shift [--requests 300] [--shift-at 150] \\
        [--before general] [--after coding] [--after-share 0.8] [--seed 0] [--trainer ...]

1. A fresh live folder; ``serve_eval.server --live`` serving ``--draft`` (greedy, chain ``--k``) and
   ``hard_mining.live`` beside it (``--trainer``: its flags; captured requests kept for step 3).
2. ``--requests`` chat requests, one at a time: ``--before`` prompts until ``--shift-at``, then
   ``--after`` prompts at ``--after-share`` and ``--before`` ones for the rest (the original domain
   after the shift). Prompts from the pool's training split that the draft's training records do
   not hold (``--records``), drawn by ``--seed``. Each response's served tau and the draft version
   that served it (the capture's record) kept.
3. The static arm: the starting draft teacher-forced on every captured request (its states: no
   target forward), the served tau as the loop serves it greedily (``hard_mining.live.served_taus``:
   equal to the loop's, ``tests/test_live.py``). Lossless check: every generated token is the
   target's argmax at its position, from the captured last states.

Printed: one JSON line per figure: the live events, per segment (before the shift, the shifted
requests' thirds, the original domain after the shift) the learning and static arms' tau, the
(tau - 1) ratio and the paired difference's 95% interval; ``OUT/live_shift.png`` the rolling tau with
the swaps marked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from eagle3.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]




def pick_prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The stream: ``--before`` prompts, then ``--after`` at ``--after-share`` (the rest ``--before``)."""
    seen: set[str] = set()
    for path in args.records:
        for line in Path(path).open(encoding="utf-8"):  # not splitlines(): texts hold U+2028
            record = json.loads(line)
            seen.add(json.dumps(record["messages"][:1], sort_keys=True))
    pool: dict[str, list[dict[str, Any]]] = {args.before: [], args.after: []}
    for line in (Path(args.pools) / "train.jsonl").open(encoding="utf-8"):
        record = json.loads(line)
        messages = [m for m in record["messages"] if m["role"] != "assistant"][:2]
        if record.get("domain") in pool and record.get("language", "en") == "en" and messages \
                and json.dumps(messages[:1], sort_keys=True) not in seen and len(messages[-1]["content"]) < 1500:
            pool[record["domain"]].append({"domain": record["domain"], "messages": messages})
    rng = random.Random(args.seed)
    for items in pool.values():
        rng.shuffle(items)
    stream = []
    for i in range(args.requests):
        domain = args.before if i < args.shift_at or rng.random() >= args.after_share else args.after
        stream.append(pool[domain].pop())
    return stream


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}) before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not become ready")


def serve_stream(args: argparse.Namespace, live: Path, stream: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import httpx

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    py = sys.executable
    server = subprocess.Popen([py, "-m", "serve_eval.server", "--draft", args.draft, "--live", str(live), "--k",
                               str(args.k), "--port", str(port), "--served-model-name", "m", "--threads", "1",
                               "--capture-dtype", args.capture_dtype],
                              cwd=ROOT, env=env, stdout=open(live.parent / "server.log", "w"), stderr=subprocess.STDOUT)
    trainer = None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, server)
        trainer = subprocess.Popen([py, "-m", "hard_mining.live", "--live", str(live), "--draft", args.draft, "--k",
                                    str(args.k), "--no-release", "--no-progress", "--threads", "1",
                                    *args.trainer.split()], cwd=ROOT, env=env,
                                   stdout=open(live.parent / "trainer.log", "w"), stderr=subprocess.STDOUT)
        served = []
        with httpx.Client(timeout=600) as client:
            for i, item in enumerate(stream):
                t0 = time.perf_counter()
                r = client.post(f"{url}/v1/chat/completions", json={
                    "model": "m", "messages": item["messages"], "max_tokens": args.max_tokens, "temperature": 0})
                r.raise_for_status()
                body = r.json()
                served.append({"i": i, "domain": item["domain"], "tau": body["spec_decode"]["tau"],
                               "seconds": round(time.perf_counter() - t0, 3)})
                if trainer.poll() is not None:
                    raise SystemExit(f"the trainer exited ({trainer.returncode}); see {live.parent}/trainer.log")
                if i % 25 == 0:
                    print(json.dumps({"served": i, "tau": served[-1]["tau"]}), file=sys.stderr, flush=True)
        return served
    finally:
        for proc in (trainer, server):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()


def static_arm(args: argparse.Namespace, live: Path) -> tuple[list[float], list[int], dict[str, int]]:
    """Per captured request: the starting draft's teacher-forced served tau, the version that served
    it; and the greedy check over every generated token."""
    from eagle3.target.model import load_target
    from hard_mining.live import link_store, served_taus
    from hard_mining.rounds import load_scoring_draft
    from hard_mining.score import target_head
    from serve_eval.capture import committed, read_spec

    capture = live / "capture"
    items = committed(capture)
    spec = read_spec(capture)
    store = link_store(live.parent / "all-captured", items, spec)
    target = load_target(args.target, dtype="float32", aux_layer_ids=spec.aux_layer_ids)
    head = target_head(target)
    taus = served_taus(load_scoring_draft(args.draft, target), head, store, args.k)
    checked = equal = ties = 0
    for i in range(len(store)):
        sample = store[i]
        with torch.no_grad():
            logits = target.head(sample.last)  # [T, V]: row t gives token t + 1
        for j in sample.loss_mask.nonzero().flatten().tolist():
            row = logits[j - 1]
            top2 = row.topk(2).values
            chosen = row[sample.input_ids[j]]
            checked += 1
            equal += int(chosen == top2[0])
            ties += int(chosen != top2[0] and float(top2[0] - top2[1]) < 1e-4)
    return taus, [int(c.record["draft_version"]) for c in items], {"checked": checked, "argmax": equal, "ties": ties}


def interval(diffs: list[float]) -> tuple[float, float, float]:
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / max(n - 1, 1))
    return mean, mean - 1.96 * sd / math.sqrt(n), mean + 1.96 * sd / math.sqrt(n)


def segment(name: str, learning: list[float], static: list[float]) -> dict[str, Any]:
    lt, st = sum(learning) / len(learning), sum(static) / len(static)
    mean, low, high = interval([a - b for a, b in zip(learning, static, strict=True)])
    return {"segment": name, "requests": len(learning), "learning_tau": round(lt, 4), "static_tau": round(st, 4),
            "tau1_ratio": round((lt - 1) / (st - 1), 3) if st > 1 else None,
            "difference": round(mean, 4), "interval": [round(low, 4), round(high, 4)]}


def plot(path: Path, served: list[dict[str, Any]], static: list[float], versions: list[int], shift: int,
         window: int = 20) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def rolling(xs: list[float]) -> list[float]:
        return [sum(xs[max(0, i - window + 1):i + 1]) / len(xs[max(0, i - window + 1):i + 1]) for i in range(len(xs))]

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(rolling([s["tau"] for s in served]), label="learning draft (served)")
    ax.plot(rolling(static), label="static draft (teacher-forced)")
    ax.axvline(shift, color="grey", linestyle="--", label="traffic shift")
    for i in range(1, len(versions)):
        if versions[i] != versions[i - 1]:
            ax.axvline(i, color="green", alpha=0.4)
            ax.text(i, ax.get_ylim()[1], f"v{versions[i]}", fontsize=7, va="top")
    ax.set_xlabel("request")
    ax.set_ylabel(f"served tau (rolling {window})")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--pools", required=True)
    parser.add_argument("--records", nargs="*", default=[], help="the draft's training records (their prompts skipped)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--shift-at", type=int, default=150)
    parser.add_argument("--before", default="general")
    parser.add_argument("--after", default="coding")
    parser.add_argument("--after-share", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capture-dtype", default="float32",
                        help="the server's; float32 makes the lossless check exact (bf16 states round logits)")
    parser.add_argument("--trainer", default="", help="more hard_mining.live flags, one string")
    args = parser.parse_args()
    torch.set_num_threads(2)
    out = Path(args.out) / f"seed-{args.seed}"
    live = out / "live"
    if live.exists():
        raise SystemExit(f"{live} exists: use a new --out")
    live.mkdir(parents=True)
    stream = pick_prompts(args)
    t0 = time.time()
    served = serve_stream(args, live, stream)
    print(json.dumps({"stream_s": round(time.time() - t0, 1)}))
    static, versions, check = static_arm(args, live)
    if len(static) != len(served):
        raise SystemExit(f"{len(served)} requests served, {len(static)} captured")
    print(json.dumps({"lossless": check}))
    for line in (live / "events.jsonl").read_text().splitlines() if (live / "events.jsonl").exists() else []:
        print(json.dumps({"event": json.loads(line)}))
    learning = [s["tau"] for s in served]
    shifted = [i for i in range(args.shift_at, len(served)) if served[i]["domain"] == args.after]
    original = [i for i in range(args.shift_at, len(served)) if served[i]["domain"] == args.before]
    third = len(shifted) // 3
    parts = {"before shift": list(range(args.shift_at)), "shifted, first third": shifted[:third],
             "shifted, second third": shifted[third:2 * third], "shifted, last third": shifted[2 * third:],
             "original domain after shift": original}
    results = [segment(name, [learning[i] for i in idx], [static[i] for i in idx]) for name, idx in parts.items()
               if len(idx) >= 2]
    for r in results:
        print(json.dumps({"seed": args.seed, **r}))
    p50 = sorted(s["seconds"] for s in served)[len(served) // 2]
    print(json.dumps({"seed": args.seed, "p50_request_s": p50, "versions": sorted(set(versions))}))
    (out / "results.json").write_text(json.dumps({"served": served, "static": static, "versions": versions,
                                                  "segments": results, "lossless": check}, indent=1))
    plot(out / "live_shift.png", served, static, versions, args.shift_at)
    return 0


if __name__ == "__main__":
    sys.exit(main())
