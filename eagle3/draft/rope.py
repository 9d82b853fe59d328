"""Rotary position embeddings of the draft families: the inverse frequencies (plain, linear,
Llama-3 and YaRN scaling, as HF and vLLM compute them), cos/sin tables, the rotation, and how a
config.json's RoPE keys are read. ``config`` arguments are :class:`eagle3.draft.model.DraftConfig`s."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_kind(scaling: dict[str, Any] | None) -> str:
    """A RoPE scaling dict's type (``rope_type``, or the older ``type``); default when unset."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def read_rope(config: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(theta, scaling dict) from a config.json's keys, read as transformers and vLLM read them:
    ``rope_parameters`` or ``rope_scaling``; per-layer-type dicts (Gemma 3's
    ``{"full_attention": .., "sliding_attention": ..}``) give the full-attention layers' RoPE; for
    llama3 / yarn / longrope a top-level ``original_max_position_embeddings`` wins over the dict's,
    and ``max_position_embeddings`` fills it in when neither has one; a top-level
    ``partial_rotary_factor`` goes into the dict."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = rope["full_attention"]
    rope = dict(rope)
    theta = rope.pop("rope_theta", None) or config.get("rope_theta") or 10000.0  # as written: callers check it
    if config.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    if rope_kind(rope) in ("llama3", "yarn", "longrope"):
        if config.get("original_max_position_embeddings") is not None:
            rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        elif config.get("max_position_embeddings") is not None:
            rope.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return theta, rope


def rope_inv_freq(config: Any, device: torch.device | None = None) -> Tensor:
    """Inverse frequencies [head_dim/2] of RoPE, with linear, Llama-3 or YaRN scaling."""
    d = config.head_dim
    inv = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    scaling = config.rope_scaling or {}
    kind = rope_kind(scaling)
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short waves
        return (1 - smooth) * inv / factor + smooth * inv
    if kind == "yarn":
        # dims that turn fewer than beta_slow times over the original context are interpolated
        # (inv / factor), more than beta_fast times kept, a linear ramp between (HF's and vLLM's formula)
        factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
        beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def dim_of(rotations: float) -> float:  # the dim index at which a wave turns `rotations` times
            return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(config.rope_theta))

        low, high = dim_of(beta_fast), dim_of(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        high = high + 0.001 if low == high else high
        ramp = ((torch.arange(d // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0.0, 1.0)
        return inv / factor * ramp + inv * (1 - ramp)  # ramp 0: extrapolated (kept), 1: interpolated
    return inv


def rope_attention_factor(config: Any) -> float:
    """The factor on cos and sin (so the attention logits scale by its square): YaRN's mscale, else 1."""
    scaling = config.rope_scaling or {}
    if rope_kind(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


def rope_cos_sin(config: Any, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [B, S, head_dim] for integer positions [B, S] (half-split layout, as HF/vLLM Llama)."""
    inv = rope_inv_freq(config, positions.device)  # [d/2]
    angles = positions.float().unsqueeze(-1) * inv  # [B, S, d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [B, S, d]
    scale = rope_attention_factor(config)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, S, heads, d] by cos/sin [B, S, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


__all__ = ["ROPE_TYPES", "apply_rope", "read_rope", "rope_attention_factor", "rope_cos_sin", "rope_inv_freq",
           "rope_kind"]
