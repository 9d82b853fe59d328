"""NVFP4 arithmetic: FP4 (E2M1) values in blocks of 16, an FP8 (E4M3) scale per block, an FP32
scale per tensor. Pure functions on tensors; what vLLM loads is written by :mod:`eagle3.nvfp4`.

The conventions are compressed-tensors' (the format vLLM reads):

* global scale ``g = 448 * 6 / amax(tensor)``: a multiplier, stored as ``*_global_scale``;
* block scale ``s = fp8(g * amax(block) / 6)``, stored as ``*_scale`` (float8_e4m3fn); a block
  of zeros gets the smallest step of FP8's mantissa (0.125) instead of 0;
* value ``x ~= code * (s / g)`` with ``code`` in 0, +-0.5, +-1, +-1.5, +-2, +-3, +-4, +-6.

Rounding is to the nearest E2M1 value, ties to the even mantissa (0.25 -> 0, 0.75 -> 1,
1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), beyond +-6 clamped.
Storage packs two codes per byte, the even-indexed element in the low nibble; a nibble is
``sign << 3 | index`` where ``index`` is the position of ``|code|`` in :data:`E2M1_VALUES`.
"""

from __future__ import annotations

import torch
from torch import Tensor

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = 6.0
FP8_MAX = 448.0  # largest float8_e4m3fn
FP8_EPS = 0.125  # torch.finfo(torch.float8_e4m3fn).eps: the scale of an all-zero block
BLOCK = 16

# Between neighbouring E2M1 magnitudes: (threshold, a tie rounds up). Ties go to the even mantissa.
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _boundaries(device: torch.device) -> Tensor:
    """float32 thresholds such that the index of |x| is the count of thresholds strictly below it: a
    threshold whose tie rounds up is moved one float32 step down (``x >= t`` is ``x > prev(t)``)."""
    t = torch.tensor([b for b, _ in _THRESHOLDS], dtype=torch.float32, device=device)
    up = torch.tensor([u for _, u in _THRESHOLDS], device=device)
    return torch.where(up, torch.nextafter(t, torch.zeros_like(t)), t)


def e2m1_index(x: Tensor) -> Tensor:
    """Index into :data:`E2M1_VALUES` of the nearest magnitude to ``|x|`` (clamped at 6), int64."""
    return torch.bucketize(x.float().abs(), _boundaries(x.device), right=False)


def round_to_e2m1(x: Tensor) -> Tensor:
    """``x`` rounded to the nearest FP4 value (same dtype as ``x``). The grid's step is 0.5 below 2,
    1 in [2, 4) and 2 from 4 to 6, so rounding is torch.round (half to even) at the local step,
    which sends each tie to the even mantissa as :data:`_THRESHOLDS` says."""
    m = x.float().abs().clamp(max=FP4_MAX)
    step = torch.where(m < 2, 0.5, torch.where(m < 4, 1.0, 2.0))
    magnitude = torch.round(m / step) * step
    return torch.where(x < 0, -magnitude, magnitude).to(x.dtype)


def pack_fp4(codes: Tensor) -> Tensor:
    """FP4 values [..., 2n] (exactly representable, e.g. from :func:`round_to_e2m1`) -> uint8 [..., n]."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the last dimension ({codes.shape[-1]}) must be even")
    nibble = e2m1_index(codes) | (torch.signbit(codes).long() << 3)  # [..., 2n]
    pairs = nibble.unflatten(-1, (-1, 2))  # [..., n, 2]
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def unpack_fp4(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """uint8 [..., n] -> FP4 values [..., 2n] in ``dtype``."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=dtype, device=packed.device)
    table = torch.cat([magnitudes, -magnitudes])  # nibble -> value, sign in bit 3
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).long()  # [..., n, 2]
    return table[nibbles].flatten(-2)


def global_scale(amax: Tensor | float) -> Tensor:
    """Per-tensor scale [1] float32 that maps ``amax`` onto FP8_MAX * FP4_MAX; 1 where amax is 0 or not finite."""
    amax = torch.as_tensor(amax, dtype=torch.float32).abs()
    scale = FP8_MAX * FP4_MAX / amax.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def block_scales(x: Tensor, gscale: Tensor) -> Tensor:
    """FP8 scale per block of 16 along the last dim: ``x`` [..., k] -> float8_e4m3fn [..., k/16]."""
    blocks = _blocks(x)  # [..., k/16, 16]
    raw = gscale * (blocks.abs().amax(-1) / FP4_MAX)  # [..., k/16]
    scale = raw.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.where(scale.float() == 0, FP8_EPS, scale.float()).to(torch.float8_e4m3fn)


def quantize(x: Tensor, gscale: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` [..., k] -> (FP4 values [..., k] as float32, FP8 block scales [..., k/16])."""
    scale = block_scales(x.float(), gscale)  # [..., k/16]
    step = scale.float() / gscale  # [..., k/16] the value of code 1 in each block
    blocks = _blocks(x.float()) / step.unsqueeze(-1)  # [..., k/16, 16]
    return round_to_e2m1(blocks.clamp(-FP4_MAX, FP4_MAX)).flatten(-2), scale


def dequantize(codes: Tensor, scale: Tensor, gscale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """FP4 values [..., k], FP8 scales [..., k/16], global scale [1] -> values [..., k] in ``dtype``."""
    step = scale.float() / gscale  # [..., k/16]
    return (_blocks(codes.float()) * step.unsqueeze(-1)).flatten(-2).to(dtype)


def fake_quantize(x: Tensor, gscale: Tensor) -> Tensor:
    """Quantise and dequantise ``x`` along its last dim with a fixed global scale and scales per
    block computed from ``x`` itself: how NVFP4 (W4A4) kernels see activations. Keeps ``x``'s dtype."""
    codes, scale = quantize(x, gscale)
    return dequantize(codes, scale, gscale, x.dtype)


def quantization_error_bound(x: Tensor, gscale: Tensor) -> Tensor:
    """Largest |x - dequantize(quantize(x))| the format allows, per element of ``x`` [..., k]:
    half the gap between the E2M1 neighbours around ``x / step`` (1 above 4, 0.5 in [2, 4], ...),
    times the block's step, plus whatever lies beyond 6 steps (the FP8 rounding of the scale can
    put a block's largest value just past the grid)."""
    step = (block_scales(x.float(), gscale).float() / gscale).unsqueeze(-1)  # [..., k/16, 1]
    mag = _blocks(x.float()).abs() / step  # [..., k/16, 16]
    half_gap = torch.where(mag >= 4, 1.0, torch.where(mag >= 2, 0.5, 0.25))
    beyond = (mag - FP4_MAX).clamp(min=0)
    return ((half_gap + beyond) * step).flatten(-2)


def _blocks(x: Tensor) -> Tensor:
    if x.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs the last dimension ({x.shape[-1]}) to be a multiple of {BLOCK}")
    return x.unflatten(-1, (-1, BLOCK))
