"""Regeneration throughput: data_gen.generate at batch 1 vs batch 8, same prompts, same run.

Also plain ``target.model.generate`` at batch 1 (the wrapper's overhead), and how many
rows batch 8 generated exactly as batch 1 did. One JSON line per figure. With ``--vllm``
(run from the venv of scripts/setup_vllm_env.sh) the vLLM backend is timed too, on the
same prompts, and its rows are compared with HF's.

    OMP_NUM_THREADS=1 .venv/bin/python bench/speed/regen_throughput.py [--target smollm2-135m] [--max-new-tokens 64]
    source scripts/vllm_env.sh; OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/speed/regen_throughput.py --vllm

Tokens counted are generated tokens (stop token included, padding of finished rows not).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from data_gen.generate import Generator, HFGenerator, generate
from eagle3.config import DEFAULT_TARGET, SamplingConfig
from eagle3.target.chat import ChatFormat
from eagle3.target.model import load_target

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain what a race condition is, with a short example in Go.",
    "Fix the bug: `def mean(xs): return sum(xs) / len(xs) + 1`",
    "Write a SQL query that lists the ten customers with the highest total order value.",
    "What is 17 * 24? Show your steps.",
    "Solve for x: 3x + 7 = 22.",
    "A train travels 180 km in 2.5 hours. What is its average speed in km/h?",
    "Prove that the sum of two even numbers is even.",
    "Traduis en anglais : « Le chat dort sur le canapé depuis ce matin. »",
    "¿Cuáles son los tres ríos más largos de Europa?",
    "Erkläre kurz, was Photosynthese ist.",
    "用一句话解释什么是机器学习。",
    "Give me three tips for writing a clear README.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Hi! How are you today?",
]


def _batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} built-in")
    parser.add_argument("--vllm", action="store_true", help="also time the vLLM backend (needs vLLM installed)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    chat = ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)
    prompts = [chat.prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS[:args.prompts]]
    sampling = SamplingConfig()
    stops = sorted(chat.stop_ids)
    generate(target, prompts[:1], stops, 4)  # warm-up

    def timed(generator: Generator, batch: int):
        t0 = time.perf_counter()
        out = [g for chunk in _batches(prompts, batch)
               for g in generator.generate(chunk, stops, args.max_new_tokens, sampling)]
        return out, time.perf_counter() - t0

    hf = HFGenerator(target)
    alone, alone_s = timed(hf, 1)
    batched, batched_s = timed(hf, args.batch)

    t0 = time.perf_counter()
    plain_tokens = 0
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=target.device)
            out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                        do_sample=False, eos_token_id=stops, pad_token_id=target.tokenizer.pad_token_id)
            new = out[0, ids.shape[1]:].tolist()
            plain_tokens += next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
    plain_s = time.perf_counter() - t0

    alone_tokens = sum(g.num_generated for g in alone)
    batched_tokens = sum(g.num_generated for g in batched)
    common = {"target": args.target, "dtype": args.dtype, "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads()}
    figures = [
        {"figure": "regen_tokens_per_s", "batch": 1, "value": round(alone_tokens / alone_s, 2),
         "tokens": alone_tokens, "seconds": round(alone_s, 2)},
        {"figure": "regen_tokens_per_s", "batch": args.batch, "value": round(batched_tokens / batched_s, 2),
         "tokens": batched_tokens, "seconds": round(batched_s, 2)},
        {"figure": f"regen_batch{args.batch}_over_batch1_ratio",
         "value": round((batched_tokens / batched_s) / (alone_tokens / alone_s), 3)},
        {"figure": "hf_generate_tokens_per_s", "batch": 1, "value": round(plain_tokens / plain_s, 2),
         "tokens": plain_tokens, "seconds": round(plain_s, 2)},
        {"figure": f"rows_equal_batch{args.batch}_vs_batch1",
         "value": sum(a == b for a, b in zip(alone, batched, strict=True)), "of": len(prompts)},
    ]
    if args.vllm:
        from data_gen.vllm_generate import VllmGenerator

        vllm = VllmGenerator(target.model.name_or_path, dtype=args.dtype)
        vllm.generate(prompts[:1], stops, 4, SamplingConfig())  # warm-up
        v_alone, v_alone_s = timed(vllm, 1)
        v_batched, v_batched_s = timed(vllm, args.batch)
        v_alone_tokens = sum(g.num_generated for g in v_alone)
        v_batched_tokens = sum(g.num_generated for g in v_batched)
        figures += [
            {"figure": "vllm_regen_tokens_per_s", "batch": 1, "value": round(v_alone_tokens / v_alone_s, 2),
             "tokens": v_alone_tokens, "seconds": round(v_alone_s, 2)},
            {"figure": "vllm_regen_tokens_per_s", "batch": args.batch,
             "value": round(v_batched_tokens / v_batched_s, 2), "tokens": v_batched_tokens,
             "seconds": round(v_batched_s, 2)},
            {"figure": f"vllm_over_hf_ratio_batch{args.batch}",
             "value": round((v_batched_tokens / v_batched_s) / (batched_tokens / batched_s), 3)},
            {"figure": "rows_equal_vllm_vs_hf", "value": sum(a == b for a, b in zip(alone, v_batched, strict=True)),
             "of": len(prompts)},
        ]
    for figure in figures:
        print(json.dumps({**figure, **common}, ensure_ascii=False))


if __name__ == "__main__":
    main()
