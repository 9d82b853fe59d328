"""Shared fixtures: tiny random models built in memory, never downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def tiny_llama(num_layers: int = 8, hidden: int = 64, vocab: int = 128, seed: int = 0):
    """A random Llama small enough for unit tests (fp32, eager-free sdpa)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def eagle3_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "eagle3-home"
    monkeypatch.setenv("EAGLE3_HOME", str(home))
    return home
