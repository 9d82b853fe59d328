"""What the trainer reads: a held-out split by sample id, epochs of micro-batches sharded by
rank, and collation into the packed or padded tensors :func:`eagle3.draft.ttt.ttt_forward` takes.

Every function here is deterministic in its arguments (seed, epoch, rank), so a resumed run
and every rank of a multi-process run agree on the data without talking to each other.

Sharding: an epoch is a list of micro-batches ``M``; optimizer step ``s`` of the epoch takes
the ``W * G`` micro-batches ``M[s*W*G : (s+1)*W*G]`` (``W`` ranks, ``G`` accumulation steps)
and rank ``r`` runs ``M[s*W*G + a*W + r]`` for ``a = 0..G-1``. So one process with G=2 and
two processes with G=1 train on the same global batches; a tail of fewer than ``W * G``
micro-batches is dropped, so that every rank runs the same number of steps.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from eagle3.store.feed import StoreFeed
from eagle3.store.shards import Sample
from eagle3.store.spec import StoreSpec


def held_out(sample_id: str, fraction: float) -> bool:
    """Whether a sample belongs to the eval split: a hash of its id, the same in every run."""
    if fraction <= 0:
        return False
    bucket = int.from_bytes(hashlib.sha256(sample_id.encode("utf-8")).digest()[:8], "big") / 2**64
    return bucket < fraction


def split_by_id(ids: Sequence[str], fraction: float) -> tuple[list[int], list[int]]:
    """(train indices, eval indices) of a store's samples for an ``eval_fraction``."""
    train, evals = [], []
    for i, sample_id in enumerate(ids):
        (evals if held_out(sample_id, fraction) else train).append(i)
    return train, evals


def epoch_batches(lengths: Sequence[int], indices: Sequence[int], batching: str, max_tokens: int,
                  seed: int, epoch: int, *, shard_of: Sequence[int] | None = None,
                  window: int = 0) -> list[list[int]]:
    """One epoch's micro-batches (lists of store indices), shuffled by (seed, epoch).

    ``pack``: first-fit rows of at most ``max_tokens`` tokens (a longer sample gets a row of its
    own); ``buckets``: similar lengths, padded size at most ``max_tokens``.

    ``window`` > 0 (with ``shard_of``, each index's shard): the shards are shuffled by (seed,
    epoch) and batched ``window`` consecutive shards at a time, so the epoch reads its shards in
    that order, each needed only while its window is trained (what online training's spool holds).
    """
    if window <= 0 or shard_of is None:
        return _batches(lengths, indices, batching, max_tokens, seed * 1_000_003 + epoch)
    by_shard: dict[int, list[int]] = {}
    for i in indices:
        by_shard.setdefault(shard_of[i], []).append(i)
    order = [k for k in shard_sequence(max(shard_of) + 1, seed, epoch) if k in by_shard]
    out = []
    for w in range(0, len(order), window):
        part = [i for k in order[w:w + window] for i in by_shard[k]]
        out += _batches(lengths, part, batching, max_tokens, (seed * 1_000_003 + epoch) * 1_000_003 + w)
    return out


def shard_sequence(num_shards: int, seed: int, epoch: int) -> list[int]:
    """Every shard of a store in the order an epoch with a window reads them (:func:`epoch_batches`
    skips those holding no sample it trains on): a function of the shard count, seed and epoch
    only, so producers of online training know it without the trainer's split or weights."""
    order = list(range(num_shards))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def _batches(lengths: Sequence[int], indices: Sequence[int], batching: str, max_tokens: int,
             seed: int) -> list[list[int]]:
    sub = [lengths[i] for i in indices]
    if batching == "pack":
        rows = pack_indices(sub, max_tokens)
        random.Random(seed).shuffle(rows)
    elif batching == "buckets":
        rows = length_buckets(sub, max_tokens, seed=seed)
    else:
        raise ValueError(f"batching={batching!r}: expected pack or buckets")
    return [[indices[j] for j in row] for row in rows]


def weighted_indices(indices: Sequence[int], ids: Sequence[str], weights: dict[str, float], seed: int,
                     epoch: int) -> list[int]:
    """``indices`` with sample ``i`` repeated floor(w) times plus once more with probability frac(w),
    w = ``weights.get(ids[i], 1.0)``; the draw depends only on (seed, epoch, id)."""
    out = []
    for i in indices:
        w = weights.get(ids[i], 1.0)
        whole = int(w)
        u = int(hashlib.sha256(f"{seed}:{epoch}:{ids[i]}".encode()).hexdigest()[:12], 16) / 16**12
        out += [i] * (whole + (u < w - whole))
    return out


