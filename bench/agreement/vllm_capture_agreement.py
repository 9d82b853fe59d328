"""Does vLLM's hidden-state capture equal ours (HF)? Aux-layer inputs and the pre-norm last state.

Run from the vLLM venv (scripts/setup_vllm_env.sh), on CPU with scripts/vllm_env.sh sourced:

    source scripts/vllm_env.sh
    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/agreement/vllm_capture_agreement.py [--aux-layer-ids 2,15,27 1,10,20]

For each aux-id set (one vLLM engine each, fp32) the same chat conversations are captured
by :class:`eagle3.target.model.Target` (HF, one sequence at a time) and by
:class:`data_gen.vllm_capture.VllmCapture` (all in one batch). One JSON line per state:

* ``max_rel``: the largest over conversations of max |vllm - hf| / max |hf|;
* ``mean_rel``: mean |vllm - hf| / mean |hf| over all rows;
* ``rows``: rows compared (every token of every conversation).

The bar is ``max_rel <= 1e-3`` for every state. Two control lines show the check can fail:
vLLM's aux states against HF's ``hidden_states[i + 1]`` (an off-by-one capture) and vLLM's
last state against HF's post-norm ``hidden_states[N]``. Then tokens/s of both captures
over the same conversations in the same run (best of ``--repeats`` after a warm-up); HF at
1 and 2 torch threads, since vLLM's CPU worker binds its own OpenMP threads (all cores).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch

from eagle3.config import DEFAULT_TARGET

CONVERSATIONS = [
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number iteratively."}],
    [{"role": "user", "content": "What is 17 * 24? Show your steps."},
     {"role": "assistant", "content": "17 * 24 = 17 * 20 + 17 * 4 = 340 + 68 = 408."},
     {"role": "user", "content": "And 408 / 12?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Explain what a race condition is, with a short example in Go."},
     {"role": "assistant", "content": "Two goroutines increment a shared counter without a lock: `go func(){ n++ }()` "
                                      "run twice can leave n == 1, because read-modify-write is not atomic."}],
    [{"role": "user", "content": "Traduis en anglais : « Le chat dort sur le canapé depuis ce matin. »"}],
    [{"role": "user", "content": "用一句话解释什么是机器学习。"},
     {"role": "assistant", "content": "机器学习是让计算机从数据中自动学习规律并据此做出预测的方法。"}],
    [{"role": "user", "content": "Summarise the plot of Romeo and Juliet in two sentences, then list three themes "
                                 "of the play and one modern film that borrows from it."}],
]


def render(fmt, messages) -> list[int]:
    if messages[-1]["role"] == "user":
        return fmt.prompt_ids(messages)
    return fmt.tokenize_conversation(messages)[0]


def rel_errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
    """(max over sequences of max|a-b|/max|b|, mean|a-b|/mean|b| over all rows)."""
    max_rel = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref, strict=True))
    diff = torch.cat([(a - b).abs().flatten() for a, b in zip(got, ref, strict=True)])
    base = torch.cat([b.abs().flatten() for b in ref])
    return max_rel, (diff.mean() / base.mean()).item()


def hf_capture(target, seqs: list[list[int]]) -> list:
    """Our HF capture as the harvester runs it: one sequence at a time, no logits."""
    return [target(torch.tensor([s]), return_logits=False) for s in seqs]


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--aux-layer-ids", nargs="+", default=["default", "1,10,20"],
                        help="comma-separated id sets, one vLLM engine each; 'default' = 2, N//2, N-3")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM is imported

    from data_gen.vllm_capture import VllmCapture
    from eagle3.target.chat import ChatFormat
    from eagle3.target.model import default_aux_layer_ids, load_target

    hf = load_target(args.target, dtype="float32", device="cpu")
    fmt = ChatFormat.for_tokenizer(hf.tokenizer)
    seqs = [render(fmt, c) for c in CONVERSATIONS]
    tokens = sum(len(s) for s in seqs)
    n = hf.num_layers
    with torch.no_grad():
        ref_hidden = [hf.model(torch.tensor([s]), output_hidden_states=True).hidden_states for s in seqs]
    print(json.dumps({"target": args.target, "conversations": len(seqs), "tokens": tokens,
                      "lengths": [len(s) for s in seqs], "num_layers": n}))

    all_pass = True
    for spec in args.aux_layer_ids:
        ids = default_aux_layer_ids(n) if spec == "default" else tuple(int(i) for i in spec.split(","))
        hf_run = load_target(args.target, dtype="float32", device="cpu", aux_layer_ids=ids)
        ids = hf_run.aux_layer_ids  # ascending, validated
        ref = hf_capture(hf_run, seqs)
        with VllmCapture(hf.model.name_or_path, ids, dtype="float32", max_model_len=args.max_model_len) as vllm:
            got = vllm.capture(seqs)
            for k, i in enumerate(ids):
                max_rel, mean_rel = rel_errors([g[0][:, k] for g in got], [r.aux[0, :, k] for r in ref])
                all_pass &= max_rel <= 1e-3
                print(json.dumps({"aux_layer_ids": list(ids), "state": f"layer_{i}_input", "vllm_id": i,
                                  "max_rel": max_rel, "mean_rel": mean_rel, "rows": tokens,
                                  "pass": max_rel <= 1e-3}))
            max_rel, mean_rel = rel_errors([g[1] for g in got], [r.last[0] for r in ref])
            all_pass &= max_rel <= 1e-3
            print(json.dumps({"aux_layer_ids": list(ids), "state": "last_pre_norm", "vllm_id": n,
                              "max_rel": max_rel, "mean_rel": mean_rel, "rows": tokens, "pass": max_rel <= 1e-3}))
            # controls: what a wrong capture would score
            off = max(rel_errors([g[0][:, k] for g in got], [h[i + 1][0] for h in ref_hidden])[0]
                      for k, i in enumerate(ids))
            post = rel_errors([g[1] for g in got], [h[n][0] for h in ref_hidden])[0]
            normed = rel_errors([hf_run.norm(g[1]) for g in got], [h[n][0] for h in ref_hidden])[0]
            print(json.dumps({"aux_layer_ids": list(ids), "control": True,
                              "aux_vs_hf_hidden_states_i_plus_1_max_rel": off,
                              "last_vs_hf_post_norm_max_rel": post,
                              "norm_of_last_vs_hf_post_norm_max_rel": normed}))

            vllm_s = best_time(functools.partial(vllm.capture, seqs), args.repeats)
        threads = torch.get_num_threads()
        hf_s = {}
        for n_threads in sorted({threads, 2}):  # vLLM's CPU worker binds its own OpenMP threads (2 here)
            torch.set_num_threads(n_threads)
            hf_s[n_threads] = best_time(functools.partial(hf_capture, hf_run, seqs), args.repeats)
        torch.set_num_threads(threads)
        print(json.dumps({"aux_layer_ids": list(ids), "figure": "capture_tokens_per_s",
                          "vllm": round(tokens / vllm_s, 1),
                          **{f"hf_{k}_threads": round(tokens / v, 1) for k, v in hf_s.items()},
                          "ratio_vllm_over_best_hf": round(min(hf_s.values()) / vllm_s, 2), "tokens": tokens,
                          "vllm_batch": len(seqs), "hf_batch": 1}))
    print(json.dumps({"figure": "vllm_capture_agreement", "pass": all_pass, "bar_max_rel": 1e-3}))


if __name__ == "__main__":
    main()
