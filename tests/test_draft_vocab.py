"""The draft vocabulary: selection by hand (ties, forced ids), d2t/t2d, id and distribution mappings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.draft.vocab import DraftVocab, count_loss_tokens, select_draft_vocab
from eagle3.fingerprint import sha256_file
from eagle3.store.shards import HarvestSpec, Sample, shard_name, write_manifest, write_shard
from tests.helpers import (
    draft_logits_to_target,
    draft_probs_to_target,
    draft_vocab_from_store,
    to_draft_logits,
    to_draft_probs,
)


def test_counts_only_loss_masked_tokens() -> None:
    ids = torch.tensor([3, 1, 3, 2])
    mask = torch.tensor([1, 0, 1, 1]).bool()
    counts = count_loss_tokens([(ids, mask), (torch.tensor([1]), torch.tensor([True]))], vocab_size=5)
    assert counts.tolist() == [0, 1, 1, 2, 0]  # the unmasked 1 of the first sample is not counted


def test_selection_by_hand_with_ties_to_the_lower_id() -> None:
    counts = torch.tensor([5, 3, 3, 0, 7, 3])
    vocab = select_draft_vocab(counts, 3)  # 4 (7), 0 (5), then 1 of the tied 1, 2, 5
    assert vocab.target_ids.tolist() == [0, 1, 4]
    assert vocab.d2t.tolist() == [0, 0, 2] and vocab.d2t.dtype == torch.int64
    assert vocab.t2d.tolist() == [True, True, False, False, True, False]
    assert select_draft_vocab(torch.zeros(10, dtype=torch.int64), 4).target_ids.tolist() == [0, 1, 2, 3]


def test_forced_ids_and_too_few_seen_tokens() -> None:
    counts = torch.tensor([5, 3, 3, 0, 7, 3])
    assert select_draft_vocab(counts, 3, always_include=[5]).target_ids.tolist() == [0, 4, 5]
    assert select_draft_vocab(counts, 3, always_include=[5]).d2t.tolist() == [0, 3, 3]
    # one token seen: the lowest unseen ids fill the vocab
    assert select_draft_vocab(torch.tensor([0, 2, 0, 0]), 3).target_ids.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        select_draft_vocab(counts, 7)
    with pytest.raises(ValueError, match="always_include"):
        select_draft_vocab(counts, 1, always_include=[1, 2])


def test_id_mappings_round_trip() -> None:
    vocab = DraftVocab.from_target_ids(torch.tensor([9, 2, 5]), 10)  # stored ascending: 2, 5, 9
    assert vocab.d2t.tolist() == [2, 4, 7]
    assert vocab.draft_to_target_ids(torch.tensor([0, 1, 2])).tolist() == [2, 5, 9]
    assert vocab.target_to_draft_ids(torch.tensor([2, 5, 9, 0, 3])).tolist() == [0, 1, 2, -1, -1]
    again = DraftVocab.from_d2t(vocab.d2t, 10)
    assert torch.equal(again.t2d, vocab.t2d) and torch.equal(again.d2t, vocab.d2t)
    with pytest.raises(ValueError, match="duplicates"):
        DraftVocab.from_target_ids(torch.tensor([1, 1]), 10)


def test_distribution_mappings() -> None:
    vocab = DraftVocab.from_target_ids(torch.tensor([1, 3, 4]), 6)
    logits = torch.tensor([[0.5, 2.0, -1.0, 0.0, 1.0, 3.0]])
    sub = to_draft_logits(logits, vocab.t2d)
    assert sub.tolist() == [[2.0, 0.0, 1.0]]
    back = draft_logits_to_target(sub, vocab.d2t, 6)
    assert back[0, [1, 3, 4]].tolist() == [2.0, 0.0, 1.0] and torch.isinf(back[0, [0, 2, 5]]).all()
    # softmax of the restricted logits == the target distribution restricted and renormalised
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(to_draft_probs(probs, vocab.t2d), torch.softmax(sub, -1))
    torch.testing.assert_close(draft_probs_to_target(torch.softmax(sub, -1), vocab.d2t, 6), torch.softmax(back, -1))


def test_vocab_from_a_harvest_store_reads_only_ids_and_masks(tmp_path: Path) -> None:
    spec = HarvestSpec(target="t", weights_fingerprint="w", tokenizer_sha256="tok", chat_template_sha256="c",
                       num_layers=8, hidden_size=4, vocab_size=16, aux_layer_ids=(2, 4, 5))
    g = torch.Generator().manual_seed(0)
    samples = [Sample(id=f"s{i}", input_ids=torch.randint(0, 16, (n,), generator=g),
                      loss_mask=torch.rand(n, generator=g) > 0.4, aux=torch.randn(n, 3, 4, generator=g),
                      last=torch.randn(n, 4, generator=g)) for i, n in enumerate([7, 9, 5])]
    entries = []
    for j, shard in enumerate([samples[:2], samples[2:]]):
        path = tmp_path / shard_name(j)
        tokens = write_shard(path, shard, spec)
        entries.append({"file": path.name, "samples": len(shard), "tokens": tokens, "loss_tokens": 0,
                        "bytes": path.stat().st_size, "sha256": sha256_file(path)})
    write_manifest(tmp_path, spec, entries, {}, {})
    got = draft_vocab_from_store(tmp_path, 6, 16)
    want = select_draft_vocab(count_loss_tokens([(s.input_ids, s.loss_mask) for s in samples], 16), 6)
    assert torch.equal(got.d2t, want.d2t) and torch.equal(got.t2d, want.t2d)
    # order of the samples does not matter
    again = select_draft_vocab(count_loss_tokens([(s.input_ids, s.loss_mask) for s in samples[::-1]], 16), 6)
    assert torch.equal(again.d2t, got.d2t)
