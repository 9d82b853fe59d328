"""Drafts in the formats serving engines load, and back: export and import.

The formats (vLLM's plain layout, speculators', SGLang's) and their ``config.json`` are described
in :mod:`eagle3.formats`. Aux layer ids inside this library always mean "the input of decoder
layer i" (HF ``hidden_states[i]``), ascending. ``load_draft`` reads all three formats and the
public ones they come from (EAGLE/SpecForge checkpoints in the plain layout, speculators
checkpoints), to evaluate a public draft or continue training it. Pickled ``.bin`` weights are
refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from eagle3.atomic import atomic_dir, holds_only
from eagle3.draft import DraftConfig, Eagle3Draft, read_rope, rope_kind
from eagle3.errors import run_cli
from eagle3.formats import (
    ARCHITECTURES,
    DFLASH_ARCHITECTURE,
    FORMATS,
    MARKER,
    DraftFormatError,
    dflash_config,
    sglang_config,
    speculators_config,
    vllm_config,
)

OUR_META = "draft.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedDraft:
    """A draft read from disk, in our terms."""

    draft: Eagle3Draft
    aux_layer_ids: tuple[int, ...] | None
    """Inputs of these target layers (ascending); None: the folder names none (engine defaults)."""
    format: str
    """vllm, speculators or sglang."""
    path: Path
    meta: dict[str, Any] = field(default_factory=dict)
    """Our draft.json when present (training step and eval figures), else {}."""
    has_embedding: bool = False
    """The checkpoint carried its own embedding (loaded); otherwise the target's must be given."""
    has_lm_head: bool = True
    """False: the checkpoint has no lm_head (engines serve it with the target's, as ModelOpt's
    full-vocab drafts ship); :func:`fit_to_target` copies the target's in."""


# ---------------------------------------------------------------- tensors


def engine_tensors(state: dict[str, Tensor], fmt: str, dtype: torch.dtype) -> dict[str, Tensor]:
    """Our state dict -> the format's tensors: no embedding, floats in ``dtype``, d2t int64, t2d bool.

    A draft over the whole target vocabulary is written without d2t/t2d: vLLM builds no mapping
    parameter when ``draft_vocab_size == vocab_size`` and refuses to load a checkpoint that has
    one (SGLang and our importer read the missing mapping as the identity)."""
    full_vocab = "d2t" in state and "t2d" in state and state["d2t"].numel() == state["t2d"].numel()
    if full_vocab and state["d2t"].any():
        raise DraftFormatError("the draft vocab is the whole target vocab but d2t is not the identity: engines read "
                               "a full-vocab draft's ids as the target's")
    out = {}
    for name, tensor in state.items():
        if name == "embed_tokens.weight" or (full_vocab and name in ("d2t", "t2d")):
            continue
        if fmt == "speculators" and name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        if name == "d2t":
            tensor = tensor.to(torch.int64)
        elif name == "t2d":
            tensor = tensor.to(torch.bool)
        else:
            tensor = tensor.to(dtype)
        out[name] = tensor.detach().cpu().contiguous()
    return out


