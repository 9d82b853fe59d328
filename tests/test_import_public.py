"""Public EAGLE-3 drafts as other tools write them: the variants load_draft must read right or
refuse by name (layouts from vLLM's, SGLang's, SpecForge's and ModelOpt's own loaders/exporters)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3.draft.formats import DraftFormatError
from eagle3.export import give_target_lm_head, load_draft
from eagle3.export import main as export_main
from eagle3.train.checkpoint import load_exported_draft
from tests.helpers import propose, public_config, public_folder, random_draft


def _folder(path: Path, draft, **config) -> Path:
    return public_folder(path, public_config(draft.config, **config),
                          {k: v.contiguous() for k, v in draft.state_dict().items() if k != "embed_tokens.weight"})


def test_specforge_ids_under_eagle_config_only_are_read_as_layer_outputs(tmp_path: Path) -> None:
    """SpecForge / ModelOpt write their ids (layer outputs, default [1, N/2 - 1, N - 4]) under
    eagle_config only; read as inputs they would feed the draft the layers below the trained ones."""
    draft = random_draft()
    folder = _folder(tmp_path / "sf", draft, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})
    with pytest.warns(UserWarning, match=r"inputs of layers \[2, 4, 5\]; vLLM would feed the inputs of layers"):
        loaded = load_draft(folder)
    assert loaded.aux_layer_ids == (2, 4, 5) and loaded.format == "sglang"
    assert load_draft(folder, "vllm").aux_layer_ids == (1, 3, 4)  # asked for vLLM's reading
    # the same ids also at the top level (vLLM's key, as our vllm exports write both): vLLM's reading
    both = _folder(tmp_path / "both", draft, eagle_aux_hidden_state_layer_ids=[1, 3, 4],
                   eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})
    assert load_draft(both).aux_layer_ids == (1, 3, 4)


def test_eagle_checkpoints_naming_the_targets_architecture_load_when_the_tensors_are_eagle3(tmp_path: Path) -> None:
    """EAGLE's own EAGLE-3 checkpoints say LlamaForCausalLM; vLLM reads them as EAGLE-3 drafts."""
    draft = random_draft(seed=5)
    loaded = load_draft(_folder(tmp_path / "ll", draft, architectures=["LlamaForCausalLM"]))
    embedding = torch.randn(draft.config.vocab_size, draft.config.hidden_size)
    assert loaded.format == "vllm" and propose(loaded.draft, embedding) == propose(draft, embedding)
    # an EAGLE-1/2 layer (no hidden_norm: fc over [embedding, state]) is still refused
    eagle1 = {k: v.contiguous() for k, v in draft.state_dict().items()
              if k != "embed_tokens.weight" and "hidden_norm" not in k}
    folder = public_folder(tmp_path / "e1", public_config(draft.config, architectures=["LlamaForCausalLM"]), eagle1)
    with pytest.raises(DraftFormatError, match=r"architectures=\['LlamaForCausalLM'\] is not an EAGLE-3 draft"):
        load_draft(folder)


