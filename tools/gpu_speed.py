"""The GPU check's speed checks (tools/gpu_check.py runs them): the loop under CUDA graphs, where a
training micro-batch and plain decoding spend their time (with the host syncs they make on CUDA),
and the trainer's race against speculators 0.9.0 on the same samples. Each reports through the
check's ``emit(check, ok, **figures)``."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from eagle3.device import allow_cudnn_sdpa, resolve_device, synchronize
from eagle3.train.config import updated

ROOT = Path(__file__).resolve().parent.parent
EVAL_SETS = ("mtbench", "humaneval", "gsm8k", "multilingual")
Emit = Callable[..., None]


def check_graphs(emit: Emit, model: Any, drafter: Any, prompts: list[list[int]], new: int, dtype: str,
                 hf_tps: float) -> None:
    """The loop with the target's static cache under CUDA graphs (``target_cache=graphs``), a chain and
    a tree: greedy against plain decoding with the dynamic cache, and both its tokens/s beside HF
    generate's; a chain's speedup beside its cost model's."""
    for mode in ("chain", "tree"):
        _check_graphs(emit, model, drafter, prompts, new, dtype, hf_tps, mode)


def _check_graphs(emit: Emit, model: Any, drafter: Any, prompts: list[list[int]], new: int, dtype: str,
                  hf_tps: float, mode: str) -> None:
    from serve_eval.adaptive import measure_cost
    from serve_eval.config import SpecConfig
    from serve_eval.spec_decode import SpeculativeDecoder

    reference = SpeculativeDecoder(model, drafter, SpecConfig("chain", k=3))
    try:
        decoder = SpeculativeDecoder(model, drafter, SpecConfig(mode, k=3, target_cache="graphs"))
        decoder.generate(prompts[0], 8), decoder.generate(prompts[0], 8, speculate=False)  # compiled here
        equal, spec, plain, taus = 0, [0.0, 0], [0.0, 0], []
        for p in prompts:
            want = reference.generate(p, new, speculate=False).tokens
            for speculate, tally in ((True, spec), (False, plain)):
                got = decoder.generate(p, new, speculate=speculate)
                equal += got.tokens == want
                tally[0], tally[1] = tally[0] + got.stats.seconds_total, tally[1] + got.stats.new_tokens
                if speculate:
                    taus.append(got.stats.tau)
        ok = equal == 2 * len(prompts) or dtype != "float32"  # bf16 may flip near-ties, as above
        tau, actual = sum(taus) / len(taus), (spec[1] / spec[0]) / (plain[1] / plain[0])
        figures: dict[str, Any] = {}
        if mode == "chain":  # the cost model of this decoder (its own cache kind and draft step) at its tau
            predicted = measure_cost(decoder, 3).speedup(tau, 3)
            figures = {"cost_model_speedup": round(predicted, 3), "of_cost_model": round(actual / predicted, 3)}
        emit(f"loop.{dtype}.{mode}.graphs", ok, prompts=len(prompts), equal=equal, of=2 * len(prompts),
             spec_tokens_per_s=round(spec[1] / spec[0], 2), plain_tokens_per_s=round(plain[1] / plain[0], 2),
             hf_generate_tokens_per_s=hf_tps, tau=round(tau, 4), speedup=round(actual, 3), **figures)
    except Exception as err:  # noqa: BLE001 - reported, and the other checks still run
        emit(f"loop.{dtype}.{mode}.graphs", False, error=f"{type(err).__name__}: {err}")


def _top_ops(prof: Any, cuda: bool, n: int = 10) -> list[list[Any]]:
    """The profiler's ops with the most self time on the device (CUDA) or the host, [name, ms]."""
    def self_time(e: Any) -> float:
        if not cuda:
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    events = sorted(prof.key_averages(), key=self_time, reverse=True)[:n]
    return [[e.key, round(self_time(e) / 1000, 3)] for e in events]


def _first_sync(fn: Any) -> str | None:
    """Run ``fn`` with syncs made errors and autograd's anomaly mode on: the first sync's message with
    the forward line of the backward node that made it (a sync in backward comes from autograd's
    thread, where sync debug warnings carry no Python frame of ours). CUDA only."""
    import warnings

    with warnings.catch_warnings(record=True) as caught, torch.autograd.detect_anomaly(check_nan=False):
        warnings.simplefilter("always")
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        except RuntimeError as err:
            if "synchroniz" not in str(err):
                return f"not a sync: {str(err).splitlines()[0][:300]}"
            forward = [str(w.message) for w in caught if "Traceback of forward call" in str(w.message)]
            lines = [ln.strip() for ln in (forward[-1] if forward else "").splitlines() if ROOT.name in ln or
                     "eagle3/" in ln or "serve_eval/" in ln]
            return f"{str(err).splitlines()[0][:300]} | forward: {' <- '.join(lines[-3:]) or 'not traced'}"
        finally:
            torch.cuda.set_sync_debug_mode(before)
    return None


