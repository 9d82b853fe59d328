"""What learning from the traffic costs the server: the same requests served three ways, one
after the other, on this machine: ``plain`` (no ``--live``), ``capture`` (``--live``, no trainer)
and ``capture+trainer`` (``--live`` with ``hard_mining.live`` training beside it the whole time).

    OMP_NUM_THREADS=1 .venv/bin/python bench/speed/live_latency.py --draft runs/quickstart/train/final \\
        --pools runs/quickstart/pools --out runs/live-latency [--requests 20] [--max-tokens 48]

Printed: per arm one JSON line (p50 and mean request seconds, target forwards per generated token
from ``/metrics``, requests captured), then each arm's p50 over ``plain``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eagle3.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]




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


def prompts(pools: Path, n: int, seed: int) -> list[list[dict[str, str]]]:
    out = []
    for line in (pools / "train.jsonl").open(encoding="utf-8"):
        record = json.loads(line)
        if record.get("domain") == "general" and record.get("language") == "en":
            user = next((m for m in record["messages"] if m["role"] == "user"), None)
            if user and len(user["content"]) < 800:
                out.append([user])
    random.Random(seed).shuffle(out)
    return out[:n]


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def arm(args: argparse.Namespace, name: str, batch: list[list[dict[str, str]]]) -> dict[str, Any]:
    import httpx

    live = Path(args.out) / name
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "serve_eval.server", "--draft", args.draft, "--k", str(args.k), "--port",
               str(port), "--served-model-name", "m", "--threads", "1"]
    if name != "plain":
        command += ["--live", str(live)]
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    trainer = None
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server)
        seconds = []
        with httpx.Client(timeout=600) as client:
            for i, messages in enumerate(batch):
                if i == args.warmup and name == "capture+trainer":  # a few captured: the trainer has work
                    trainer = subprocess.Popen(
                        [sys.executable, "-m", "hard_mining.live", "--live", str(live), "--draft", args.draft,
                         "--round-requests", "2", "--holdout", "2", "--steps", "1000", "--threads", "1",
                         "--no-progress"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(args.trainer_start_s)  # loaded and training before the timed requests
                t0 = time.perf_counter()
                r = client.post(f"{url}/v1/chat/completions", json={
                    "model": "m", "messages": messages, "max_tokens": args.max_tokens, "temperature": 0})
                r.raise_for_status()
                if i >= args.warmup:
                    seconds.append(time.perf_counter() - t0)
            text = client.get(f"{url}/metrics").text
        if trainer is not None and trainer.poll() is not None:
            raise SystemExit(f"the trainer exited ({trainer.returncode}) during the measurement")
        forwards, tokens = metric(text, "eagle3_target_forwards_total"), metric(text, "eagle3_generation_tokens_total")
        ordered = sorted(seconds)
        return {"arm": name, "requests": len(seconds), "p50_s": round(ordered[len(ordered) // 2], 3),
                "mean_s": round(sum(seconds) / len(seconds), 3),
                "target_forwards_per_token": round(forwards / tokens, 4) if tokens else None,
                "captured": int(metric(text, "eagle3_capture_requests"))}
    finally:
        for proc in (trainer, server):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--pools", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4, help="requests before the timed ones (not timed)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--trainer-start-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if Path(args.out).exists():
        raise SystemExit(f"{args.out} exists: use a new --out")
    batch = prompts(Path(args.pools), args.warmup + args.requests, args.seed)
    rows = [arm(args, name, batch) for name in ("plain", "capture", "capture+trainer")]
    for row in rows:
        print(json.dumps(row))
    for row in rows[1:]:
        print(json.dumps({"ratio": f"{row['arm']} / plain", "p50": round(row["p50_s"] / rows[0]["p50_s"], 3),
                          "target_forwards_per_token": (row["target_forwards_per_token"],
                                                        rows[0]["target_forwards_per_token"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
