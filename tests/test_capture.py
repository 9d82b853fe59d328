"""The server's capture (serve_eval.capture): a request's sample taken from the forwards the loop ran,
equal to a harvest of the same ids; written whole, once, within its budget; a folder of another
target refused by name."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eagle3.store.capture import HFCapture
from eagle3.store.shards import HarvestSpec, HarvestStore, Sample, shard_entry, shard_name, write_manifest, write_shard
from hard_mining.score import score_sample, target_head
from serve_eval.capture import CaptureError, CaptureWriter, committed, read_captured, release_below
from serve_eval.config import SpecConfig
from serve_eval.spec_decode import SpeculativeDecoder
from tests.helpers import PROMPTS, make_draft, make_target

CONFIGS = [
    SpecConfig("chain", k=3),
    SpecConfig("tree", k=3, topk=2, budget=6),
    SpecConfig("chain", k=3, proposer="hybrid", lookup_k=4),
    SpecConfig("chain", k=3, target_cache="static"),
]


def spec_of(target, dtype: str = "float32") -> HarvestSpec:
    return HarvestSpec(target="tiny", weights_fingerprint="w", tokenizer_sha256="t", chat_template_sha256="c",
                       num_layers=target.num_layers, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                       aux_layer_ids=tuple(target.aux_layer_ids), dtype=dtype, max_seq_len=512)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.mode}-{c.proposer}-{c.target_cache}")
def test_captured_states_equal_a_harvest_of_the_served_ids_at_no_extra_forward(config: SpecConfig) -> None:
    target = make_target()
    decoder = SpeculativeDecoder(target, make_draft(target), config)
    for prompt in PROMPTS:
        off = decoder.generate(prompt, 20)
        on = decoder.generate(prompt, 20, capture=True)
        assert on.tokens == off.tokens and off.states is None
        assert on.stats.target_forwards == off.stats.target_forwards  # no extra target forward
        ids = prompt + on.tokens
        aux, last = on.states
        assert aux.shape[0] == last.shape[0] == len(ids) - 1  # the last token was never fed
        ref = HFCapture(target).capture([ids])[0]
        torch.testing.assert_close(aux, ref["aux"][:-1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(last, ref["last"][:-1], rtol=1e-5, atol=1e-5)


def test_plain_decoding_captures_too() -> None:
    target = make_target()
    gen = SpeculativeDecoder(target, None).generate(PROMPTS[0], 12, capture=True)
    ref = HFCapture(target).capture([PROMPTS[0] + gen.tokens])[0]
    torch.testing.assert_close(gen.states[0], ref["aux"][:-1], rtol=1e-5, atol=1e-5)


def _store(root: Path, sample: Sample, spec: HarvestSpec) -> HarvestStore:
    path = root / shard_name(0)
    write_shard(path, [sample], spec)
    write_manifest(root, spec, [shard_entry(path, 1, len(sample), int(sample.loss_mask.sum()))], {}, {})
    return HarvestStore(root)


def test_a_captured_sample_trains_as_its_harvest(tmp_path: Path) -> None:
    """ids and mask exactly, states within round-off, and the training loss and acceptance of the
    sample equal to a harvest's of the same ids: the unfed last row is read by no loss."""
    from eagle3.store.batches import load_batch

    target = make_target()
    draft = make_draft(target)
    prompt = PROMPTS[1]
    gen = SpeculativeDecoder(target, draft, SpecConfig("chain", k=3)).generate(prompt, 16, capture=True)
    spec = spec_of(target)
    writer = CaptureWriter(tmp_path / "capture", spec, 2**30)
    assert writer.write(prompt, gen.tokens, gen.states, {"draft_version": 0})
    (item,) = committed(tmp_path / "capture")
    got = read_captured(item, spec)
    ids = torch.tensor(prompt + gen.tokens)
    assert torch.equal(got.input_ids, ids)
    assert got.loss_mask.tolist() == [False] * len(prompt) + [True] * len(gen.tokens)
    ref = HFCapture(target).capture([ids.tolist()])[0]
    torch.testing.assert_close(got.aux[:-1], ref["aux"][:-1], rtol=1e-5, atol=1e-5)
    harvested = Sample("h", ids, got.loss_mask, ref["aux"], ref["last"])
    head = target_head(target)
    scores = []
    for name, sample in (("captured", got), ("harvested", harvested)):
        store = _store(tmp_path / name, sample, spec)
        scores.append(score_sample(draft.float(), head, load_batch(store, [0], "buckets"), ttt_steps=3))
    assert scores[0]["accepted"] == scores[1]["accepted"]
    assert scores[0]["loss"] == pytest.approx(scores[1]["loss"], rel=1e-5)
    assert scores[0]["loss"] > 0


def _states(n: int, spec: HarvestSpec) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(n, len(spec.aux_layer_ids), spec.hidden_size), torch.randn(n, spec.hidden_size))


def test_each_request_is_written_once_and_a_restart_goes_on_after_it(tmp_path: Path) -> None:
    spec = spec_of(make_target(), "bfloat16")
    folder = tmp_path / "capture"
    writer = CaptureWriter(folder, spec, 2**30)
    for n in (3, 5):
        assert writer.write([1, 2, 3], list(range(4, 4 + n)), _states(2 + n, spec), {"draft_version": 0})
    (folder / "requests" / ".r-00000009.safetensors.tmp").write_bytes(b"cut by a kill")
    writer.close()
    again = CaptureWriter(folder, spec, 2**30)  # a restarted server
    assert again.next_seq == 2 and not list((folder / "requests").glob(".*.tmp"))
    assert again.write([1], [7, 8], _states(2, spec), {"draft_version": 1})
    items = committed(folder)
    assert [c.seq for c in items] == [0, 1, 2] and items[2].record["draft_version"] == 1
    assert [c.tokens for c in items] == [6, 8, 3]
    assert release_below(folder, 2) == 2 and [c.seq for c in committed(folder)] == [2]


def test_a_full_folder_pauses_capture_and_a_damaged_request_is_refused(tmp_path: Path) -> None:
    spec = spec_of(make_target(), "bfloat16")
    writer = CaptureWriter(tmp_path / "c", spec, 12_000)
    written = [writer.write([1, 2], [3, 4, 5], _states(4, spec), {}) for _ in range(12)]
    assert written[0] and not written[-1] and writer.paused == written.count(False) >= 1
    assert writer.used_bytes() <= 12_000
    item = committed(tmp_path / "c")[0]
    data = bytearray(item.path.read_bytes())
    data[-1] ^= 0xFF
    item.path.write_bytes(bytes(data))
    with pytest.raises(Exception, match="sha256"):
        read_captured(item, spec)


def test_a_folder_of_another_target_or_a_live_server_is_refused(tmp_path: Path) -> None:
    spec = spec_of(make_target())
    writer = CaptureWriter(tmp_path / "c", spec, 2**30)
    with pytest.raises(CaptureError, match="another server"):
        CaptureWriter(tmp_path / "c", spec, 2**30)
    writer.close()
    with pytest.raises(CaptureError, match="weights_fingerprint"):
        CaptureWriter(tmp_path / "c", replace(spec, weights_fingerprint="other"), 2**30)
    assert json.loads((tmp_path / "c" / "capture.json").read_text())["spec"]["weights_fingerprint"] == "w"
