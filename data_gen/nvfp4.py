"""Stage CLI: ``python -m data_gen.nvfp4`` converts a target to the compressed-tensors NVFP4 checkpoint vLLM loads.

    python -m data_gen.nvfp4 --target smollm2-135m --calibration runs/pools/train.jsonl --out runs/nvfp4/smollm2

The output folder is then a target like any other (``target.name_or_path=<out>``): the harvester,
the regenerator, training and the serving loop run it emulated (:func:`eagle3.target.nvfp4.load_emulated`),
W4A4 as Blackwell computes it.

:func:`convert` loads the source (an INT4 ``pack-quantized`` checkpoint, as Kimi K2.x ships, is
dequantised on load by transformers' compressed-tensors integration), runs calibration
conversations through it to find each Linear's input range, and writes every Linear (``ignore``
aside, ``lm_head`` by default) as ``weight_packed`` (two FP4 per byte), ``weight_scale`` (FP8 per
16 inputs), ``weight_global_scale`` and, for W4A4, ``input_global_scale``. Linears that vLLM fuses
(siblings reading the same input: q/k/v, gate/up) share one weight global scale, as vLLM keeps
one per fused layer. The arithmetic is :mod:`eagle3.target.nvfp4`'s.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from data_gen.config import QuantizeConfig
from eagle3.atomic import atomic_dir, check_replaceable
from eagle3.cli import add_dataclass_arguments, dataclass_from_args
from eagle3.config import DEFAULT_TARGET
from eagle3.conversations import iter_user_conversations
from eagle3.device import resolve_dtype
from eagle3.errors import run_cli
from eagle3.target import nvfp4
from eagle3.target.chat import ChatFormat
from eagle3.target.model import TargetLoadError, from_pretrained_complete
from eagle3.target.nvfp4 import FORMAT, MODES, NVFP4Error, nvfp4_quantization
from eagle3.target.source import resolve_target

REPORT_FILE = "eagle3_nvfp4.json"



def _is_earlier_conversion(folder: Path) -> bool:
    return (folder / REPORT_FILE).is_file()


# --------------------------------------------------------------------------- calibration


@dataclass
class Calibration:
    """What the calibration conversations showed about each Linear's input."""

    input_amax: dict[str, float] = field(default_factory=dict)
    fused: list[list[str]] = field(default_factory=list)
    """Sibling Linears that read the very same input tensor (vLLM fuses them into one GEMM)."""
    tokens: int = 0


