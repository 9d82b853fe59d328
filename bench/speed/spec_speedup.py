"""Speculative decoding speed on this machine: the bundled loop against plain decoding in the same
loop and against HF ``generate``, next to the cost model's prediction for the measured tau.

    OMP_NUM_THREADS=1 .venv/bin/python bench/speed/spec_speedup.py --draft runs/train/best --pools runs/pools \\
        [--per-set 5] [--max-new-tokens 96] [--k 3] [--mode chain|tree] [--device auto] [--target-dtype auto]

One JSON line per figure:

* ``cost_model`` (:func:`serve_eval.adaptive.measure_cost`, synchronised on CUDA): a target forward
  over 1 and K+1 new tokens after a ``--context``-token prefix (KV cache), one draft step, the
  break-even tau and the ceiling; the predicted speedup for a tau is
  ``tau * t(1) / (t(K+1) + K * t_draft)`` (verifying K+1 tokens costs t(K+1), drafting them K steps);
* ``baseline``: HF ``generate`` greedy (KV cache) vs our plain loop on the same prompts — the
  plain loop must be at least as fast, or the speedup is measured against a slow baseline;
* ``speculative`` per eval set and overall: tau, acceptance per position, tokens/s of the
  speculative and plain loops, the measured speedup, the prediction for that tau and their ratio
  (the gap is the loop's own overhead);
* ``beside`` per eval set and overall, for each of ``--compare`` (default: ``lookup``, the untrained
  prompt-lookup baseline; ``hybrid``: the draft and the lookup in one verified tree): its tau (tokens
  per target forward), speedup and greedy equality on the same prompts, and its ratio to the draft's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from eagle3.config import add_target_arguments  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    add_target_arguments(parser)
    parser.add_argument("--pools", default="runs/pools")
    parser.add_argument("--sets", default="mtbench,humaneval,gsm8k,multilingual")
    parser.add_argument("--per-set", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--mode", choices=("chain", "tree"), default="chain")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--compare", default="lookup",
                        help="proposers run beside the draft on the same prompts, comma separated ('' for none)")
    parser.add_argument("--out", default=None, help="also write serve_eval's report here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from eagle3.config import SamplingConfig
    from eagle3.device import synchronize
    from eagle3.draft.formats import DraftFormatError
    from eagle3.target.chat import ChatFormat
    from eagle3.target.model import TargetLoadError, TargetSourceError
    from serve_eval.adaptive import measure_cost
    from serve_eval.config import SpecConfig
    from serve_eval.eval_runs import load_pair
    from serve_eval.evaluate import evaluate, read_prompts, write_report
    from serve_eval.spec_decode import SpeculativeDecoder

    try:
        target, draft = load_pair(args.draft, args.target, args.target_dtype, args.device)
        chat = ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)
        prompts = {n: read_prompts(Path(args.pools), n, args.per_set, chat) for n in args.sets.split(",")}
    except (DraftFormatError, TargetLoadError, TargetSourceError, ValueError, OSError) as err:
        raise SystemExit(f"spec_speedup: error: {err}") from None

    config = SpecConfig(args.mode, args.k, args.topk, args.budget)
    width = args.budget if args.mode == "tree" else args.k
    cost = measure_cost(SpeculativeDecoder(target, draft, config), width, args.context, args.repeats)
    print(json.dumps({"figure": "cost_model", "device": str(target.device), "context": args.context,
                      **cost.explain(args.k, width=width)}), flush=True)

    # the honest baseline: HF generate greedy on the same prompts, against our plain loop
    flat = [p for items in prompts.values() for p in items]
    stops = sorted(chat.stop_ids)
    hf_tokens, hf_seconds = 0, 0.0
    for p in flat:
        synchronize(target.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = target.model.generate(torch.tensor([p], device=target.device), max_new_tokens=args.max_new_tokens,
                                        do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
        synchronize(target.device)
        hf_seconds += time.perf_counter() - start
        hf_tokens += out.shape[1] - len(p)
    compare = [c for c in args.compare.split(",") if c]
    report = evaluate(target, draft, prompts, config=config, params=SamplingConfig(),
                      max_new_tokens=args.max_new_tokens, stop_ids=stops, progress=False, compare=compare)
    plain_tps = report["overall"]["plain_tokens_per_s"]
    print(json.dumps({"figure": "baseline", "hf_generate_tokens_per_s": round(hf_tokens / hf_seconds, 2),
                      "plain_loop_tokens_per_s": plain_tps,
                      "plain_over_hf": round(plain_tps / (hf_tokens / hf_seconds), 3)}), flush=True)
    for name, s in [*report["sets"].items(), ("overall", report["overall"])]:
        line = {"figure": "speculative", "set": name, "mode": args.mode, "k": args.k, "tau": s["tau"],
                "accept_per_pos": s["accept_per_pos"], "spec_tokens_per_s": s["spec_tokens_per_s"],
                "plain_tokens_per_s": s["plain_tokens_per_s"], "speedup": s["speedup"],
                "equal": s.get("equal"), "prompts": s["prompts"]}
        predicted = cost.speedup(s["tau"], args.k, width)
        line.update(predicted_speedup=round(predicted, 3),
                    measured_over_predicted=round(s["speedup"] / predicted, 3) if s["speedup"] else None)
        print(json.dumps(line), flush=True)
    for proposer, other in report["compare"].items():
        for name, s in [*other["sets"].items(), ("overall", other["overall"])]:
            mine = report["overall"] if name == "overall" else report["sets"][name]
            print(json.dumps({"figure": "beside", "proposer": proposer, "set": name, "tau": s["tau"],
                              "speedup": s["speedup"], "equal": s.get("equal"), "prompts": s["prompts"],
                              "tau_over_draft": round(s["tau"] / mine["tau"], 3),
                              "speedup_over_draft": round(s["speedup"] / mine["speedup"], 3)
                              if s["speedup"] and mine["speedup"] else None}), flush=True)
    if args.out:
        report["draft"], report["target"] = args.draft, args.target
        write_report(report, Path(args.out), "disabled")


if __name__ == "__main__":
    main()
