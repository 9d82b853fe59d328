"""Stage: how far a quantised target (NVFP4, emulated) is from its reference, on the eval sets.

    python -m serve_eval.quant_report --quantized runs/nvfp4/smollm2 [--reference smollm2-135m] \\
        --pools runs/pools --out runs/nvfp4/quality [--per-set 10] [--max-new-tokens 96]

Per prompt (first user turn, chat template) the reference decodes greedily; then both models read
prompt + that continuation and we compare them token by token:

* ``top1_agreement``: the quantised model's argmax equals the reference's token (teacher-forced);
* ``kl``: KL(reference || quantised) of the next-token distributions, nats per token;
* ``ppl_reference`` / ``ppl_quantized``: perplexity of the reference continuation, and
  ``ppl_prompt_*`` of the prompts themselves (text neither model wrote);
* free-running: the quantised model also decodes greedily; ``greedy_equal`` counts outputs
  identical to the reference's, ``greedy_common_prefix`` the mean length they share.

Writes ``report.json`` and ``report.md`` to ``--out`` and prints one JSON line per set.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.atomic import atomic_write_text
from eagle3.config import DEFAULT_TARGET
from eagle3.errors import InputError, run_cli
from serve_eval.config import EVAL_SETS, EvalConfig
from serve_eval.eval_runs import first_divergence
from serve_eval.evaluate import read_prompts


@torch.no_grad()
def compare_on(reference: Any, quantized: Any, prompt: list[int], continuation: list[int]) -> dict[str, Tensor]:
    """Per-token comparisons of two targets on ``prompt + continuation`` (the continuation scored)."""
    ids = torch.tensor([prompt + continuation], device=reference.device)
    ref = reference(ids, return_logits=True).logits[0].float().log_softmax(-1)  # [seq, vocab]
    qua = quantized(ids.to(quantized.device), return_logits=True).logits[0].float().log_softmax(-1).to(ref.device)
    targets = ids[0, 1:]  # position t predicts token t+1
    ref, qua = ref[:-1], qua[:-1]  # [seq-1, vocab]
    start = len(prompt) - 1  # first position predicting a continuation token
    kl = F.kl_div(qua, ref, log_target=True, reduction="none").sum(-1)  # [seq-1] KL(ref || qua)
    return {
        "nll_ref": -ref.gather(-1, targets[:, None])[:, 0],  # [seq-1]
        "nll_q": -qua.gather(-1, targets[:, None])[:, 0],
        "agree": qua.argmax(-1) == ref.argmax(-1),
        "kl": kl,
        "start": torch.tensor(start, device=ids.device),
    }


def _mean(values: list[Tensor]) -> float:
    cat = torch.cat([v.float().reshape(-1) for v in values]) if values else torch.zeros(0)
    return float(cat.mean()) if cat.numel() else float("nan")


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    gen = [r["cmp"] for r in rows]
    cont = [{k: g[k][int(g["start"]):] for k in ("nll_ref", "nll_q", "agree", "kl")} for g in gen]
    prompt = [{k: g[k][: int(g["start"])] for k in ("nll_ref", "nll_q")} for g in gen]
    return {
        "prompts": len(rows),
        "tokens": sum(len(c["agree"]) for c in cont),
        "top1_agreement": round(_mean([c["agree"] for c in cont]), 4),
        "kl": round(_mean([c["kl"] for c in cont]), 5),
        "ppl_reference": round(float(torch.exp(torch.tensor(_mean([c["nll_ref"] for c in cont])))), 4),
        "ppl_quantized": round(float(torch.exp(torch.tensor(_mean([c["nll_q"] for c in cont])))), 4),
        "ppl_prompt_reference": round(float(torch.exp(torch.tensor(_mean([p["nll_ref"] for p in prompt])))), 4),
        "ppl_prompt_quantized": round(float(torch.exp(torch.tensor(_mean([p["nll_q"] for p in prompt])))), 4),
        "greedy_equal": sum(r["equal"] for r in rows),
        "greedy_common_prefix": round(sum(r["common"] for r in rows) / max(len(rows), 1), 2),
        "greedy_tokens": round(sum(r["length"] for r in rows) / max(len(rows), 1), 2),
    }


def run(reference: Any, quantized: Any, prompts: dict[str, list[list[int]]], max_new_tokens: int,
        stop_ids: Sequence[int]) -> dict[str, Any]:
    from data_gen.generate import generate

    per_set: dict[str, Any] = {}
    everything: list[dict[str, Any]] = []
    for name, items in prompts.items():
        rows = []
        for prompt in items:
            ref_out = generate(reference, [prompt], stop_ids, max_new_tokens)[0].token_ids
            q_out = generate(quantized, [prompt], stop_ids, max_new_tokens)[0].token_ids
            diverge = first_divergence(ref_out, q_out)
            rows.append({"cmp": compare_on(reference, quantized, prompt, ref_out), "equal": diverge is None,
                         "common": len(ref_out) if diverge is None else diverge, "length": len(ref_out)})
        per_set[name] = summarise(rows)
        everything += rows
        print(json.dumps({"set": name, **per_set[name]}), flush=True)
    per_set["overall"] = summarise(everything)
    print(json.dumps({"set": "overall", **per_set["overall"]}), flush=True)
    return per_set


def markdown(report: dict[str, Any]) -> str:
    cols = ["prompts", "tokens", "top1_agreement", "kl", "ppl_reference", "ppl_quantized", "ppl_prompt_reference",
            "ppl_prompt_quantized", "greedy_equal", "greedy_common_prefix", "greedy_tokens"]
    lines = [f"# {report['quantized']} ({report['mode']}) vs {report['reference']}", "",
             "| set | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, row in report["sets"].items():
        lines.append(f"| {name} | " + " | ".join(str(row[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("serve_eval.quant_report", _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_eval.quant_report", description=__doc__.splitlines()[0])
    parser.add_argument("--quantized", required=True, help="NVFP4 checkpoint folder (python -m data_gen.nvfp4)")
    parser.add_argument("--quantized-mode", choices=("auto", "w4a4", "w4a16"), default="auto")
    parser.add_argument("--reference", default=DEFAULT_TARGET)
    parser.add_argument("--pools", default="runs/pools")
    parser.add_argument("--sets", default=",".join(EVAL_SETS))
    parser.add_argument("--per-set", type=int, default=EvalConfig.per_set, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=EvalConfig.max_new_tokens,
                        help="greedy tokens per prompt (the evaluation's default)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="auto", help="where both models run (fp32): auto (CUDA when present), "
                        "cpu, cuda, cuda:N")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    for flag in ("per_set", "max_new_tokens", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    torch.set_num_threads(args.threads)

    from eagle3.fingerprint import tokenizer_fingerprint
    from eagle3.target.chat import ChatFormat
    from eagle3.target.model import load_target

    quantized = load_target(args.quantized, dtype="float32", device=args.device, nvfp4_mode=args.quantized_mode)
    reference = load_target(args.reference, dtype="float32", device=args.device)
    if tokenizer_fingerprint(reference.tokenizer) != tokenizer_fingerprint(quantized.tokenizer):
        raise InputError(f"{args.quantized} and {args.reference} have different tokenizers")
    chat = ChatFormat.for_tokenizer(reference.tokenizer, reference.model.generation_config)
    prompts = {name: read_prompts(Path(args.pools), name, args.per_set, chat) for name in args.sets.split(",") if name}
    sets = run(reference, quantized, prompts, args.max_new_tokens, sorted(chat.stop_ids))
    report = {"reference": args.reference, "quantized": args.quantized,
              "mode": getattr(quantized.model, "nvfp4_mode", "dense"), "per_set": args.per_set,
              "max_new_tokens": args.max_new_tokens, "sets": sets}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.json", json.dumps(report, indent=2))
    atomic_write_text(out / "report.md", markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
