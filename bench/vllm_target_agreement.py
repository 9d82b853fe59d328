"""Does real vLLM load our converted target and decode it as HF does? Greedy, same prompts.

Run from the vLLM venv (scripts/setup_vllm_env.sh), on CPU with scripts/vllm_env.sh sourced:

    source scripts/vllm_env.sh
    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/vllm_target_agreement.py

Prints one JSON line per prompt (tokens equal up to the first divergence) and a summary.
"""

from __future__ import annotations

import argparse
import json
import time

PROMPTS = [
    "What is 2+2?",
    "Write a Python function that checks whether a number is prime.",
    "Explain photosynthesis to a ten-year-old.",
    "Traduis en anglais : « Il pleut depuis trois jours. »",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    from eagle3.target import load_target

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

    t0 = time.perf_counter()
    llm = LLM(model=target.model.name_or_path, dtype="float32", enforce_eager=True, max_model_len=2048,
              enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                        SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens))
    equal = 0
    for prompt, ref, out in zip(PROMPTS, hf, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        same = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got)))
        equal += got == ref
        print(json.dumps({"prompt": prompt[:40], "hf_tokens": len(ref), "vllm_tokens": len(got),
                          "equal_prefix": same, "identical": got == ref}))
    print(json.dumps({"figure": "vllm_hf_greedy_identical", "value": equal, "of": len(PROMPTS),
                      "vllm_load_s": round(load_s, 1)}))


if __name__ == "__main__":
    main()
