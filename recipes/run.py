"""``eagle3-run``: compose a hydra recipe, convert it once to dataclasses, run the pipeline."""

from __future__ import annotations

import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from recipes.config import PipelineConfig

ConfigStore.instance().store(name="pipeline_schema", node=PipelineConfig)


def _user_errors() -> tuple[type[Exception], ...]:
    """What a stage raises for bad input or settings, with a message naming the key or file:
    printed as one line, not a traceback (bugs keep theirs)."""
    from eagle3.errors import Eagle3Error

    return (Eagle3Error, FileExistsError)


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
