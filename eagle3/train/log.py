"""Where the trainer's numbers go: rank 0 writes ``metrics.jsonl`` and a wandb run; every
other rank gets a null sink. :class:`PhaseClock` times a step's phases for them."""

from __future__ import annotations

import json
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.atomic import atomic_write_text
from eagle3.device import synchronize
from eagle3.errors import ConfigError

WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class LogSpec:
    """What the run reports, and where (``train.log.*``)."""

    every: int = 1
    """Write metrics every N optimizer steps."""
    wandb_mode: str = "offline"
    """offline (synced later with ``wandb sync``), online, or disabled."""
    wandb_project: str = "eagle3"
    """The wandb project the run is logged under."""
    wandb_run_name: str | None = None
    """None: the name of ``train.out_dir``."""
    progress: bool = True
    """A tqdm progress bar on rank 0."""
    phase_times: bool = False
    """Log where each step's time goes (``time/<phase>_ms``: load, forward, backward, optimizer,
    metrics), each phase closed by a device sync: the syncs take away the overlap they measure, so
    the run's tokens/s is then not its speed."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ConfigError(f"train.log.every={self.every}: must be >= 1")
        if self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"train.log.wandb_mode={self.wandb_mode!r}: expected one of {', '.join(WANDB_MODES)}")


class NullSink:
    """Accepts metrics and drops them (ranks > 0)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class RunSink(NullSink):
    """``metrics.jsonl`` (one JSON object per call, with ``step``) plus a wandb run.

    On resume from step N the file keeps only records with step <= N, so that it reads as one
    uninterrupted run; the wandb run continues under the id kept in ``wandb_run_id``.
    """

    def __init__(self, out_dir: str | Path, log: LogSpec, *, config: dict[str, Any], resume_step: int | None) -> None:
        wandb_mode = log.wandb_mode
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / "metrics.jsonl"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            atomic_write_text(self.path, "")
        elif self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines(keepends=True)
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            atomic_write_text(self.path, "".join(kept))
        self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115  (closed in close())
        self.run = None
        if wandb_mode != "disabled":
            import wandb

            id_file = self.out_dir / "wandb_run_id"
            run_id = id_file.read_text().strip() if resume_step is not None and id_file.is_file() else None
            run_id = run_id or secrets.token_hex(4)
            atomic_write_text(id_file, run_id + "\n")
            (self.out_dir / "wandb").mkdir(exist_ok=True)
            self.run = wandb.init(project=log.wandb_project, name=log.wandb_run_name or self.out_dir.name, id=run_id,
                                  resume="allow", dir=str(self.out_dir), mode=wandb_mode, config=config,
                                  settings=wandb.Settings(console="off", silent=True))
            from eagle3.dashboards import define_metrics

            define_metrics(self.run, "train")

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **metrics}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.run is not None:
            self.run.log(record)

    def close(self) -> None:
        self.file.close()
        if self.run is not None:
            self.run.finish()
            self.run = None


def read_metrics(out_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl``, in order."""
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


__all__ = ["WANDB_MODES", "LogSpec", "NullSink", "RunSink", "read_metrics"]


class PhaseClock:
    """Where a training step's time goes: milliseconds per phase (reading the batch, forward,
    backward, optimizer, metrics), each phase closed by a device sync so that its own queued work
    is counted in it. On with ``train.log.phase_times`` only: the syncs take away the overlap of host
    and device work that they measure, so a run's tokens/s with it is not the run's speed."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device = device
        self.enabled = enabled
        self._ms: dict[str, float] = defaultdict(float)
        self._last = 0.0

    def start(self) -> None:
        if self.enabled:
            synchronize(self.device)
            self._ms.clear()
            self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """The time since the last mark goes to ``phase`` (summed over a step's micro-batches)."""
        if self.enabled:
            synchronize(self.device)
            now = time.perf_counter()
            self._ms[phase] += (now - self._last) * 1000
            self._last = now

    def metrics(self) -> dict[str, float]:
        """This step's ``time/<phase>_ms`` (empty when off)."""
        return {f"time/{k}_ms": round(v, 3) for k, v in self._ms.items()} if self.enabled else {}
