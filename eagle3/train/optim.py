"""The trainer's optimisation set-up: the lr schedule, the precision, DeepSpeed's config, its Muon
(parameter groups, Newton-Schulz variant and dtype, the ZeRO clip), and the engine they make."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from eagle3.device import bf16_matmul_speedup
from eagle3.distributed import Runtime
from eagle3.train.config import LR_SCHEDULES, TrainConfig


def warmup_decay(warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0,
                 kind: str = "cosine") -> Callable[[int], float]:
    """LR factor of optimizer step s (0-based): (s+1)/warmup, then ``kind`` (cosine or linear)
    from 1 to ``min_lr_ratio`` at the last step, or constant 1."""
    if kind not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {kind!r}: expected one of {', '.join(LR_SCHEDULES)}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return factor


def muon_ns_method(setting: str, device: torch.device | str) -> str:
    """``auto`` -> DeepSpeed's Gram Newton-Schulz on CUDA, the original bf16 one elsewhere."""
    if setting != "auto":
        return setting
    return "gram" if torch.device(device).type == "cuda" else "standard"


def resolve_precision(cfg: TrainConfig, device: torch.device) -> str:
    """``train.precision``, with ``auto`` made fp32 or bf16 for this device (see TrainConfig)."""
    if cfg.precision != "auto":
        return cfg.precision
    fast = device.type == "cuda" or (device.type == "cpu" and bf16_matmul_speedup("cpu") > 1.0)
    return "bf16" if fast and not (cfg.optimizer == "muon" and cfg.zero_stage == 0) else "fp32"


def muon_ns_in_fp32_where_bf16_is_slow(device: torch.device | str) -> bool:
    """On a CPU without bf16 units, make DeepSpeed's Newton-Schulz run in fp32; True if it did.

    DeepSpeed runs the iteration in bf16 (fp16 for ``gram``) whenever its accelerator reports
    support, which its CPU accelerator always does; on an AVX2-only CPU those products ran
    ~170x slower than fp32 and Muon took most of each step. Its iteration reads
    ``original_muon.ns_compute_dtype`` at every call, so this replaces that lookup (process-wide)
    with fp32, which is only more precise.

    Why process-wide: DeepSpeed takes the dtype from that module function inside its optimizer step,
    with no setting on the engine or the optimizer to pass one; every engine of the process runs on
    the same CPU, whose missing bf16 units are what the patch answers, so none of them wants bf16.
    """
    if torch.device(device).type != "cpu" or bf16_matmul_speedup("cpu") > 1.0:
        return False
    from deepspeed.runtime.zero.muon import original_muon

    original_muon.ns_compute_dtype = lambda ns_method="gram": torch.float32
    return True


def unclip_muon_updates_under_zero(engine: Any) -> bool:
    """Stop DeepSpeed's ZeRO optimizer from clipping Muon's updates; True if the engine has one.

    Under ZeRO (stages 1-3, except bf16 at stage 1, which takes DeepSpeed's BF16 optimizer)
    DeepSpeed orthogonalises each Muon matrix's gradient while it reduces it and then
    clips by the global norm of what it holds: the orthogonalised updates, whose norm is ~20-60
    for any gradient. With ``max_grad_norm=0.5`` every Muon step shrank ~40-100x (measured:
    SmolLM2 drafts trained at ZeRO 1 in fp32 learnt far less than at ZeRO 0 or in bf16 at ZeRO 1,
    whose losses match each other). Those updates are normalised already, so nothing of value is lost
    without that clip; the auxiliary AdamW's gradients are not clipped either in this set-up.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    zero = engine.optimizer
    if not isinstance(zero, DeepSpeedZeroOptimizer | DeepSpeedZeroOptimizer_Stage3):
        return False
    zero.clip_grad = 0.0
    return True


def muon_param_groups(model: nn.Module, lr: float, ns_method: str = "gram") -> list[dict[str, Any]]:
    """Trainable parameters tagged for DeepSpeed's Muon, one group per Muon matrix.

    Muon takes the hidden 2-D matrices (fc, attention, MLP); lm_head (an output layer) and the
    norms go to the auxiliary AdamW at ``lr``. DeepSpeed's orthogonalised step for a
    [out, in] matrix has an RMS of about 1/sqrt(in) per unit lr; each matrix's lr is set so that
    the step's RMS is 0.2 * lr, the RMS of an AdamW step (speculators' ``match_rms_adamw``), so
    warmup and decay act on both halves alike. ``ns_method`` is DeepSpeed's Newton-Schulz variant
    for each Muon group (see :func:`muon_ns_method`).
    """
    groups: list[dict[str, Any]] = []
    adam: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            p.use_muon = False
            continue
        p.use_muon = p.ndim == 2 and "lm_head" not in name
        if p.use_muon:
            groups.append({"params": [p], "lr": 0.2 * lr * math.sqrt(p.shape[1]), "name": name,
                           "ns_method": ns_method})
        else:
            adam.append(p)
    return [*groups, {"params": adam, "lr": lr, "name": "adamw"}]


def deepspeed_config(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    optimizer: dict[str, Any] = {}
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    if cfg.optimizer == "muon":
        zero["reduce_scatter"] = False  # DeepSpeed's Muon needs each matrix's whole gradient (it refuses otherwise)
        optimizer = {
            "optimizer": {"type": "Muon", "params": {
                "lr": cfg.lr, "momentum": cfg.muon_momentum, "betas": [cfg.adam_beta1, cfg.adam_beta2],
                "eps": cfg.adam_eps, "weight_decay": cfg.weight_decay, "torch_adam": True}},
            "data_types": {"grad_accum_dtype": "fp32"},
        }
    return {
        **optimizer,
        "train_micro_batch_size_per_gpu": 1,  # one micro-batch = one packed row / bucket
        "gradient_accumulation_steps": cfg.gradient_accumulation,
        "train_batch_size": cfg.gradient_accumulation * world_size,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # a torch AdamW: nothing JIT-compiled
        "bf16": {"enabled": cfg.precision == "bf16"},
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
        # its throughput timer synchronises the device at every forward and step (the trainer times itself)
        "timers": {"throughput": {"enabled": False}},
    }


def build_engine(cfg: TrainConfig, model: torch.nn.Module, rt: Runtime) -> Any:
    """The DeepSpeed engine around ``model``: a torch AdamW, or DeepSpeed's Muon built from the config."""
    import deepspeed

    schedule = warmup_decay(cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio, cfg.lr_schedule)
    if cfg.optimizer == "muon":  # DeepSpeed builds Muon + its auxiliary AdamW from the config
        muon_ns_in_fp32_where_bf16_is_slow(rt.device)
        groups = muon_param_groups(model, cfg.lr, muon_ns_method(cfg.muon_ns_method, rt.device))
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=groups,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
            config=deepspeed_config(cfg, rt.world_size))
        return engine
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg, rt.world_size))
    return engine


__all__ = ["build_engine", "deepspeed_config", "muon_ns_in_fp32_where_bf16_is_slow", "muon_ns_method",
           "muon_param_groups", "resolve_precision", "unclip_muon_updates_under_zero", "warmup_decay"]