def test_a_pickled_checkpoint_gets_the_pickle_message_whatever_its_architecture(tmp_path: Path) -> None:
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (folder / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(DraftFormatError, match="pytorch_model.bin are pickles, never loaded"):
        load_draft(folder)


def test_null_config_values_mean_unset(tmp_path: Path) -> None:
    """ModelOpt fills the template keys it has no value for with null."""
    draft = random_draft(seed=6)
    loaded = load_draft(_folder(tmp_path / "null", draft, rope_scaling=None, max_position_embeddings=None,
                                num_key_value_heads=draft.config.num_key_value_heads, head_dim=None,
                                rope_theta=draft.config.rope_theta))
    embedding = torch.randn(draft.config.vocab_size, draft.config.hidden_size)
    assert propose(loaded.draft, embedding) == propose(draft, embedding)
    assert loaded.draft.config.max_position_embeddings == 2048


@pytest.mark.parametrize("change,message", [
    ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state=false"),
    ({"bias": True}, "bias=true is not supported"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config is set"),
])
def test_variants_we_cannot_serve_are_refused_by_name(tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(DraftFormatError, match=message):
        load_draft(_folder(tmp_path / "x", random_draft(), **change))


def _headless(path: Path, draft) -> Path:
    """The draft as nvidia/gpt-oss-120b-Eagle3 ships: full vocabulary, no lm_head, no mapping."""
    tensors = {k: v.contiguous() for k, v in draft.state_dict().items()
               if k not in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d")}
    return public_folder(path, public_config(draft.config), tensors)


def test_a_draft_without_its_own_lm_head_serves_with_the_targets(tmp_path: Path) -> None:
    """vLLM gives such a draft the target's lm_head; so do fit_to_target, continued training
    (train.init.draft) and the conversion CLI, which writes it without one again."""
    draft = random_draft(seed=3, draft_vocab_size=128, target_hidden_size=64)  # the whole vocabulary
    assert draft.config.draft_vocab_size == draft.config.vocab_size
    target_head = draft.lm_head.weight.detach().clone()  # the target's lm_head the draft was trained with
    folder = _headless(tmp_path / "nohead", draft)
    loaded = load_draft(folder)
    assert not loaded.has_lm_head
    with pytest.raises(DraftFormatError, match="no lm_head.weight: load it with its target"):
        load_exported_draft(folder)
    with pytest.raises(DraftFormatError, match=r"no lm_head.weight, and the target's \(128, 16\) does not fit"):
        give_target_lm_head(loaded, torch.randn(128, 16))
    give_target_lm_head(loaded, target_head)
    embedding = torch.randn(draft.config.vocab_size, draft.config.hidden_size)
    assert loaded.has_lm_head and propose(loaded.draft, embedding) == propose(draft, embedding)
    # converted without a target: still headless, and the same draft once given the target's head
    assert export_main(["--draft", str(folder), "--out", str(tmp_path / "spec"), "--format", "speculators",
                        "--dtype", "float32", "--verifier", "t", "--aux-layer-ids", "1,4,6"]) == 0
    again = load_draft(tmp_path / "spec")
    assert not again.has_lm_head
    give_target_lm_head(again, target_head)
    assert propose(again.draft, embedding) == propose(draft, embedding)


def test_a_headless_draft_with_a_reduced_vocab_is_refused_by_name(tmp_path: Path) -> None:
    """vLLM would give it the target's lm_head over the whole vocabulary, which d2t does not index."""
    draft = random_draft(draft_vocab_size=64)
    tensors = {k: v.contiguous() for k, v in draft.state_dict().items()
               if k not in ("embed_tokens.weight", "lm_head.weight")}
    folder = public_folder(tmp_path / "nohead", public_config(draft.config), tensors)
    with pytest.raises(DraftFormatError, match="no lm_head.weight and draft_vocab_size=64 < vocab_size=128"):
        load_draft(folder)


def test_a_non_integer_id_under_eagle_config_is_named(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "bad", random_draft(), eagle_config={"eagle_aux_hidden_state_layer_ids": [1, "x", 4]})
    with pytest.raises(DraftFormatError, match=r"eagle_config.eagle_aux_hidden_state_layer_ids=\[1, 'x', 4\] is not"):
        load_draft(folder)


def test_rope_keys_outside_the_scaling_dict_are_read_as_vllm_reads_them(tmp_path: Path) -> None:
    """transformers (and so vLLM) let a top-level original_max_position_embeddings win over the
    scaling dict's, fill it from max_position_embeddings when neither has one, and move a top-level
    partial_rotary_factor into the dict."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    draft = random_draft()
    top = load_draft(_folder(tmp_path / "top", draft, rope_scaling=yarn, original_max_position_embeddings=8192))
    assert top.draft.config.rope_scaling["original_max_position_embeddings"] == 8192
    bare = {k: v for k, v in yarn.items() if k != "original_max_position_embeddings"}
    filled = load_draft(_folder(tmp_path / "fill", draft, rope_scaling=bare, max_position_embeddings=16384))
    assert filled.draft.config.rope_scaling["original_max_position_embeddings"] == 16384
    with pytest.raises(DraftFormatError, match="partial_rotary_factor=0.5: vLLM would rotate part"):
        load_draft(_folder(tmp_path / "part", draft, partial_rotary_factor=0.5))
