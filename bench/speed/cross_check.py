"""Cross-checks in one run: our loop (plain, fixed K, adaptive K) vs HF prompt-lookup decoding vs
vLLM (the same exported draft, and its n-gram speculator), on the same eval prompts.

    OMP_NUM_THREADS=1 .venv/bin/python bench/speed/cross_check.py --draft runs/train/best --pools runs/pools \\
        [--per-set 5] [--max-new-tokens 96] [--k 3] [--no-vllm] [--out runs/cross_check.md]

Rows (one JSON line each, then the table on stderr and in ``--out``):

* ``ours-plain``: our loop without the draft (one target forward per token): the baseline of
  every ``ours-*`` speedup;
* ``ours-k<K>``: fixed chain depth K; ``ours-adaptive``: depth 0..K chosen per round from the
  request's running acceptance and the cost model measured at start (:mod:`serve_eval.adaptive`),
  acceptance carried across requests as the server does;
* ``hf-generate`` and ``hf-prompt-lookup``: transformers ``generate`` greedy, without and with
  ``prompt_lookup_num_tokens``; the lookup's speedup is over ``hf-generate``;
* ``vllm-plain``, ``vllm-eagle3``, ``vllm-ngram``: vLLM on CPU (``tools/vllm_judge.py`` in the
  vLLM venv), tau from its spec-decode counters; speedups over ``vllm-plain``.

``tau`` is tokens per target forward (1 for plain decoding); ``equal`` counts prompts whose
greedy output equals the plain decoding of the same engine. ``tau_vs_vllm`` on the ours-k row:
our loop's tau over vLLM's for the same draft and K (the two implementations should agree within
a few percent).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from eagle3.config import DEFAULT_TARGET

ROOT = Path(__file__).resolve().parents[2]


def run_ours(decoder: Any, prompts: dict[str, list[list[int]]], stops: list[int], max_new: int,
             policy_for: Any = None, speculate: bool = True) -> dict[str, Any]:
    """Every set's prompts through ``decoder``; per set: tokens, seconds, forwards, rounds."""
    out: dict[str, Any] = {}
    for name, items in prompts.items():
        rows, seconds, forwards, accepted, depths = [], 0.0, 0, [], []
        for p in items:
            policy = policy_for.start() if policy_for is not None else None
            gen = decoder.generate(p, max_new, set(stops), speculate=speculate, policy=policy)
            if policy is not None:
                policy_for.finish(policy)
            rows.append(gen.tokens)
            seconds += gen.stats.seconds_total
            forwards += gen.stats.target_forwards + 1  # + prefill, which emits the first token
            accepted += gen.stats.accepted
            depths += gen.stats.depths
        out[name] = {"tokens": rows, "seconds": seconds, "forwards": forwards, "accepted": accepted,
                     "depths": depths}
    return out


def run_hf(target: Any, prompts: dict[str, list[list[int]]], stops: list[int], max_new: int,
           lookup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    for name, items in prompts.items():
        rows, seconds = [], 0.0
        for p in items:
            start = time.perf_counter()
            with torch.no_grad():
                ids = target.model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                                            eos_token_id=stops, pad_token_id=stops[0], **extra)
            seconds += time.perf_counter() - start
            rows.append(ids[0, len(p):].tolist())
        out[name] = {"tokens": rows, "seconds": seconds}
    return out


def row(method: str, name: str, got: dict[str, Any], base: dict[str, Any], tau: float | None,
        **extra: Any) -> dict[str, Any]:
    n = sum(len(t) for t in got["tokens"])
    tps = n / got["seconds"] if got["seconds"] else 0.0
    base_tps = sum(len(t) for t in base["tokens"]) / base["seconds"] if base["seconds"] else 0.0
    equal = sum(a == b for a, b in zip(got["tokens"], base["tokens"], strict=True))
    return {"figure": "cross_check", "method": method, "set": name, "tau": round(tau, 4) if tau else None,
            "tokens_per_s": round(tps, 2), "speedup": round(tps / base_tps, 3) if base_tps else None,
            "equal": equal, "prompts": len(got["tokens"]), **extra}


def merged(results: dict[str, Any]) -> dict[str, Any]:
    """All sets as one."""
    out: dict[str, Any] = {"tokens": [], "seconds": 0.0, "forwards": 0, "accepted": [], "depths": []}
    for r in results.values():
        out["tokens"] += r["tokens"]
        out["seconds"] += r["seconds"]
        for key in ("forwards",):
            out[key] += r.get(key, 0)
        for key in ("accepted", "depths"):
            out[key] += r.get(key, [])
    return out


def ours_tau(r: dict[str, Any]) -> float:
    rounds = r["accepted"]
    return sum(a + 1 for a in rounds) / len(rounds) if rounds else 1.0


