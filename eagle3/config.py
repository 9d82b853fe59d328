"""The settings every part shares: the target and sampling.

The trainer's settings live beside it (``eagle3/train/config.py``), and each stage keeps its own
beside its code (``data_gen/config.py``, ``serve_eval/config.py``, ``hard_mining/config.py``);
``recipes/config.py`` composes them into the pipeline's tree, over which the Hydra recipes compose
YAML.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from eagle3.errors import ConfigError

_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_TARGET = "smollm2-135m"
"""The embedded default target (:mod:`eagle3.target.source` knows where it comes from)."""


@dataclass
class TargetConfig:
    """Which model the draft speculates for, and how to run it."""

    RUN_ONLY: ClassVar[tuple[str, ...]] = ("device", "attn_implementation", "trust_remote_code", "architecture")
    """The fields that do not change what the target computes (beyond a device's or a kernel's round-off;
    ``architecture`` is checked against the loaded model)."""

    name_or_path: str = DEFAULT_TARGET
    """An embedded target name, a local HF model folder, a local .gguf file, or a hub id."""
    dtype: str = "auto"
    """auto (bf16 on CUDA and on CPUs with native bf16, AVX512-BF16 or AMX; fp32 on other CPUs), float32,
    bfloat16 or float16."""
    device: str = "auto"
    """auto, cpu, cuda, cuda:N."""
    aux_layer_ids: list[int] | None = None
    """Decoder layers whose inputs feed the draft; default (2, N//2, N-3)."""
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    """Run code shipped with the model folder: only for models you trust."""
    architecture: dict[str, Any] | None = None
    """The target's architecture as its config.json states it (hidden_size, num_hidden_layers,
    vocab_size, ...; nested under ``text_config`` for multimodal checkpoints): lets a recipe be
    planned without the weights (``stages=[size]``: draft shape and parameter count). Once the
    model is loaded, every value given here is checked against its config."""
    nvfp4_mode: str = "auto"
    """For an NVFP4 checkpoint (``python -m data_gen.nvfp4 --out DIR``), run emulated: auto (as the
    checkpoint says: W4A4 when it has activation scales), w4a4, or w4a16 (weights only)."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"target.dtype={self.dtype!r}: expected one of {', '.join(_DTYPES)}")
        if self.nvfp4_mode not in ("auto", "w4a4", "w4a16"):
            raise ConfigError(f"target.nvfp4_mode={self.nvfp4_mode!r}: expected auto, w4a4 or w4a16")
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise ConfigError(f"target.device={self.device!r}: expected auto, cpu, cuda, cuda:N or mps")


def add_target_arguments(parser: Any, *, target: str | None = None, dtype_aliases: tuple[str, ...] = ()) -> None:
    """``--target``, ``--target-dtype`` and ``--device`` on an argparse CLI that loads a target, with
    :class:`TargetConfig`'s defaults and meanings (the one definition of these three flags)."""
    parser.add_argument("--target", default=TargetConfig.name_or_path if target is None else target,
                        help="embedded target name, model folder, .gguf file or hub id (default %(default)s)")
    parser.add_argument("--target-dtype", *dtype_aliases, dest="target_dtype", default=TargetConfig.dtype,
                        choices=_DTYPES, help="auto: bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16, "
                                              "AMX), fp32 elsewhere (default %(default)s)")
    parser.add_argument("--device", default=TargetConfig.device,
                        help="where the target (and draft) run: auto (CUDA when present), cpu, cuda, cuda:N")



@dataclass(frozen=True)
class SamplingConfig:
    """How the target picks each token, everywhere it decodes (regeneration, the serving loop, the
    server): ``temperature == 0`` is greedy (top_p/top_k then unused). How many tokens is the
    caller's ``max_new_tokens``."""

    temperature: float = 0.0
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]; 1 disables it."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables it."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k}: must be >= 0 (0 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
