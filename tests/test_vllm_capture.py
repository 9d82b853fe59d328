"""vLLM capture equals HF capture on the default target. Runs only where vLLM is installed:

    source scripts/vllm_env.sh
    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest tests/test_vllm_capture.py
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")

from data_gen.vllm_capture import VllmCapture  # noqa: E402
from eagle3.config import DEFAULT_TARGET  # noqa: E402
from eagle3.target.model import Target, load_target  # noqa: E402

pytestmark = pytest.mark.integration

AUX_IDS = (1, 10, 20)  # not the defaults: a wrong config key would fall back to (2, 15, 27) unnoticed


@pytest.fixture(scope="module")
def hf() -> Target:
    return load_target(DEFAULT_TARGET, dtype="float32", device="cpu", aux_layer_ids=AUX_IDS)


@pytest.fixture(scope="module")
def capture(hf: Target):
    with VllmCapture(hf.model.name_or_path, AUX_IDS, dtype="float32", max_model_len=512) as cap:
        yield cap


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_capture_matches_hf(hf: Target, capture: VllmCapture) -> None:
    texts = ["Why is the sky blue?", "Write a haiku about the sea, then translate it into French."]
    seqs = [hf.tokenizer(hf.tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                          add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"] for t in texts]
    got = capture.capture(seqs)  # both in one batch, different lengths
    assert len(got) == len(seqs)
    for seq, (aux, last) in zip(seqs, got, strict=True):
        ref = hf(torch.tensor([seq]), return_logits=False)
        assert aux.shape == (len(seq), len(AUX_IDS), hf.hidden_size) and aux.dtype == torch.float32
        assert last.shape == (len(seq), hf.hidden_size) and last.dtype == torch.float32
        for k in range(len(AUX_IDS)):
            assert _rel(aux[:, k], ref.aux[0, :, k]) <= 1e-3, AUX_IDS[k]
        assert _rel(last, ref.last[0]) <= 1e-3
    assert os.listdir(capture._dir) == []  # per-request files are removed once read


def test_refuses_prefix_caching(hf: Target) -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        VllmCapture(hf.model.name_or_path, AUX_IDS, enable_prefix_caching=True)