def vllm_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    py = ROOT / ".venv-vllm" / "bin" / "python"
    if not py.is_file():
        print("cross_check: no .venv-vllm (scripts/setup_vllm_env.sh): vLLM rows skipped", file=sys.stderr)
        return []
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    setup = ROOT / "scripts" / "vllm_env.sh"
    cmd = [str(py), "tools/vllm_judge.py", "--draft", f"eagle3={args.draft}", "--ngram", "--pools", args.pools,
           "--sets", args.sets, "--per-set", str(args.per_set), "--k", str(args.k),
           "--max-new-tokens", str(args.max_new_tokens), "--target", args.target]
    shell = f"source {setup} >/dev/null 2>&1; exec " + " ".join(f"'{c}'" for c in cmd) if setup.is_file() else None
    proc = subprocess.run(["bash", "-c", shell] if shell else cmd, cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE)
    if proc.returncode != 0:
        print(f"cross_check: vllm_judge failed (exit {proc.returncode}): vLLM rows skipped", file=sys.stderr)
        return []
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def table(rows: list[dict[str, Any]]) -> str:
    head = "| method | set | tau | tokens/s | speedup | equal | notes |\n|---|---|---|---|---|---|---|\n"
    body = []
    for r in rows:
        notes = ", ".join(f"{k} {v}" for k, v in r.items()
                          if k not in ("figure", "method", "set", "tau", "tokens_per_s", "speedup", "equal",
                                       "prompts") and v is not None)
        body.append(f"| {r['method']} | {r['set']} | {r['tau'] if r['tau'] is not None else '-'} | "
                    f"{r['tokens_per_s']} | {r['speedup'] if r['speedup'] is not None else '-'} | "
                    f"{r['equal']}/{r['prompts']} | {notes} |")
    return head + "\n".join(body) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--pools", default="runs/pools")
    parser.add_argument("--sets", default="mtbench,humaneval,gsm8k,multilingual")
    parser.add_argument("--per-set", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--lookup", type=int, default=10, help="HF prompt_lookup_num_tokens")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--out", default=None, help="write the table (markdown) here too")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from eagle3.target.chat import ChatFormat
    from serve_eval.adaptive import AdaptiveSession, measure_cost
    from serve_eval.config import SpecConfig
    from serve_eval.eval_runs import load_pair_meta
    from serve_eval.evaluate import read_prompts
    from serve_eval.server import draft_prior
    from serve_eval.spec_decode import SpeculativeDecoder

    target, draft, meta = load_pair_meta(args.draft, args.target)
    chat = ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)
    prompts = {n: read_prompts(Path(args.pools), n, args.per_set, chat) for n in args.sets.split(",")}
    stops = sorted(chat.stop_ids)
    decoder = SpeculativeDecoder(target, draft, SpecConfig("chain", args.k))
    cost = measure_cost(decoder, args.k)
    print(json.dumps({"figure": "cost_model", **cost.as_dict()}), flush=True)

    results = {
        "ours-plain": run_ours(decoder, prompts, stops, args.max_new_tokens, speculate=False),
        f"ours-k{args.k}": run_ours(decoder, prompts, stops, args.max_new_tokens),
        "ours-adaptive": run_ours(decoder, prompts, stops, args.max_new_tokens,
                                  policy_for=AdaptiveSession(cost, args.k, draft_prior(meta, args.k))),
        "hf-generate": run_hf(target, prompts, stops, args.max_new_tokens, 0),
        "hf-prompt-lookup": run_hf(target, prompts, stops, args.max_new_tokens, args.lookup),
    }
    rows: list[dict[str, Any]] = []
    vllm = [] if args.no_vllm else vllm_rows(args)
    vllm_tau = {(x["draft"], x["set"]): x for x in vllm if x.get("figure") == "vllm_judge"}
    for name in [*prompts, "overall"]:
        pick = (lambda r: merged(r)) if name == "overall" else (lambda r, n=name: r[n])
        plain, hf = pick(results["ours-plain"]), pick(results["hf-generate"])
        rows.append(row("ours-plain", name, plain, plain, 1.0))
        fixed = pick(results[f"ours-k{args.k}"])
        extra: dict[str, Any] = {}
        if name != "overall" and ("eagle3", name) in vllm_tau:
            extra["tau_vs_vllm"] = round(ours_tau(fixed) / vllm_tau[("eagle3", name)]["tau"], 4)
        extra.update(drafts=len(fixed["accepted"]), accepted=sum(fixed["accepted"]))  # raw counts, as vLLM's
        rows.append(row(f"ours-k{args.k}", name, fixed, plain, ours_tau(fixed), **extra))
        adaptive = pick(results["ours-adaptive"])
        depths = adaptive["depths"]
        rows.append(row("ours-adaptive", name, adaptive, plain, ours_tau(adaptive),
                        mean_depth=round(sum(depths) / len(depths), 3) if depths else None,
                        plain_rounds=round(sum(d == 0 for d in depths) / len(depths), 3) if depths else None))
        rows.append(row("hf-generate", name, hf, hf, 1.0, over_ours_plain=round(
            (sum(len(t) for t in hf["tokens"]) / hf["seconds"]) /
            (sum(len(t) for t in plain["tokens"]) / plain["seconds"]), 3)))
        rows.append(row("hf-prompt-lookup", name, pick(results["hf-prompt-lookup"]), hf, None))
    for x in vllm:
        if x.get("figure") != "vllm_judge":
            continue
        method = "vllm-eagle3" if x["draft"] == "eagle3" else f"vllm-{x['draft']}"
        rows.append({"figure": "cross_check", "method": method, "set": x["set"], "tau": x["tau"],
                     "tokens_per_s": x["tokens_per_s"],
                     "speedup": round(x["tokens_per_s"] / x["plain_tokens_per_s"], 3),
                     "equal": x["equal"], "prompts": x["prompts"], "vllm_plain_tokens_per_s": x["plain_tokens_per_s"],
                     "drafts": x["drafts"], "accepted": x["accepted"]})
    for r in rows:
        print(json.dumps(r), flush=True)
    text = table(rows)
    print(text, file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
