"""Loss weights per position (train.loss.hard_tokens, train.loss.token_weights): the weighted unroll against the
unweighted one with masks, the mapping of listed tokens into packed and bucketed batches, the hard-token
schedule, bad files, and a training run that pins its weights."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eagle3.draft.ttt import prepare_targets, ttt_forward
from eagle3.errors import TrainError
from eagle3.store.batches import collate
from eagle3.store.shards import Sample
from eagle3.train.token_weights import TokenWeights, read_token_weights, target_entropy
from tests.helpers import packed_batch, tiny_draft


def _forward(draft, batch, weight=None, mask=None, **kw):
    targets = prepare_targets(batch["target_logits"], draft.t2d)
    targets = replace(targets, weight=weight)
    return ttt_forward(draft, batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"],
                       batch["loss_mask"] if mask is None else mask, targets, num_steps=3, **kw)


@pytest.mark.parametrize("return_logits", [False, True])
def test_unit_weights_change_nothing_and_zero_weights_equal_a_mask(return_logits: bool) -> None:
    draft = tiny_draft(1)
    batch = packed_batch([[9, 7], [5, 11]], t2d=draft.t2d)
    with torch.no_grad():
        plain = _forward(draft, batch, return_logits=return_logits)
        ones = _forward(draft, batch, torch.ones(batch["input_ids"].shape), return_logits=return_logits)
        torch.testing.assert_close(ones.loss, plain.loss, rtol=0, atol=0)
        # weight 0 on learning p[j] (predicting x[j+1]) is the loss of the mask without token j+1
        weight = torch.ones(batch["input_ids"].shape)
        mask = batch["loss_mask"].clone()
        for row, j in ((0, 4), (1, 2), (1, 9)):
            weight[row, j] = 0.0
            mask[row, j + 1] = False
        dropped = _forward(draft, batch, weight, return_logits=return_logits)
        masked = _forward(draft, batch, mask=mask, return_logits=return_logits)
        assert (dropped.loss - plain.loss).abs() > 1e-4  # it changed something
        torch.testing.assert_close(dropped.loss, masked.loss, rtol=1e-5, atol=1e-6)
        # the matches and counts are the unweighted ones: weights change what is learned, not what is measured
        assert torch.equal(dropped.match, plain.match) and torch.equal(dropped.count, plain.count)
        # a uniform weight is a weighted mean: the same loss
        torch.testing.assert_close(_forward(draft, batch, torch.full(weight.shape, 3.0),
                                            return_logits=return_logits).loss, plain.loss, rtol=1e-6, atol=1e-6)


def test_up_weighting_moves_the_gradient_toward_those_positions() -> None:
    draft = tiny_draft(1)
    batch = packed_batch([[12]], t2d=draft.t2d)
    weight = torch.ones(batch["input_ids"].shape)
    weight[0, 5] = 50.0
    grads = []
    for w in (None, weight):
        draft.zero_grad()
        _forward(draft, batch, w).loss.backward()
        grads.append(draft.fc.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])


def _samples(lengths: list[int]) -> list[Sample]:
    return [Sample(id=f"s{n}", input_ids=torch.arange(n_tok), loss_mask=torch.ones(n_tok, dtype=torch.bool),
                   aux=torch.zeros(n_tok, 3, 4), last=torch.zeros(n_tok, 4)) for n, n_tok in enumerate(lengths)]


@pytest.mark.parametrize("batching", ["pack", "buckets"])
def test_listed_tokens_land_on_the_position_that_predicts_them(batching: str) -> None:
    samples = _samples([5, 7, 4])
    batch = collate(samples, batching)
    tw = TokenWeights({"s1": [(3, 4.0), (0, 9.0), (99, 9.0)], "s2": [(1, 0.0)]})
    out = tw.attach(batch, [s.id for s in samples], batching)["token_weight"]
    expect = torch.ones(out.shape)
    if batching == "pack":  # s0 at 0..4, s1 at 5..11, s2 at 12..15
        expect[0, 5 + 2] = 4.0
        expect[0, 12 + 0] = 0.0
    else:
        expect[1, 2] = 4.0
        expect[2, 0] = 0.0
    assert torch.equal(out, expect)  # token 0 has no predicting position, 99 is past the sample: ignored
    assert "token_weight" not in tw.attach(batch, ["a", "b", "c"], batching)  # none listed: unchanged


def test_hard_tokens_by_entropy_and_their_schedule() -> None:
    sharp = torch.tensor([0.97, 0.01, 0.01, 0.01])
    flat = torch.full((4,), 0.25)
    probs = torch.stack([sharp, flat, torch.zeros(4)]).view(1, 3, 4)
    assert target_entropy(probs)[0, 2] == 0 and target_entropy(probs)[0, 1] > 1.38
    down = TokenWeights({}, "downweight", max_entropy=1.0, hard_weight=0.25, steps=10)
    assert torch.equal(down({}, probs, step=5), torch.tensor([[1.0, 0.25, 1.0]]))
    phase = TokenWeights({}, "phase_in", max_entropy=1.0, hard_weight=0.0, steps=11)
    assert [phase.hard_weight_at(s) for s in (0, 5, 10, 20)] == [0.0, 0.5, 1.0, 1.0]
    assert phase({}, probs, step=10) is None  # weight 1 everywhere at the last step: nothing to weigh
    assert TokenWeights({}).active is False and down.active
    listed = {"token_weight": torch.tensor([[2.0, 2.0, 1.0]])}
    assert torch.equal(down(listed, probs, step=0), torch.tensor([[2.0, 0.5, 1.0]]))  # both sources multiply


def test_bad_token_weight_files_are_named(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    for text, message in (("{", "Expecting"), ("[1]", "expected a JSON object"),
                          ('{"a": [[1]]}', "sample 'a': expected"), ('{"a": [[-1, 1.0]]}', "sample 'a'"),
                          ('{"a": [[1, -2]]}', "sample 'a'"), ('{"zz": [[1, 2]]}', "none of its ids")):
        path.write_text(text)
        with pytest.raises(TrainError, match=message) as err:
            read_token_weights(str(path), ["a", "b"])
        assert str(path) in str(err.value)
    path.write_text(json.dumps({"a": [[3, 2.5]], "zz": [[1, 0]]}))
    assert read_token_weights(str(path), ["a"]) == {"a": [(3, 2.5)], "zz": [(1, 0.0)]}
