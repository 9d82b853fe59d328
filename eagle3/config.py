"""The typed config tree. Hydra recipes in ``recipes/`` compose YAML over these dataclasses;
the entry point converts once, and nothing below it sees a ``DictConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class TargetConfig:
    """Which model the draft speculates for, and how to run it."""

    name_or_path: str = "smollm2-135m"
    """An embedded target name, a local HF model folder, a local .gguf file, or a hub id."""
    dtype: str = "auto"
    """auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16 or float16."""
    device: str = "auto"
    """auto, cpu, cuda, cuda:N."""
    aux_layer_ids: list[int] | None = None
    """Decoder layers whose inputs feed the draft; default (2, N//2, N-3)."""
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    """Run code shipped with the model folder: only for models you trust."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"target.dtype={self.dtype!r}: expected one of {', '.join(_DTYPES)}")


@dataclass
class PipelineConfig:
    """One run of the pipeline: every stage reads its part of this tree."""

    target: TargetConfig = field(default_factory=TargetConfig)
    out_dir: str = "runs/quickstart"
    """Where every stage writes its outputs."""
    stages: list[str] = field(default_factory=lambda: ["target"])
    """Stages to run, in order."""
    threads: int = 1
    """torch intra-op threads on CPU; 1 was fastest on a loaded 2-core machine."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads={self.threads}: must be >= 1")
