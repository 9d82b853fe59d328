"""Regeneration: the cached engine vs depth-by-depth re-prefilling, on the quickstart's own prompts,
beside the limit of the target's forward on this machine.

The same conversations (the first ``--conversations`` of the quickstart's domain-balanced selection,
sorted as the pipeline sorts them) regenerated twice in one run: ``depth`` (every turn's whole prompt
fed again, HF ``generate`` per depth: how regeneration ran before the engine) and ``cached`` (the
engine: the history fed once, rows decoded together and refilled). Greedy, so both must write the same
tokens (counted), and every token the engine wrote is checked against the argmax of one full forward over
its prompt and reply (ties within 1e-4 named). The limit: this machine's memory bandwidth (a large
copy) and matmul rate (fp32, 64 x 576 x 1536 products, one thread) give the fastest each forward
could be — decode reads the weights once per step and each row's cache slots, prefill is
compute-bound — and the engine's decode/prefill rates are printed beside it. One JSON line per figure.

    OMP_NUM_THREADS=1 .venv/bin/python bench/speed/regen_cached.py --pool runs/quickstart/prompts.jsonl \\
        [--conversations 16] [--rows 8] [--max-new-tokens 80]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from data_gen.engine import Engine, greedy_check
from data_gen.generate import regenerate_conversations
from data_gen.regenerate import read_pool
from eagle3.config import DEFAULT_TARGET
from eagle3.target.chat import ChatFormat
from eagle3.target.model import load_target


def machine_rates() -> tuple[float, float]:
    """(bytes/s of a 256 MiB copy, fp32 matmul FLOP/s at 64 rows) on this thread count."""
    a = torch.randn(64 * 2**20)
    b = torch.empty_like(a)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    bandwidth = 2 * a.numel() * 4 * 5 / (time.perf_counter() - t0)
    x, w = torch.randn(64, 576), torch.randn(1536, 576)
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    t0 = time.perf_counter()
    for _ in range(200):
        torch.nn.functional.linear(x, w)
    flops = 2 * 64 * 576 * 1536 * 200 / (time.perf_counter() - t0)
    return bandwidth, flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", required=True, help="conversations jsonl, e.g. runs/quickstart/prompts.jsonl")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--skip-depth", action="store_true", help="time the engine only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    records = read_pool(Path(args.pool))[: args.conversations]
    target = load_target(args.target, dtype="float32", device="cpu")
    chat = ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config)
    convs = [r["messages"] for r in records]
    tools = [r.get("tools") for r in records]
    bandwidth, flops = machine_rates()
    params = sum(p.numel() for p in target.model.parameters())
    weight_bytes = params * 4
    cfg = target.config
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    print(json.dumps({"figure": "machine", "copy_gb_per_s": round(bandwidth / 1e9, 2),
                      "matmul_gflop_per_s": round(flops / 1e9, 1), "params": params,
                      "kv_bytes_per_token": kv_bytes}))

    t0 = time.perf_counter()
    engine = Engine(target, args.rows, chat.stop_ids, args.max_new_tokens)
    cached = regenerate_conversations(target, chat, convs, args.max_new_tokens, engine=engine, tools=tools)
    cached_s = time.perf_counter() - t0
    st = engine.stats
    new_tokens = sum(t.num_generated for c in cached for t in c.turns)
    # the limit of what the engine fed: decode steps read the weights once and their rows' slots;
    # prefill (and every forward) needs 2 x params FLOPs per token
    decode_limit_s = max(st.decode_forwards * weight_bytes / bandwidth + st.decode_kv_slots * kv_bytes / bandwidth,
                         2 * params * st.decode_tokens / flops)
    prefill_limit_s = 2 * params * st.prefill_tokens / flops
    print(json.dumps({
        "figure": "cached", "conversations": len(convs), "rows": args.rows, "seconds": round(cached_s, 1),
        "new_tokens": new_tokens, "new_tokens_per_s": round(new_tokens / cached_s, 1),
        "fed_tokens": st.fed_tokens, "conversation_tokens": st.conversation_tokens,
        "fed_per_conversation_token": round(st.fed_tokens / st.conversation_tokens, 3),
        "decode_tokens_per_s": round(st.decode_tokens / st.decode_seconds, 1),
        "decode_limit_tokens_per_s": round(st.decode_tokens / decode_limit_s, 1),
        "decode_rows_per_forward": round(st.decode_tokens / st.decode_forwards, 2),
        "prefill_tokens_per_s": round(st.prefill_tokens / st.prefill_seconds, 1),
        "prefill_limit_tokens_per_s": round(st.prefill_tokens / prefill_limit_s, 1),
    }))
    checked, equal, ties = greedy_check(target, cached)  # every regenerated token vs a full forward's argmax
    print(json.dumps({"figure": "greedy_argmax", "tokens": checked, "argmax": equal, "round_off_ties": ties,
                      "other": checked - equal - ties}))
    if args.skip_depth:
        return
    t0 = time.perf_counter()
    depth = regenerate_conversations(target, chat, convs, args.max_new_tokens, tools=tools)
    depth_s = time.perf_counter() - t0
    fed_depth = sum(len(p) + len(t.token_ids) for c in depth for p, t in zip(c.prompts, c.turns, strict=True))
    same = sum(a.token_ids == b.token_ids for x, y in zip(cached, depth, strict=True)
               for a, b in zip(x.turns, y.turns, strict=True))
    turns = sum(len(c.turns) for c in depth)
    print(json.dumps({"figure": "depth", "seconds": round(depth_s, 1),
                      "new_tokens_per_s": round(sum(t.num_generated for c in depth for t in c.turns) / depth_s, 1),
                      "fed_tokens_at_least": fed_depth}))
    print(json.dumps({"figure": "speedup", "cached_vs_depth": round(depth_s / cached_s, 2),
                      "turns_equal": f"{same}/{turns}"}))


if __name__ == "__main__":
    main()
