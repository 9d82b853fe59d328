"""The trainer's optimisation set-up: the lr schedule, the precision, DeepSpeed's config, its Muon
(parameter groups, Newton-Schulz variant and dtype, the ZeRO clip), and the engine they make."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eagle3.device import bf16_matmul_speedup
from eagle3.distributed import Runtime
from eagle3.errors import ConfigError

LR_SCHEDULES = ("cosine", "linear", "constant")
"""What ``train.optim.schedule`` may name (see :func:`warmup_decay`)."""
KEY = "train.optim"


@dataclass
class OptimSpec:
    """The optimizer and its schedule (``train.optim.*``)."""

    name: str = "adamw"
    """adamw; or muon: Muon (orthogonalised momentum, DeepSpeed's) on the draft's hidden 2-D
    matrices (fc, attention, MLP) and AdamW on the rest (lm_head, norms), as speculators does."""
    lr: float = 1e-4
    """Peak learning rate (AdamW; with ``name=muon`` each Muon matrix's step is scaled to
    the RMS an AdamW step of this lr would have, 0.2 * lr, so one lr serves both halves)."""
    schedule: str = "cosine"
    """After warmup: cosine or linear decay to lr * min_lr_ratio at the last step (speculators'
    default is linear), or constant."""
    warmup_steps: int = 50
    """Linear warmup from lr / warmup_steps to lr."""
    min_lr_ratio: float = 0.0
    """Where the decay ends, as a share of lr."""
    weight_decay: float = 0.0
    """Decoupled weight decay on every trained parameter (AdamW's; with Muon, both halves)."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay."""
    adam_beta2: float = 0.95
    """AdamW's second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW's denominator epsilon."""
    muon_momentum: float = 0.95
    """Momentum of the Muon half (DeepSpeed's Muon)."""
    muon_ns_method: str = "auto"
    """Newton-Schulz variant of DeepSpeed's Muon: gram (fp16 Gram iteration, DeepSpeed's default,
    the faster one on GPUs), standard (the original bf16 iteration), or auto: gram on CUDA,
    standard elsewhere (on this project's CPUs standard runs the step's 8 matrices 3.7x faster,
    same spectrum after 5 steps)."""
    max_grad_norm: float = 0.5
    """Gradient clipping by global norm; 0 disables it. Not applied to Muon runs under DeepSpeed's
    ZeRO optimizer (zero_stage >= 1, except bf16 at stage 1), which would clip Muon's
    orthogonalised updates instead of the gradients (see ``unclip_muon_updates_under_zero``)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"{KEY}.lr={self.lr}: must be > 0")
        if self.name not in ("adamw", "muon"):
            raise ConfigError(f"{KEY}.name={self.name!r}: expected adamw or muon")
        if self.muon_ns_method not in ("auto", "gram", "standard"):
            raise ConfigError(f"{KEY}.muon_ns_method={self.muon_ns_method!r}: expected auto, gram or standard")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"{KEY}.muon_momentum={self.muon_momentum}: must be in [0, 1)")
        if self.schedule not in LR_SCHEDULES:
            raise ConfigError(f"{KEY}.schedule={self.schedule!r}: expected one of {', '.join(LR_SCHEDULES)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"{KEY}.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if self.warmup_steps < 0:
            raise ConfigError(f"{KEY}.warmup_steps={self.warmup_steps}: must be >= 0")
        for name in ("weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{KEY}.{name}={getattr(self, name)}: must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{KEY}.{name}={getattr(self, name)}: must be in [0, 1)")
        if self.adam_eps <= 0:
            raise ConfigError(f"{KEY}.adam_eps={self.adam_eps}: must be > 0")


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


def resolve_precision(precision: str, optim: OptimSpec, zero_stage: int, device: torch.device) -> str:
    """``train.precision``, with ``auto`` made fp32 or bf16 for this device (see TrainConfig)."""
    if precision != "auto":
        return precision
    fast = device.type == "cuda" or (device.type == "cpu" and bf16_matmul_speedup("cpu") > 1.0)
    return "bf16" if fast and not (optim.name == "muon" and zero_stage == 0) else "fp32"


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


def deepspeed_config(optim: OptimSpec, *, precision: str, zero_stage: int, gradient_accumulation: int,
                     world_size: int) -> dict[str, Any]:
    """DeepSpeed's config: the optimizer (Muon's built by DeepSpeed), ZeRO, precision and batch sizes."""
    optimizer: dict[str, Any] = {}
    zero: dict[str, Any] = {"stage": zero_stage}
    if optim.name == "muon":
        zero["reduce_scatter"] = False  # DeepSpeed's Muon needs each matrix's whole gradient (it refuses otherwise)
        optimizer = {
            "optimizer": {"type": "Muon", "params": {
                "lr": optim.lr, "momentum": optim.muon_momentum, "betas": [optim.adam_beta1, optim.adam_beta2],
                "eps": optim.adam_eps, "weight_decay": optim.weight_decay, "torch_adam": True}},
            "data_types": {"grad_accum_dtype": "fp32"},
        }
    return {
        **optimizer,
        "train_micro_batch_size_per_gpu": 1,  # one micro-batch = one packed row / bucket
        "gradient_accumulation_steps": gradient_accumulation,
        "train_batch_size": gradient_accumulation * world_size,
        "gradient_clipping": optim.max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # a torch AdamW: nothing JIT-compiled
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
        # its throughput timer synchronises the device at every forward and step (the trainer times itself)
        "timers": {"throughput": {"enabled": False}},
    }


def build_engine(optim: OptimSpec, steps: int, model: torch.nn.Module, rt: Runtime, *, precision: str,
                 zero_stage: int, gradient_accumulation: int) -> tuple[Any, Callable[[int], float]]:
    """(the DeepSpeed engine around ``model``, ``steps`` optimizer steps long (:func:`deepspeed_config`'s
    settings): a torch AdamW, or DeepSpeed's Muon built from the config; the factor of ``optim.lr`` at
    each step)."""
    import deepspeed

    config = deepspeed_config(optim, precision=precision, zero_stage=zero_stage,
                              gradient_accumulation=gradient_accumulation, world_size=rt.world_size)
    schedule = warmup_decay(optim.warmup_steps, steps, optim.min_lr_ratio, optim.schedule)
    if optim.name == "muon":  # DeepSpeed builds Muon + its auxiliary AdamW from the config
        muon_ns_in_fp32_where_bf16_is_slow(rt.device)
        groups = muon_param_groups(model, optim.lr, muon_ns_method(optim.muon_ns_method, rt.device))
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=groups,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule), config=config)
        return engine, schedule
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2),
                                  eps=optim.adam_eps, weight_decay=optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine, schedule


__all__ = ["LR_SCHEDULES", "OptimSpec", "build_engine", "deepspeed_config", "muon_ns_in_fp32_where_bf16_is_slow",
           "muon_ns_method",
           "muon_param_groups", "resolve_precision", "unclip_muon_updates_under_zero", "warmup_decay"]