def quantizable_linears(model: nn.Module, ignore: Sequence[str] = ("lm_head",)) -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` whose name is not ignored (a name matches an entry equal to it or
    ending in ``.<entry>``); each must have a multiple of 16 inputs."""
    chosen = {}
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    unmatched = [i for i in ignore if not any(name == i or name.endswith("." + i) for name in linears)]
    if unmatched:  # a typo would quantise what it meant to keep
        raise NVFP4Error(f"ignore {unmatched}: matches no Linear of the model (e.g. {', '.join(linears[:3])})")
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or any(name == i or name.endswith("." + i) for i in ignore):
            continue
        if module.in_features % nvfp4.BLOCK:
            raise NVFP4Error(f"{name}: {module.in_features} inputs is not a multiple of {nvfp4.BLOCK}; "
                             f"add it to ignore to keep it unquantised")
        chosen[name] = module
    return chosen


@torch.no_grad()
def calibrate(model: nn.Module, linears: dict[str, nn.Linear], batches: Iterable[Tensor]) -> Calibration:
    """Run ``batches`` of token ids [1, seq] through ``model`` and record, per Linear, the largest
    |input| seen (compressed-tensors' ``static_minmax`` observer), and which siblings share an input."""
    calib = Calibration()
    first_pass: dict[str, Tensor] = {}  # inputs of the first batch, held so that no id is reused

    def observe(name: str, module: nn.Module, args: tuple) -> None:
        x = args[0]
        calib.input_amax[name] = max(calib.input_amax.get(name, 0.0), x.detach().abs().amax().item())
        if calib.tokens == 0:
            first_pass.setdefault(name, x)

    handles = [m.register_forward_pre_hook(functools.partial(observe, n)) for n, m in linears.items()]
    try:
        for ids in batches:
            model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
            if calib.tokens == 0:
                calib.fused = _siblings_sharing_input({n: id(x) for n, x in first_pass.items()})
                first_pass.clear()
            calib.tokens += ids.numel()
    finally:
        for h in handles:
            h.remove()
    if calib.tokens == 0:
        raise NVFP4Error("calibration got no tokens: pass at least one conversation")
    missing = sorted(set(linears) - set(calib.input_amax))
    if missing:
        raise NVFP4Error(f"calibration never reached {missing[:5]} ({len(missing)} Linears): "
                         "they would have no input scale")
    return calib


def _siblings_sharing_input(input_ids: dict[str, int]) -> list[list[str]]:
    groups: dict[tuple[str, int], list[str]] = {}
    for name, tensor_id in input_ids.items():
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        groups.setdefault((parent, tensor_id), []).append(name)
    return [sorted(g) for g in groups.values() if len(g) > 1]


# --------------------------------------------------------------------------- conversion


def quantize_linear(weight: Tensor, weight_gscale: Tensor, input_amax: float | None) -> dict[str, Tensor]:
    """One Linear's tensors in the compressed-tensors NVFP4 layout (local names)."""
    codes, scale = nvfp4.quantize(weight, weight_gscale)  # [out, in], [out, in/16]
    tensors = {"weight_packed": nvfp4.pack_fp4(codes), "weight_scale": scale,
               "weight_global_scale": weight_gscale.float().reshape(1).clone()}
    if input_amax is not None:
        tensors["input_global_scale"] = nvfp4.global_scale(input_amax)
    return tensors


def quantization_config(mode: str, ignore: Sequence[str]) -> dict[str, Any]:
    """The ``quantization_config`` of config.json, built with compressed-tensors' own schema."""
    try:
        from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
        from compressed_tensors.quantization.quant_scheme import NVFP4, NVFP4A16
    except ImportError as err:
        raise NVFP4Error(f"the NVFP4 conversion needs the [nvfp4] extra: pip install -e '.[nvfp4]' ({err})") from None

    preset = NVFP4 if mode == "w4a4" else NVFP4A16
    qc = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], format=FORMAT, **preset)},
        format=FORMAT, ignore=list(ignore), quantization_status="compressed",
    )
    out = qc.model_dump(mode="json")
    out["quant_method"] = "compressed-tensors"
    return out


def load_source(src: str, dtype: torch.dtype) -> tuple[nn.Module, Any, Path]:
    """A dense model, its tokenizer and folder from a target spec (embedded name, folder, .gguf);
    an INT4 compressed-tensors checkpoint is dequantised on load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer


    folder = Path(resolve_target(src).location)
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    quant = config.get("quantization_config") or {}
    kwargs: dict[str, Any] = {}
    if quant:
        if quant.get("quant_method") != "compressed-tensors":
            raise NVFP4Error(f"{folder}/config.json: quantization_config.quant_method="
                             f"{quant.get('quant_method')!r}; only compressed-tensors checkpoints are dequantised")
        if quant.get("format") == FORMAT:
            raise NVFP4Error(f"{folder}: already NVFP4 ({FORMAT})")
        from transformers.utils.quantization_config import CompressedTensorsConfig

        kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    try:
        model = from_pretrained_complete(AutoModelForCausalLM, folder, dtype=dtype, use_safetensors=True, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except TargetLoadError as err:
        raise NVFP4Error(str(err)) from None
    except (OSError, ValueError, KeyError) as err:  # transformers on a folder that holds no model it knows
        raise NVFP4Error(f"{folder}: cannot load as a causal LM ({type(err).__name__}: {err})") from None
    return model.eval(), tokenizer, folder


@torch.no_grad()
def convert(src: str, out: str | Path, *, mode: str = "w4a4", calibration: Sequence[Sequence[int]] = (),
            ignore: Sequence[str] = ("lm_head",), dtype: torch.dtype = torch.float32,
            max_shard_bytes: int = 4 << 30, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``src`` as an NVFP4 checkpoint at ``out`` (atomically) and return its report.

    ``calibration``: token-id sequences run through the source to set the input global scales
    (needed for w4a4; w4a16 writes no activation scales). ``extra`` is added to the report."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    if mode not in MODES:
        raise NVFP4Error(f"mode={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "w4a4" and not calibration:
        raise NVFP4Error("w4a4 needs calibration conversations for the activation scales")
    check_replaceable(out, _is_earlier_conversion)
    model, tokenizer, folder = load_source(src, dtype)
    linears = quantizable_linears(model, ignore)
    # w4a16 needs no activation ranges, but one forward still shows which Linears share an input
    sequences = [list(s) for s in calibration if len(s)] or [list(range(min(16, model.config.vocab_size)))]
    calib = calibrate(model, linears, (torch.tensor([s]) for s in sequences))
    shared_gscale = _shared_weight_gscales(linears, calib.fused)

    state: dict[str, Tensor] = {}
    errors: dict[str, float] = {}
    for name, module in linears.items():
        w = module.weight.float()
        tensors = quantize_linear(w, shared_gscale[name], calib.input_amax[name] if mode == "w4a4" else None)
        dq = nvfp4.dequantize(nvfp4.unpack_fp4(tensors["weight_packed"]), tensors["weight_scale"],
                            tensors["weight_global_scale"])
        errors[name] = ((dq - w).norm() / w.norm().clamp(min=1e-12)).item()
        state.update({f"{name}.{k}": v for k, v in tensors.items()})
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for key, tensor in model.state_dict().items():
        module_name, _, leaf = key.rpartition(".")
        if module_name in linears and leaf == "weight":
            continue
        if tied and key == "lm_head.weight":
            continue  # written once, as the embedding
        state[key] = tensor.contiguous()

    # matrices written as they were: embeddings, ignored Linears, and anything that is not an nn.Linear
    # (e.g. MoE experts stored as one fused 3D parameter): the report names them
    unquantized = {k: int(v.numel()) for k, v in model.state_dict().items()
                   if v.dim() >= 2 and k.rpartition(".")[0] not in linears and not (tied and k == "lm_head.weight")}
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["quantization_config"] = quantization_config(mode, ignore)
    report = {
        "source": str(folder), "mode": mode, "ignore": list(ignore),
        "calibration_tokens": calib.tokens if calibration else 0, "calibration_sequences": len(calibration),
        "quantized_linears": len(linears), "fused_groups": calib.fused,
        "quantized_parameters": sum(m.weight.numel() for m in linears.values()),
        "unquantized_matrices": unquantized,
        "weight_relative_error": {"mean": sum(errors.values()) / max(len(errors), 1),
                                  "max": max(errors.values(), default=0.0)},
        "per_linear": {n: {"weight_relative_error": errors[n], "input_amax": calib.input_amax[n]} for n in linears},
        **(extra or {}),
    }
    out = Path(out)
    with atomic_dir(out, replaces=_is_earlier_conversion) as tmp:
        split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_bytes)
        for filename, keys in split.filename_to_tensors.items():
            save_file({k: state[k] for k in keys}, tmp / filename, metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                     "weight_map": split.tensor_to_filename}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        tokenizer.save_pretrained(tmp)
        for extra in ("generation_config.json", "chat_template.jinja"):
            if (folder / extra).is_file() and not (tmp / extra).exists():
                shutil.copy(folder / extra, tmp / extra)
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2))
    return report


def _shared_weight_gscales(linears: dict[str, nn.Linear], fused: list[list[str]]) -> dict[str, Tensor]:
    """Per Linear its weight global scale; a fused group gets the smallest of its members' (the
    largest |w| of the group maps to the top of the grid, so no member overflows FP8)."""
    scales = {n: nvfp4.global_scale(m.weight.detach().float().abs().amax()) for n, m in linears.items()}
    for group in fused:
        shared = torch.stack([scales[n] for n in group]).amin(0)
        for n in group:
            scales[n] = shared
    return scales


# --------------------------------------------------------------------------- command line


def calibration_sequences(path: str | Path, tokenizer: Any, *, samples: int, max_tokens: int,
                          seed: int = 0) -> list[list[int]]:
    """Token ids of ``samples`` conversations from a pool or dataset jsonl (a seeded random pick,
    whole conversations in the target's chat template, cut at ``max_tokens``)."""

    chat = ChatFormat.for_tokenizer(tokenizer)
    conversations = [messages for _, messages in iter_user_conversations(path, strict=True)]
    if not conversations:
        raise NVFP4Error(f"{path}: no conversations to calibrate on")
    random.Random(seed).shuffle(conversations)
    return [chat.tokenize_conversation(m)[0][:max_tokens] for m in conversations[:samples]]


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("nvfp4", _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    import argparse

    from transformers import AutoTokenizer


    parser = argparse.ArgumentParser(
        prog="python -m data_gen.nvfp4",
        description="Convert a target (BF16, or INT4 compressed-tensors pack-quantized) to a compressed-tensors "
                    "NVFP4 checkpoint; run it here by passing the output folder as the target.")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="embedded name, model folder or .gguf")
    add_dataclass_arguments(parser, QuantizeConfig, required=("out_dir",), aliases={"out_dir": "--out"})
    parser.add_argument("--dtype", default="float32", help="dtype the source is loaded and calibrated in")
    parser.add_argument("--seed", type=int, default=0, help="the calibration pick's seed")
    args = parser.parse_args(argv)
    calib: list[list[int]] = []
    # --ignore also as one comma-separated word, as earlier versions took it
    cfg = dataclass_from_args(QuantizeConfig, args, ignore=[i for w in args.ignore for i in w.split(",") if i])
    if cfg.calibration:
        where = resolve_target(args.target).location
        try:
            tokenizer = AutoTokenizer.from_pretrained(where)
        except (OSError, ValueError, KeyError) as err:  # transformers on a folder without a tokenizer it knows
            raise NVFP4Error(f"{where}: cannot load the tokenizer ({type(err).__name__}: {err})") from None
        calib = calibration_sequences(cfg.calibration, tokenizer, samples=cfg.samples,
                                      max_tokens=cfg.max_tokens, seed=args.seed)
    report = convert(args.target, cfg.out_dir, mode=cfg.mode, calibration=calib, ignore=cfg.ignore,
                     dtype=resolve_dtype(args.dtype, torch.device("cpu")))
    summary = {k: report[k] for k in ("mode", "quantized_linears", "calibration_sequences", "calibration_tokens",
                                      "weight_relative_error")}
    summary["fused_groups"] = len(report["fused_groups"])
    summary["quantized_parameters"] = report["quantized_parameters"]
    summary["unquantized_matrices"] = {"count": len(report["unquantized_matrices"]),
                                       "parameters": sum(report["unquantized_matrices"].values())}
    print(json.dumps({"out": str(cfg.out_dir), **summary}))
    return 0


def prepare_vllm_on_cpu(model: str | Path) -> bool:
    """Let vLLM on a machine without CUDA run an NVFP4 checkpoint: vLLM registers no NVFP4 kernel
    for CPUs, so its own emulation kernel (its fallback on GPUs without FP4) is added to the CPU's
    list, and the engine runs in this process so that the registration reaches it. Call before
    creating the ``LLM``; returns whether anything was changed (False for other checkpoints or on CUDA)."""
    if torch.cuda.is_available() or nvfp4_quantization(model) is None:
        return False
    import os

    from vllm.model_executor.kernels.linear import _POSSIBLE_NVFP4_KERNELS, EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    _POSSIBLE_NVFP4_KERNELS[PlatformEnum.CPU] = [EmulationNvFp4LinearKernel]
    return True


if __name__ == "__main__":
    sys.exit(main())
