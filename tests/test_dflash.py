"""DFlash: the batched block training against the draft run block by block as vLLM serves it
(context keys in the draft's cache, one non-causal forward over the bonus and mask tokens)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from eagle3.draft.families import parameter_count as trainable_parameter_count
from eagle3.draft.families.dflash import DFlashDraft
from eagle3.draft.families.dflash import dflash_forward as ttt_forward
from eagle3.draft.model import KVCache
from eagle3.draft.ttt import prepare_targets
from serve_eval.config import SpecConfig
from serve_eval.spec_decode import SpeculativeDecoder
from tests.helpers import (
    DRAFT_VOCAB,
    MASK,
    PROMPTS,
    OracleDecoder,
    assert_sampling_matches_target,
    dflash_for,
    documents,
    make_target,
    packed_batch,
    plain,
    tiny_dflash,
    train_briefly,
)


@torch.no_grad()
def served_logits(draft: DFlashDraft, batch: dict, num_steps: int) -> dict:
    """{(row, k, t): logits} as vLLM serves DFlash: the cache holds the context of positions <= t
    (added one token at a time), then one block [x[t+1], mask x K] at positions t+1.. proposes."""
    out = {}
    for row, start, end in documents(batch):
        ids = batch["input_ids"][row]
        cache = KVCache()
        for t in range(start, end - 1):
            draft.add_context(batch["aux"][row:row + 1, t:t + 1], torch.tensor([[t - start]]), cache)
            block = torch.tensor([[int(ids[t + 1])] + [MASK] * num_steps])
            logits = draft.propose(block, torch.arange(t - start + 1, t - start + 2 + num_steps)[None], cache)
            for k in range(num_steps):
                if t + k + 1 < end:
                    out[row, k, t] = logits[0, k + 1]
    return out


@pytest.mark.parametrize("num_layers,lengths", [(1, [[9, 7], [5, 11]]), (2, [[9, 7], [5, 11]]), (1, [[300]])])
def test_batched_blocks_equal_serving(num_layers: int, lengths) -> None:
    draft = tiny_dflash(num_layers)
    batch = packed_batch(lengths, t2d=draft.t2d)
    ref = served_logits(draft, batch, 3)
    with torch.no_grad():
        out = ttt_forward(draft, batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"],
                          batch["loss_mask"], prepare_targets(batch["target_logits"], draft.t2d), num_steps=3,
                          return_logits=True)
    gaps: dict[int, float] = {}
    for (row, k, t), logits in ref.items():
        gaps[k] = max(gaps.get(k, 0.0), (out.logits[k][row, t] - logits).abs().max().item())
    assert sorted(gaps) == [0, 1, 2]
    assert max(gaps.values()) < 1e-4, gaps


def test_the_whole_trained_block_runs_whatever_the_steps_scored() -> None:
    """Inside the block attention goes both ways, so fewer steps (training, scoring) or a smaller k
    (serving) still run the trained block and read its first slots."""
    draft = tiny_dflash(block_size=4)
    batch = packed_batch([[10, 8]], t2d=draft.t2d)
    args = (batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"], batch["loss_mask"],
            prepare_targets(batch["target_logits"], draft.t2d))
    with torch.no_grad():
        full = ttt_forward(draft, *args, num_steps=3, return_logits=True)
        short = ttt_forward(draft, *args, num_steps=2, return_logits=True)
    for k in range(2):
        torch.testing.assert_close(short.logits[k], full.logits[k])
    for bad in (0, 4):
        with pytest.raises(ValueError, match="proposes 1..3 tokens"):
            ttt_forward(draft, *args, num_steps=bad)
    with pytest.raises(ValueError, match="2 step weights for 3 steps"):
        ttt_forward(draft, *args, num_steps=3, weights=[1.0, 1.0])


def test_a_causal_block_is_not_what_is_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a causal mask inside the block changes the logits of every slot but the
    last, so the test above sees the block's attention pattern."""
    draft = tiny_dflash()
    batch = packed_batch([[12]], t2d=draft.t2d)
    cache = KVCache()
    draft.add_context(batch["aux"][:, :6], torch.arange(6)[None], cache)
    block, pos = torch.tensor([[3, MASK, MASK, MASK]]), torch.arange(6, 10)[None]
    full = draft.propose(block, pos, cache)
    real = torch.nn.functional.scaled_dot_product_attention

    def causal(q, k, v, **kw):
        n, m = q.shape[-2], k.shape[-2]
        mask = torch.arange(m)[None] <= torch.arange(n)[:, None] + (m - n)
        return real(q, k, v, attn_mask=mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", causal)
    causal_logits = draft.propose(block, pos, cache)
    monkeypatch.undo()
    assert (full[0, 1] - causal_logits[0, 1]).abs().max() > 1e-3
    assert torch.allclose(full[0, 3], causal_logits[0, 3], atol=1e-5)


def test_training_lowers_the_loss_and_counts_parameters() -> None:
    draft = tiny_dflash().train()
    losses = train_briefly(draft, packed_batch([[12, 12], [24]], t2d=draft.t2d))
    assert losses[-1] < 0.8 * losses[0], losses
    assert trainable_parameter_count(draft.config) == sum(p.numel() for p in draft.parameters() if p.requires_grad)


def test_skipping_unread_rows_changes_nothing() -> None:
    draft = tiny_dflash(2)
    batch = packed_batch([[20, 12], [9, 23]], t2d=draft.t2d)
    batch["loss_mask"][:, ::3] = 0  # prompts: rows nobody reads
    targets = prepare_targets(batch["target_logits"], draft.t2d)
    args = (batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"], batch["loss_mask"], targets)
    with torch.no_grad():
        full = ttt_forward(draft, *args, num_steps=3, skip_unread_rows=False)
        skip = ttt_forward(draft, *args, num_steps=3)
    torch.testing.assert_close(full.loss, skip.loss)
    assert torch.equal(full.count, skip.count) and torch.equal(full.match, skip.match)


# ---------------------------------------------------------------- the serving loop


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_plain_decoding(k: int) -> None:
    target = make_target()
    decoder = SpeculativeDecoder(target, dflash_for(target), SpecConfig("chain", k=k))
    for prompt in PROMPTS:
        assert decoder.generate(prompt, 24).tokens == plain(target, prompt)


@pytest.mark.parametrize("wrong", [0, 3])
def test_greedy_equals_plain_decoding_when_blocks_are_accepted(wrong: int) -> None:
    target = make_target()
    decoder = OracleDecoder(target, dflash_for(target), SpecConfig("chain", k=3), wrong=wrong)
    for prompt in PROMPTS:
        got = decoder.generate(prompt, 30)
        assert got.tokens == plain(target, prompt, 30)
        assert got.stats.tau > 3.0 if wrong == 0 else 1.0 < got.stats.tau < 4.0


def test_k_beyond_the_block_and_trees_are_refused() -> None:
    target = make_target()
    with pytest.raises(ValueError, match="at most 3"):
        SpeculativeDecoder(target, dflash_for(target), SpecConfig("chain", k=4))
    with pytest.raises(ValueError, match="tree"):
        SpeculativeDecoder(target, dflash_for(target), SpecConfig("tree", k=3))


@pytest.mark.slow
def test_sampled_generation_matches_the_target_distribution() -> None:
    assert_sampling_matches_target(SpecConfig("chain", k=2), dflash_for)


def test_export_writes_vllms_dflash_config_and_imports_back(tmp_path) -> None:
    import json

    from safetensors.torch import load_file

    from eagle3.draft.formats import DraftFormatError
    from eagle3.export import export_draft_folder, load_draft

    draft = tiny_dflash(2)
    folder = export_draft_folder(tmp_path / "d", draft.state_dict(), draft.config, (2, 4, 6), dtype="float32")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    # vLLM reads target_layer_ids as layer outputs and adds one: our aux ids (layer inputs) minus one
    assert cfg["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 3, 5], "causal": False}
    assert cfg["block_size"] == 4 and cfg["rope_theta"] == draft.config.rope_theta
    assert cfg["num_hidden_layers"] == 2 and cfg["draft_vocab_size"] == DRAFT_VOCAB
    names = set(load_file(str(folder / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "layers.1.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight",
            "layers.0.input_layernorm.weight", "layers.1.mlp.down_proj.weight", "norm.weight", "lm_head.weight",
            "d2t"} <= names
    assert not any(n.startswith(("midlayer", "model.")) or n == "embed_tokens.weight" for n in names)
    loaded = load_draft(folder, embed_tokens_weight=draft.embed_tokens.weight)
    same = replace(draft.config, initializer_range=0.02)  # the init's spread is not a checkpoint key
    assert loaded.aux_layer_ids == (2, 4, 6) and loaded.draft.config == same
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.draft.state_dict()[name], tensor), name
    for fmt in ("speculators", "sglang"):
        with pytest.raises(DraftFormatError, match="by vLLM only"):
            export_draft_folder(tmp_path / fmt, draft.state_dict(), draft.config, (2, 4, 6), fmt, verifier="t")
    # transformers writes layer_types for every Qwen3 config: all full attention is the non-causal block
    (folder / "config.json").write_text(json.dumps({**cfg, "layer_types": ["full_attention"] * 2}))
    assert load_draft(folder).draft.config == same
    for change in ({"dflash_config": {**cfg["dflash_config"], "causal": True}}, {"is_causal": True},
                   {"layer_types": ["full_attention", "sliding_attention"]}):
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(DraftFormatError, match="causal or sliding"):
            load_draft(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "dflash_config": {"target_layer_ids": [1, 3, 5]}}))
    with pytest.raises(DraftFormatError, match="mask_token_id"):
        load_draft(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "block_size": 1, "num_speculative_tokens": 0}))
    with pytest.raises(DraftFormatError, match="block_size=1: a DFlash draft needs block_size >= 2"):
        load_draft(folder)  # the family's own check, at load, as a format error naming the file
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftFormatError, match="format 'sglang' does not apply"):
        load_draft(folder, "sglang")
