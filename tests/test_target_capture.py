"""The one capture implementation, checked against HF's own outputs on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from eagle3.target import Target, check_aux_layer_ids, default_aux_layer_ids
from tests.conftest import tiny_llama


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(tiny_llama(num_layers=8), tokenizer=None)


def test_default_ids_follow_eagle3() -> None:
    assert default_aux_layer_ids(30) == (2, 15, 27)  # SmolLM2-135M
    assert default_aux_layer_ids(61) == (2, 30, 58)  # DeepSeek-V3 / Kimi K2
    with pytest.raises(ValueError, match="duplicates"):
        default_aux_layer_ids(5)  # 2, 2, 2
    with pytest.raises(ValueError, match="out of range"):
        check_aux_layer_ids((1, 8), 8)
    assert check_aux_layer_ids((5, 1, 3), 8) == (1, 3, 5)


def test_capture_equals_hf_hidden_states(target: Target) -> None:
    ids = torch.randint(3, 128, (2, 11))
    out = target(ids)
    ref = target.model(ids, output_hidden_states=True)
    assert target.aux_layer_ids == (2, 4, 5)
    for k, i in enumerate(target.aux_layer_ids):
        torch.testing.assert_close(out.aux[:, :, k], ref.hidden_states[i], rtol=0, atol=0)
    # HF's last entry is after the final norm; ours is before it.
    torch.testing.assert_close(target.norm(out.last), ref.hidden_states[-1], rtol=0, atol=0)
    assert not torch.allclose(out.last, ref.hidden_states[-1])
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    torch.testing.assert_close(target.head(out.last), ref.logits, rtol=0, atol=0)


def test_last_state_equals_final_norm_input(target: Target) -> None:
    seen: list[torch.Tensor] = []
    handle = target.norm.register_forward_hook(lambda mod, args, output: seen.append(args[0]))
    try:
        out = target(torch.randint(3, 128, (1, 9)))
    finally:
        handle.remove()
    assert len(seen) == 1
    torch.testing.assert_close(out.last, seen[0], rtol=0, atol=0)


def test_non_default_layer_ids() -> None:
    model = tiny_llama(num_layers=8)
    target = Target(model, tokenizer=None, aux_layer_ids=[6, 0, 3])
    ids = torch.randint(3, 128, (1, 7))
    out = target(ids)
    ref = model(ids, output_hidden_states=True)
    assert out.aux.shape == (1, 7, 3, 64)
    for k, i in enumerate((0, 3, 6)):
        torch.testing.assert_close(out.aux[:, :, k], ref.hidden_states[i], rtol=0, atol=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_batch_of_one(target: Target, side: str) -> None:
    torch.manual_seed(1)
    lengths = [5, 12, 9, 1]
    rows = [torch.randint(3, 128, (n,)) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        cols = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[r, cols], mask[r, cols] = row, 1
    batched = target(ids, attention_mask=mask)
    for r, row in enumerate(rows):
        alone = target(row[None])
        cols = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        torch.testing.assert_close(batched.aux[r, cols], alone.aux[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batched.last[r, cols], alone.last[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batched.logits[r, cols], alone.logits[0], rtol=1e-5, atol=1e-5)


def test_kv_cache_continuation_equals_full_forward(target: Target) -> None:
    torch.manual_seed(2)
    ids = torch.randint(3, 128, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 is left-padded
    full = target(ids, attention_mask=mask)
    step = target(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
    aux, last = [step.aux], [step.last]
    cache = step.past_key_values
    for t in range(6, 10):
        step = target(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=cache, use_cache=True)
        cache = step.past_key_values
        aux.append(step.aux)
        last.append(step.last)
    valid = mask.bool()
    torch.testing.assert_close(torch.cat(aux, 1)[valid], full.aux[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(last, 1)[valid], full.last[valid], rtol=1e-5, atol=1e-5)


def test_attention_mask_shape_is_checked(target: Target) -> None:
    with pytest.raises(ValueError, match="expected"):
        target(torch.ones(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 5))


def test_capture_state_is_released(target: Target) -> None:
    target(torch.ones(1, 3, dtype=torch.long))
    assert target._captured is None
    # The model outside the wrapper is unaffected by the hooks.
    target.model(torch.ones(1, 3, dtype=torch.long))
    assert target._captured is None
