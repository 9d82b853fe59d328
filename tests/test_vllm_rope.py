"""The draft's scaled RoPE equals the one vLLM builds from the exported config (``get_rope``: the
same call its EAGLE-3 Llama layer makes). Runs only where vLLM is installed, in a second or two:

    source scripts/vllm_env.sh
    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest tests/test_vllm_rope.py
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from eagle3.draft.model import DraftConfig, rope_cos_sin  # noqa: E402

CASES = {
    "llama31": (500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}),
    "qwen3_yarn": (1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "gpt_oss": (150000.0, {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "truncate": False, "original_max_position_embeddings": 4096}),
    "yarn_mscale": (10000.0, {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                              "beta_fast": 16, "original_max_position_embeddings": 4096}),
    "linear": (10000.0, {"rope_type": "linear", "factor": 4.0}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_draft_rope_equals_vllms(case: str) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    theta, scaling = CASES[case]
    config = DraftConfig(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, vocab_size=16, draft_vocab_size=16, rope_theta=theta, rope_scaling=scaling,
                         max_position_embeddings=131072)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(32, 131072, True, {**scaling, "rope_theta": theta}, torch.float32)
    positions = torch.tensor([[0, 1, 7, 100, 2000, 30000, 100000]])
    want_cos, want_sin = rope.cos_sin_cache[positions[0]].chunk(2, dim=-1)  # [7, d/2] each
    cos, sin = rope_cos_sin(config, positions, torch.float32)  # [1, 7, d]: the half repeated
    # fp32 angles up to 1e5 rad: vLLM's einsum and our product round differently in the last bits
    torch.testing.assert_close(cos[0, :, :16], want_cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin[0, :, :16], want_sin, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_exported_config_gives_vllm_the_drafts_rope(case: str, fmt: str, tmp_path) -> None:
    """The same through the file: config.json as we export it, parsed by vLLM's own config loader
    (legacy keys, the speculators nesting and transformers' standardisation included), then its RoPE."""
    import json

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import get_config

    from eagle3.draft.formats import speculators_config, vllm_config

    theta, scaling = CASES[case]
    config = DraftConfig(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, vocab_size=16, draft_vocab_size=16, rope_theta=theta, rope_scaling=dict(scaling),
                         max_position_embeddings=131072)
    written = vllm_config(config, [1, 2, 3]) if fmt == "vllm" else speculators_config(config, [1, 2, 3], verifier="t")
    (tmp_path / "config.json").write_text(json.dumps(written))
    read = get_config(str(tmp_path), trust_remote_code=False)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(32, read.max_position_embeddings, True, dict(read.rope_parameters), torch.float32)
    positions = torch.tensor([[0, 1, 7, 100, 2000, 30000, 100000]])
    want_cos, want_sin = rope.cos_sin_cache[positions[0]].chunk(2, dim=-1)
    cos, sin = rope_cos_sin(config, positions, torch.float32)
    torch.testing.assert_close(cos[0, :, :16], want_cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin[0, :, :16], want_sin, atol=1e-5, rtol=0)
