"""Co-located training: the trainer's own target computes the states of each micro-batch just
before the draft trains on it; nothing but the plan and the samples' tokens is on disk.

The folder is a plan without states (:mod:`eagle3.store.planned`: ``python -m data_gen.produce
--max-epochs 0`` writes it, or the pipeline's harvest stage with ``train.data.mode=colocated``). The
states go through the capture the harvest uses (:class:`eagle3.store.capture.HFCapture`) and are
rounded through the plan's store dtype, so the draft sees what an offline store of the same plan
would hold, up to batch composition: the harvest captures a shard's samples in batches sorted by
length, this store a micro-batch's samples in batches of the same size, and a target's padded
forward can differ in the last bit between the two.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from eagle3.store.capture import HFCapture, capture_rows
from eagle3.store.planned import PLAN, PlannedSamples
from eagle3.store.shards import Sample, StoreError, as_stored


class ColocatedStore(PlannedSamples):
    """A store whose ``store[i]`` (and ``get_many``) runs the attached target on the samples asked for."""

    reads_ahead = False  # its reads run the target, on the trainer's device
    computes_states = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root)
        settings = self.plan_record.get("settings", {})
        if settings.get("backend", "hf") != "hf":
            raise StoreError(f"{self.root / PLAN}: planned with harvest.backend={settings['backend']}; co-located "
                             "training captures with the trainer's own HF target: plan with --backend hf")
        self.batch_size = int(settings.get("batch_size", 8))
        self.capture: HFCapture | None = None
        self.capture_s, self.captured_tokens = 0.0, 0

    def attach(self, target: Any) -> None:
        """Capture with ``target`` (checked against the plan by the trainer before)."""
        self.capture = HFCapture(target, self.spec.topk)

    def summary(self) -> dict[str, Any]:
        return {"capture_seconds": round(self.capture_s, 2)}  # the target's share of the time

    def get_many(self, indices: Sequence[int]) -> list[Sample]:
        """The samples ``indices`` with their states, captured in batches of the plan's batch size
        (similar lengths together, as the harvest batches a shard)."""
        if self.capture is None:
            raise StoreError(f"{self.root}: no target attached to capture the states with")
        t0 = time.perf_counter()
        need = set(indices)
        rows = capture_rows(self.capture, [(i, self.sample_ids[i], self.token_columns(i)[0].tolist()) for i in need],
                            self.batch_size)
        self.capture_s += time.perf_counter() - t0
        self.captured_tokens += sum(self.lengths[i] for i in need)
        return [self._sample(i, rows[i]) for i in indices]

    def _sample(self, i: int, row: dict[str, Any]) -> Sample:
        ids, mask = self.token_columns(i)
        sample = Sample(id=self.sample_ids[i], input_ids=ids.clone(), loss_mask=mask.clone(),
                        aux=as_stored(row["aux"], self.spec.dtype))
        if self.spec.store == "last":
            sample.last = as_stored(row["last"], self.spec.dtype)
        else:
            sample.topk_ids, sample.topk_logprobs = row["topk_ids"].long(), row["topk_logprobs"].float()
        return sample

    def __getitem__(self, i: int) -> Sample:
        return self.get_many([i])[0]


__all__ = ["ColocatedStore"]
