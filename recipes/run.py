"""``eagle3-run``: compose a hydra recipe, convert it once to dataclasses, run the pipeline."""

from __future__ import annotations

import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from eagle3.errors import run_cli
from recipes.config import PipelineConfig

ConfigStore.instance().store(name="pipeline_schema", node=PipelineConfig)


@hydra.main(version_base="1.3", config_path=".", config_name="pipeline")
def main(cfg: DictConfig) -> None:
    try:
        config = OmegaConf.to_object(cfg)
    except ValueError as err:  # the dataclasses' range checks: the message names the key
        sys.exit(f"eagle3-run: error: {err}")
    assert isinstance(config, PipelineConfig)
    sys.exit(run_cli("eagle3-run", _run, config))


def _run(config: PipelineConfig) -> int:
    """The pipeline here, or submitted to the launcher's cluster."""
    import json

    from recipes.launch import submit
    from recipes.pipeline import run_pipeline

    if config.launcher.kind == "none":
        run_pipeline(config)
    else:
        print(json.dumps({"submitted": submit(config, config.launcher)}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    main()
