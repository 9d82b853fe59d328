"""The draft folder formats serving engines load, and the ``config.json`` of each.

Three on-disk formats, each a folder with ``config.json`` + ``model.safetensors`` (no embedding:
every engine uses the target's own)::

    vllm         Llama config with architectures ["LlamaForCausalLMEagle3"]; tensors fc.weight,
                 midlayer.*, norm.weight, lm_head.weight [Vd, H], d2t (int64 offsets), t2d (bool);
                 no d2t/t2d when the draft vocab is the whole target vocab (vLLM refuses them then).
                 Aux ids under both keys vLLM reads: top-level eagle_aux_hidden_state_layer_ids
                 and eagle_config.eagle_aux_hidden_state_layer_ids. Our trainer's best/ and
                 final/ are this format (plus our draft.json).
    speculators  vllm-project/speculators' config (speculators_model_type "eagle3",
                 transformer_layer_config, speculators_config with the verifier), so that
                 ``vllm serve <draft>`` finds the target; the decoder layer is ``layers.0.*``.
    sglang       the vllm layout, with the aux ids only under eagle_config and **one less**:
                 SGLang (and SpecForge) read configured ids as layer *outputs* (SGLang adds 1 and
                 records the input of that layer), while our ids, like vLLM's, name the layer whose
                 *input* is captured. SGLang after PR #25454 adds the 1 only when the first id is 1,
                 so ids starting at 2 (the EAGLE-3 default, written [1, ...]) are read right by every
                 version; others get a warning. A sglang folder is for SGLang only: vLLM reads the
                 top-level key first and would fall back to the shifted ids. SGLang's draft has no
                 norm_before_residual variant and reads exactly three aux states. An unmarked plain
                 folder whose ids are only there and start at 1 (SpecForge's and ModelOpt's
                 exports) is read this way too, with a warning.

Each draft family picks its writer (:meth:`eagle3.draft.families.DraftFamily.engine_config`): a DFlash
draft is written as vLLM's ``DFlashDraftModel`` (:mod:`eagle3.draft.families.dflash`), in the vllm format
only; a P-EAGLE draft in the vllm format only: the EAGLE-3 tensors plus ``mask_hidden`` [A*H_t], and
``parallel_drafting: true`` with the top-level ``mask_token_id`` (:mod:`eagle3.draft.families.peagle`).

Every format writes ``norm_before_residual``, ``norm_before_fc``, ``fc_norm`` and ``norm_output``
explicitly (all four variants are implemented by :class:`eagle3.draft.model.Eagle3Draft`): the defaults
differ between engines and formats (vLLM's speculators path defaults ``norm_before_residual`` to
true, its plain path to false; speculators 0.9.0 trains with the first, second and fourth on).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eagle3.draft.model import DraftConfig, DraftHead, read_rope, rope_kind
from eagle3.errors import Eagle3Error

FORMATS = ("vllm", "speculators", "sglang")

MARKER = "eagle3_forge"  # config.json key recording which of our formats wrote the folder

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")

NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")

class DraftFormatError(Eagle3Error, ValueError):
    """A draft folder this library cannot read or write; the message names the file and key."""

def layer_config(config: DraftConfig, torch_dtype: str) -> dict[str, Any]:
    """The Llama config of the draft's decoder layer(s), as HF/vLLM read it."""
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": config.num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": config.vocab_size,
        "torch_dtype": torch_dtype,
        **window_config(config),
    }


def window_config(config: DraftConfig) -> dict[str, Any]:
    """A sliding-window draft's ``sliding_window`` and ``layer_types`` (vLLM's Llama layers read the
    window from ``layer_types``; a window without them is full attention there)."""
    if config.sliding_window is None:
        return {}
    return {"sliding_window": config.sliding_window,
            "layer_types": ["full_attention" if i in config.full_attention_layers else "sliding_attention"
                            for i in range(config.num_layers)]}


def read_window(layer: dict[str, Any], num_layers: int, path: Path) -> dict[str, Any]:
    """:class:`DraftConfig`'s window fields from a layer config, as vLLM reads them: ``sliding_window``
    applies to the layers ``layer_types`` names ``sliding_attention``, and to none without it."""
    window, types = layer.get("sliding_window"), layer.get("layer_types")
    if window is None or not types:
        return {}
    if len(types) != num_layers or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise DraftFormatError(f"{path}: layer_types={types!r}: expected one of sliding_attention or full_attention "
                               f"per draft layer ({num_layers})")
    if "sliding_attention" not in types:
        return {}
    return {"sliding_window": int(window),
            "full_attention_layers": [i for i, t in enumerate(types) if t == "full_attention"]}

def _flags(config: DraftConfig) -> dict[str, Any]:
    return {key: getattr(config, key) for key in NORM_FLAGS}

DFLASH_ARCHITECTURE = "DFlashDraftModel"