def _syncs_during(fn: Any, dev: torch.device) -> list[str] | None:
    """Run ``fn``; on CUDA, the ``file:line`` of every operation that made the host wait for the device
    (torch's sync debug mode); None elsewhere."""
    import warnings

    if dev.type != "cuda":
        fn()
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def check_profile(emit: Emit, cfg: Any, draft: Path, target: Path, pools: Path, device: str,
                  size: dict[str, Any]) -> None:
    """Where the time goes: a training micro-batch (forward, backward, tally; the draft in the trainer's
    dtype) and plain decoding, each with the host syncs it makes on CUDA and the profiler's top ops."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from eagle3.draft.metrics import AcceptanceTally
    from eagle3.draft.target_head import TargetHead
    from eagle3.draft.ttt import layout_rows
    from eagle3.store.batches import load_batch
    from eagle3.store.shards import HarvestStore
    from eagle3.target.chat import ChatFormat
    from eagle3.train.step import TTTModel, train_forward
    from serve_eval.eval_runs import load_pair
    from serve_eval.evaluate import read_prompts
    from serve_eval.spec_decode import SpeculativeDecoder

    dev = resolve_device(device)
    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    model, drafter = load_pair(str(draft), str(target), "float32", device)
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        ttt = TTTModel(drafter.to(dtype).train(), num_steps=cfg.train.ttt_steps, step_decay=1.0)
        head, t2d = TargetHead.of_target(model).to(dtype), drafter.t2d  # the trainer's head: the target's dtype
        store = HarvestStore(cfg.harvest.out_dir)
        idx, tokens = [], 0
        for i in range(len(store)):
            if tokens + len(store[i].input_ids) > size["micro_batch_tokens"] and idx:
                break
            idx, tokens = [*idx, i], tokens + len(store[i].input_ids)
        batch = load_batch(store, idx, "pack", stored=True)  # as the trainer reads it

        def micro_batch() -> None:
            out, _ = train_forward(ttt, head, batch, t2d, dtype, dev)
            out.loss.backward()
            AcceptanceTally(cfg.train.ttt_steps, dev).add(out)

        micro_batch()  # warm-up (and the draft vocab's ids, read once per run)
        syncs = _syncs_during(micro_batch, dev)
        synchronize(dev)
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            micro_batch()
            synchronize(dev)
            seconds = time.perf_counter() - t0
        located = _first_sync(micro_batch) if syncs else None  # where the first one comes from

        def timed_ms() -> float:
            micro_batch()  # warm-up (a new layout's shapes)
            synchronize(dev)
            t0 = time.perf_counter()
            micro_batch()
            synchronize(dev)
            return round((time.perf_counter() - t0) * 1000, 2)

        grouped = timed_ms()  # attention by groups of documents, as the trainer runs it
        with mock.patch("eagle3.train.step.layout_rows", functools.partial(layout_rows, segment_tokens=None)):
            whole = timed_ms()  # attention over the whole row
        emit("profile.train_micro_batch", not syncs, tokens=tokens, ms=round(seconds * 1000, 2), first_sync=located,
             documents=len(idx), ms_unprofiled=grouped, ms_whole_row_attention=whole,
             tokens_per_s=round(tokens / seconds, 1), host_syncs=None if syncs is None else len(syncs),
             sync_sites=None if syncs is None else Counter(syncs).most_common(8), top_ops=_top_ops(prof, cuda))
    except Exception as err:  # noqa: BLE001 - reported, and the decoding profile still runs
        emit("profile.train_micro_batch", False, error=f"{type(err).__name__}: {err}")
    try:
        model, _ = load_pair(str(draft), str(target), "auto", device)
        chat = ChatFormat.for_tokenizer(model.tokenizer, model.model.generation_config)
        prompt = read_prompts(pools, EVAL_SETS[0], 1, chat)[0]
        decoder = SpeculativeDecoder(model, None)
        new = size["loop_tokens"]
        decoder.generate(prompt, 4, speculate=False)  # warm-up

        def ms_per_token() -> float:
            st = decoder.generate(prompt, new, speculate=False).stats
            return round((st.seconds_total - st.seconds_prefill) / max(st.target_forwards, 1) * 1000, 3)

        plain = ms_per_token()  # attention as the library runs it (cuDNN's backend left out on CUDA)
        with allow_cudnn_sdpa():  # torch's own choice: on H100 cuDNN, which builds a graph per new length
            cudnn_first, cudnn_again = ms_per_token(), ms_per_token()
        with profile(activities=acts) as prof:
            got = decoder.generate(prompt, new, speculate=False)
        syncs = _syncs_during(lambda: decoder.generate(prompt, new, speculate=False), dev)
        st = got.stats
        steps = max(st.target_forwards, 1)  # the forwards after the prefill
        emit("profile.plain_decoding", got.stats.new_tokens == new, new_tokens=new, ms_per_token=plain,
             ms_per_token_cudnn_first=cudnn_first, ms_per_token_cudnn_again=cudnn_again,
             ms_per_token_profiled=round((st.seconds_total - st.seconds_prefill) / steps * 1000, 3),
             forward_ms_per_token=round(st.seconds_verify / steps * 1000, 3),
             host_syncs_per_token=None if syncs is None else round(len(syncs) / new, 2),
             sync_sites=None if syncs is None else Counter(syncs).most_common(8), top_ops=_top_ops(prof, cuda))
    except Exception as err:  # noqa: BLE001
        emit("profile.plain_decoding", False, error=f"{type(err).__name__}: {err}")


def check_speculators(emit: Emit, cfg: Any, target: Path, out: Path, device: str, size: dict[str, Any],
                      python: str) -> None:
    """The trainer's race on this device: speculators 0.9.0 (``python``: a venv with it,
    scripts/setup_speculators_env.sh) trains on the same harvested samples as the pipeline's train
    stage did (its draft vocab, TTT steps, packed rows of the same length, optimizer steps, AdamW as
    ours; its own init, schedule and loss weights), eager with SDPA; both tokens/s and peak memory."""
    train_dir = Path(cfg.train.out_dir)
    data, spec_out = out / "speculators-data", out / "speculators-train"
    dev = resolve_device(device)
    try:
        ours = json.loads((train_dir / "summary.json").read_text())
        shutil.rmtree(data, ignore_errors=True)
        steps = [[sys.executable, "bench/studies/speculators_data.py", "--store", cfg.train.data.store, "--out",
                  str(data),
                  "--draft-vocab", str(train_dir / "draft_vocab.safetensors"), "--eval-fraction", "0"],
                 [python, "bench/studies/speculators_train.py", "--data", str(data), "--target", str(target),
                  "--out", str(spec_out), "--steps", str(cfg.train.steps), "--ttt-steps", str(cfg.train.ttt_steps),
                  "--seq-len", str(cfg.train.data.micro_batch_tokens), "--optimizer", "adamw", "--overwrite",
                  "--train-data-ratio", "0.9",  # it needs held-out rows; tokens/s is what is compared
                  "--dtype", "bfloat16" if dev.type == "cuda" else "float32"]]
        # one process of its own: not the distributed settings our trainer left in this one's environment
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        for cmd, log_name in zip(steps, ("speculators-data.log", "speculators-train.log"), strict=True):
            log = out / log_name  # written as it goes: what a run cut off by the time limit got to
            with log.open("w") as f:
                done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1800)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd[:2])} failed: {log.read_text()[-800:]}")
        theirs = json.loads((spec_out / "result.json").read_text())
        emit("race.train", True, ours_tokens_per_s=ours["tokens_per_s"],
             speculators_tokens_per_s=theirs["tokens_per_s"],
             ours_over_speculators=round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3),
             ours_peak_gib=ours.get("peak_gpu_gib"), ours_last_loss=ours.get("last_loss"),
             speculators_loss_last=theirs.get("loss_last"), steps=cfg.train.steps, ttt_steps=cfg.train.ttt_steps,
             seq_len=cfg.train.data.micro_batch_tokens)
    except Exception as err:  # noqa: BLE001 - reported; the other checks still run
        emit("race.train", False, error=f"{type(err).__name__}: {err}")


def check_train_phases(emit: Emit, cfg: Any, steps: int = 12) -> None:
    """Where a training step's time goes (``train.log.phase_times``: each phase closed by a device
    sync), the first two steps apart, and the same with torch free to pick cuDNN's attention, which
    builds a graph for every new row length (``EAGLE3_CUDNN_SDPA=1``)."""
    import dataclasses

    from eagle3.train.log import read_metrics
    from recipes.pipeline import STAGES

    def run(name: str) -> dict[str, Any]:
        out = Path(cfg.train.out_dir).with_name(f"train-phases-{name}")
        shutil.rmtree(out, ignore_errors=True)
        STAGES["train"](dataclasses.replace(cfg, train=updated(cfg.train, {
            "out_dir": str(out), "steps": steps, "data.eval_store": None, "eval_every": 0, "save_every": 0,
            "log.every": 1, "log.phase_times": True})))
        rows = [r for r in read_metrics(out) if "train/loss" in r]
        later = rows[2:]

        def ms(r: dict[str, Any]) -> dict[str, float]:
            return {k[5:-3]: round(v, 1) for k, v in r.items() if k.startswith("time/")}

        mean = {k: round(sum(ms(r)[k] for r in later) / len(later), 1) for k in ms(later[0])} if later else {}
        tokens = sum(r["train/tokens"] for r in later)
        total = sum(sum(ms(r).values()) for r in later)
        return {"first_ms": ms(rows[0]), "second_ms": ms(rows[1]) if len(rows) > 1 else None,
                "later_mean_ms": mean, "later_tokens_per_s": round(tokens / total * 1000, 1) if total else None}

    try:
        ours = run("default")
        with allow_cudnn_sdpa():
            cudnn = run("cudnn") if resolve_device(cfg.train.device).type == "cuda" else None
        emit("profile.train_step", True, steps=steps, **ours, cudnn_allowed=cudnn)
    except Exception as err:  # noqa: BLE001 - reported; the other checks still run
        emit("profile.train_step", False, error=f"{type(err).__name__}: {err}")


__all__ = ["check_graphs", "check_profile", "check_speculators", "check_train_phases"]
