"""The run's data before its first step: the training store opened (offline, online's spool, or
co-located's plan), the target training needs, checked against the store, the sample weights,
the held-out split, and every shard verified."""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from eagle3.config import TargetConfig
from eagle3.distributed import Runtime, any_rank, print0
from eagle3.errors import TrainError
from eagle3.fingerprint import sha256_file
from eagle3.store.batches import epoch_batches, split_by_id
from eagle3.store.colocated import ColocatedStore
from eagle3.store.feed import StoreFeed
from eagle3.store.shards import HarvestStore, StoreError, open_stores, verify_stores
from eagle3.store.spec import StoreSpec
from eagle3.store.spool import SpoolStore
from eagle3.target.model import Target, load_target, load_target_head
from eagle3.train.config import TrainConfig


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


@dataclass
class TrainData:
    """What a run trains and evaluates on: the store, its training indices and their weights, and the
    held-out store (the training store itself for an id-hash split; None without one) with its indices
    and its micro-batches (every rank's), and its identity: what a resumed run must read again."""

    store: StoreFeed
    train_idx: list[int]
    weights_by_id: dict[str, float]
    eval_store: Any
    eval_idx: list[int]
    eval_batches: list[list[int]]
    identity: dict[str, Any]


def open_data(cfg: TrainConfig, target_cfg: TargetConfig, target: Target | None,
              rt: Runtime) -> tuple[TrainData, Target]:
    """The run's data and the target it needs (its head, or all of it co-located; ``target`` when given),
    checked before anything is written or read for training: a window the rows are longer than, the
    sample weights, the held-out split, the store's states from these weights, every shard verified."""
    data = cfg.data
    store = open_train_store(data, cfg.seed, rt.rank)
    check_window(cfg.draft.sliding_window, store)
    weights_by_id = sample_weights(data, store)
    eval_store, train_idx, eval_idx = eval_split(data, store)
    eval_batches = (epoch_batches(eval_store.lengths, eval_idx, data.batching, data.micro_batch_tokens, cfg.seed, 0)
                    if eval_store is not None else [])
    if target is None:
        colocated = store.computes_states  # the whole target, on this rank's device
        target = load_target_for(replace(target_cfg, device=str(rt.device)) if colocated else target_cfg,
                                 store.spec.aux_layer_ids, full=colocated)
    check_weights(target, store.spec)
    store.check_target(target)
    if eval_store is not None and eval_store is not store:
        eval_store.check_target(target)
    try:
        verify_stores([*store.verified_files(), *filter(None, [data.eval_store])], Path(cfg.out_dir) / VERIFIED,
                      rt.rank, rt.world_size, functools.partial(any_rank, rt))
    except StoreError as err:
        raise TrainError(f"{err}; nothing was trained (python -m data_gen.harvest verify <store> checks a store)"
                         ) from None
    # what a resumed run must read again, pinned in its checkpoints beside the settings: the training
    # store's samples and shards, the held-out store's (the best draft is picked on it), the weights files
    held_out = eval_store.identity() if eval_store is not None and eval_store is not store else None
    files = {"sample_weights": data.sample_weights, "token_weights": cfg.loss.token_weights}
    identity = {"store.samples": len(store), "store.shards": store.identity(), "eval_store.shards": held_out,
                **{key: sha256_file(Path(path)) if path else None for key, path in files.items()}}
    store.attach(target)  # co-located: this rank's target computes each micro-batch's states
    return TrainData(store, train_idx, weights_by_id, eval_store, eval_idx, eval_batches, identity), target


def check_window(window: int | None, store: Any) -> None:
    """A sliding window no shorter than the store's longest row never acts in training: refused."""
    if window is None:
        return
    lengths = getattr(store, "lengths", None)
    longest, what = (max(lengths), "longest row") if lengths else (store.spec.max_seq_len, "max_seq_len")
    if window >= longest:
        raise TrainError(f"train.draft.sliding_window={window}: not shorter than the store's {what} ({longest} "
                         "tokens), so the draft would never train with its window; harvest longer rows or set a "
                         "smaller window")


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


def sample_weights(data: StoreSpec, store: StoreFeed) -> dict[str, float]:
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


def eval_split(data: StoreSpec,
               store: StoreFeed) -> tuple[StoreFeed | None, list[int], list[int]]:
    """(eval store, training indices, eval indices): ``train.data.eval_store`` less the conversations it
    shares with the training store, or an id-hash split of the training store. The caller checks a
    held-out store against the target."""
    if data.eval_store:
        try:
            eval_store: StoreFeed | None = HarvestStore(Path(data.eval_store))
        except StoreError as err:
            raise TrainError(f"train.data.eval_store: {err}") from None
        assert eval_store is not None
        if not len(eval_store):
            raise TrainError(f"train.data.eval_store={data.eval_store}: holds no sample; nothing to evaluate on")
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
