"""A tiny pipeline (harvest, then training on two ranks) on a random target, launched here or on a
cluster: what the launch tests and CI's two-node Slurm check run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3.tiny import regenerated_data, save_lively


def tiny_pipeline(root: Path, kind: str = "local") -> Any:
    """A harvest + two-rank training pipeline on a lively target, launched locally or on Slurm."""
    from data_gen.config import HarvestConfig
    from eagle3.config import TargetConfig
    from eagle3.train.config import train_config
    from recipes.config import LauncherConfig, PipelineConfig

    model = save_lively(root / "model")
    data = regenerated_data(root / "data.jsonl", 24, turns=2)
    return PipelineConfig(
        target=TargetConfig(name_or_path=str(model), dtype="float32", device="cpu"),
        harvest=HarvestConfig(data=str(data), out_dir=str(root / "harvest"), dtype="float32", max_shard_mb=0.02),
        train=train_config(**{"data.store": str(root / "harvest"), "data.micro_batch_tokens": 256,
                              "data.batching": "buckets", "draft.vocab_size": 64, "data.eval_fraction": 0.2,
                              "optim.warmup_steps": 1, "optim.lr": 1e-3, "log.wandb_mode": "disabled",
                              "log.progress": False}, out_dir=str(root / "train"), steps=2, eval_every=0, save_every=0),
        stages=["harvest", "train"], out_dir=str(root),
        launcher=LauncherConfig(kind=kind, folder=str(root / "submitit"), harvest_shards=2, tasks_per_node=2,
                                timeout_min=10),
    )


__all__ = ["tiny_pipeline"]
