"""NVFP4, the format: its arithmetic and running such a checkpoint here as Blackwell computes it.

FP4 (E2M1) values in blocks of 16, an FP8 (E4M3) scale per block, an FP32 scale per tensor, with
compressed-tensors' conventions (the format vLLM reads):

* global scale ``g = 448 * 6 / amax(tensor)``: a multiplier, stored as ``*_global_scale``;
* block scale ``s = fp8(g * amax(block) / 6)``, stored as ``*_scale`` (float8_e4m3fn); a block
  of zeros gets the smallest step of FP8's mantissa (0.125) instead of 0;
* value ``x ~= code * (s / g)`` with ``code`` in 0, +-0.5, +-1, +-1.5, +-2, +-3, +-4, +-6.

Rounding is to the nearest E2M1 value, ties to the even mantissa (0.25 -> 0, 0.75 -> 1,
1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), beyond +-6 clamped.
Storage packs two codes per byte, the even-indexed element in the low nibble; a nibble is
``sign << 3 | index`` where ``index`` is the position of ``|code|`` in :data:`E2M1_VALUES`.

:func:`load_emulated` builds the model from an NVFP4 checkpoint with dequantised weights; in
``w4a4`` mode every quantised Linear also fake-quantises its input per block of 16 with the
calibrated global scale (what the FP4 tensor cores multiply), in ``w4a16`` only weights are FP4.
Converting a model to NVFP4 is :mod:`data_gen.nvfp4`'s. Both are tested against compressed-tensors'
reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from eagle3.errors import Eagle3Error

FORMAT = "nvfp4-pack-quantized"
MODES = ("w4a4", "w4a16")


class NVFP4Error(Eagle3Error, ValueError):
    """A checkpoint or conversion request that cannot be honoured; the message names the file or key."""



# --------------------------------------------------------------------------- arithmetic

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


# --------------------------------------------------------------------------- emulated loading


def nvfp4_quantization(folder: str | Path) -> dict[str, Any] | None:
    """The checkpoint's NVFP4 ``quantization_config`` (None for a checkpoint in another format)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    quant = json.loads(path.read_text()).get("quantization_config") or {}
    formats = {quant.get("format")} | {g.get("format") for g in (quant.get("config_groups") or {}).values()}
    return quant if FORMAT in formats else None


class ActivationFakeQuant:
    """Forward pre-hook: the Linear's input fake-quantised to NVFP4 with a fixed global scale."""

    def __init__(self, gscale: Tensor) -> None:
        self.gscale = gscale

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        if self.gscale.device != args[0].device:  # moved once, not on every call
            self.gscale = self.gscale.to(args[0].device)
        return (fake_quantize(args[0], self.gscale), *args[1:])


def load_emulated(folder: str | Path, *, dtype: torch.dtype = torch.float32, mode: str = "auto",
                  attn_implementation: str = "sdpa") -> nn.Module:
    """An HF causal LM from an NVFP4 checkpoint, its weights dequantised; ``mode`` ``auto`` follows
    the checkpoint (w4a4 when it has activation scales), ``w4a16`` ignores activation scales."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    folder = Path(folder)
    quant = nvfp4_quantization(folder)
    if quant is None:
        raise NVFP4Error(f"{folder}/config.json: no {FORMAT} quantization_config")
    if mode not in ("auto", *MODES):
        raise NVFP4Error(f"nvfp4 mode={mode!r}: expected auto, w4a4 or w4a16")
    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise NVFP4Error(f"{folder}: no safetensors files")
    raw: dict[str, Tensor] = {}
    for file in files:
        with safe_open(file, "pt") as f:
            for key in f.keys():
                raw[key] = f.get_tensor(key)
    state: dict[str, Tensor] = {}
    input_scales: dict[str, Tensor] = {}
    for key in list(raw):
        if not key.endswith(".weight_packed"):
            continue
        name = key[: -len(".weight_packed")]
        try:
            packed = raw.pop(key)
            scale, gscale = raw.pop(f"{name}.weight_scale"), raw.pop(f"{name}.weight_global_scale")
        except KeyError as err:
            raise NVFP4Error(f"{folder}: {name} has weight_packed but no {err.args[0]}") from None
        state[f"{name}.weight"] = dequantize(unpack_fp4(packed), scale, gscale.float(), dtype)
        if f"{name}.input_global_scale" in raw:
            input_scales[name] = raw.pop(f"{name}.input_global_scale").float()
    state.update({k: v.to(dtype) if v.is_floating_point() else v for k, v in raw.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise NVFP4Error(f"{folder}: checkpoint does not match the config "
                         f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()

    has_acts = bool(input_scales)
    use_acts = {"auto": has_acts, "w4a4": True, "w4a16": False}[mode]
    if use_acts and not has_acts:
        raise NVFP4Error(f"{folder}: w4a4 emulation asked for, but the checkpoint has no input_global_scale "
                         "(a weight-only NVFP4A16 checkpoint)")
    if use_acts:
        modules = dict(model.named_modules())
        for name, gscale in input_scales.items():
            modules[name].register_forward_pre_hook(ActivationFakeQuant(gscale))
    model.nvfp4_mode = "w4a4" if use_acts else "w4a16"
    model.config._name_or_path = str(folder)  # what from_pretrained would record: the harvest manifest reads it
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()
