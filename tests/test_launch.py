"""The job layout of recipes/launch.py, run with submitit's local executor (no Slurm needed): a
harvest array over 2 shards and a 2-task (2-rank, gloo) training job on a tiny saved target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.store.shards import HarvestStore, verify_store
from recipes.launch import LaunchError, submit
from tests.helpers import tiny_pipeline


@pytest.mark.slow
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


def test_local_jobs_see_the_gpus_they_are_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit's local executor hides every GPU unless told: one 8-GPU node without Slurm needs the
    training job to see all of them (a rank per GPU) and each harvest task its own."""
    import submitit

    from recipes import launch
    from recipes.config import LauncherConfig

    seen: list[tuple[int, dict]] = []
    monkeypatch.setattr(submitit.LocalExecutor, "submit",
                        lambda self, fn, cfg, i, n: seen.append((i, dict(self.parameters))))
    node = LauncherConfig(kind="local", folder=str(tmp_path), gpus_per_node=4, harvest_shards=6, tasks_per_node=4)
    launch._array(node, "harvest", launch.harvest_shard, None, [])
    assert [(i, p["visible_gpus"], p["gpus_per_node"]) for i, p in seen] == [
        (0, (0,), 1), (1, (1,), 1), (2, (2,), 1), (3, (3,), 1), (4, (0,), 1), (5, (1,), 1)]
    train = launch._executor(node, "train", gpus=range(4), tasks_per_node=4).parameters
    assert train["visible_gpus"] == (0, 1, 2, 3) and train["gpus_per_node"] == 4 and train["tasks_per_node"] == 4
    cpu = launch._executor(LauncherConfig(kind="local", folder=str(tmp_path)), "prepare").parameters
    assert cpu["gpus_per_node"] == 0  # a CPU machine: nothing to see, as before
