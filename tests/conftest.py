"""Shared fixtures: tiny random models built in memory, never downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_VOCAB, tiny_llama, tiny_tokenizer

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))




@pytest.fixture
def eagle3_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "eagle3-home"
    monkeypatch.setenv("EAGLE3_HOME", str(home))
    return home








@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    """A tiny random Llama + tokenizer saved as an HF folder (safetensors)."""
    folder = tmp_path / "tiny-llama"
    tiny_llama(vocab=TINY_VOCAB).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder
