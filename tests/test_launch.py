"""The job layout of recipes/launch.py, run with submitit's local executor (no Slurm needed): a
harvest array over 2 shards and a 2-task (2-rank, gloo) training job on a tiny saved target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.shards import HarvestStore, verify_store
from recipes.launch import LaunchError, submit
from tests.helpers import tiny_pipeline


def test_harvest_array_and_two_rank_training_as_local_jobs(tmp_path: Path) -> None:
    cfg = tiny_pipeline(tmp_path)
    out = submit(cfg, cfg.launcher)
    assert len(out["jobs"]["harvest"]) == 2 and len(out["jobs"]["train"]) == 1
    shards = out["results"]["harvest"]
    assert {s["worker"] for s in shards} == {"0/2", "1/2"} and any(s["complete"] for s in shards)
    assert all(s["shards_run"] >= 1 for s in shards)  # both workers did part of the work
    store = HarvestStore(tmp_path / "harvest")
    assert len(store) == 24 and len(store.manifest["shards"]) >= 2
    verify_store(tmp_path / "harvest")
    summary = json.loads((tmp_path / "train" / "summary.json").read_text())
    assert json.loads((tmp_path / "train.json").read_text())["world_size"] == 2  # recorded as the stage
    assert json.loads((tmp_path / "harvest.json").read_text())["complete"]
    assert summary["world_size"] == 2 and summary["steps"] == 2
    assert (tmp_path / "train" / "final" / "model.safetensors").is_file()


def test_slurm_without_a_cluster_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_pipeline(tmp_path, "slurm")
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no srun, no sbatch
    with pytest.raises(LaunchError, match="launcher=slurm: .*srun.* use launcher=local"):
        submit(cfg, cfg.launcher)
    sbatch = tmp_path / "bin" / "sbatch"  # a login node whose controller is down
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: Unable to contact slurm controller' >&2\nexit 1\n")
    sbatch.chmod(0o755)
    (tmp_path / "bin" / "srun").symlink_to(sbatch)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    with pytest.raises(LaunchError, match="launcher=slurm: .*Unable to contact slurm controller"):
        submit(cfg, cfg.launcher)
