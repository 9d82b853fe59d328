"""Every shipped recipe composes into the typed config tree; typos fail naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

import recipes.run  # noqa: F401  (registers the schema)
from eagle3.config import PipelineConfig, TargetConfig, TrainConfig

RECIPES = Path(recipes.run.__file__).parent
TARGETS = sorted(p.stem for p in (RECIPES / "target").glob("*.yaml"))


@pytest.mark.parametrize("target", TARGETS)
def test_every_target_recipe_composes(target: str) -> None:
    with initialize_config_module(config_module="recipes", version_base="1.3"):
        cfg = compose(config_name="pipeline", overrides=[f"target={target}"])
    config = OmegaConf.to_object(cfg)
    assert isinstance(config, PipelineConfig) and isinstance(config.target, TargetConfig)
    assert config.target.name_or_path


def test_default_recipe_is_the_embedded_target() -> None:
    with initialize_config_module(config_module="recipes", version_base="1.3"):
        config = OmegaConf.to_object(compose(config_name="pipeline"))
    assert config.target.name_or_path == "smollm2-135m"
    assert config.stages == ["target", "pools", "regenerate", "harvest", "train"]
    assert config.train.store == "runs/quickstart/harvest" and config.train.out_dir == "runs/quickstart/train"
    assert isinstance(config.train, TrainConfig) and config.train.eval_fraction > 0
    assert config.harvest.data == "runs/quickstart/regenerate/dataset/regenerated.jsonl"
    assert config.regenerate.pool == "runs/quickstart/prompts.jsonl"
    assert config.pools.out_dir == "runs/quickstart/pools"


def test_typo_fails_at_composition_naming_the_key() -> None:
    with initialize_config_module(config_module="recipes", version_base="1.3"):
        with pytest.raises(ConfigCompositionException, match="target.dtyp"):
            compose(config_name="pipeline", overrides=["target.dtyp=float32"])
        cfg = compose(config_name="pipeline")
    with pytest.raises(ConfigKeyError, match="nme_or_path"):
        OmegaConf.merge(cfg, {"target": {"nme_or_path": "x"}})


def test_invalid_values_fail_with_the_field_named() -> None:
    with initialize_config_module(config_module="recipes", version_base="1.3"):
        cfg = compose(config_name="pipeline", overrides=["target.dtype=fp33"])
    with pytest.raises(ValueError, match="target.dtype='fp33'"):
        OmegaConf.to_object(cfg)
    with initialize_config_module(config_module="recipes", version_base="1.3"):
        with pytest.raises(ConfigCompositionException, match="train.stpes"):
            compose(config_name="pipeline", overrides=["train.stpes=3"])
        cfg = compose(config_name="pipeline", overrides=["train.zero_stage=7"])
    with pytest.raises(ValueError, match="train.zero_stage=7"):
        OmegaConf.to_object(cfg)


def test_unknown_stage_is_named() -> None:
    from recipes.pipeline import run_pipeline

    known = r"known stages are \['target', 'pools', 'regenerate', 'harvest', 'train'\]"
    with pytest.raises(ValueError, match=r"unknown \['harvst'\]; " + known):
        run_pipeline(PipelineConfig(stages=["target", "harvst"]))