def vllm_config(config: DraftConfig, aux_layer_ids: Sequence[int], torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json of the plain format (vLLM, EAGLE, SpecForge)."""
    ids = checked_ids(aux_layer_ids, config)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **layer_config(config, torch_dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "num_aux_hidden_states": len(ids),
        **_flags(config),
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        MARKER: {"format": "vllm", "aux_layer_ids": ids},
    }

def sglang_config(config: DraftConfig, aux_layer_ids: Sequence[int], torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json for SGLang: ids shifted down by one (SGLang adds it back), under eagle_config only."""
    ids = checked_ids(aux_layer_ids, config)
    if ids[0] < 1:
        raise DraftFormatError(f"aux layer ids {ids}: SGLang cannot capture the input of layer 0 (the embedding "
                               "output); its configured ids name layer outputs")
    variants = [key for key in NORM_FLAGS if getattr(config, key)]
    if variants or len(ids) != 3:
        raise DraftFormatError(f"SGLang's EAGLE-3 draft reads exactly 3 aux states and has none of the "
                               f"{', '.join(NORM_FLAGS)} variants "
                               f"(this draft: {len(ids)} states, {variants or 'none'})")
    if config.sliding_window is not None:
        raise DraftFormatError(f"sliding_window={config.sliding_window}: SGLang's EAGLE-3 Llama layer is not known to "
                               "read a draft's sliding window (it would attend in full); export it in the vllm or "
                               "speculators format")
    if config.num_layers != 1:  # older releases refuse more; newer ones name them otherwise and skip ours unread
        raise DraftFormatError(f"SGLang's EAGLE-3 draft loads one decoder layer (this draft: {config.num_layers}); "
                               "export it in the vllm or speculators format")
    if ids[0] != 2:
        warnings.warn(f"aux layer ids {ids} are written as {[i - 1 for i in ids]} for SGLang's +1 convention; SGLang "
                      "releases with PR #25454 add the 1 only when the first id is 1 and would read other layers",
                      stacklevel=2)
    cfg = vllm_config(config, ids, torch_dtype)
    del cfg["eagle_aux_hidden_state_layer_ids"]
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True}
    cfg[MARKER] = {"format": "sglang", "aux_layer_ids": ids}
    return cfg

def speculators_config(config: DraftConfig, aux_layer_ids: Sequence[int], *, verifier: str,
                       verifier_architectures: Sequence[str] = (), speculative_tokens: int = 3,
                       torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json of vllm-project/speculators' eagle3 format."""
    ids = checked_ids(aux_layer_ids, config)
    layer = {**layer_config(config, torch_dtype), "architectures": ["LlamaForCausalLM"]}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        **_flags(config),
        "eagle_aux_hidden_state_layer_ids": ids,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "torch_dtype": torch_dtype,
        MARKER: {"format": "speculators", "aux_layer_ids": ids},
    }

def checked_ids(aux_layer_ids: Sequence[int], config: DraftConfig) -> list[int]:
    ids = sorted(int(i) for i in aux_layer_ids)
    if len(set(ids)) != len(ids) or len(ids) != config.num_aux_layers:
        raise DraftFormatError(f"aux layer ids {list(aux_layer_ids)}: expected {config.num_aux_layers} distinct "
                               "ids (the draft's fc reads that many states)")
    return ids


# ---------------------------------------------------------------- reading a folder

OUR_META = "draft.json"
"""Our own record beside an exported draft (draft config, aux layer ids, training step, eval figures)."""


@dataclass
class LoadedDraft:
    """A draft read from disk, in our terms."""

    draft: DraftHead
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


def nonfinite_tensors(tensors: dict[str, Tensor]) -> list[str]:
    """Names of the floating tensors holding a NaN or Inf: a diverged or corrupted draft."""
    return [k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()]


def read_json(path: Path) -> dict[str, Any]:
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


def is_id_list(ids: Any) -> bool:
    """A JSON list of layer ids: integers, booleans excluded."""
    return isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)


def specforge_ids(cfg: dict[str, Any]) -> list[int] | None:
    """The ids of an unmarked plain config that names them only under ``eagle_config`` and
    starts at 1: SpecForge's and ModelOpt's convention (layer outputs; their default for N layers
    is [1, N/2 - 1, N - 4], the inputs of vLLM's default layers). None otherwise."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if MARKER in cfg or cfg.get("eagle_aux_hidden_state_layer_ids") or not ids or not is_id_list(ids):
        return None  # a bad list is named by _aux_ids
    return ids if min(ids) == 1 else None


def aux_ids_of(cfg: dict[str, Any], fmt: str, path: Path) -> tuple[int, ...] | None:
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
        if not is_id_list(ids):
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
            **read_window(layer, num("num_hidden_layers", layer.get("num_hidden_layers", 1)), path),
            mask_token_id=num("mask_token_id", cfg["mask_token_id"]) if parallel else None,
            **flags,
        )
    except KeyError as err:
        raise DraftFormatError(f"{path}: config key {err.args[0]!r} is missing") from None
    except DraftFormatError:
        raise
    except (TypeError, ValueError) as err:  # DraftConfig's own checks
        raise DraftFormatError(f"{path}: {err}") from None


def our_meta(folder: Path) -> dict[str, Any]:
    return read_json(folder / OUR_META) if (folder / OUR_META).is_file() else {}


def fill_draft(draft: Any, tensors: dict[str, Tensor], d2t: Tensor, t2d: Tensor, folder: Path) -> None:
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
