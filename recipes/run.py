"""``eagle3-run``: compose a hydra recipe, convert it once to dataclasses, run the pipeline."""

from __future__ import annotations

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from eagle3.config import PipelineConfig

ConfigStore.instance().store(name="pipeline_schema", node=PipelineConfig)


@hydra.main(version_base="1.3", config_path=".", config_name="pipeline")
def main(cfg: DictConfig) -> None:
    import json

    from recipes.launch import submit
    from recipes.pipeline import run_pipeline

    config = OmegaConf.to_object(cfg)
    assert isinstance(config, PipelineConfig)
    if config.launcher.kind == "none":
        run_pipeline(config)
    else:
        print(json.dumps({"submitted": submit(config, config.launcher)}, default=str), flush=True)


if __name__ == "__main__":
    main()