def steps_per_epoch(num_batches: int, world_size: int, accumulation: int) -> int:
    return num_batches // (world_size * accumulation)


def rank_batch_index(step_in_epoch: int, micro: int, rank: int, world_size: int, accumulation: int) -> int:
    """Index in the epoch's list of rank ``rank``'s micro-batch ``micro`` of a step (module docstring)."""
    return step_in_epoch * world_size * accumulation + micro * world_size + rank


def eval_batches_for_rank(batches: Sequence[list[int]], rank: int, world_size: int) -> list[list[int] | None]:
    """Rank r takes batches r, r+W, ...; every rank gets the same count (None pads: a forward
    whose results are not counted, so that ZeRO-3's collectives stay in step)."""
    mine: list[list[int] | None] = list(batches[rank::world_size])
    want = -(-len(batches) // world_size)
    return mine + [None] * (want - len(mine))


def collate(samples: Sequence[Sample], batching: str) -> dict[str, torch.Tensor]:
    """Samples -> batch tensors [B, S, ...]: one packed row (``pack``) or padded rows (``buckets``).

    Keys: input_ids, loss_mask, position_ids, document_ids [B, S]; aux [B, S, A, H]; and last
    [B, S, H] or topk_ids/topk_logprobs [B, S, K]. Padding has loss_mask 0 and document id -1.
    """
    if batching == "pack":
        return {k: v.unsqueeze(0) for k, v in pack(samples).items()}
    width = max(len(s) for s in samples)

    def padded(rows: list[torch.Tensor], fill: float | int | bool = 0) -> torch.Tensor:
        out = rows[0].new_full((len(rows), width, *rows[0].shape[1:]), fill)
        for r, row in enumerate(rows):
            out[r, : len(row)] = row
        return out

    batch = {
        "input_ids": padded([s.input_ids for s in samples]),  # [B, S]
        "loss_mask": padded([s.loss_mask for s in samples], False),  # [B, S]
        "aux": padded([s.aux for s in samples]),  # [B, S, A, H]
        "position_ids": padded([torch.arange(len(s)) for s in samples]),  # [B, S]
        "document_ids": padded([torch.zeros(len(s), dtype=torch.long) for s in samples], -1),  # [B, S]
    }
    if samples[0].last is not None:
        batch["last"] = padded([s.last for s in samples])  # [B, S, H]
    else:
        batch["topk_ids"] = padded([s.topk_ids for s in samples])  # [B, S, K]
        batch["topk_logprobs"] = padded([s.topk_logprobs for s in samples])
    return batch


def load_batch(store: StoreFeed, indices: Sequence[int], batching: str,
               stored: bool = False) -> dict[str, torch.Tensor]:
    """A micro-batch; a store that computes its states (co-located training) gets the indices at once.
    ``stored``: states in the store's float dtype where the store reads so (``HarvestStore.read``),
    else fp32."""
    get_many = getattr(store, "get_many", None)
    if get_many is not None:
        return collate(get_many(indices), batching)
    return collate([store.read(i, stored=stored) for i in indices], batching)


class BatchLoader:
    """Micro-batches from a store, each one's successor read on a background thread (and pinned, for
    a copy to CUDA that does not block) while the device works on the current one.

    ``ahead`` reads ahead; by default it does for a store of shard files (``HarvestStore`` or a union
    of them) training on CUDA, where the host would otherwise wait idle for the device; a store that
    computes its states or streams them (co-located, online) is read in line, as is everything on a
    CPU, whose cores do the training. A batch asked for other than the one read ahead is read in line:
    the data never depend on the reading ahead."""

    def __init__(self, store: Any, batching: str, device: torch.device, ahead: bool | None = None) -> None:
        self.store, self.batching = store, batching
        self.pin = device.type == "cuda"
        if ahead is None:
            ahead = self.pin and store.reads_ahead
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="batch-ahead") if ahead else None
        self._pending: tuple[tuple[int, ...], Future[dict[str, torch.Tensor]]] | None = None

    def _read(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        batch = load_batch(self.store, indices, self.batching, stored=True)  # converted on the device
        return {k: v.pin_memory() for k, v in batch.items()} if self.pin else batch

    def get(self, indices: Sequence[int], then: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
        """The batch of ``indices``; ``then``, the next one the caller will ask for, is read meanwhile."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == tuple(indices):
            batch = pending[1].result()
        else:
            if pending is not None:
                pending[1].exception()  # not needed (its error too); done before this read: reads never overlap
            batch = self._read(indices)
        if self._pool is not None and then is not None:
            self._pending = (tuple(then), self._pool.submit(self._read, list(then)))
        return batch

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pending = None


__all__ = [
    "BatchLoader", "collate", "epoch_batches", "epoch_plan", "eval_batches_for_rank", "first_micro_batch", "held_out",
    "load_batch", "rank_batch_index", "shard_sequence", "split_by_id", "steps_per_epoch",
    "weighted_indices",
]


def length_buckets(lengths: Sequence[int], max_tokens: int, seed: int = 0, shuffle: bool = True) -> list[list[int]]:
    """Batches of sample indices with similar lengths, each padded size <= max_tokens.

    Samples are sorted by length inside random windows of 100 batches' worth, so batches
    are tight on padding but the order still varies with ``seed``.
    """
    order = list(range(len(lengths)))
    rng = random.Random(seed)
    if shuffle:
        rng.shuffle(order)
    window = max(1, 100 * max(1, max_tokens // max(1, int(sum(lengths) / max(1, len(lengths))))))
    batches: list[list[int]] = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w:w + window], key=lambda i: lengths[i])
        batch: list[int] = []
        for i in chunk:
            if batch and max(lengths[j] for j in batch + [i]) * (len(batch) + 1) > max_tokens:
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
    if shuffle:
        rng.shuffle(batches)
    return batches


def pack_indices(lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """Greedy first-fit packing of samples into rows of at most ``max_len`` tokens (in order
    of decreasing length); samples longer than ``max_len`` get a row of their own."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        slot = next((r for r, free in enumerate(room) if free >= n), None)
        if slot is None:
            rows.append([i])
            room.append(max_len - n)
        else:
            rows[slot].append(i)
            room[slot] -= n
    return rows


def pack(samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    """Concatenate samples into one row, keeping per-document boundaries for the trainer's masks.

    ``position_ids`` restart at 0 for each document and ``document_ids`` number them, so
    attention never crosses a document and RoPE positions are each document's own.
    """
    cat = {
        "input_ids": torch.cat([s.input_ids for s in samples]),  # [T]
        "loss_mask": torch.cat([s.loss_mask for s in samples]),  # [T]
        "aux": torch.cat([s.aux for s in samples]),  # [T, A, H]
        "position_ids": torch.cat([torch.arange(len(s)) for s in samples]),  # [T]
        "document_ids": torch.cat([torch.full((len(s),), k) for k, s in enumerate(samples)]),  # [T]
    }
    if samples[0].last is not None:
        cat["last"] = torch.cat([s.last for s in samples])  # [T, H]
    else:
        cat["topk_ids"] = torch.cat([s.topk_ids for s in samples])
        cat["topk_logprobs"] = torch.cat([s.topk_logprobs for s in samples])
    return cat


def epoch_plan(data: StoreSpec, seed: int, store: Any, train_idx: Sequence[int], weights_by_id: dict[str, float],
               epoch: int) -> list[list[int]]:
    """Epoch ``epoch``'s micro-batches (store indices), every rank's, in the order they are dealt."""
    idx = (weighted_indices(train_idx, store.sample_ids, weights_by_id, seed, epoch) if weights_by_id
           else train_idx)
    return epoch_batches(store.lengths, idx, data.batching, data.micro_batch_tokens, seed, epoch,
                         shard_of=store.shard_of if data.shard_window else None, window=data.shard_window)


def first_micro_batch(data: StoreSpec, seed: int, store: Any, train_idx: Sequence[int],
                      weights_by_id: dict[str, float]) -> dict[str, torch.Tensor]:
    """The run's first micro-batch (epoch 0's first, every rank's first read), as the loader builds it."""
    store.begin_epoch(0)
    plan = epoch_plan(data, seed, store, train_idx, weights_by_id, 0)
    return load_batch(store, plan[0], data.batching)
