"""A harvest plan without states: ``plan.json`` (the harvest's plan: spec, settings, shard spans)
and ``index.safetensors`` (every sample's id and tokens), what online producers write first and
what a trainer plans its epochs from (split, draft vocab, batches) before any state exists.
Online and co-located training read their samples' tokens here."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

from eagle3.atomic import atomic_write_bytes
from eagle3.store.feed import StoreFeed
from eagle3.store.shards import HarvestSpec, StoreError, check_compatible

PLAN = "plan.json"  # the harvest's plan (data_gen.harvest.plan_harvest pins it)
INDEX = "index.safetensors"


def write_index(root: str | os.PathLike[str], samples: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> None:
    """Every sample's id and tokens (input ids, loss mask), what a trainer plans an epoch from
    before any state exists; the same file from every producer (rewritten only when missing)."""
    path = Path(root) / INDEX
    if path.is_file():
        return
    lengths = [len(ids) for _, ids, _ in samples]
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
    tensors = {"input_ids": torch.tensor([t for _, ids, _ in samples for t in ids], dtype=torch.int32),
               "loss_mask": torch.tensor([m for _, _, mask in samples for m in mask], dtype=torch.uint8),
               "offsets": offsets}
    meta = {"eagle3": json.dumps({"format": "eagle3-spool-index-1", "samples": [sid for sid, _, _ in samples]})}
    atomic_write_bytes(path, save(tensors, metadata=meta))

def read_index(root: str | os.PathLike[str]) -> tuple[list[str], torch.Tensor, torch.Tensor, list[int]]:
    """(sample ids, input ids [T] int64, loss mask [T] bool, offsets [n + 1]) of a spool's index."""
    path = Path(root) / INDEX
    try:
        with safe_open(str(path), framework="pt") as f:
            ids = json.loads(f.metadata()["eagle3"])["samples"]
            return ids, f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool(), \
                f.get_tensor("offsets").tolist()
    except FileNotFoundError:
        raise StoreError(f"{path}: missing; start a producer (python -m data_gen.produce) on this spool first") \
            from None
    except Exception as err:  # safetensors raises its own error types for damaged files
        raise StoreError(f"{path}: unreadable spool index ({err})") from err

def plan_digest(root: str | os.PathLike[str]) -> str:
    """The digest of the harvest plan (``plan.json``) a spool's shards follow."""
    path = Path(root) / PLAN
    try:
        return hashlib.sha256(json.dumps(json.loads(path.read_text()), sort_keys=True).encode()).hexdigest()
    except (OSError, json.JSONDecodeError) as err:
        raise StoreError(f"{path}: unreadable ({err})") from None


class PlannedSamples(StoreFeed):
    """A plan's samples without their states: ids, tokens, lengths, the shard each is in, and the
    spec the states must follow; what a store offers a trainer before ``store[i]``. Subclasses
    say where the states come from (a spool, or the trainer's own target)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        path = self.root / PLAN
        try:
            plan = json.loads(path.read_text())
        except FileNotFoundError:
            raise StoreError(f"{path}: missing; plan the data first (python -m data_gen.produce ... "
                             "--max-epochs 0 writes the plan and every sample's tokens, no state)") from None
        except json.JSONDecodeError as err:
            raise StoreError(f"{path}: not valid JSON ({err})") from None
        self.plan_record = plan
        self.spec = HarvestSpec.from_json(plan["spec"])
        self.plan = [(int(a), int(b)) for a, b in plan["shards"]]
        self.sample_ids, self._input_ids, self._loss_mask, self._offsets = read_index(self.root)
        self.lengths = [b - a for a, b in itertools.pairwise(self._offsets)]
        if len(self.lengths) != (self.plan[-1][1] if self.plan else 0):
            raise StoreError(f"{self.root / INDEX}: {len(self.lengths)} samples, the plan has "
                             f"{self.plan[-1][1] if self.plan else 0}")
        self.shard_of = [k for k, (a, b) in enumerate(self.plan) for _ in range(a, b)]
        self.digest = plan_digest(self.root)

    def identity(self) -> list[str]:
        """The plan's digest and each shard's place in it (no shard file exists before it is made)."""
        return [f"{self.digest}:{k}" for k in range(len(self.plan))]

    def __len__(self) -> int:
        return len(self.lengths)

    def token_columns(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self._offsets[i], self._offsets[i + 1]
        return self._input_ids[a:b], self._loss_mask[a:b]

    def token_digests(self) -> list[bytes]:
        ids = self._input_ids.numpy()
        return [hashlib.blake2b(ids[a:b].tobytes(), digest_size=16).digest()
                for a, b in itertools.pairwise(self._offsets)]

    def check_target(self, target: Any) -> None:
        from eagle3.fingerprint import tokenizer_fingerprint

        check_compatible(self.spec, tokenizer_sha256=tokenizer_fingerprint(target.tokenizer),
                         num_layers=target.num_layers, hidden_size=target.hidden_size,
                         vocab_size=target.vocab_size, where=str(self.root / PLAN))


__all__ = ["INDEX", "PLAN", "PlannedSamples", "plan_digest", "read_index", "write_index"]
