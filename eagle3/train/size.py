"""Size a draft without the target's weights: its shape and trainable parameters from the
target's config (a recipe's ``target.architecture``, or the model folder's config.json).

The count is made twice: by the closed form (:func:`eagle3.draft.families.parameter_count`)
and by building the draft on the ``meta`` device (no memory) and summing ``requires_grad``
parameters, so that a frontier-sized draft is checked before any GPU is booked.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Any

import torch

from eagle3.config import TargetConfig
from eagle3.draft.families import family_of, get_family, parameter_count
from eagle3.draft.model import DraftConfig
from eagle3.target.positions import ROPE_KEYS
from eagle3.train.config import TrainConfig


def target_architecture(target: TargetConfig) -> dict[str, Any]:
    """The recipe's architecture, else the config.json of the target (no weights loaded)."""
    if target.architecture:
        return dict(target.architecture)
    from transformers import AutoConfig

    from eagle3.target.source import resolve_target

    where = resolve_target(target.name_or_path).location
    return AutoConfig.from_pretrained(where, trust_remote_code=target.trust_remote_code).to_dict()


def text_architecture(architecture: dict[str, Any]) -> dict[str, Any]:
    return dict(architecture.get("text_config") or architecture)


def count_on_meta(config: DraftConfig) -> dict[str, int]:
    """Trainable and frozen parameters of the draft built on the meta device."""
    with torch.device("meta"):
        draft = family_of(config).build(config)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in draft.parameters() if not p.requires_grad)
    return {"trainable": trainable, "frozen": frozen}


def size_draft(target: TargetConfig, train: TrainConfig) -> dict[str, Any]:
    """Draft config, aux layer ids and parameter counts for this target and training config."""
    arch = text_architecture(target_architecture(target))
    unstated = [name for name, keys in (("max_position_embeddings", {"max_position_embeddings"}),
                                        ("rope_parameters", set(ROPE_KEYS))) if not keys & set(arch)]
    if target.architecture and unstated:
        print(f"size: target.architecture states no {' or '.join(unstated)}: the draft is sized with 2,048 "
              "positions and plain RoPE (theta 10,000), not the target's; training takes the target's own",
              file=sys.stderr)
    n = int(arch["num_hidden_layers"])
    ids = sorted(target.aux_layer_ids) if target.aux_layer_ids is not None else [2, n // 2, n - 3]
    vocab = min(train.draft.vocab_size, int(arch["vocab_size"]))
    # a parallel family's mask token is chosen when training starts (it needs the tokenizer); any id counts alike
    mask_id = train.draft.mask_token_id or 0 if get_family(train.draft.family).reads_mask_token else None
    config = DraftConfig.from_target_config(arch, draft_vocab_size=vocab, num_aux_layers=len(ids),
                                            **train.draft_overrides(mask_id))
    counted = count_on_meta(config)
    closed = parameter_count(config)
    if counted["trainable"] != closed:
        raise AssertionError(f"trainable parameters: {counted['trainable']} on meta, {closed} by the closed form")
    return {"target": target.name_or_path, "target_layers": n, "aux_layer_ids": ids, "family": config.family,
            "draft": asdict(config),
            "trainable_parameters": counted["trainable"], "frozen_embedding_parameters": counted["frozen"],
            "trainable_billions": round(counted["trainable"] / 1e9, 3), "row": row_plan(train)}


def row_plan(train: TrainConfig) -> dict[str, int]:
    """A training row's tokens and, split over ``train.context_parallel`` ranks, the most rows one
    rank's unroll reads (its equal share of a row of even work, and the K + 1 after it)."""
    n = train.context_parallel
    share = -(-train.data.micro_batch_tokens // n) + (train.ttt_steps + 1 if n > 1 else 0)
    return {"micro_batch_tokens": train.data.micro_batch_tokens, "context_parallel": n, "rank_rows": share}


__all__ = ["count_on_meta", "row_plan", "size_draft", "target_architecture", "text_architecture"]
