"""Shared fixtures: tiny random models built in memory, never downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_VOCAB, tiny_llama, tiny_tokenizer

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
# target.dtype=auto is bf16 on CPUs with native bf16 (eagle3.device.cpu_native_bf16): the tests compare
# exact and round-off figures computed in fp32, on whatever CPU runs them
os.environ.setdefault("EAGLE3_CPU_BF16", "0")


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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--all", action="store_true", help="run the tests marked slow too (left out by default)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (over ~30 s each) are left out of the default run, which stays under ~10
    minutes; ``-m slow`` runs only them, ``--all`` everything (CI runs them beside the quickstart)."""
    if config.getoption("--all") or "slow" in (config.getoption("-m") or ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]
