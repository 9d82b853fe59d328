"""Hydra recipes and the pipeline entry point (``eagle3-run``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DRAFT_RECIPES = Path(__file__).parent / "draft"


def draft_recipe(name: str) -> dict[str, Any]:
    """The ``train`` settings of ``recipes/draft/<name>.yaml`` (what the pipeline's ``draft=<name>``
    sets), for the tools that train outside the pipeline; ``none``: no settings (the library's
    defaults)."""
    if name == "none":
        return {}
    from dataclasses import fields

    from omegaconf import OmegaConf

    from eagle3.config import TrainConfig

    path = DRAFT_RECIPES / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in DRAFT_RECIPES.glob("*.yaml")))
        raise ValueError(f"draft recipe {name!r}: no {path}; known: {known}, none")
    settings = OmegaConf.to_container(OmegaConf.load(path))
    known = {f.name for f in fields(TrainConfig)}
    for key, value in settings.items():
        if key not in known:
            raise ValueError(f"{path}: {key!r} is not a train setting")
        if value is None or isinstance(value, list | dict):
            raise ValueError(f"{path}: {key}={value!r}: a draft recipe sets single values")
    return settings
