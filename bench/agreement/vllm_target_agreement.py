"""Does real vLLM load our converted target and decode it as HF does? Greedy, same prompts.

Run from the vLLM venv (scripts/setup_vllm_env.sh), on CPU with scripts/vllm_env.sh sourced:

    source scripts/vllm_env.sh
    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/agreement/vllm_target_agreement.py

Prints one JSON line per prompt (tokens equal up to the first divergence) and a summary.

An NVFP4 checkpoint (``python -m data_gen.nvfp4``) is read by vLLM's compressed-tensors loader;
vLLM registers no NVFP4 kernel for CPUs, so on CPU (``data_gen.nvfp4.prepare_vllm_on_cpu``) the engine
runs in-process with vLLM's own emulation kernel (its fallback on GPUs without FP4) added to the
CPU's list: vLLM's emulation judges ours.
"""

from __future__ import annotations

import argparse
import json
import time

from eagle3.config import DEFAULT_TARGET

PROMPTS = [
    "What is 2+2?",
    "Write a Python function that checks whether a number is prime.",
    "Explain photosynthesis to a ten-year-old.",
    "Traduis en anglais : « Il pleut depuis trois jours. »",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--reference", help="a second target (e.g. the BF16 original of an NVFP4 checkpoint): "
                                            "its teacher-forced top-1 agreement with ours gives the scale")
    args = parser.parse_args()
    import torch
    from vllm import LLM, SamplingParams

    from eagle3.target.model import load_target

    target = load_target(args.target, dtype="float32", device="cpu")
    tok = target.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for p in PROMPTS]
    hf = []
    with torch.no_grad():
        for ids in prompts:
            out = target.model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False)
            hf.append(out[0, len(ids):].tolist())

    from data_gen.nvfp4 import prepare_vllm_on_cpu

    prepare_vllm_on_cpu(target.model.name_or_path)
    t0 = time.perf_counter()
    llm = LLM(model=target.model.name_or_path, dtype="float32", enforce_eager=True, max_model_len=2048,
              enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                        SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens))
    equal = 0
    for prompt, ids, ref, out in zip(PROMPTS, prompts, hf, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        same = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got)))
        equal += got == ref
        margin = None
        if got != ref and same < min(len(ref), len(got)):  # our top-2 logit margin where they part
            with torch.no_grad():
                logits = target(torch.tensor([ids + ref[:same]])).logits[0, -1]
            top2 = logits.topk(2).values
            margin = round(float(top2[0] - top2[1]), 6)
        print(json.dumps({"prompt": prompt[:40], "hf_tokens": len(ref), "vllm_tokens": len(got),
                          "equal_prefix": same, "identical": got == ref, "top2_margin_at_divergence": margin}))
    print(json.dumps({"figure": "vllm_hf_greedy_identical", "value": equal, "of": len(PROMPTS),
                      "vllm_load_s": round(load_s, 1)}))

    # teacher-forced on prompt + our continuation: does vLLM's argmax equal ours at each position?
    full = [ids + ref for ids, ref in zip(prompts, hf, strict=True)]
    scored = llm.generate([{"prompt_token_ids": f} for f in full],
                          SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    with torch.no_grad():
        ours = [target(torch.tensor([f])).logits[0, :-1].argmax(-1).tolist() for f in full]  # predicts f[1:]
    vllm_top = [[next(t for t, lp in s.prompt_logprobs[i].items() if lp.rank == 1) for i in range(1, len(f))]
                for f, s in zip(full, scored, strict=True)]
    agree = sum(a == b for o, v in zip(ours, vllm_top, strict=True) for a, b in zip(o, v, strict=True))
    total = sum(len(o) for o in ours)
    print(json.dumps({"figure": "vllm_hf_teacher_forced_top1_agreement", "value": round(agree / total, 4),
                      "tokens": total}))
    if args.reference:
        other = load_target(args.reference, dtype="float32", device="cpu")
        with torch.no_grad():
            theirs = [other(torch.tensor([f])).logits[0, :-1].argmax(-1).tolist() for f in full]
        agree = sum(a == b for o, r in zip(ours, theirs, strict=True) for a, b in zip(o, r, strict=True))
        print(json.dumps({"figure": "reference_hf_teacher_forced_top1_agreement", "reference": args.reference,
                          "value": round(agree / total, 4), "tokens": total}))


if __name__ == "__main__":
    main()
