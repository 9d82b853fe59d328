"""The one capture implementation, checked against HF's own outputs on tiny random targets
(Llama, and the families whose logits are not plain ``lm_head(norm(h))``)."""

from __future__ import annotations

import pytest
import torch

from eagle3.draft.target_head import TargetHead
from eagle3.target.model import (
    CAPTURE_TOLERANCE,
    LogitTransform,
    Target,
    TargetLoadError,
    check_aux_layer_ids,
    check_capture,
    default_aux_layer_ids,
    load_target,
    load_target_head,
    verify_capture,
)
from tests.helpers import TINY_VOCAB, tiny_kimi_k25, tiny_llama, tiny_tokenizer


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


# Families whose logits are lm_head's output scaled and/or soft-capped; Qwen3 as a plain one.
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "final_logit_softcapping": 5.0}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 8.0, "embedding_multiplier": 12.0}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.0625}),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", {"kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 8,
                                                           "qk_rope_head_dim": 8, "dim_model_base": 6}),
    "hyperclovax": ("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", {"logits_scaling": 4.0}),
}


def family_model(name: str, dtype: torch.dtype = torch.float32):
    import transformers

    config_class, model_class, extra = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # sharper logits, so that a missing scale or cap shows
        for name_, param in model.named_parameters():
            if "norm" not in name_:
                param.mul_(4.0)
    return model.to(dtype)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_head_equal_the_models_own(family: str) -> None:
    target = Target(family_model(family), tokenizer=None)
    assert target.logit_transform.identity == (family == "qwen3")
    errors = check_capture(target, torch.randint(3, TINY_VOCAB, (2, 13)))
    assert all(value <= 1e-5 for value in errors.values()), errors
    # Without the transform these families' logits are far off: the check can fail.
    if family != "qwen3":
        target.logit_transform = LogitTransform()
        errors = check_capture(target, torch.randint(3, TINY_VOCAB, (2, 13)))
        assert errors["logits"] > 10 * CAPTURE_TOLERANCE and errors["head_of_last"] > 10 * CAPTURE_TOLERANCE


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_targets_pass_the_load_check(family: str) -> None:
    """On GPUs targets load in bf16: rounding must stay inside the check's bf16 tolerance (MiniCPM3
    scales the hidden state before lm_head, we scale the logits after it)."""
    verify_capture(Target(family_model(family, torch.bfloat16), tokenizer=None), family)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_trainer_head_gives_the_models_distribution(split: bool, temperature: float,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's distribution over the draft vocab from stored pre-norm states, on a target
    whose logits are scaled and soft-capped (Granite scale + a Gemma-style cap), tempered after
    the cap when asked."""
    model = family_model("granite")
    model.config.final_logit_softcapping = 3.0
    target = Target(model, tokenizer=None)
    assert target.logit_transform == LogitTransform(scale=1 / 8.0, softcap=3.0)
    ids = torch.randint(3, TINY_VOCAB, (1, 12))
    out = target(ids)
    ref = model(ids).logits  # [1, 12, V] granite's own scaling, without the cap
    ref = torch.tanh(ref / 3.0) * 3.0
    t2d = torch.zeros(TINY_VOCAB, dtype=torch.bool)
    t2d[::3] = True
    head = TargetHead.of_target(target, temperature).float()
    head._split_pays = split
    # a CPU with bf16 units
    monkeypatch.setattr("eagle3.draft.target_head.bf16_matmul_speedup", lambda device_type: 2.0)
    batch = {"last": out.last, "loss_mask": torch.ones(1, 12, dtype=torch.long),
             "document_ids": torch.zeros(1, 12, dtype=torch.long)}
    got = head.targets(batch, t2d)
    want = torch.softmax(ref[..., t2d] / temperature, dim=-1)
    torch.testing.assert_close(got.probs[:, :-1], want[:, :-1], rtol=1e-5, atol=1e-6)
    assert torch.equal(got.argmax[:, :-1], ref.argmax(-1)[:, :-1])


def test_load_refuses_logits_it_cannot_reproduce(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "granite"
    family_model("granite").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    target = load_target(str(folder), dtype="float32", device="cpu")
    assert target.logit_transform.scale == 1 / 8.0
    # A family whose transform is unknown (simulated by forgetting Granite's) fails at load, naming it.
    monkeypatch.setattr(LogitTransform, "of", classmethod(lambda cls, config: cls()))
    with pytest.raises(TargetLoadError, match=r"granite: GraniteForCausalLM does not compute .*logits"):
        load_target(str(folder), dtype="float32", device="cpu")


def test_a_family_without_sdpa_loads_with_eager_attention(tmp_path) -> None:
    """Gemma 2 soft-caps its attention logits, which SDPA cannot: transformers refuses to load it
    with the default ``sdpa`` (every stage failed on a Gemma 2 target, the eval stage and mining
    whatever target.attn_implementation said). It loads with eager attention instead."""
    folder = tmp_path / "gemma2"
    model = family_model("gemma2")
    assert model.config.attn_logit_softcapping  # the reason transformers has no SDPA for it
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    target = load_target(str(folder), dtype="float32", device="cpu")  # verify_capture ran at load
    assert target.model.config._attn_implementation == "eager"
    ids = torch.randint(3, TINY_VOCAB, (1, 11))
    torch.testing.assert_close(target(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert load_target(str(tiny_model_folder(tmp_path)), dtype="float32",
                       device="cpu").model.config._attn_implementation == "sdpa"  # the others keep SDPA


def tiny_model_folder(tmp_path):
    folder = tmp_path / "llama"
    tiny_llama(vocab=TINY_VOCAB).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder




def test_multimodal_target_runs_its_text_path(tmp_path) -> None:
    folder = tiny_kimi_k25(tmp_path / "kimi")
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "language_model.model.norm.weight" in set(f.keys())  # the layout transformers renames
    target = load_target(str(folder), dtype="float32", device="cpu")  # verify_capture ran at load
    assert type(target.decoder).__name__ == "DeepseekV3Model" and target.num_layers == 8
    errors = check_capture(target, torch.randint(3, TINY_VOCAB, (2, 9)))
    assert max(errors.values()) <= 1e-6, errors


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "kimi-k25"])
def test_head_only_load_equals_the_full_load(tmp_path, kind: str) -> None:
    folder = tmp_path / kind
    if kind == "kimi-k25":
        tiny_kimi_k25(folder)
    else:
        model = tiny_llama(vocab=TINY_VOCAB)
        if kind == "llama-tied":
            model.config.tie_word_embeddings = True
            model.tie_weights()
        model.save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
    full = load_target(str(folder), dtype="float32", device="cpu")
    head = load_target_head(str(folder), dtype="float32")
    assert (head.lm_head.weight is head.embed_tokens.weight) == (kind == "llama-tied")
    for part in ("embed_tokens", "norm", "lm_head"):
        assert torch.equal(getattr(head, part).weight, getattr(full, part).weight), part
    assert (head.num_layers, head.hidden_size, head.vocab_size, head.aux_layer_ids) == (
        full.num_layers, full.hidden_size, full.vocab_size, full.aux_layer_ids)
    last = full(torch.randint(3, TINY_VOCAB, (1, 7))).last
    assert torch.equal(head.head(last), full.head(last))
    assert all(p.is_meta for p in head.layers.parameters())  # the decoder layers were never read
    with pytest.raises(RuntimeError, match="load_target_head"):
        head(torch.ones(1, 3, dtype=torch.long))


def test_head_only_load_names_a_missing_tensor(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "llama"
    tiny_llama(vocab=TINY_VOCAB).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TargetLoadError, match=r"llama: no tensor for model\.norm\.weight"):
        load_target_head(str(folder), dtype="float32")


def test_trainer_head_copies_the_head_only() -> None:
    """The norm carries the capture hook, bound to the Target: a plain deepcopy copied the whole model."""
    target = Target(tiny_llama(num_layers=8), tokenizer=None)
    head = TargetHead.of_target(target)
    assert not head.norm._forward_pre_hooks and not head.norm._forward_pre_hooks_with_kwargs
    assert sum(p.numel() for p in head.parameters()) == target.norm.weight.numel() + target.lm_head.weight.numel()
    x = torch.randn(3, 64)
    assert torch.equal(head.lm_head(head.norm(x)), target.head(x))
    assert head.lm_head.weight.data_ptr() != target.lm_head.weight.data_ptr()  # a copy, not the target's own


def test_head_only_load_reads_a_sharded_checkpoint(tmp_path) -> None:
    folder = tmp_path / "llama"
    model = tiny_llama(vocab=TINY_VOCAB)
    model.save_pretrained(folder, max_shard_size="40KB")
    tiny_tokenizer().save_pretrained(folder)
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2
    head = load_target_head(str(folder), dtype="float32")
    assert torch.equal(head.lm_head.weight, model.lm_head.weight)
    assert torch.equal(head.norm.weight, model.model.norm.weight)


def test_head_only_load_refuses_a_quantized_head(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "llama"
    tiny_llama(vocab=TINY_VOCAB).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    state["lm_head.weight"] = state["lm_head.weight"].to(torch.float8_e4m3fn)  # FP8 block style: weight + scale
    state["lm_head.weight_scale_inv"] = torch.ones(1)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TargetLoadError, match=r"lm_head\.weight is stored quantized .*weight_scale_inv"):
        load_target_head(str(folder), dtype="float32")


def test_a_logit_rule_the_capture_cannot_reproduce_is_refused() -> None:
    model = tiny_llama()
    model.config.unpadded_vocab_size = 100  # Inkling-style: the logits are sliced to this width
    with pytest.raises(ValueError, match="unpadded_vocab_size"):
        Target(model, tokenizer=None)
