"""bench/studies/speculators_data.py on a tiny store: the files speculators 0.9.0 reads, without speculators."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.draft.vocab import DraftVocab
from eagle3.store.batches import split_by_id
from eagle3.store.shards import HarvestSpec, HarvestStore, Sample, shard_name, write_manifest, write_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "studies"))
import speculators_data  # noqa: E402

VOCAB, H, AUX = 64, 16, (1, 3, 5)


def _store(root: Path, dtype: str = "bfloat16", n: int = 12, seed: int = 0, store: str = "last") -> Path:
    spec = HarvestSpec(target="tiny", weights_fingerprint="w", tokenizer_sha256="tok", chat_template_sha256="c",
                       num_layers=8, hidden_size=H, vocab_size=VOCAB, aux_layer_ids=AUX, dtype=dtype,
                       store=store, topk=4 if store == "topk" else 0)
    g = torch.Generator().manual_seed(seed)
    samples = []
    for k in range(n):
        t = 5 + k
        s = Sample(id=f"conv-{seed}-{k}", input_ids=torch.randint(0, VOCAB, (t,), generator=g),
                   loss_mask=torch.rand(t, generator=g) > 0.4, aux=torch.randn(t, len(AUX), H, generator=g))
        if store == "topk":
            s.topk_ids, s.topk_logprobs = torch.randint(0, VOCAB, (t, 4), generator=g), -torch.rand(t, 4, generator=g)
        else:
            s.last = torch.randn(t, H, generator=g) * 3
        samples.append(s)
    entries = []
    for j, part in enumerate((samples[: n // 2], samples[n // 2:])):
        path = root / shard_name(j)
        tokens = write_shard(path, part, spec)
        entries.append({"file": path.name, "samples": len(part), "tokens": tokens, "loss_tokens": 0,
                        "bytes": path.stat().st_size, "sha256": ""})
    write_manifest(root, spec, entries, {}, {})
    return root


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_rows_states_and_split_match_the_store(tmp_path: Path, dtype: str) -> None:
    store_dir = _store(tmp_path / "store", dtype)
    out = tmp_path / "spec"
    assert speculators_data.main(["--store", str(store_dir), "--out", str(out), "--eval-fraction", "0.3"]) == 0
    store = HarvestStore(store_dir)
    train_idx, eval_idx = split_by_id(store.sample_ids, 0.3)
    assert train_idx and eval_idx
    order = train_idx + eval_idx
    record = json.loads((out / "eagle3_conversion.json").read_text())
    assert record["aux_layer_ids"] == list(AUX) and record["train_rows"] == len(train_idx)
    assert int(record["rows"] * record["train_data_ratio"]) == len(train_idx)  # speculators' split point
    assert record["hidden_states_dtype"] == ("bfloat16" if dtype == "bfloat16" else "float32")

    from datasets import load_from_disk

    data = load_from_disk(str(out))
    assert data.format["type"] == "torch" and len(data) == len(order)
    for row, i in enumerate(order):
        sample = store[i]
        item = data[row]
        hs = load_file(str(out / "hidden_states" / f"hs_{row}.safetensors"))
        assert torch.equal(item["input_ids"], sample.input_ids) and item["input_ids"].dtype == torch.int64
        assert torch.equal(hs["token_ids"], item["input_ids"])  # speculators drops rows where these differ
        assert torch.equal(item["loss_mask"], sample.loss_mask.long()) and int(item["seq_len"]) == len(sample)
        states = hs["hidden_states"].float()
        assert states.shape == (len(sample), len(AUX) + 1, H)
        # exact: bf16 stays bf16, dequantised fp8 is written in fp32
        assert torch.equal(states[:, :-1], sample.aux) and torch.equal(states[:, -1], sample.last)
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    want: dict[int, int] = {}
    for i in train_idx:
        s = store[i]
        for t in s.input_ids[s.loss_mask].tolist():
            want[t] = want.get(t, 0) + 1
    assert freq == want


def test_draft_vocab_and_predicted_mask(tmp_path: Path) -> None:
    store_dir = _store(tmp_path / "store")
    vocab = DraftVocab.from_target_ids(torch.tensor([0, 3, 7, 8, 20, 63]), VOCAB)
    vocab_file = tmp_path / "draft_vocab.safetensors"
    save_file({"d2t": vocab.d2t, "t2d": vocab.t2d}, str(vocab_file))
    out = tmp_path / "spec"
    assert speculators_data.main(["--store", str(store_dir), "--out", str(out), "--eval-fraction", "0",
                                  "--draft-vocab", str(vocab_file), "--loss-mask", "predicted"]) == 0
    d2t, t2d = np.load(out / "d2t-6.npy"), np.load(out / "t2d-6.npy")
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_
    assert torch.equal(torch.from_numpy(d2t), vocab.d2t) and torch.equal(torch.from_numpy(t2d), vocab.t2d)
    record = json.loads((out / "eagle3_conversion.json").read_text())
    assert record["val_rows"] == 0 and record["train_data_ratio"] is None

    from datasets import load_from_disk

    store, data = HarvestStore(store_dir), load_from_disk(str(out))
    for row in range(len(store)):
        mask = store[row].loss_mask.long()
        assert torch.equal(data[row]["loss_mask"], torch.cat([mask[1:], mask.new_zeros(1)]))


def test_bad_input_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store_dir = _store(tmp_path / "store")
    bad = tmp_path / "vocab.safetensors"
    save_file({"d2t": torch.zeros(3, dtype=torch.int64)}, str(bad))
    out = tmp_path / "spec"
    assert speculators_data.main(["--store", str(store_dir), "--out", str(out), "--draft-vocab", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err and not out.exists()
    folder = tmp_path / "not-a-draft"  # a folder is read as a draft in any format
    folder.mkdir()
    assert speculators_data.main(["--store", str(store_dir), "--out", str(out), "--draft-vocab", str(folder)]) == 2
    assert f"{folder / 'config.json'}: missing" in capsys.readouterr().err and not out.exists()

    wrong = tmp_path / "wrong.safetensors"
    save_file({"d2t": torch.zeros(3, dtype=torch.int64), "t2d": torch.zeros(VOCAB + 1, dtype=torch.bool)},
              str(wrong))
    assert speculators_data.main(["--store", str(store_dir), "--out", str(out), "--draft-vocab", str(wrong)]) == 2
    assert str(wrong) in capsys.readouterr().err

    assert speculators_data.main(["--store", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert "nowhere: no such store" in capsys.readouterr().err

    topk = _store(tmp_path / "topk", store="topk")
    assert speculators_data.main(["--store", str(topk), "--out", str(out)]) == 2
    assert "store=last" in capsys.readouterr().err and not out.exists()

    (out).mkdir()
    assert speculators_data.main(["--store", str(store_dir), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_speculators_muon_in_fp32_orthogonalises_like_torchs_bf16_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    """The race's fp32 stand-in for torch.optim.Muon's bf16 Newton-Schulz (CPUs without bf16 units)."""
    import speculators_train
    import torch.optim._muon as muon_mod

    monkeypatch.setattr(muon_mod, "_zeropower_via_newtonschulz", muon_mod._zeropower_via_newtonschulz)
    bf16 = muon_mod._zeropower_via_newtonschulz
    speculators_train.muon_in_fp32()
    fp32 = muon_mod._zeropower_via_newtonschulz
    assert fp32 is not bf16
    for shape in ((48, 96), (96, 48)):  # wide and tall
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        want, got = bf16(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7), fp32(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert got.dtype == torch.float32 and want.dtype == torch.bfloat16 and got.shape == grad.shape
        torch.testing.assert_close(got, want.float(), atol=0.03, rtol=0.05)
        singular = torch.linalg.svdvals(got)
        assert singular.min() > 0.3 and singular.max() < 1.5  # near-orthogonal, as the quintic leaves it