def _our_names(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """A checkpoint's names -> ours: ``layers.0.`` is the first layer (midlayer), ``model.`` dropped."""
    out = {}
    for name, tensor in tensors.items():
        if name.startswith("model."):
            name = name[len("model."):]
        if name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        out[name] = tensor
    return out


# ---------------------------------------------------------------- export


def _is_earlier_export(folder: Path) -> bool:
    """Only our files, and our mark on them (a downloaded draft has the same two file names)."""
    if not holds_only("model.safetensors", "config.json", OUR_META)(folder):
        return False
    if (folder / OUR_META).is_file():
        return True
    try:
        return MARKER in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False


def nonfinite_tensors(tensors: dict[str, Tensor]) -> list[str]:
    """Names of the floating tensors holding a NaN or Inf: a diverged or corrupted draft."""
    return [k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()]


def export_draft_folder(out: str | os.PathLike[str], state: dict[str, Tensor], config: DraftConfig,
                        aux_layer_ids: Sequence[int], fmt: str = "vllm", *, dtype: str = "bfloat16",
                        verifier: str | None = None, verifier_architectures: Sequence[str] = (),
                        speculative_tokens: int = 3, meta: dict[str, Any] | None = None) -> Path:
    """Write one draft folder in ``fmt`` atomically (complete or absent); returns its path.

    ``state``: an :class:`Eagle3Draft` state dict (our names). ``meta``: written as draft.json
    (our training record) next to the engine files. ``verifier`` (the target's name or path) is
    required by the speculators format, so that ``vllm serve <draft>`` knows the target.
    """
    if fmt not in FORMATS:
        raise DraftFormatError(f"format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise DraftFormatError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if fmt == "vllm" and config.family == "dflash":
        cfg = dflash_config(config, aux_layer_ids, dtype)
    elif fmt == "vllm":
        cfg = vllm_config(config, aux_layer_ids, dtype)
    elif fmt == "sglang":
        cfg = sglang_config(config, aux_layer_ids, dtype)
    else:
        if not verifier:
            raise DraftFormatError("the speculators format needs the verifier (the target's name or path)")
        cfg = speculators_config(config, aux_layer_ids, verifier=verifier,
                                 verifier_architectures=verifier_architectures,
                                 speculative_tokens=speculative_tokens, torch_dtype=dtype)
    tensors = engine_tensors(state, fmt, DTYPES[dtype])
    if nonfinite := nonfinite_tensors(tensors):
        raise DraftFormatError(f"{out}: not exported: NaN/Inf in {', '.join(nonfinite[:4])} (a diverged draft)")
    with atomic_dir(out, replaces=_is_earlier_export) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if meta is not None:
            (tmp / OUR_META).write_text(json.dumps(meta, indent=1) + "\n")
    return Path(out)


# ---------------------------------------------------------------- import


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DraftFormatError(f"{path}: missing (a draft folder needs config.json and model.safetensors)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DraftFormatError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise DraftFormatError(f"{path}: expected a JSON object")
    return data


def looks_like_eagle3(names: Sequence[str]) -> bool:
    """Tensor names (ours, see :func:`_our_names`) of an EAGLE-3 decoder layer: ``fc`` over the aux
    states and a first layer with ``hidden_norm`` (its 2H attention input). EAGLE-1/2 drafts have
    an fc over [embedding, state] and no ``hidden_norm``; MLA drafts have no ``q_proj``."""
    have = set(names)
    return {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight"} <= have


def detect_format(cfg: dict[str, Any], path: Path, names: Sequence[str] = ()) -> str:
    """vllm, speculators or sglang, from a config.json's contents (and the checkpoint's tensor
    ``names``: a plain config whose architecture is the target's, as EAGLE's own checkpoints write
    ``LlamaForCausalLM``, counts as vllm when the tensors are an EAGLE-3 layer, as vLLM reads it)."""
    marker = cfg.get(MARKER)
    if isinstance(marker, dict) and marker.get("format") in FORMATS:
        return marker["format"]
    if "speculators_model_type" in cfg:
        if cfg["speculators_model_type"] != "eagle3":
            raise DraftFormatError(f"{path}: speculators_model_type={cfg['speculators_model_type']!r}, only eagle3 "
                                   "drafts are supported")
        return "speculators"
    archs = cfg.get("architectures") or []
    if any(a in ARCHITECTURES for a in archs) or (archs == ["LlamaForCausalLM"] and looks_like_eagle3(names)):
        return "vllm"
    raise DraftFormatError(f"{path}: architectures={archs} is not an EAGLE-3 draft (expected one of "
                           f"{', '.join(ARCHITECTURES)}, LlamaForCausalLM with an EAGLE-3 layer's tensors, "
                           "or a speculators config)")


def _is_id_list(ids: Any) -> bool:
    """A JSON list of layer ids: integers, booleans excluded."""
    return isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)


def _specforge_ids(cfg: dict[str, Any]) -> list[int] | None:
    """The ids of an unmarked plain config that names them only under ``eagle_config`` and
    starts at 1: SpecForge's and ModelOpt's convention (layer outputs; their default for N layers
    is [1, N/2 - 1, N - 4], the inputs of vLLM's default layers). None otherwise."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if MARKER in cfg or cfg.get("eagle_aux_hidden_state_layer_ids") or not ids or not _is_id_list(ids):
        return None  # a bad list is named by _aux_ids
    return ids if min(ids) == 1 else None


def _aux_ids(cfg: dict[str, Any], fmt: str, path: Path) -> tuple[int, ...] | None:
    """The aux ids in our terms (input of layer i), from where the format keeps them; places
    that disagree are refused (an engine would feed whichever one it reads)."""
    shift = 1 if fmt == "sglang" else 0  # SGLang adds 1 to the ids it is given
    eagle = cfg.get("eagle_config") or {}
    marker = cfg.get(MARKER)
    places = {"eagle_aux_hidden_state_layer_ids": (cfg.get("eagle_aux_hidden_state_layer_ids"), shift),
              "eagle_config.eagle_aux_hidden_state_layer_ids": (eagle.get("eagle_aux_hidden_state_layer_ids"), shift),
              f"{MARKER}.aux_layer_ids": (marker.get("aux_layer_ids") if isinstance(marker, dict) else None, 0)}
    found: dict[str, tuple[int, ...]] = {}
    for key, (ids, add) in places.items():
        if ids is None or ids == []:
            continue
        if not _is_id_list(ids):
            raise DraftFormatError(f"{path}: {key}={ids!r} is not a list of integers")
        found[key] = tuple(sorted(i + add for i in ids))
    if len(set(found.values())) > 1:
        raise DraftFormatError(f"{path}: the aux layer ids disagree ("
                               + ", ".join(f"{key}={list(ids)}" for key, ids in found.items())
                               + (" in our terms, SGLang's +1 undone" if shift else "") + "); fix config.json")
    return next(iter(found.values()), None)


def draft_config_from_json(cfg: dict[str, Any], fmt: str, path: Path, num_aux_layers: int | None,
                           parallel: bool = False) -> DraftConfig:
    """A :class:`DraftConfig` from a config.json (either layout); unsupported variants are refused by name.
    ``parallel``: the checkpoint holds ``mask_hidden`` (a P-EAGLE draft), so ``mask_token_id`` is required."""
    cfg = {k: v for k, v in cfg.items() if v is not None}  # null means unset (ModelOpt writes its template's)
    layer = cfg.get("transformer_layer_config", cfg) if fmt == "speculators" else cfg
    layer = {k: v for k, v in layer.items() if v is not None}
    # vLLM's defaults: the speculators path assumes norm_before_residual, the plain path does not
    flags = {"norm_before_residual": fmt == "speculators", "norm_before_fc": False, "fc_norm": False,
             "norm_output": False}
    eagle = cfg.get("eagle_config") or {}
    for key in flags:
        value = eagle.get(key, cfg.get(key, layer.get(key)))
        if value is not None:
            flags[key] = bool(value)
    if layer.get("attention_bias") or layer.get("mlp_bias") or cfg.get("bias") is True:
        raise DraftFormatError(f"{path}: attention_bias/mlp_bias/bias=true is not supported (the draft has no "
                               "biases; SGLang reads bias as an fc bias, vLLM as an o_proj one)")
    if cfg.get("quantization_config") or layer.get("quantization_config"):
        raise DraftFormatError(f"{path}: quantization_config is set: quantized drafts are not supported (export "
                               "the draft unquantized)")
    act = layer.get("hidden_act", "silu")
    if act != "silu":
        raise DraftFormatError(f"{path}: hidden_act={act!r}, only silu (SwiGLU) is supported")
    theta, rope = read_rope(layer)
    if (partial := rope.pop("partial_rotary_factor", 1.0)) != 1.0:
        raise DraftFormatError(f"{path}: partial_rotary_factor={partial!r}: vLLM would rotate part of the draft's "
                               "head; the draft rotates all of it")
    kind = rope_kind(rope)
    parallel = parallel or bool(cfg.get("parallel_drafting"))
    if parallel and cfg.get("mask_token_id") is None:
        raise DraftFormatError(f"{path}: a P-EAGLE draft (mask_hidden / parallel_drafting) needs the top-level "
                               "mask_token_id (the token vLLM feeds at each mask position)")

    def num(key: str, value: Any, cast: type = int) -> Any:
        try:
            return cast(value)
        except (TypeError, ValueError):
            raise DraftFormatError(f"{path}: {key}={value!r} is not a number") from None

    try:
        hidden = num("hidden_size", layer["hidden_size"])
        heads = num("num_attention_heads", layer["num_attention_heads"])
        vocab = num("vocab_size", layer.get("vocab_size") or cfg["vocab_size"])
        return DraftConfig(
            hidden_size=hidden,
            intermediate_size=num("intermediate_size", layer["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=num("num_key_value_heads", layer.get("num_key_value_heads") or heads),
            head_dim=num("head_dim", layer.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=num("draft_vocab_size", cfg.get("draft_vocab_size") or layer.get("draft_vocab_size")
                                 or vocab),
            target_hidden_size=num("target_hidden_size", cfg.get("target_hidden_size")
                                   or layer.get("target_hidden_size") or hidden),
            num_aux_layers=num_aux_layers or num("num_aux_hidden_states", cfg.get("num_aux_hidden_states") or 3),
            rms_norm_eps=num("rms_norm_eps", layer.get("rms_norm_eps", 1e-6), float),
            rope_theta=num("rope_theta", theta, float),
            rope_scaling=None if kind == "default" else rope,
            max_position_embeddings=num("max_position_embeddings", layer.get("max_position_embeddings", 2048)),
            num_layers=num("num_hidden_layers", layer.get("num_hidden_layers", 1)),
            mask_token_id=num("mask_token_id", cfg["mask_token_id"]) if parallel else None,
            **flags,
        )
    except KeyError as err:
        raise DraftFormatError(f"{path}: config key {err.args[0]!r} is missing") from None
    except DraftFormatError:
        raise
    except (TypeError, ValueError) as err:  # DraftConfig's own checks
        raise DraftFormatError(f"{path}: {err}") from None


def load_draft(folder: str | os.PathLike[str], fmt: str = "auto", *,
               embed_tokens_weight: Tensor | None = None) -> LoadedDraft:
    """Read a draft folder (``config.json`` + ``model.safetensors``) of any supported format.

    ``fmt``: auto (from config.json; a plain folder counts as vllm) or one of FORMATS: pass
    ``sglang`` for a public SGLang-style folder whose ids follow SGLang's convention (our own
    sglang exports are recognised by their marker). ``embed_tokens_weight``: the target's
    embedding, used when the checkpoint has none (the usual case).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DraftFormatError(f"{folder}: not a draft folder")
    cfg = _read_json(folder / "config.json")
    if fmt != "auto" and fmt not in FORMATS:
        raise DraftFormatError(f"format {fmt!r}: expected auto or one of {', '.join(FORMATS)}")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = (f" ({', '.join(pickles)} are pickles, never loaded here: convert them to safetensors "
                "yourself if you trust their source)") if pickles else ""
        raise DraftFormatError(f"{folder}: no .safetensors weights{hint}")
    dflash = DFLASH_ARCHITECTURE in (cfg.get("architectures") or [])
    tensors: dict[str, Tensor] = {}
    for path in weights:
        try:
            tensors.update(load_file(str(path)) if dflash else _our_names(load_file(str(path))))
        except (SafetensorError, OSError) as err:
            raise DraftFormatError(f"{path}: not a readable safetensors file ({err}); truncated or corrupt?") from None
    if dflash:
        if fmt not in ("auto", "vllm"):
            raise DraftFormatError(f"{folder}: a DFlashDraftModel folder is vLLM's layout; format {fmt!r} does not "
                                   "apply")
        return _load_dflash(folder, cfg, tensors, embed_tokens_weight)
    found = detect_format(cfg, folder / "config.json", list(tensors))
    if fmt == "auto":
        fmt = found
        if fmt == "vllm" and (ids := _specforge_ids(cfg)) is not None:
            fmt = "sglang"
            warnings.warn(f"{folder / 'config.json'}: eagle_config.eagle_aux_hidden_state_layer_ids={ids} only, "
                          f"starting at 1: read as SpecForge/ModelOpt/SGLang ids (layer outputs), i.e. the inputs "
                          f"of layers {[i + 1 for i in ids]}; vLLM would feed the inputs of layers {ids}. Pass "
                          "the vllm format to read them as vLLM does", stacklevel=2)
    if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise DraftFormatError(f"{folder / 'config.json'}: eagle_config.use_aux_hidden_state=false: this draft "
                               "reads the target's last hidden state, not aux layers (EAGLE-1/2 style); not "
                               "supported")
    ids = _aux_ids(cfg, fmt, folder / "config.json")
    config = draft_config_from_json(cfg, fmt, folder / "config.json", len(ids) if ids else None,
                                    parallel="mask_hidden" in tensors)
    has_lm_head = "lm_head.weight" in tensors
    if not has_lm_head and config.draft_vocab_size != config.vocab_size:
        raise DraftFormatError(f"{folder}: no lm_head.weight and draft_vocab_size={config.draft_vocab_size} < "
                               f"vocab_size={config.vocab_size}: vLLM would give it the target's lm_head over the "
                               "whole vocabulary, which its d2t does not index; not servable")
    if not has_lm_head and config.hidden_size != config.target_hidden_size:
        raise DraftFormatError(f"{folder}: no lm_head.weight and hidden_size={config.hidden_size} != "
                               f"target_hidden_size={config.target_hidden_size}: the target's lm_head cannot "
                               "read this draft's states")
    if "fc.weight" in tensors:  # the checkpoint decides how many aux states fc reads
        width = tensors["fc.weight"].shape[1]
        if width % config.target_hidden_size:
            raise DraftFormatError(f"{folder}: fc.weight {tuple(tensors['fc.weight'].shape)} does not read a "
                                   f"multiple of target_hidden_size={config.target_hidden_size}")
        if width // config.target_hidden_size != config.num_aux_layers:
            if ids:
                raise DraftFormatError(f"{folder}: fc.weight reads {width // config.target_hidden_size} aux states,"
                                       f" the config names {len(ids)} layers {list(ids)}")
            config = DraftConfig(**{**asdict(config), "num_aux_layers": width // config.target_hidden_size})
    has_embedding = "embed_tokens.weight" in tensors
    draft = Eagle3Draft(config, None if has_embedding else embed_tokens_weight)
    if "d2t" not in tensors:  # a full-vocab draft: draft id i is target id i
        if config.draft_vocab_size != config.vocab_size:
            raise DraftFormatError(f"{folder}: draft_vocab_size={config.draft_vocab_size} < vocab_size="
                                   f"{config.vocab_size} but the checkpoint has no d2t mapping")
        tensors["d2t"] = torch.zeros(config.vocab_size, dtype=torch.int64)
    if "t2d" not in tensors:  # vLLM ignores t2d; rebuild it from d2t
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(len(tensors["d2t"])) + tensors["d2t"].long()] = True
        tensors["t2d"] = t2d
    if "mask_hidden" in tensors:  # vLLM reads any layout of it as one row (view(1, -1))
        tensors["mask_hidden"] = tensors["mask_hidden"].reshape(-1)
    d2t, t2d = tensors.pop("d2t").long(), tensors.pop("t2d").bool()
    _fill(draft, tensors, d2t, t2d, folder)
    return LoadedDraft(draft=draft, aux_layer_ids=ids, format=fmt, path=folder, meta=_our_meta(folder),
                       has_embedding=has_embedding, has_lm_head=has_lm_head)


def _our_meta(folder: Path) -> dict[str, Any]:
    return _read_json(folder / OUR_META) if (folder / OUR_META).is_file() else {}


def _fill(draft: Any, tensors: dict[str, Tensor], d2t: Tensor, t2d: Tensor, folder: Path) -> None:
    """Load a checkpoint's tensors (our names) and vocab mapping into ``draft``, refusing, by name,
    tensors the config does not have or lacks (but the embedding and lm_head), other shapes, NaN/Inf."""
    want = draft.state_dict()
    extra = sorted(set(tensors) - set(want))
    missing = sorted(set(want) - set(tensors) - {"embed_tokens.weight", "d2t", "t2d", "lm_head.weight"})
    if extra or missing:
        raise DraftFormatError(f"{folder}: the weights do not fit the config (unexpected {extra[:8]}, "
                               f"missing {missing[:8]})")
    bad = [f"{k} {tuple(v.shape)} vs {tuple(want[k].shape)}" for k, v in tensors.items() if v.shape != want[k].shape]
    if bad:
        raise DraftFormatError(f"{folder}: tensor shapes differ from config.json: {'; '.join(bad[:4])}")
    if nonfinite := nonfinite_tensors(tensors):
        raise DraftFormatError(f"{folder}: NaN/Inf in {', '.join(nonfinite[:4])}: a diverged or corrupted draft")
    draft.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    try:
        draft.set_draft_vocab(d2t, t2d)
    except ValueError as err:
        raise DraftFormatError(f"{folder}: d2t/t2d: {err}") from None


def _load_dflash(folder: Path, cfg: dict[str, Any], tensors: dict[str, Tensor],
                 embed_tokens_weight: Tensor | None) -> LoadedDraft:
    """A ``DFlashDraftModel`` folder (vLLM's layout: dflash_config.target_layer_ids name layer outputs)."""
    from eagle3.dflash import DFlashDraft

    where = folder / "config.json"
    options = cfg.get("dflash_config") or {}
    tensors = {k[len("model."):] if k.startswith("model.") else k: v for k, v in tensors.items()}
    # causality as vLLM resolves it: is_causal, then dflash_config.causal, then sliding layers
    causal = cfg.get("is_causal", options.get("causal"))
    sliding = options.get("use_swa") or "sliding_attention" in (cfg.get("layer_types") or [])
    if causal or sliding or (causal is None and sliding):
        raise DraftFormatError(f"{where}: a causal or sliding-window DFlash draft is not supported (only the "
                               "non-causal block of full-attention layers)")
    ids = options.get("target_layer_ids")
    if not _is_id_list(ids) or options.get("mask_token_id") is None:
        raise DraftFormatError(f"{where}: dflash_config needs target_layer_ids (a list of ints) and mask_token_id")
    aux = tuple(sorted(int(i) + 1 for i in ids))  # vLLM captures them in ascending order
    plain = {k: v for k, v in cfg.items() if k != "dflash_config"}
    if plain.get("rope_theta") is None and not (plain.get("rope_parameters") or {}).get("rope_theta"):
        plain["rope_theta"] = 1e6  # vLLM's default for a DFlash draft without one
    base = draft_config_from_json(plain, "vllm", where, len(aux))
    block = cfg.get("block_size") or (cfg.get("num_speculative_tokens") or 0) + 1
    try:
        config = DraftConfig(**{**asdict(base), "mask_token_id": int(options["mask_token_id"]),
                                "block_size": int(block)})
    except (TypeError, ValueError) as err:
        raise DraftFormatError(f"{where}: {err} (the block: block_size, or num_speculative_tokens + 1)") from None
    draft = DFlashDraft(config, None if "embed_tokens.weight" in tensors else embed_tokens_weight)
    d2t = tensors.pop("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64)).long()
    tensors.pop("t2d", None)
    target_ids = torch.arange(len(d2t)) + d2t
    outside = bool(((target_ids < 0) | (target_ids >= config.vocab_size)).any())
    if d2t.shape != (config.draft_vocab_size,) or outside:
        raise DraftFormatError(f"{folder}: d2t {tuple(d2t.shape)} does not map draft_vocab_size="
                               f"{config.draft_vocab_size} ids into the vocabulary of {config.vocab_size}")
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    if "lm_head.weight" not in tensors:
        raise DraftFormatError(f"{folder}: no lm_head.weight (a DFlash draft has its own head)")
    _fill(draft, tensors, d2t, t2d, folder)
    return LoadedDraft(draft=draft, aux_layer_ids=aux, format="vllm", path=folder,  # type: ignore[arg-type]
                       meta=_our_meta(folder), has_embedding="embed_tokens.weight" in tensors, has_lm_head=True)


def check_draft_fits_target(loaded: LoadedDraft, *, hidden_size: int, vocab_size: int,
                            aux_layer_ids: Sequence[int] | None = None) -> None:
    """Fail, naming the mismatch, when a draft cannot serve this target."""
    c = loaded.draft.config
    problems = []
    if c.target_hidden_size != hidden_size:
        problems.append(f"target_hidden_size {c.target_hidden_size} != the target's hidden size {hidden_size}")
    if c.vocab_size != vocab_size:
        problems.append(f"vocab_size {c.vocab_size} != the target's vocabulary {vocab_size}")
    if aux_layer_ids is not None and loaded.aux_layer_ids is not None \
            and tuple(sorted(aux_layer_ids)) != loaded.aux_layer_ids:
        problems.append(f"aux layer ids {list(loaded.aux_layer_ids)} != {sorted(aux_layer_ids)}")
    if problems:
        raise DraftFormatError(f"{loaded.path}: the draft does not fit the target: {'; '.join(problems)}")


def fit_to_target(loaded: LoadedDraft, target: Any) -> None:
    """Check a loaded draft against a loaded target (hidden size, vocabulary, aux layer ids, and the
    tokenizer where the draft recorded the fingerprint of the one it was trained with) and give it
    the target's embedding when it carries none. Mismatches raise :class:`DraftFormatError`."""
    from eagle3.fingerprint import tokenizer_fingerprint

    check_draft_fits_target(loaded, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                            aux_layer_ids=target.aux_layer_ids)
    trained_with, served = loaded.meta.get("tokenizer_sha256"), tokenizer_fingerprint(target.tokenizer)
    if trained_with and trained_with != served:
        raise DraftFormatError(f"{loaded.path}: the draft was trained with another tokenizer than {target.name}'s "
                               f"(tokenizer sha256 {trained_with[:12]}... != {served[:12]}...)")
    if not loaded.has_embedding:
        loaded.draft.load_embedding(target.embed_tokens.weight.detach().float())
    if not loaded.has_lm_head:
        give_target_lm_head(loaded, target.lm_head.weight)


def give_target_lm_head(loaded: LoadedDraft, weight: Tensor) -> None:
    """A draft that ships without lm_head reads the target's (as vLLM shares it); no-op otherwise."""
    if loaded.has_lm_head:
        return
    try:
        loaded.draft.init_lm_head_from_target(weight.detach().float(), loaded.draft.d2t)
    except (ValueError, IndexError) as err:
        raise DraftFormatError(f"{loaded.path}: no lm_head.weight, and the target's {tuple(weight.shape)} "
                               f"does not fit it ({err})") from None
    loaded.has_lm_head = True


# ---------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("export", _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3.export",
                                     description="Convert a draft folder (ours, vLLM/EAGLE/SpecForge, speculators, "
                                                 "SGLang) into the format an engine loads.")
    parser.add_argument("--draft", required=True, help="draft folder, e.g. runs/train/best")
    parser.add_argument("--out", required=True, help="output folder (written atomically)")
    parser.add_argument("--format", choices=FORMATS, default="vllm")
    parser.add_argument("--from-format", default="auto", choices=("auto", *FORMATS),
                        help="how to read --draft (auto: from its config.json)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--verifier", default=None,
                        help="the target's name or path (speculators format; default: draft.json's target)")
    parser.add_argument("--aux-layer-ids", default=None,
                        help="comma-separated ids, for a draft folder that names none (engine defaults)")
    parser.add_argument("--speculative-tokens", type=int, default=3)
    args = parser.parse_args(argv)
    if args.speculative_tokens < 1:
        parser.error(f"--speculative-tokens must be >= 1, got {args.speculative_tokens}")
    if Path(args.out).resolve() == Path(args.draft).resolve():
        parser.error(f"--out {args.out} is the --draft folder: an export would replace the draft it reads; "
                     "pass another --out")
    loaded = load_draft(args.draft, args.from_format)
    ids = loaded.aux_layer_ids
    if args.aux_layer_ids:
        try:
            given = tuple(int(i) for i in args.aux_layer_ids.split(","))
        except ValueError:
            parser.error(f"--aux-layer-ids={args.aux_layer_ids!r}: expected comma-separated integers")
        if ids is not None and tuple(sorted(given)) != ids:  # relabelling: the engine would feed other layers
            raise DraftFormatError(f"{args.draft}: trained on aux layers {list(ids)}; --aux-layer-ids "
                                   f"{list(given)} is only for a folder that names none")
        ids = given
    if ids is None:
        raise DraftFormatError(f"{args.draft}: names no aux layer ids; pass --aux-layer-ids (the target's "
                               "default is 2,N//2,N-3 for N decoder layers)")
    verifier = args.verifier or loaded.meta.get("target")
    meta = {k: v for k, v in loaded.meta.items() if k != "format"} or None
    state = loaded.draft.state_dict()
    if not loaded.has_lm_head:  # written without one too: engines give it the target's
        del state["lm_head.weight"]
    export_draft_folder(args.out, state, loaded.draft.config, ids, args.format, dtype=args.dtype,
                        verifier=verifier, speculative_tokens=args.speculative_tokens, meta=meta)
    print(json.dumps({"stage": "export", "from": str(args.draft), "from_format": loaded.format, "out": args.out,
                      "format": args.format, "aux_layer_ids": list(ids), "dtype": args.dtype}))
    return 0


__all__ = [
    "FORMATS", "DraftFormatError", "LoadedDraft", "check_draft_fits_target", "detect_format",
    "draft_config_from_json", "engine_tensors", "export_draft_folder", "fit_to_target", "give_target_lm_head",
    "load_draft", "nonfinite_tensors",
]

if __name__ == "__main__":
    sys.exit(main())
