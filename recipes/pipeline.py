"""The pipeline: runs the configured stages in order on one typed config.

Stages are added here as the project grows (pools -> regenerate -> harvest -> train ->
mine -> eval); each writes its outputs under ``out_dir`` atomically.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eagle3.atomic import atomic_write_text
from eagle3.config import PipelineConfig
from eagle3.target import check_capture, load_target

log = logging.getLogger(__name__)

_PROBE_MESSAGES = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


def stage_target(cfg: PipelineConfig) -> dict[str, Any]:
    """Fetch/convert and load the target; check the aux-layer capture against HF; time a forward."""
    t0 = time.perf_counter()
    target = load_target(**asdict(cfg.target))
    load_s = time.perf_counter() - t0
    tok = target.tokenizer
    if tok.chat_template:
        text = tok.apply_chat_template(_PROBE_MESSAGES, tokenize=False, add_generation_prompt=True)
    else:
        text = _PROBE_MESSAGES[0]["content"]
    ids = torch.tensor([tok(text, add_special_tokens=tok.chat_template is None)["input_ids"]], device=target.device)
    errors = check_capture(target, ids)
    t0 = time.perf_counter()
    repeats = 3
    for _ in range(repeats):
        target(ids, return_logits=False)
    forward_tok_s = repeats * ids.shape[1] / (time.perf_counter() - t0)
    return {
        "target": target.name,
        "architecture": type(target.model).__name__,
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "aux_layer_ids": list(target.aux_layer_ids),
        "dtype": str(target.dtype).removeprefix("torch."),
        "device": str(target.device),
        "has_chat_template": bool(tok.chat_template),
        "load_seconds": round(load_s, 2),
        "probe_tokens": ids.shape[1],
        "capture_max_rel_error_vs_hf": errors,
        "prefill_tokens_per_s": round(forward_tok_s, 1),
    }


def stage_pools(cfg: PipelineConfig) -> dict[str, Any]:
    """Prompt pools and held-out eval sets; reused when already built with the same config."""
    from data_gen.pools import build_pools, format_counts, pools_config_of

    existing = pools_config_of(cfg.pools.out_dir)
    if existing is not None and existing == pools_config_of(cfg.pools):
        manifest = json.loads((Path(cfg.pools.out_dir) / "manifest.json").read_text())
        print(f"pools: up to date in {cfg.pools.out_dir}")
    else:
        manifest = build_pools(cfg.pools)
    print(format_counts(manifest))
    return {"out_dir": cfg.pools.out_dir, **manifest["counts"]}


STAGES: dict[str, Callable[[PipelineConfig], dict[str, Any]]] = {"target": stage_target, "pools": stage_pools}


def run_pipeline(cfg: PipelineConfig) -> dict[str, dict[str, Any]]:
    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown:
        raise ValueError(f"stages: unknown {unknown}; known stages are {list(STAGES)}")
    torch.manual_seed(cfg.seed)
    if not torch.cuda.is_available():
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    results: dict[str, dict[str, Any]] = {}
    for name in cfg.stages:
        log.info("stage %s", name)
        results[name] = STAGES[name](cfg)
        atomic_write_text(out / f"{name}.json", json.dumps(results[name], indent=2) + "\n")
        print(json.dumps({"stage": name, **results[name]}), flush=True)
    return results
