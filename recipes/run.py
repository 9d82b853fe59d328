"""``eagle3-run``: compose a hydra recipe, convert it once to dataclasses, run the pipeline."""

from __future__ import annotations

import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from eagle3.errors import run_cli
from recipes.config import PipelineConfig

ConfigStore.instance().store(name="pipeline_schema", node=PipelineConfig)


def moved_train_keys(argv: list[str]) -> list[str]:
    """One line per ``train.<key>`` of an earlier version among the overrides in ``argv`` and the
    ``train:`` block of the recipe it names (hydra's own message would only say the key is unknown)."""
    from pathlib import Path

    from eagle3.train.config import SECTIONS, moved_key

    lines = []
    for arg in argv:
        key, eq, _ = arg.lstrip("+~").partition("=")
        parts = key.split(".")
        if eq and len(parts) == 2 and parts[0] == "train" and (moved := moved_key(parts[1])):
            lines.append(moved)
    name, folder = "pipeline", Path(__file__).parent
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag in ("--config-name", "-cn"):
            name = value
        elif flag in ("--config-path", "-cp"):
            folder = Path(value)
    recipe = folder / f"{name.removesuffix('.yaml')}.yaml"
    if recipe.is_file():
        import yaml

        train = (yaml.safe_load(recipe.read_text()) or {}).get("train")
        for key, value in (train.items() if isinstance(train, dict) else ()):
            if (moved := moved_key(str(key))) and not (key in SECTIONS and isinstance(value, dict)):
                lines.append(f"{recipe}: {moved}")
    return lines


def run() -> None:
    """The ``eagle3-run`` entry point: moved keys named first, then hydra."""
    if moved := moved_train_keys(sys.argv[1:]):
        print("\n".join(f"eagle3-run: error: {line}" for line in moved), file=sys.stderr)
        sys.exit(2)  # bad input, as every entry point says it
    main()


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
    run()
