"""The shard store on its own: encoding, fp8 bounds, verification, reading, bucketing, packing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3.fingerprint import sha256_file
from eagle3.store.batches import length_buckets, pack, pack_indices
from eagle3.store.shards import (
    FP8_MAX,
    HarvestSpec,
    HarvestStore,
    Sample,
    StoreError,
    bytes_per_token,
    check_compatible,
    dequantize,
    quantize_fp8,
    shard_name,
    shard_plan,
    verify_store,
    write_manifest,
    write_shard,
)


def _spec(**kw) -> HarvestSpec:
    base = dict(target="t", weights_fingerprint="w", tokenizer_sha256="tok", chat_template_sha256="c",
                num_layers=8, hidden_size=16, vocab_size=64, aux_layer_ids=(2, 4, 5))
    return HarvestSpec(**{**base, **kw})


def _samples(n: int, seed: int = 0, topk: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        t = 3 + k
        s = Sample(id=f"s{k}", input_ids=torch.randint(0, 64, (t,), generator=g),
                   loss_mask=torch.rand(t, generator=g) > 0.5, aux=torch.randn(t, 3, 16, generator=g) * 5)
        if topk:
            s.topk_ids = torch.randint(0, 64, (t, topk), generator=g)
            s.topk_logprobs = -torch.rand(t, topk, generator=g)
        else:
            s.last = torch.randn(t, 16, generator=g) * 5
        out.append(s)
    return out


def _store(root: Path, spec: HarvestSpec, shards: list[list[Sample]]) -> Path:
    entries = []
    for j, samples in enumerate(shards):
        path = root / shard_name(j)
        tokens = write_shard(path, samples, spec)
        entries.append({"file": path.name, "samples": len(samples), "tokens": tokens,
                        "loss_tokens": int(sum(s.loss_mask.sum() for s in samples)), "bytes": path.stat().st_size,
                        "sha256": sha256_file(path)})
    write_manifest(root, spec, entries, {}, {})
    return root


def test_fp8_per_row_error_is_within_e4m3_precision() -> None:
    x = torch.randn(64, 128) * torch.logspace(-3, 3, 64).unsqueeze(1)  # rows of very different magnitude
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    err = (dequantize(q, scale) - x).abs()
    amax = x.abs().amax(dim=1, keepdim=True)
    # e4m3 has 3 mantissa bits: relative step 2^-3 -> rounding error <= 2^-4 of the value, or of the
    # smallest normal step near zero (2^-6 * scale).
    assert (err <= x.abs() / 16 + amax / FP8_MAX * 2**-6 + 1e-12).all()
    zeros = torch.zeros(2, 8)
    q0, s0 = quantize_fp8(zeros)
    assert torch.equal(dequantize(q0, s0), zeros)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_round_trip_through_a_store(tmp_path: Path, dtype: str) -> None:
    spec = _spec(dtype=dtype)
    samples = _samples(5)
    _store(tmp_path, spec, [samples[:2], samples[2:]])
    store = HarvestStore(tmp_path)
    assert len(store) == 5 and store.lengths == [3, 4, 5, 6, 7]
    tol = {"float32": 0, "bfloat16": 2**-8, "float8_e4m3fn": 2**-4}[dtype]
    for want, got in zip(samples, store, strict=True):
        assert got.id == want.id
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.loss_mask, want.loss_mask)
        for name in ("aux", "last"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == torch.float32 and a.shape == b.shape
            assert ((a - b).abs() <= tol * b.abs().amax(-1, keepdim=True) + 1e-6).all(), name
    assert verify_store(tmp_path)["samples"] == 5


def test_topk_store(tmp_path: Path) -> None:
    spec = _spec(store="topk", topk=4)
    samples = _samples(2, topk=4)
    _store(tmp_path, spec, [samples])
    got = HarvestStore(tmp_path)[1]
    assert got.last is None and torch.equal(got.topk_ids, samples[1].topk_ids)
    assert torch.equal(got.topk_logprobs, samples[1].topk_logprobs)
    with pytest.raises(ValueError, match="store=topk with topk > 0"):
        _spec(store="topk", topk=0)


def test_fp8_halves_the_bytes_per_token() -> None:
    bf16 = bytes_per_token(_spec(hidden_size=4096))
    fp8 = bytes_per_token(_spec(hidden_size=4096, dtype="float8_e4m3fn"))
    assert 0.49 < fp8 / bf16 < 0.51


def test_verify_catches_corrupt_truncated_and_missing(tmp_path: Path) -> None:
    _store(tmp_path, _spec(), [_samples(2), _samples(3, seed=1)])
    shard = tmp_path / shard_name(1)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"shard-00001.safetensors: sha256 differs"):
        verify_store(tmp_path)
    shard.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(StoreError, match="shard-00001.safetensors: sha256 differs"):
        verify_store(tmp_path)
    shard.unlink()
    with pytest.raises(StoreError, match="shard-00001.safetensors: missing shard"):
        verify_store(tmp_path)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(StoreError, match="manifest.json: missing; the harvest has not finished"):
        HarvestStore(tmp_path)


def test_verify_catches_a_shard_of_the_wrong_shape(tmp_path: Path) -> None:
    _store(tmp_path, _spec(), [_samples(2)])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    two_layers = _samples(2)
    for sample in two_layers:
        sample.aux = sample.aux[:, :2]  # as if harvested with other aux layer ids
    write_shard(tmp_path / shard_name(0), two_layers, _spec(aux_layer_ids=(2, 4)))
    manifest["shards"][0]["sha256"] = sha256_file(tmp_path / shard_name(0))
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"aux has shape \[7, 2, 16\], expected \[7, 3, 16\]"):
        verify_store(tmp_path)


def test_manifest_vs_target_mismatch_names_the_key() -> None:
    spec = _spec()
    check_compatible(spec, tokenizer_sha256="tok", num_layers=8, hidden_size=16, vocab_size=64)
    with pytest.raises(StoreError, match="harvested with hidden_size=16, but the target has 32"):
        check_compatible(spec, hidden_size=32)
    with pytest.raises(StoreError, match="tokenizer_sha256='tok'"):
        check_compatible(spec, tokenizer_sha256="other")


def test_shard_plan_bounds_bytes_and_covers_everything() -> None:
    lengths = [5, 1, 7, 30, 2, 2, 9]
    plan = shard_plan(lengths, bytes_per_tok=10, max_shard_bytes=100)
    assert plan[0][0] == 0 and plan[-1][1] == len(lengths)
    assert all(a < b for a, b in plan) and all(plan[k][1] == plan[k + 1][0] for k in range(len(plan) - 1))
    for a, b in plan:
        assert sum(lengths[a:b]) * 10 <= 100 or b - a == 1  # only a lone over-size sample may exceed
    assert (3, 4) in plan  # the 300-byte sample sits alone


def test_length_buckets_respect_the_token_budget() -> None:
    lengths = [((i * 37) % 50) + 1 for i in range(200)]
    batches = length_buckets(lengths, max_tokens=128, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(200))
    assert all(max(lengths[i] for i in b) * len(b) <= 128 for b in batches)
    assert batches == length_buckets(lengths, max_tokens=128, seed=3)
    assert batches != length_buckets(lengths, max_tokens=128, seed=4)


def test_packing_keeps_documents_apart() -> None:
    samples = _samples(3)
    packed = pack(samples)
    assert packed["input_ids"].shape == (12,)
    assert packed["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert packed["document_ids"].tolist() == [0] * 3 + [1] * 4 + [2] * 5
    rows = pack_indices([5, 9, 3, 4, 12], max_len=12)
    assert sorted(i for r in rows for i in r) == [0, 1, 2, 3, 4]
    assert all(sum([5, 9, 3, 4, 12][i] for i in r) <= 12 for r in rows)


def test_compare_stores_reports_the_worst_relative_error(tmp_path: Path) -> None:
    from eagle3.store.shards import compare_stores

    spec = _spec(dtype="float32")
    ref = _samples(3)
    other = _samples(3)
    other[1].aux[2, 1, 5] += 0.5  # one perturbed value in layer 4's input
    _store(tmp_path / "a", spec, [ref])
    _store(tmp_path / "b", spec, [other])
    errors = compare_stores(tmp_path / "a", tmp_path / "b")
    assert errors["layer_2_input"] == 0 and errors["last_pre_norm"] == 0
    assert errors["layer_4_input"] == pytest.approx(0.5 / ref[1].aux[:, 1].abs().max().item(), rel=1e-5)
    _store(tmp_path / "c", spec, [_samples(2)])
    with pytest.raises(StoreError, match="hold different samples"):
        compare_stores(tmp_path / "a", tmp_path / "c")
