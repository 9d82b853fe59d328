"""The draft head: vLLM's parameter names and shapes, the layer by hand, RoPE against HF, the
serving-time cache, weights from the target, and the parameter count of an 8B-sized draft."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from eagle3.draft.families import parameter_count as trainable_parameter_count
from eagle3.draft.model import DraftConfig, Eagle3Draft, KVCache, rope_cos_sin
from eagle3.draft.vocab import DraftVocab
from eagle3.target.model import Target
from tests.helpers import randomised, small_config, tiny_llama, tiny_tokenizer, to_draft_logits

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}






# ---------------------------------------------------------------- names and shapes vLLM loads

# From vLLM 0.11+ model_executor/models/llama_eagle3.py: `midlayer.` is mapped to `layers.0.`,
# q/k/v and gate/up are stacked on load, the first layer's q/k/v read 2*hidden, `d2t` becomes
# draft_id_to_target_id, `t2d` is skipped, and `embed_tokens` is optional (the target's is used).
VLLM_SHAPES = {
    "fc.weight": (64, 3 * 48),
    "midlayer.input_layernorm.weight": (64,),
    "midlayer.hidden_norm.weight": (64,),
    "midlayer.self_attn.q_proj.weight": (4 * 16, 2 * 64),
    "midlayer.self_attn.k_proj.weight": (2 * 16, 2 * 64),
    "midlayer.self_attn.v_proj.weight": (2 * 16, 2 * 64),
    "midlayer.self_attn.o_proj.weight": (64, 4 * 16),
    "midlayer.post_attention_layernorm.weight": (64,),
    "midlayer.mlp.gate_proj.weight": (128, 64),
    "midlayer.mlp.up_proj.weight": (128, 64),
    "midlayer.mlp.down_proj.weight": (64, 128),
    "norm.weight": (64,),
    "lm_head.weight": (32, 64),
    "d2t": (32,),
    "t2d": (128,),
}


def test_state_dict_is_what_vllm_loads() -> None:
    draft = Eagle3Draft(small_config())
    state = draft.vllm_state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == VLLM_SHAPES
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    with_embedding = draft.vllm_state_dict(include_embedding=True)
    assert tuple(with_embedding["embed_tokens.weight"].shape) == (128, 64)


def test_deeper_draft_names_its_extra_layers_like_vllm() -> None:
    state = Eagle3Draft(small_config(num_layers=3)).vllm_state_dict()
    extra = {k for k in state if k.startswith("layers.")}
    assert {k.split(".")[1] for k in extra} == {"1", "2"}  # vLLM's layers.1, layers.2 (midlayer is layers.0)
    assert tuple(state["layers.1.self_attn.q_proj.weight"].shape) == (64, 64)  # later layers read H, not 2H
    assert "layers.1.hidden_norm.weight" not in state
    assert set(VLLM_SHAPES) <= set(state)


def test_trainable_parameter_count_of_a_llama_3_1_8b_sized_draft() -> None:
    config = DraftConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=128256, draft_vocab_size=32000, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072)
    with torch.device("meta"):
        draft = Eagle3Draft(config)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in draft.parameters() if not p.requires_grad)
    print(f"\nLlama-3.1-8B-sized EAGLE-3 draft: {trainable:,} trainable parameters, "
          f"{frozen:,} frozen (embedding)")
    # fc 3*4096*4096 + q 8192*4096 + k,v 2*8192*1024 + o 4096*4096 + MLP 3*4096*14336
    # + 3 layer norms + final norm 4*4096 + lm_head 32000*4096
    closed_form = (3 * 4096 * 4096 + 8192 * 4096 + 2 * 8192 * 1024 + 4096 * 4096 + 3 * 4096 * 14336
                   + 4 * 4096 + 32000 * 4096)
    assert trainable == trainable_parameter_count(config) == closed_form == 424_689_664
    assert frozen == 128256 * 4096
    two_layers = DraftConfig(**{**config.__dict__, "num_layers": 2})
    with torch.device("meta"):
        deeper = Eagle3Draft(two_layers)
    assert sum(p.numel() for p in deeper.parameters() if p.requires_grad) == trainable_parameter_count(two_layers)


# ---------------------------------------------------------------- the computation by hand


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_one_token_forward_by_hand(norm_before_residual: bool) -> None:
    """Embedding first, hidden second in the 2H input; residual = fc output; output pre-norm.

    One token on an empty cache attends only to itself, so attention is o_proj(v) and RoPE drops out.
    """
    draft = randomised(Eagle3Draft(small_config(norm_before_residual=norm_before_residual)))
    layer = draft.midlayer
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(1, 1, 3, 48, generator=g)
    token = torch.tensor([[7]])
    with torch.no_grad():
        hidden = aux.flatten(-2) @ draft.fc.weight.T  # [1, 1, 64]
        emb = draft.embed_tokens.weight[7].view(1, 1, 64)

        def rms(x, w):
            return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

        x = torch.cat([rms(emb, layer.input_layernorm.weight), rms(hidden, layer.hidden_norm.weight)], -1)
        v = (x @ layer.self_attn.v_proj.weight.T).view(1, 1, 2, 16).repeat_interleave(2, dim=2).reshape(1, 1, 64)
        residual = rms(hidden, layer.hidden_norm.weight) if norm_before_residual else hidden
        h = residual + v @ layer.self_attn.o_proj.weight.T
        n = rms(h, layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        mlp = (F.silu(n @ mlp.gate_proj.weight.T) * (n @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        want_prenorm = h + mlp
        want_logits = rms(want_prenorm, draft.norm.weight) @ draft.lm_head.weight.T

        prenorm, logits = draft(token, draft.combine_aux(aux), torch.tensor([[5]]))
    torch.testing.assert_close(prenorm, want_prenorm)
    torch.testing.assert_close(logits, want_logits)


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_ROPE, {"rope_type": "linear", "factor": 4.0}])
def test_rope_matches_hf_llama(rope_scaling: dict | None) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "default", "rope_theta": 500000.0, **(rope_scaling or {})}
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                     num_hidden_layers=2, vocab_size=128, max_position_embeddings=16384, rope_parameters=params)
    config = DraftConfig.from_target_config(hf, draft_vocab_size=32)
    assert config.rope_theta == 500000.0 and (config.rope_scaling is None) == (rope_scaling is None)
    positions = torch.tensor([[0, 1, 7, 100, 5000, 16000]])
    want_cos, want_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, 6, 16), positions)
    cos, sin = rope_cos_sin(config, positions, torch.float32)
    torch.testing.assert_close(cos, want_cos)
    torch.testing.assert_close(sin, want_sin)


YARN_CASES = {
    # Qwen3 / Qwen2.5 as their model cards enable it: mscale = 0.1 ln(4) + 1 on cos and sin
    "qwen3": ("qwen3", "Qwen3", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                        "original_max_position_embeddings": 32768}),
    # gpt-oss as shipped: an untruncated ramp
    "gpt_oss": ("gpt_oss", "GptOss", {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                           "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
    # mscale / mscale_all_dim (DeepSeek-style keys) and an explicit attention factor
    "mscale": ("qwen3", "Qwen3", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                         "mscale_all_dim": 1.0, "beta_fast": 16, "original_max_position_embeddings": 4096}),
    "attention_factor": ("qwen3", "Qwen3", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                   "attention_factor": 1.5, "original_max_position_embeddings": 2048}),
}


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_yarn_rope_matches_hf(case: str) -> None:
    """YaRN's frequencies and its factor on cos / sin, against transformers' own rotary embedding
    (vLLM's YaRNScalingRotaryEmbedding computes the same formula, checked end to end by
    bench/studies/arch_check.py --archs qwen3_yarn,gpt_oss)."""
    import importlib

    import transformers

    module, family, params = YARN_CASES[case]
    hf = getattr(transformers, f"{family}Config")(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
        num_hidden_layers=2, vocab_size=128, max_position_embeddings=131072, rope_parameters=dict(params))
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    rotary = getattr(modeling, f"{family}RotaryEmbedding")(hf)
    config = DraftConfig.from_target_config(hf, draft_vocab_size=32)
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_theta == params["rope_theta"]
    positions = torch.tensor([[0, 1, 7, 100, 5000, 16000, 100000]])
    want_cos, want_sin = rotary(torch.zeros(1, 7, 16), positions)  # [1, 7, d] (gpt-oss: [1, 7, d/2])
    cos, sin = rope_cos_sin(config, positions, torch.float32)  # [1, 7, d], the half repeated
    assert rotary.attention_scaling != 1.0
    torch.testing.assert_close(cos[..., :want_cos.shape[-1]], want_cos)
    torch.testing.assert_close(sin[..., :want_sin.shape[-1]], want_sin)


def test_a_partial_rotary_target_gives_a_whole_head_draft() -> None:
    """The draft's RoPE is its own (vLLM reads it from the exported config): a target's
    partial_rotary_factor is not inherited, and a draft config asking for one is refused."""
    params = {**YARN_CASES["qwen3"][2], "partial_rotary_factor": 0.5}
    config = DraftConfig.from_target_config({"hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128,
                                             "vocab_size": 128, "rope_parameters": params}, draft_vocab_size=32)
    assert config.rope_scaling == {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        small_config(rope_scaling=params)


def test_prefill_at_once_equals_one_token_at_a_time() -> None:
    draft = randomised(Eagle3Draft(small_config(num_layers=2)))
    g = torch.Generator().manual_seed(2)
    ids, hidden = torch.randint(0, 128, (2, 6), generator=g), torch.randn(2, 6, 64, generator=g)
    pos = torch.arange(6).expand(2, 6)
    with torch.no_grad():
        cache = KVCache()
        h_all, logits_all = draft(ids[:, :4], hidden[:, :4], pos[:, :4], cache)
        h_more, logits_more = draft(ids[:, 4:], hidden[:, 4:], pos[:, 4:], cache)  # continue the cache
        assert len(cache) == 6
        one = KVCache()
        steps = [draft(ids[:, i : i + 1], hidden[:, i : i + 1], pos[:, i : i + 1], one) for i in range(6)]
    tol = dict(rtol=1e-4, atol=1e-4)  # different matmul shapes round differently
    torch.testing.assert_close(torch.cat([h_all, h_more], 1), torch.cat([s[0] for s in steps], 1), **tol)
    torch.testing.assert_close(torch.cat([logits_all, logits_more], 1), torch.cat([s[1] for s in steps], 1), **tol)


# ---------------------------------------------------------------- weights from the target


def test_from_target_config_and_weights_from_the_target() -> None:
    target = Target(tiny_llama(), tiny_tokenizer())
    config = DraftConfig.from_target_config(target.config, draft_vocab_size=16)
    assert (config.hidden_size, config.target_hidden_size, config.vocab_size) == (64, 64, 128)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.intermediate_size == 128 and config.rms_norm_eps == target.config.rms_norm_eps
    vocab = DraftVocab.from_target_ids(torch.arange(0, 128, 8), 128)

    draft = Eagle3Draft(config, embed_tokens_weight=target.embed_tokens.weight)
    draft.set_draft_vocab(vocab.d2t, vocab.t2d)
    draft.init_lm_head_from_target(target.lm_head.weight, vocab.d2t, target_norm_weight=target.norm.weight)

    assert not draft.embed_tokens.weight.requires_grad
    assert torch.equal(draft.embed_tokens.weight, target.embed_tokens.weight)
    assert "embed_tokens.weight" not in {n for n, p in draft.named_parameters() if p.requires_grad}
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight[::8])
    last = torch.randn(2, 5, 64)
    with torch.no_grad():  # a draft state equal to the target's gives the target's logits on the draft vocab
        torch.testing.assert_close(draft.compute_logits(last), to_draft_logits(target.head(last), vocab.t2d))
    assert draft.draft_to_target_ids(torch.tensor([0, 1, 15])).tolist() == [0, 8, 120]


@pytest.mark.parametrize("variant", [{}, {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}])
def test_readout_init_starts_as_the_targets_logit_lens_at_the_deepest_aux_state(variant: dict) -> None:
    target = Target(tiny_llama(), tiny_tokenizer())
    config = DraftConfig.from_target_config(target.config, draft_vocab_size=16, **variant)
    vocab = DraftVocab.from_target_ids(torch.arange(0, 128, 8), 128)
    draft = randomised(Eagle3Draft(config, embed_tokens_weight=target.embed_tokens.weight), seed=3)
    draft.set_draft_vocab(vocab.d2t, vocab.t2d)
    draft.init_lm_head_from_target(target.lm_head.weight, vocab.d2t, target_norm_weight=target.norm.weight)
    aux = torch.randn(2, 5, 3, 64)  # [B, S, A, H_t]
    ids, positions = torch.randint(0, 128, (2, 5)), torch.arange(5).expand(2, 5)
    with torch.no_grad():
        before = draft(ids, draft.combine_aux(aux), positions)[1]
        draft.init_as_readout()
        after = draft(ids, draft.combine_aux(aux), positions)[1]
        lens = to_draft_logits(target.head(aux[:, :, -1]), vocab.t2d)
    assert not torch.allclose(before, lens, atol=1e-2)
    torch.testing.assert_close(after, lens, atol=1e-4, rtol=1e-4)
    assert not draft.midlayer.self_attn.o_proj.weight.any() and not draft.midlayer.mlp.down_proj.weight.any()
    with pytest.raises(ValueError, match="target_hidden_size"):
        Eagle3Draft(small_config()).init_as_readout()


def test_bad_configs_and_vocab_fail_naming_the_field() -> None:
    with pytest.raises(ValueError, match="num_key_value_heads"):
        small_config(num_key_value_heads=3)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        small_config(draft_vocab_size=129)
    with pytest.raises(ValueError, match="longrope"):
        small_config(rope_scaling={"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        small_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    draft = Eagle3Draft(small_config())
    vocab = DraftVocab.from_target_ids(torch.arange(32) * 2, 128)
    with pytest.raises(ValueError, match="t2d"):
        draft.set_draft_vocab(vocab.d2t, ~vocab.t2d)
    with pytest.raises(ValueError, match="embedding"):
        draft.load_embedding(torch.zeros(128, 32))


@pytest.mark.parametrize("variant", [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_output": True}])
def test_norm_variants_as_vllm_computes_them(variant: dict) -> None:
    """input_norm over the concatenated aux states, fc_norm per state, and the post-norm state fed on."""
    draft = randomised(Eagle3Draft(small_config(**variant)), seed=5)
    assert trainable_parameter_count(draft.config) == sum(p.numel() for p in draft.parameters() if p.requires_grad)
    aux = torch.randn(2, 3, 3, 48)  # [B, S, A, H_t]
    x = aux.flatten(-2)
    if variant.get("norm_before_fc"):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + draft.config.rms_norm_eps) * draft.input_norm.weight
    if variant.get("fc_norm"):
        x = torch.cat([a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + draft.config.rms_norm_eps) * n.weight
                       for a, n in zip(aux.unbind(2), draft.fc_norm, strict=True)], dim=-1)
    torch.testing.assert_close(draft.combine_aux(aux), x @ draft.fc.weight.T)
    prenorm = torch.randn(2, 3, 64)
    want = draft.norm(prenorm) if variant.get("norm_output") else prenorm
    assert torch.equal(draft.next_hidden(prenorm), want)


def test_per_layer_type_rope_gives_the_full_attention_layers_rope_from_the_config_and_its_dict() -> None:
    """Gemma 3 keeps one RoPE per layer type; the draft takes the full-attention one, read the same
    from the loaded config (training) and from config.json's dict (the plan)."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=32, vocab_size=100, rope_theta=1e6, rope_local_base_freq=1e4,
                              rope_scaling={"rope_type": "linear", "factor": 8.0})
    from_object = DraftConfig.from_target_config(config, draft_vocab_size=50)
    from_dict = DraftConfig.from_target_config(json.loads(config.to_json_string()), draft_vocab_size=50)
    assert from_object.rope_theta == from_dict.rope_theta == 1e6
    assert from_object.rope_scaling == from_dict.rope_scaling and from_object.rope_scaling["factor"] == 8.0
