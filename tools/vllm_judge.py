"""The neutral judge: exported drafts served by real vLLM, acceptance per eval set, and greedy
output checked against vLLM without speculation.

Run from the vLLM venv (scripts/setup_vllm_env.sh), on CPU with scripts/vllm_env.sh sourced:

    source scripts/vllm_env.sh
    OMP_NUM_THREADS=1 .venv-vllm/bin/python tools/vllm_judge.py --draft ours=runs/train/best \\
        [--draft peer=DIR ...] --pools runs/pools --per-set 10 --k 3 --max-new-tokens 128 [--controls]

Each engine runs in its own child process (vLLM's CPU engine is not made to be built twice in
one process): first the target alone, then the target with each draft (``method=eagle3``,
``num_speculative_tokens=K``; P-EAGLE drafts with ``parallel_drafting``, DFlash drafts with
``method=dflash`` and K = their block size - 1), fp32, eager, prefix caching off, the same
prompt token ids (rendered with the target's chat template; MT-Bench contributes its first
turn). For every eval set and draft one JSON line:

* ``tau``: 1 + accepted / drafts from ``llm.get_metrics()`` (``vllm:spec_decode_num_drafts``,
  ``..._num_accepted_tokens``), the mean tokens per target forward including the bonus token;
  ``accept_per_pos``: ``..._num_accepted_tokens_per_pos`` / drafts; ``by_context``: the same per
  context-length bucket of the prompts (0-1k, 1-2k, 2-4k, ...: each bucket's prompts are one
  ``generate`` call, since the counters are engine-wide), for long-context sets
  (``python -m data_gen.long_context``); the engine's ``max_model_len`` fits the longest prompt;
* ``tokens_per_forward``: generated tokens per target forward after the prefill, rounds that proposed
  nothing included (:func:`tokens_per_forward`). This is the figure to compare across speculators:
  vLLM's ``tau`` counts only the rounds that drafted, which for n-gram (no draft where nothing
  matches) reads far higher than the tokens each forward of the target actually gave;
* ``tokens_per_s``: generated tokens / wall seconds of that set's ``generate`` call, and the same
  for the plain engine (``plain_tokens_per_s``) — a CPU figure, not a GPU speedup;
* ``equal``: prompts whose greedy output equals the plain engine's; each other prompt is a
  divergence, reported with the target's top-2 logit margin at the first differing position
  (HF, fp32). Lossless means every divergence has a margin below 1e-4 (a near-tie that the
  batched verification's different reduction order may flip); a larger margin is a failure.

``--ngram`` adds vLLM's n-gram (prompt lookup) speculator, K tokens, 2-5-gram matches.
``--controls`` adds, for every draft whose aux layer ids are not the target's defaults, copies
whose ids are wrong on purpose: ``ids-removed`` (the keys deleted, so vLLM falls back to its
defaults) and ``off-by-one`` (every id + 1, the bug class of sglang #25454 / vLLM #43671). If
vLLM read our ids from the right key, both controls lose acceptance. For a sliding-window draft it
also adds ``window-removed`` (its ``layer_types`` deleted, so vLLM attends in full): with prompts
longer than the window, equal acceptance there means vLLM ignored the window.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

from eagle3.config import DEFAULT_TARGET  # noqa: E402
from eagle3.target.positions import context_length  # noqa: E402

# the eval prompts and the divergence check are serve_eval's, so both judges read the same text
from serve_eval.config import EVAL_SETS  # noqa: E402
from serve_eval.eval_runs import first_divergence, judged_margin  # noqa: E402
from serve_eval.evaluate import read_prompts  # noqa: E402

SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


# ---------------------------------------------------------------- one engine, in a child process


def _counters(llm: Any) -> dict[str, Any]:
    got: dict[str, Any] = {v: 0 for v in SPEC_METRICS.values()}
    got["per_pos"] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_METRICS:
            got[SPEC_METRICS[metric.name]] += metric.value
        elif metric.name == PER_POS:
            values = list(metric.values)
            got["per_pos"] = [a + b for a, b in zip(values, got["per_pos"] + [0] * len(values), strict=False)]
    return got


def run_engine(job: dict[str, Any]) -> dict[str, Any]:
    """Generate every set's prompts greedily; spec-decode counters per set when a draft is given."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    from data_gen.nvfp4 import prepare_vllm_on_cpu

    prepare_vllm_on_cpu(job["target"])  # an NVFP4 target on CPU: vLLM's emulation kernel

    settings: dict[str, Any] = dict(model=job["target"], tokenizer=job["target"], dtype="float32",
                                    max_model_len=job["max_model_len"], seed=0, enable_prefix_caching=False,
                                    enforce_eager=True, disable_log_stats=False,
                                    model_impl=job.get("model_impl", "auto"))
    if job.get("method") == "ngram":  # vLLM's prompt-lookup speculator: no draft model
        settings["speculative_config"] = {"method": "ngram", "num_speculative_tokens": job["k"],
                                          "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    elif job.get("draft"):
        settings["speculative_config"] = {"model": job["draft"], **draft_family(job["draft"], job["k"])}
    llm = LLM(**settings)
    params = SamplingParams(max_tokens=job["max_new_tokens"], temperature=0.0, stop_token_ids=job["stop_ids"],
                            detokenize=False)
    out: dict[str, Any] = {}
    for name, prompts in job["prompts"].items():
        tokens: list[list[int]] = [[] for _ in prompts]
        got: dict[str, Any] = {"seconds": 0.0, "by_context": {}}
        for bucket, rows in group_by_context(prompts).items():  # one generate per bucket: counters per bucket
            before = _counters(llm)
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": prompts[r]} for r in rows], params, use_tqdm=False)
            got["seconds"] += time.perf_counter() - start
            after = _counters(llm)
            for r, o in zip(rows, outs, strict=True):
                tokens[r] = list(o.outputs[0].token_ids)
            delta = {k: after[k] - before[k] for k in SPEC_METRICS.values()}
            delta["per_pos"] = [a - b for a, b in zip(after["per_pos"], before["per_pos"] + [0] * len(after["per_pos"]),
                                                      strict=False)]
            got["by_context"][bucket] = delta
        out[name] = {"tokens": tokens, **got, **merge_counters(list(got["by_context"].values()))}
    return out


def tokens_per_forward(generated: int, prompts: int, accepted: int) -> float:
    """Generated tokens per target forward after the prefill: each prompt's first token comes from its
    prefill, and each later forward gives its accepted draft tokens and one more, so a prompt's
    forwards are ``its tokens - 1 - its accepted``, whether that round drafted or not."""
    forwards = generated - prompts - accepted
    return round((generated - prompts) / forwards, 4) if forwards > 0 else 1.0


def group_by_context(prompts: list[list[int]]) -> dict[str, list[int]]:
    """Prompt rows by the context-length bucket of their length (shortest bucket first): vLLM's
    counters are engine-wide, so acceptance by context is read from one ``generate`` per bucket.
    A round's context is its prompt plus what it generated, so a prompt near an edge counts below it."""
    from eagle3.draft.metrics import CONTEXT_BUCKETS, context_bucket

    groups: dict[str, list[int]] = {}
    for row, prompt in enumerate(prompts):
        groups.setdefault(context_bucket(len(prompt)), []).append(row)
    return dict(sorted(groups.items(), key=lambda item: CONTEXT_BUCKETS.index(item[0])))


def merge_counters(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The sums of several ``generate`` calls' counter deltas (per position too)."""
    total: dict[str, Any] = {k: sum(p[k] for p in parts) for k in SPEC_METRICS.values()}
    width = max((len(p["per_pos"]) for p in parts), default=0)
    total["per_pos"] = [sum(p["per_pos"][i] for p in parts if i < len(p["per_pos"])) for i in range(width)]
    return total


def by_context(got: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """tau and acceptance per position of each context bucket that drafted."""
    return {bucket: {"drafts": c["drafts"], "tau": round(1 + c["accepted"] / c["drafts"], 4),
                     "accept_per_pos": [round(x / c["drafts"], 4) for x in c["per_pos"]]}
            for bucket, c in got["by_context"].items() if c["drafts"]}


def draft_family(folder: str, k: int) -> dict[str, Any]:
    """The speculative_config keys (beyond ``model``) a draft folder is served with at ``k`` tokens a
    round: its family's (:func:`eagle3.draft.families.base.vllm_speculative_config`, from its config.json,
    ours or speculators'; a DFlash draft keeps its trained block, a speculators P-EAGLE its depth)."""
    from eagle3.draft.families import vllm_speculative_config

    return vllm_speculative_config(json.loads((Path(folder) / "config.json").read_text()), k)


def in_child(job: dict[str, Any]) -> dict[str, Any]:
    """``run_engine(job)`` in a fresh interpreter (vLLM spawns its own engine processes)."""
    with tempfile.TemporaryDirectory(prefix="vllm-engine-") as tmp:
        job_file, result_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_file.write_text(json.dumps(job))
        env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        subprocess.run([sys.executable, __file__, "--engine-job", str(job_file), "--engine-out", str(result_file)],
                       check=True, env=env, stdout=sys.stderr)  # vLLM logs to stdout: keep ours JSON only
        return json.loads(result_file.read_text())


# ---------------------------------------------------------------- controls and margins


def control_copies(draft: Path, default_ids: list[int], num_layers: int, workdir: Path) -> dict[str, Path]:
    """Copies of a vLLM/speculators draft folder with its aux ids made wrong on purpose."""
    cfg = json.loads((draft / "config.json").read_text())
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if not ids:
        return {}
    if sorted(ids) == sorted(default_ids):
        return {}  # with the defaults a key vLLM ignores goes unnoticed anyway: nothing to prove
    variants: dict[str, list[int] | None] = {"ids-removed": None}
    if max(ids) + 1 < num_layers:
        variants["off-by-one"] = [i + 1 for i in ids]
    out = {}
    for name, new in variants.items():
        dest = workdir / f"{draft.name}-{name}"
        shutil.copytree(draft, dest)
        edited = json.loads(json.dumps(cfg))
        for holder in (edited, edited.get("eagle_config") or {}, edited.get("eagle3_forge") or {}):
            for key in ("eagle_aux_hidden_state_layer_ids", "aux_layer_ids"):
                if key in holder:
                    if new is None:
                        del holder[key]
                    else:
                        holder[key] = new
        (dest / "config.json").write_text(json.dumps(edited, indent=2))
        out[name] = dest
    return out


def window_controls(draft: Path, workdir: Path) -> dict[str, Path]:
    """A sliding-window draft's copy with its ``layer_types`` removed (vLLM then attends in full): if
    vLLM honours the window, the two serve different drafts and their acceptance differs."""
    cfg = json.loads((draft / "config.json").read_text())
    holders = [cfg, cfg.get("transformer_layer_config") or {}]
    if not any("sliding_attention" in (h.get("layer_types") or []) for h in holders):
        return {}
    dest = workdir / f"{draft.name}-window-removed"
    shutil.copytree(draft, dest)
    edited = json.loads(json.dumps(cfg))
    for holder in (edited, edited.get("transformer_layer_config") or {}):
        holder.pop("layer_types", None)
    (dest / "config.json").write_text(json.dumps(edited, indent=2))
    return {"window-removed": dest}


# ---------------------------------------------------------------- main


def judge(target_folder: str, drafts: dict[str, Path | None], prompts: dict[str, list[list[int]]], *, k: int,
          max_new_tokens: int, stop_ids: list[int], target: Any, model_impl: str = "auto") -> list[dict[str, Any]]:
    """One line per (draft, set): tau, acceptance per position, tokens/s, greedy equality."""
    longest = max((len(p) for ps in prompts.values() for p in ps), default=0)
    room = context_length(target.model.config)
    if room is not None and longest + max_new_tokens > room:
        raise SystemExit(f"--max-new-tokens {max_new_tokens} after the longest prompt ({longest} tokens) exceeds the "
                         f"target's context of {room}")
    job = {"target": target_folder, "prompts": prompts, "k": k, "max_new_tokens": max_new_tokens,
           "stop_ids": stop_ids, "max_model_len": max(2048, longest + max_new_tokens), "model_impl": model_impl}
    plain = in_child(job)
    lines = []
    for name, folder in drafts.items():
        served_k = k if folder is None else draft_family(str(folder), k)["num_speculative_tokens"]
        spec = in_child({**job, "method": "ngram"} if folder is None else {**job, "draft": str(folder)})
        for set_name, got in spec.items():
            base = plain[set_name]
            cases = []
            for row, (ours, ref) in enumerate(zip(got["tokens"], base["tokens"], strict=True)):
                at = first_divergence(ours, ref)
                if at is None:
                    continue
                margin, tie = judged_margin(target, prompts[set_name][row] + ref[:at])
                cases.append({"prompt": row, "position": at, "margin": round(margin, 6), "tie": tie})
            drafts_n = max(got["drafts"], 1)
            generated = sum(len(t) for t in got["tokens"])
            lines.append({
                "figure": "vllm_judge", "draft": name, "set": set_name, "prompts": len(got["tokens"]), "k": served_k,
                "tau": round(1 + got["accepted"] / drafts_n, 4),
                "tokens_per_forward": tokens_per_forward(generated, len(got["tokens"]), got["accepted"]),
                "accept_per_pos": [round(x / drafts_n, 4) for x in got["per_pos"]],
                "by_context": by_context(got),
                "drafts": got["drafts"], "accepted": got["accepted"], "generated_tokens": generated,
                "tokens_per_s": round(generated / got["seconds"], 1),
                "plain_tokens_per_s": round(sum(len(t) for t in base["tokens"]) / base["seconds"], 1),
                "equal": len(got["tokens"]) - len(cases), "divergences": cases,
                "lossless": all(c["tie"] for c in cases),
            })
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--engine-job"]:  # the child side of in_child
        result = run_engine(json.loads(Path(argv[1]).read_text()))
        Path(argv[3]).write_text(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", action="append", default=[], help="NAME=FOLDER (repeatable)")
    parser.add_argument("--ngram", action="store_true", help="also judge vLLM's n-gram speculator (as 'ngram')")
    parser.add_argument("--pools", default="runs/pools", help="pools folder with eval/*.jsonl")
    parser.add_argument("--sets", default=",".join(EVAL_SETS))
    parser.add_argument("--per-set", type=int, default=10)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--controls", action="store_true",
                        help="also serve copies with wrong aux ids (and a windowed draft's copy without its window)")
    parser.add_argument("--thinking", default="template", choices=["template", "on", "off"],
                        help="render the prompts with the template's thinking switch on or off (reasoning targets)")
    parser.add_argument("--model-impl", default="auto", choices=["auto", "vllm", "transformers"],
                        help="vLLM's implementation of the target (transformers: its Transformers modeling backend, "
                             "for families whose native class lacks EAGLE-3 support); the draft's stays native")
    args = parser.parse_args(argv)

    from eagle3.target.chat import ChatFormat
    from eagle3.target.model import default_aux_layer_ids, load_target
    from eagle3.target.source import resolve_target

    folder = resolve_target(args.target).location
    target = load_target(args.target, dtype="float32", device="cpu")
    chat = ChatFormat.for_tokenizer(target.tokenizer, target.model.generation_config).in_mode(args.thinking)
    prompts = {name: read_prompts(Path(args.pools), name, args.per_set, chat) for name in args.sets.split(",")}
    if not args.draft and not args.ngram:
        raise SystemExit("give at least one --draft NAME=FOLDER, or --ngram")
    drafts: dict[str, Path | None] = {}
    for item in args.draft:
        name, _, path = item.partition("=")
        if not path or not (Path(path) / "config.json").is_file():
            raise SystemExit(f"--draft {item}: expected NAME=FOLDER with a config.json")
        drafts[name] = Path(path)
    with tempfile.TemporaryDirectory(prefix="vllm-judge-") as tmp:
        if args.controls:
            for name, path in list(drafts.items()):
                if path is None:
                    continue
                copies = control_copies(path, list(default_aux_layer_ids(target.num_layers)), target.num_layers,
                                        Path(tmp))
                for variant, copy in {**copies, **window_controls(path, Path(tmp))}.items():
                    drafts[f"{name}:{variant}"] = copy
        if args.ngram:
            drafts["ngram"] = None
        lines = judge(str(folder), drafts, prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                      stop_ids=sorted(chat.stop_ids), target=target, model_impl=args.model_impl)
    for line in lines:
        print(json.dumps(line), flush=True)
    for name in drafts:
        mine = [x for x in lines if x["draft"] == name]
        drafts_n = sum(x["drafts"] for x in mine)
        print(json.dumps({"figure": "vllm_judge_overall", "draft": name,
                          "tau": round(1 + sum(x["accepted"] for x in mine) / max(drafts_n, 1), 4),
                          "tokens_per_forward": tokens_per_forward(sum(x["generated_tokens"] for x in mine),
                                                                   sum(x["prompts"] for x in mine),
                                                                   sum(x["accepted"] for x in mine)),
                          "equal": sum(x["equal"] for x in mine), "prompts": sum(x["prompts"] for x in mine),
                          "lossless": all(x["lossless"] for x in mine)}), flush=True)


if __name__ == "__main__":
    main()
