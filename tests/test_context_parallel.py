"""Context parallelism (:mod:`eagle3.draft.context`): a row split over 2 or 3 gloo processes gives the
one-process unroll's loss, counts, matches and gradients (within fp32 round-off)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import eagle3.draft.ttt as ttt
from eagle3.distributed import ContextGroup, shutdown
from eagle3.draft.context import balanced_bounds, split_batch
from eagle3.draft.families import family_of
from eagle3.errors import TrainError
from eagle3.train.step import run_batch
from tests.helpers import packed_batch, tiny_draft

CASES = {
    "one layer": dict(doc_lengths=[[70, 50, 80]], num_layers=1, variant={}, checkpointing=False),
    "two layers, checkpointed": dict(doc_lengths=[[120, 80]], num_layers=2, variant={}, checkpointing=True),
    "window": dict(doc_lengths=[[150, 130]], num_layers=2,
                   variant={"sliding_window": 40, "full_attention_layers": [1]}, checkpointing=False),
    "two rows, 300 long": dict(doc_lengths=[[300], [120, 180]], num_layers=1, variant={}, checkpointing=False),
    "p-eagle": dict(doc_lengths=[[90, 110]], num_layers=1, variant={"family": "peagle", "mask_token_id": 3},
                    checkpointing=False),
}


def _run(draft: torch.nn.Module, batch: dict, num_steps: int, checkpointing: bool, shard=None) -> ttt.TTTOutput:
    draft.zero_grad(set_to_none=True)
    out = family_of(draft.config).forward(  # P-EAGLE's feeds its mask rows
        draft, batch["input_ids"], batch["aux"], batch["position_ids"], batch["document_ids"], batch["loss_mask"],
        ttt.prepare_targets(batch["target_logits"], draft.t2d), num_steps=num_steps,
        gradient_checkpointing=checkpointing, **({} if shard is None else {"shard": shard}))
    out.loss.backward()
    return out


def _worker(rank: int, size: int, store: str, num_steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        for case in CASES:
            _check(CASES[case], rank, size, num_steps)
    finally:
        shutdown()  # the graphs that hold the group collected before it goes


def _check(spec: dict, rank: int, size: int, num_steps: int) -> None:
    draft = tiny_draft(num_layers=spec["num_layers"], **spec["variant"]).train()
    batch = packed_batch(spec["doc_lengths"], seed=3, t2d=draft.t2d)
    whole = _run(draft, batch, num_steps, spec["checkpointing"])
    want = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}

    cost = 1 + num_steps * ttt.read_mask(batch["loss_mask"], batch["document_ids"], num_steps).long()
    for split_cost in (None, cost):  # equal ranges, then ranges of equal work (as the trainer cuts them)
        local, shard = split_batch(batch, rank, size, num_steps + 1, cost=split_cost)
        part = _run(draft, local, num_steps, spec["checkpointing"], shard)
        torch.testing.assert_close(shard.total(part.loss), whole.loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(shard.total(part.loss_sum), whole.loss_sum, rtol=1e-5, atol=1e-5)
        assert torch.equal(shard.total(part.count), whole.count)
        own = slice(shard.lo, shard.lo + shard.own)
        assert torch.equal(part.counted[:, :, :shard.own], whole.counted[:, :, own])
        assert not part.counted[:, :, shard.own:].any()  # the halo (and the padding) never counts
        assert torch.equal((part.match & part.counted)[:, :, :shard.own], (whole.match & whole.counted)[:, :, own])
        for name, p in draft.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(shard.total(p.grad), want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_ranges_of_equal_cost_by_hand() -> None:
    assert balanced_bounds(torch.ones(10), 2) == [0, 5, 10]
    assert balanced_bounds(torch.ones(10), 3) == [0, 4, 7, 10]
    # the work at the end of the row (a reply after a long prompt) gets its own ranks
    assert balanced_bounds(torch.tensor([1.0] * 8 + [8.0] * 2), 2) == [0, 9, 10]
    assert balanced_bounds(torch.tensor([0.0] * 9 + [5.0]), 3) == [0, 8, 9, 10]  # each range at least a row


def test_a_shard_sees_the_keys_of_the_whole_row_in_order() -> None:
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    local, shard = split_batch({"document_ids": doc, "loss_mask": torch.ones_like(doc, dtype=torch.bool)}, 1, 3, 2)
    assert (shard.lo, shard.own, shard.width) == (3, 3, 3)  # ranges 0-2, 3-5, 6
    assert local["document_ids"].tolist() == [[1, 1, 1, 1, -1]]  # own rows 3-5, halo 6 and one past the row
    assert shard.keys_row.tolist() == [0, 1, 2, 3, 4, 5, 6, -1, -1]
    mask = shard.attention_mask(local["document_ids"], window=2)[0].int().tolist()
    assert mask == [[0, 0, 0, 1, 0, 0, 0, 0, 0],  # row 3, the first of its document, sees itself
                    [0, 0, 0, 1, 1, 0, 0, 0, 0],
                    [0, 0, 0, 0, 1, 1, 0, 0, 0],  # row 5: its window of two
                    [0, 0, 0, 0, 0, 1, 1, 0, 0],  # row 6, on the next rank, through the gathered keys
                    [1, 0, 0, 0, 0, 0, 0, 0, 0]]  # past the row: nothing to see, so the first key


@pytest.mark.parametrize("size", [2, 3])
def test_a_row_split_over_ranks_gives_the_one_process_loss_and_gradients(size: int, tmp_path: Path) -> None:
    """Every case of CASES. 3 ranks: the rows do not divide (padding rows past the row); the chunks
    (67-150 rows) hold fewer rows than one document, so a query's keys come from the ranks before it."""
    mp.spawn(_worker, args=(size, str(tmp_path / "store"), 4), nprocs=size, join=True)


def test_a_row_shorter_than_the_context_group_is_named() -> None:
    model = SimpleNamespace(num_steps=3)  # what run_batch reads before it would split the batch
    batch = {"document_ids": torch.zeros(1, 1, dtype=torch.long), "loss_mask": torch.ones(1, 1, dtype=torch.bool)}
    group = ContextGroup(size=2, rank=0, group=None, data_rank=0, data_world=1)
    with pytest.raises(TrainError, match=r"train.context_parallel=2: a batch row of 1 tokens cannot be split"):
        run_batch(model, None, batch, torch.zeros(4, dtype=torch.bool), torch.float32, torch.device("cpu"), group)

