"""The rule between the pipeline's stages: a stage's folder keeps the recipe settings that shaped
it (``recipe.json``: dotted recipe keys, as a recipe or the command line writes them) and says
itself whether it is up to date for the settings of a new run.

A setting shapes a stage when another value would have made it write something else; those that
only say where or how fast (output folders, threads, workers) are named by the config class that
owns them, in its ``RUN_ONLY``. A stage's settings are those of every section it reads, the
sections upstream of it included, so a folder made from other data names the recipe key that
made the data differ. A folder with no record (made by an earlier version, or by a library's own
command) is left to that library's manifest checks, and gets its record when the stage finishes.
The stages that recompute rather than resume (eval, quantize) keep their settings in their report
and redo their work when a run's differ.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from eagle3.atomic import atomic_write_text
from eagle3.errors import Eagle3Error

RECORD = "recipe.json"


class PipelineError(Eagle3Error, ValueError):
    """The recipe cannot run as composed; the message names the key."""


def shaping(section: str, config: Any) -> dict[str, Any]:
    """The settings of one recipe section that shape what a stage writes, as ``section.field`` ->
    JSON value: every field of ``config`` but its class's ``RUN_ONLY`` (nested sections dotted)."""
    run_only = set(getattr(type(config), "RUN_ONLY", ()))
    out: dict[str, Any] = {}
    for f in fields(config):
        if f.name in run_only:
            continue
        value = getattr(config, f.name)
        if is_dataclass(value) and not isinstance(value, type):
            out |= shaping(f"{section}.{f.name}", value)
        else:
            out[f"{section}.{f.name}"] = json.loads(json.dumps(value, default=_plain))
    return out


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in fields(value)}
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not a recipe value")


def redo(folder: Path) -> str:
    """The way out of a folder made otherwise, as every refusal of the pipeline's says it."""
    return f"delete {folder} to redo the stage (the stages after it then redo their part too)"


def made_otherwise(stage: str, folder: Path, key: str, old: Any = None, new: Any = None) -> PipelineError:
    """A stage's folder made with other settings: the recipe key, both values, and the way out."""
    values = "" if old is None and new is None else f": {old!r} there, {new!r} now"
    return PipelineError(f"{stage}: {folder} was made with another {key}{values}; set it back to resume, or "
                         f"{redo(folder)}")


@dataclass(frozen=True)
class StageFolder:
    """One stage's output folder and the settings a run asks of it."""

    stage: str
    folder: Path
    settings: dict[str, Any]

    @property
    def record_path(self) -> Path:
        return self.folder / RECORD

    def recorded(self) -> dict[str, Any] | None:
        """The settings the folder was made with; None when it keeps none."""
        try:
            text = self.record_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            saved = json.loads(text)
        except json.JSONDecodeError as err:
            raise PipelineError(f"{self.stage}: {self.record_path}: not readable JSON ({err}); it records the "
                                f"settings that made {self.folder}: restore it, or delete {self.folder} to redo "
                                "the stage") from None
        if not isinstance(saved, dict) or not isinstance(saved.get("settings"), dict):
            raise PipelineError(f"{self.stage}: {self.record_path}: expected {{\"settings\": {{...}}}}")
        return saved["settings"]

    def up_to_date(self) -> bool | None:
        """Whether the folder was made with these settings: True; None when it keeps no record. Made
        with others: a :class:`PipelineError` naming the first recipe key that differs (or that one side
        lacks: a key renamed or added since)."""
        saved = self.recorded()
        if saved is None or (saved != self.settings and self.holds_only_its_record()):
            return None  # nothing made yet (a first attempt that failed early): nothing to keep
        if saved == self.settings:
            return True
        key = next(k for k in [*self.settings, *saved]
                   if k not in saved or k not in self.settings or saved[k] != self.settings[k])
        if key not in saved:
            raise PipelineError(f"{self.stage}: {self.folder} was made by an earlier version (its {RECORD} has no "
                                f"{key}); {redo(self.folder)}")
        if key not in self.settings:
            raise PipelineError(f"{self.stage}: {self.folder} was made with {key}, a setting this version does not "
                                f"have; {redo(self.folder)}")
        raise made_otherwise(self.stage, self.folder, key, saved[key], self.settings[key])

    def holds_only_its_record(self) -> bool:
        """Whether the folder is missing or holds nothing but its record (and a writer's temporaries)."""
        if not self.folder.is_dir():
            return True
        return all(p.name == RECORD or (p.name.startswith(".") and p.name.endswith(".tmp"))
                   for p in self.folder.iterdir())

    def record(self) -> None:
        """Keep these settings in the folder (atomically)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        body = {"stage": self.stage, "settings": self.settings}
        atomic_write_text(self.record_path, json.dumps(body, indent=1, sort_keys=True) + "\n")

    @contextmanager
    def handed_off(self) -> Iterator[bool | None]:
        """Around a stage that resumes: refuse a folder made otherwise before anything is written; a
        new folder gets its record first (a kill leaves it behind, so a resume is checked by it too);
        when the stage finishes, the folder keeps the record. Yields :meth:`up_to_date`."""
        state = self.up_to_date()
        if state is None and self.holds_only_its_record():
            self.record()
        yield state
        if state is not True:
            self.record()
