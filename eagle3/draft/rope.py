"""Rotary position embeddings of the draft families: the inverse frequencies (plain, linear,
Llama-3 and YaRN scaling, as HF and vLLM compute them), cos/sin tables and the rotation (how a
config.json states its RoPE: :mod:`eagle3.target.positions`). ``config`` arguments are
:class:`eagle3.draft.model.DraftConfig`s."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from eagle3.target.positions import read_rope, rope_kind

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
