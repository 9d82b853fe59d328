"""Tiny random targets whose greedy outputs vary (plain tiny_llama repeats one token)."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3.target import Target
from tests.conftest import TINY_VOCAB, tiny_llama, tiny_tokenizer


def sharpen(model: torch.nn.Module, factor: float = 8.0) -> torch.nn.Module:
    """Scale a random model's weights (norms and MoE router gates aside) by ``factor``: sharper,
    more varied next-token choices than the init's near-uniform ones."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name and not name.endswith("mlp.gate.weight") and ".router." not in name:
                param.mul_(factor)
    return model


def lively_llama(num_layers: int = 8, seed: int = 0):
    """tiny_llama with its weights (norms aside) scaled by 8: sharper, more varied next-token choices."""
    return sharpen(tiny_llama(num_layers=num_layers, vocab=TINY_VOCAB, seed=seed))


def lively_target(chat_template: str | None = None, **kwargs) -> Target:
    tokenizer = tiny_tokenizer() if chat_template is None else tiny_tokenizer(chat_template)
    return Target(lively_llama(**kwargs), tokenizer, name="lively")


def save_lively(folder: Path, **kwargs) -> Path:
    lively_llama(**kwargs).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder
