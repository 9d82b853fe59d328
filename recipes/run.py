"""``eagle3-run``: compose a hydra recipe, convert it once to dataclasses, run the pipeline."""

from __future__ import annotations

import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from eagle3.config import PipelineConfig

ConfigStore.instance().store(name="pipeline_schema", node=PipelineConfig)


def _user_errors() -> tuple[type[Exception], ...]:
    """What a stage raises for bad input or settings, with a message naming the key or file:
    printed as one line, not a traceback (bugs keep theirs)."""
    from eagle3.checkpoint import CheckpointError
    from eagle3.conversations import ConversationError
    from eagle3.export import DraftFormatError
    from eagle3.harvest import HarvestError
    from eagle3.nvfp4 import NVFP4Error
    from eagle3.regenerate import RegenerateError
    from eagle3.shards import StoreError
    from eagle3.target import TargetLoadError
    from eagle3.target_source import TargetSourceError
    from eagle3.train import TrainError
    from hard_mining.rounds import MineError
    from recipes.launch import LaunchError
    from recipes.pipeline import PipelineError

    return (PipelineError, CheckpointError, ConversationError, DraftFormatError, HarvestError, NVFP4Error,
            RegenerateError, StoreError, TargetLoadError, TargetSourceError, TrainError, MineError, LaunchError,
            FileExistsError)


@hydra.main(version_base="1.3", config_path=".", config_name="pipeline")
def main(cfg: DictConfig) -> None:
    import json

    from recipes.launch import submit
    from recipes.pipeline import run_pipeline

    try:
        config = OmegaConf.to_object(cfg)
    except ValueError as err:  # the dataclasses' range checks: the message names the key
        sys.exit(f"eagle3-run: error: {err}")
    assert isinstance(config, PipelineConfig)
    try:
        if config.launcher.kind == "none":
            run_pipeline(config)
        else:
            print(json.dumps({"submitted": submit(config, config.launcher)}, default=str), flush=True)
    except _user_errors() as err:
        sys.exit(f"eagle3-run: error: {err}")


if __name__ == "__main__":
    main()
