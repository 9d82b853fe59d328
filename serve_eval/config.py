"""The serving evaluation's and the NVFP4 stage's settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle3.config import WANDB_MODES


@dataclass
class EvalConfig:
    """The serving evaluation (serve_eval): the bundled loop, speculative vs plain, on the eval sets."""

    draft: str | None = None
    """Draft folder; None: the last mining round's draft, else the training run's final one."""
    sets: list[str] = field(default_factory=lambda: ["mtbench", "humaneval", "gsm8k", "multilingual"])
    per_set: int = 10
    max_new_tokens: int = 96
    mode: str = "chain"
    k: int = 3
    topk: int = 4
    budget: int = 16
    temperature: float = 0.0
    out_dir: str = ""
    wandb_mode: str = "offline"

    def __post_init__(self) -> None:
        if self.mode not in ("chain", "tree"):
            raise ValueError(f"eval.mode={self.mode!r}: expected chain or tree")
        for name in ("per_set", "max_new_tokens", "k", "topk", "budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name}={getattr(self, name)}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"eval.temperature={self.temperature}: must be >= 0")
        if self.wandb_mode not in WANDB_MODES:
            raise ValueError(f"eval.wandb_mode={self.wandb_mode!r}: expected one of {', '.join(WANDB_MODES)}")


@dataclass
class QuantizeConfig:
    """The ``quantize`` stage: convert the target to NVFP4 (as Blackwell serves it) and run every later
    stage (regeneration, harvest, training, mining, evaluation) on the converted target, emulated."""

    mode: str = "w4a4"
    """w4a4 (weights and activations FP4, activation scales calibrated) or w4a16 (weights only)."""
    calibration: str = ""
    """Pool jsonl whose conversations calibrate; empty: the pools stage's train pool."""
    samples: int = 64
    max_tokens: int = 512
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    out_dir: str = ""
    """The converted checkpoint; empty: ``<out_dir>/nvfp4-target``."""

    def __post_init__(self) -> None:
        if self.mode not in ("w4a4", "w4a16"):
            raise ValueError(f"quantize.mode={self.mode!r}: expected w4a4 or w4a16")
        for name in ("samples", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"quantize.{name}={getattr(self, name)}: must be >= 1")
