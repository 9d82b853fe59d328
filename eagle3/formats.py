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

A DFlash draft is written as vLLM's ``DFlashDraftModel`` (:func:`dflash_config`), in the vllm
format only. A P-EAGLE draft (``mask_token_id`` set) is written in the vllm format only: the EAGLE-3 tensors plus
``mask_hidden`` [A*H_t], and ``parallel_drafting: true`` with the top-level ``mask_token_id``.

Every format writes ``norm_before_residual``, ``norm_before_fc``, ``fc_norm`` and ``norm_output``
explicitly (all four variants are implemented by :class:`eagle3.draft.Eagle3Draft`): the defaults
differ between engines and formats (vLLM's speculators path defaults ``norm_before_residual`` to
true, its plain path to false; speculators 0.9.0 trains with the first, second and fourth on).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from eagle3.draft import DraftConfig
from eagle3.errors import Eagle3Error

FORMATS = ("vllm", "speculators", "sglang")

MARKER = "eagle3_forge"  # config.json key recording which of our formats wrote the folder

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")

NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")

class DraftFormatError(Eagle3Error, ValueError):
    """A draft folder this library cannot read or write; the message names the file and key."""

def _layer_config(config: DraftConfig, torch_dtype: str) -> dict[str, Any]:
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
    }

def _flags(config: DraftConfig) -> dict[str, Any]:
    return {key: getattr(config, key) for key in NORM_FLAGS}

DFLASH_ARCHITECTURE = "DFlashDraftModel"


def dflash_config(config: DraftConfig, aux_layer_ids: Sequence[int], torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json of a DFlash draft as vLLM's ``DFlashDraftModel`` reads it: a Qwen3 config, the
    block size, and ``dflash_config`` whose ``target_layer_ids`` name layer *outputs* (our aux ids,
    which name layer inputs, minus one); ``causal: false`` (the block attends both ways) and
    ``rope_theta`` written explicitly (vLLM assumes 1e6 when it is absent)."""
    ids = _checked_ids(aux_layer_ids, config)
    if ids[0] < 1:
        raise DraftFormatError(f"aux layer ids {ids}: DFlash names layer outputs, so it cannot read the input of "
                               "layer 0 (the embedding output)")
    layer = _layer_config(config, torch_dtype)
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        **layer,
        "model_type": "qwen3",
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "num_aux_hidden_states": len(ids),
        "block_size": config.block_size,
        "num_speculative_tokens": (config.block_size or 2) - 1,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": [i - 1 for i in ids],
                          "causal": False},
        MARKER: {"format": "vllm", "aux_layer_ids": ids, "family": "dflash"},
    }


def vllm_config(config: DraftConfig, aux_layer_ids: Sequence[int], torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json of the plain format (vLLM, EAGLE, SpecForge)."""
    ids = _checked_ids(aux_layer_ids, config)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_layer_config(config, torch_dtype),
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
    ids = _checked_ids(aux_layer_ids, config)
    if ids[0] < 1:
        raise DraftFormatError(f"aux layer ids {ids}: SGLang cannot capture the input of layer 0 (the embedding "
                               "output); its configured ids name layer outputs")
    variants = [key for key in NORM_FLAGS if getattr(config, key)]
    if variants or len(ids) != 3:
        raise DraftFormatError(f"SGLang's EAGLE-3 draft reads exactly 3 aux states and has none of the "
                               f"{', '.join(NORM_FLAGS)} variants "
                               f"(this draft: {len(ids)} states, {variants or 'none'})")
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
    ids = _checked_ids(aux_layer_ids, config)
    layer = {**_layer_config(config, torch_dtype), "architectures": ["LlamaForCausalLM"]}
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

def _checked_ids(aux_layer_ids: Sequence[int], config: DraftConfig) -> list[int]:
    ids = sorted(int(i) for i in aux_layer_ids)
    if len(set(ids)) != len(ids) or len(ids) != config.num_aux_layers:
        raise DraftFormatError(f"aux layer ids {list(aux_layer_ids)}: expected {config.num_aux_layers} distinct "
                               "ids (the draft's fc reads that many states)")
    return ids
