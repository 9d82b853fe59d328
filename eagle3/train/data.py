"""The run's data before its first step: the training store opened (offline, online's spool, or
co-located's plan), the target training needs, checked against the store, the sample weights,
the held-out split, and every shard verified."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3.config import TargetConfig
from eagle3.distributed import Runtime, all_reduce_sum, print0
from eagle3.errors import TrainError
from eagle3.store.batches import epoch_batches, split_by_id, weighted_indices
from eagle3.store.colocated import ColocatedStore
from eagle3.store.feed import StoreFeed
from eagle3.store.shards import HarvestStore, StoreError, StoreUnion, open_stores, store_state, verify_store
from eagle3.store.spec import StoreSpec
from eagle3.store.spool import SpoolStore
from eagle3.target.model import Target, load_target, load_target_head


def read_sample_weights(path: str | None, key: str = "train.data.sample_weights",
                        error: type[Exception] = TrainError) -> dict[str, float]:
    """A sample-weights file (JSON: sample id -> finite weight >= 0; none: {}) read and checked; a bad
    one raises ``error`` naming ``key``."""
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise error(f"{key}={path}: {err}") from None
    if not isinstance(data, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                             and math.isfinite(v) and v >= 0 for v in data.values()):
        raise error(f"{key}={path}: expected a JSON object of sample id -> finite weight >= 0")
    return {str(k): float(v) for k, v in data.items()}


VERIFIED = "verified_stores.json"


def verify_stores(roots: Sequence[str], record: Path, rt: Runtime) -> list[str]:
    """Every shard of ``roots`` checked against its manifest (sha256, tensor shapes) before the run
    reads a sample, the shards split over the ranks. A store this run has verified and that is
    unchanged since (its manifest, each shard's size and modification time, kept in ``record``) is
    not hashed again, so a resume costs nothing. Returns the stores hashed now."""
    try:
        known = json.loads(record.read_text()) if record.is_file() else {}
    except ValueError:
        known = {}
    states = {root: store_state(root) for root in dict.fromkeys(roots)}
    todo = [root for root, state in states.items() if not state or known.get(os.path.realpath(root)) != state]
    bad: StoreError | None = None
    for root in todo:
        try:
            verify_store(root, (rt.rank, rt.world_size))
        except StoreError as err:
            bad = err
            break
    failed = all_reduce_sum(torch.tensor([float(bad is not None)], device=rt.device))
    if bad is not None:
        raise TrainError(f"{bad}; nothing was trained (python -m data_gen.harvest verify <store> checks a store)")
    if failed.item():
        raise TrainError("a store failed its verification on another rank (its message names the shard); "
                         "nothing was trained")
    if rt.rank == 0 and todo:
        from eagle3.atomic import atomic_write_text

        record.parent.mkdir(parents=True, exist_ok=True)
        known |= {os.path.realpath(root): states[root] for root in todo if states[root]}
        atomic_write_text(record, json.dumps(known, indent=1) + "\n")
    return todo


def open_train_store(data: StoreSpec, seed: int, rank: int = 0) -> StoreFeed:
    """The training store (with ``train.data.extra_stores``), each named by its key when it cannot be read;
    online, the spool (this rank its reader); co-located, the plan (its states captured by the trainer)."""
    if data.mode == "colocated":
        try:
            return ColocatedStore(data.store)
        except StoreError as err:
            raise TrainError(f"train.data.store: {err}") from None
    if data.mode in ("online", "hybrid"):
        try:
            store = SpoolStore(data.store, seed=seed, reader=rank, wait_s=data.spool_wait_s,
                               keep_first_epoch=data.mode == "hybrid", stale_s=data.producer_stale_s,
                               grace_s=data.producer_grace_s)
            store.check_budget(data.shard_window)
            return store
        except StoreError as err:
            raise TrainError(f"train.data.store: {err}") from None
    try:
        store = open_stores([data.store, *data.extra_stores])
    except StoreError as err:
        base_ok = (Path(data.store) / "manifest.json").is_file()
        key = "train.data.extra_stores" if data.extra_stores and base_ok else "train.data.store"
        raise TrainError(f"{key}: {err}") from None
    if len(set(map(os.path.realpath, [data.store, *data.extra_stores]))) <= len(data.extra_stores):
        raise TrainError(f"train.data.extra_stores={list(data.extra_stores)}: a store is named twice (train.data.store="
                         f"{data.store}); its samples would count double")
    return store


def sample_weights(data: StoreSpec, store: HarvestStore | StoreUnion) -> dict[str, float]:
    """``train.data.sample_weights`` read and checked against the store's sample ids."""
    weights_by_id = read_sample_weights(data.sample_weights)
    sample_ids = set(store.sample_ids)
    if weights_by_id and not set(weights_by_id) & sample_ids:
        raise TrainError(f"train.data.sample_weights={data.sample_weights}: none of its ids is a sample of the "
                         "training "
                         f"store (e.g. {next(iter(weights_by_id))!r}; the store's: {store.sample_ids[:1]})")
    if weights_by_id and not any(weights_by_id.get(i, 1.0) > 0 for i in sample_ids):  # unlisted: 1
        raise TrainError(f"train.data.sample_weights={data.sample_weights}: every sample's weight is 0; nothing to "
                         "train on")
    if unknown := len(set(weights_by_id) - sample_ids):
        print0(f"train.data.sample_weights: {unknown} of {len(weights_by_id)} ids are not samples of the training "
               "store")
    return weights_by_id


def eval_split(data: StoreSpec, store: HarvestStore | StoreUnion,
               target: Target) -> tuple[HarvestStore | StoreUnion | None, list[int], list[int]]:
    """(eval store, training indices, eval indices): ``train.data.eval_store`` less the conversations it
    shares with the training store, or an id-hash split of the training store."""
    if data.eval_store:
        try:
            eval_store: HarvestStore | StoreUnion | None = HarvestStore(Path(data.eval_store))
        except StoreError as err:
            raise TrainError(f"train.data.eval_store: {err}") from None
        assert eval_store is not None
        if not len(eval_store):
            raise TrainError(f"train.data.eval_store={data.eval_store}: holds no sample; nothing to evaluate on")
        eval_store.check_target(target)
        if eval_store.spec.aux_layer_ids != store.spec.aux_layer_ids:
            raise TrainError(f"train.data.eval_store={data.eval_store}: aux_layer_ids "
                             f"{list(eval_store.spec.aux_layer_ids)}"
                             f" differ from the training store's {list(store.spec.aux_layer_ids)}")
        seen = set(store.token_digests())
        shared = [d in seen for d in eval_store.token_digests()]  # the same conversation (tokens) in both
        if all(shared):
            raise TrainError(f"train.data.eval_store={data.eval_store}: every one of its {len(eval_store)} samples is "
                             "also "
                             "a training sample (same tokens): its figures and the best/ draft would be measured on "
                             "training data; evaluate on a store of other conversations")
        train_idx, eval_idx = list(range(len(store))), [i for i, dup in enumerate(shared) if not dup]
        if len(eval_idx) < len(eval_store):
            print0(f"train.data.eval_store: {len(eval_store) - len(eval_idx)} of its {len(eval_store)} samples are "
                   "also "
                   f"training samples (same tokens); evaluating on the other {len(eval_idx)}")
    else:
        train_idx, eval_idx = split_by_id(store.sample_ids, data.eval_fraction)
        eval_store = store if eval_idx else None
    if not train_idx or (data.eval_fraction > 0 and not eval_idx):
        raise TrainError(f"train.data.eval_fraction={data.eval_fraction} leaves {len(train_idx)} training and "
                         f"{len(eval_idx)} eval samples of {len(store)} in {data.store}")
    return eval_store, train_idx, eval_idx


def epoch_plan(data: StoreSpec, seed: int, store: Any, train_idx: Sequence[int], weights_by_id: dict[str, float],
               epoch: int) -> list[list[int]]:
    """Epoch ``epoch``'s micro-batches (store indices), every rank's, in the order they are dealt."""
    idx = (weighted_indices(train_idx, store.sample_ids, weights_by_id, seed, epoch) if weights_by_id
           else train_idx)
    return epoch_batches(store.lengths, idx, data.batching, data.micro_batch_tokens, seed, epoch,
                         shard_of=store.shard_of if data.shard_window else None, window=data.shard_window)


def load_target_for(target_cfg: TargetConfig, aux_layer_ids: Sequence[int], full: bool = False) -> Target:
    """The target training needs: its head only, or (``full``, co-located training) all of it,
    loaded as the harvest loads it."""
    if target_cfg.aux_layer_ids is not None and sorted(target_cfg.aux_layer_ids) != sorted(aux_layer_ids):
        raise TrainError(f"target.aux_layer_ids={target_cfg.aux_layer_ids}, but the store was harvested with "
                         f"{list(aux_layer_ids)}")
    if full:
        return load_target(target_cfg.name_or_path, dtype=target_cfg.dtype, device=target_cfg.device,
                           aux_layer_ids=aux_layer_ids, attn_implementation=target_cfg.attn_implementation,
                           trust_remote_code=target_cfg.trust_remote_code, nvfp4_mode=target_cfg.nvfp4_mode,
                           architecture=target_cfg.architecture)
    # training reads only the target's embedding, final norm and lm_head (a few GB for a 1T model)
    return load_target_head(target_cfg.name_or_path, dtype=target_cfg.dtype, aux_layer_ids=aux_layer_ids,
                            trust_remote_code=target_cfg.trust_remote_code, architecture=target_cfg.architecture)


def check_weights(target: Target, spec: Any) -> None:
    """The store's states must come from these weights: a sibling checkpoint with the same
    tokenizer and shapes (base and instruct, BF16 and NVFP4) passes every other check."""
    from eagle3.fingerprint import UNKNOWN_WEIGHTS, weights_fingerprint

    mine = weights_fingerprint(target.location)
    known = mine not in UNKNOWN_WEIGHTS and spec.weights_fingerprint not in UNKNOWN_WEIGHTS
    if known and mine != spec.weights_fingerprint:
        raise TrainError(f"target.name_or_path={target.name}: not the weights the store was harvested "
                         f"from (the store names {spec.target}, weights fingerprint {spec.weights_fingerprint[:12]}, "
                         f"these {mine[:12]}); train with the target that harvested it")
