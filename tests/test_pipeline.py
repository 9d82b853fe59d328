"""The pipeline's stages end to end on a tiny saved target and a hand-made pools folder: reruns
reuse every stage, a retrained draft is evaluated again, a stage folder made with other settings
fails naming the recipe key (before any input is rewritten), and the report names the aux layers."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from data_gen.config import HarvestConfig, RegenerateConfig, SelectConfig, UserFileConfig
from eagle3.config import TargetConfig
from eagle3.train.config import train_config
from recipes.config import PipelineConfig
from recipes.pipeline import PipelineError, run_pipeline
from serve_eval.config import EvalConfig
from tests.helpers import record_file, save_lively


def _pools(root: Path) -> Path:
    (root / "eval").mkdir(parents=True)
    record_file(root / "train.jsonl", range(24), "t")
    record_file(root / "val.jsonl", range(100, 108), "v")
    record_file(root / "eval" / "mtbench.jsonl", range(200, 204), "e")
    return root


def _config(root: Path, **changes: object) -> PipelineConfig:
    cfg = PipelineConfig(
        target=TargetConfig(name_or_path=str(root / "model"), dtype="float32", device="cpu", aux_layer_ids=[1, 3, 6]),
        select=SelectConfig(num_prompts=8),
        regenerate=RegenerateConfig(pool=str(root / "run" / "prompts.jsonl"), out_dir=str(root / "run" / "regenerate"),
                                    max_new_tokens=6, batch_size=4),
        harvest=HarvestConfig(data=str(root / "run" / "regenerate" / "dataset" / "regenerated.jsonl"),
                              out_dir=str(root / "run" / "harvest"), dtype="float32"),
        val=SelectConfig(num_prompts=4, split="val"),
        train=train_config(**{"data.store": str(root / "run" / "harvest"),
                              "data.eval_store": str(root / "run" / "val" / "harvest"), "data.eval_fraction": 0.0,
                              "data.micro_batch_tokens": 256, "draft.vocab_size": 64, "optim.warmup_steps": 1,
                              "log.wandb_mode": "disabled", "log.progress": False},
                              out_dir=str(root / "run" / "train"), steps=2, eval_every=0, save_every=0),
        eval=EvalConfig(sets=["mtbench"], per_set=2, max_new_tokens=6, out_dir=str(root / "run" / "eval"),
                        wandb_mode="disabled"),
        stages=["regenerate", "harvest", "val", "train", "eval", "report"], out_dir=str(root / "run"),
    )
    cfg.pools.out_dir = str(root / "pools")
    return replace(cfg, **changes)


def test_stages_rerun_retrain_and_a_changed_key(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    save_lively(tmp_path / "model")
    _pools(tmp_path / "pools")
    cfg = _config(tmp_path)
    run_pipeline(cfg)
    run = tmp_path / "run"
    report = (run / "report.md").read_text()
    assert "decoder layers [1, 3, 6] of 8" in report
    assert json.loads((run / "report.json").read_text())["aux_layer_ids"] == [1, 3, 6]
    first_eval = (run / "eval" / "report.json").read_bytes()
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith('{"stage": ')]
    summary = lines[-1]  # each stage's wall time, in its file, the report and the run's last line
    assert summary["stage"] == "summary" and list(summary["stage_seconds"]) == cfg.stages
    assert summary["stage_seconds"]["train"] == json.loads((run / "train.json").read_text())["stage_seconds"] > 0
    assert summary["seconds"] == pytest.approx(sum(summary["stage_seconds"].values()), abs=0.2)
    assert "Stage times (s;" in report and f"train {summary['stage_seconds']['train']:g}" in report

    run_pipeline(cfg)  # nothing changed: every stage reused
    out = capsys.readouterr().out
    assert "train: finished earlier" in out and "eval: up to date" in out
    assert (run / "eval" / "report.json").read_bytes() == first_eval

    run_pipeline(replace(cfg, train=replace(cfg.train, steps=6)))  # the draft at train/final changes
    assert "eval: up to date" not in capsys.readouterr().out
    assert json.loads((run / "eval" / "report.json").read_text())["settings"]["draft_sha256"] != \
        json.loads(first_eval)["settings"]["draft_sha256"]

    prompts = (run / "prompts.jsonl").read_text()
    with pytest.raises(PipelineError, match=r"regenerate: .*run/regenerate was made with another select\.num_prompts: "
                                            r"8 there, 12 now; set it back to resume, or delete"):
        run_pipeline(replace(cfg, select=SelectConfig(num_prompts=12)))
    assert (run / "prompts.jsonl").read_text() == prompts  # refused before the selection was rewritten
    with pytest.raises(PipelineError, match=r"regenerate: .* another regenerate\.max_new_tokens: 6 there, 7 now"):
        run_pipeline(replace(cfg, regenerate=replace(cfg.regenerate, max_new_tokens=7)))
    with pytest.raises(PipelineError, match=r"harvest: .*run/harvest was made with another harvest\.dtype: "
                                            r"'float32' there, 'bfloat16' now"):
        run_pipeline(replace(cfg, harvest=replace(cfg.harvest, dtype="bfloat16")))
    with pytest.raises(PipelineError, match=r"val: .*run/val was made with another val\.num_prompts: 4 there, 6 now"):
        run_pipeline(replace(cfg, val=SelectConfig(num_prompts=6, split="val")))
    # where and how fast are not what: a rerun with more threads resumes every stage
    capsys.readouterr()
    run_pipeline(replace(cfg, regenerate=replace(cfg.regenerate, threads=2), threads=2))
    assert "eval: up to date" in capsys.readouterr().out
    # more workers would split val's 4 prompts into smaller batches, which do shape its replies
    with pytest.raises(PipelineError, match=r"val: .*run/val was made with another val regeneration batch "
                                            r"\(regenerate\.batch_size, at most val\.num_prompts / "
                                            r"regenerate\.workers\): 4 there, 2 now"):
        run_pipeline(replace(cfg, regenerate=replace(cfg.regenerate, workers=2)))
    # a key the record lacks: renamed or added since the folder was made
    record = run / "harvest" / "recipe.json"
    kept = json.loads(record.read_text())
    del kept["settings"]["harvest.topk"]
    record.write_text(json.dumps(kept))
    with pytest.raises(PipelineError, match=r"harvest: .*run/harvest was made by an earlier version \(its recipe\.json "
                                            r"has no harvest\.topk\); delete .*run/harvest to redo the stage"):
        run_pipeline(cfg)
    # no record (an earlier version's folder, or one a library's own command made): its manifest decides
    record.unlink()
    (run / "regenerate" / "recipe.json").unlink()
    with pytest.raises(PipelineError, match=r"regenerate: .*run/regenerate holds a regeneration made with "
                                            r"max_new_tokens=6, but this run has max_new_tokens=7.*; or delete"):
        run_pipeline(replace(cfg, regenerate=replace(cfg.regenerate, max_new_tokens=7)))
    run_pipeline(cfg)  # the same settings: resumed, and the folders keep their record again
    assert json.loads(record.read_text())["settings"]["harvest.dtype"] == "float32"
    assert (run / "regenerate" / "recipe.json").is_file()


def test_a_stage_killed_before_it_finished_is_checked_by_its_record(tmp_path: Path) -> None:
    """A new folder gets its record before the stage writes into it, so a run killed midway and resumed
    with other settings is refused by recipe key, not by the library's own names."""
    from recipes.handoff import StageFolder

    cfg = _config(tmp_path)
    folder = StageFolder("harvest", Path(cfg.harvest.out_dir), {"harvest.dtype": "float32"})
    with pytest.raises(RuntimeError, match="killed"), folder.handed_off():
        (folder.folder / "shard-00000.safetensors").write_bytes(b"half")
        raise RuntimeError("killed")
    other = StageFolder("harvest", folder.folder, {"harvest.dtype": "bfloat16"})
    with pytest.raises(PipelineError, match=r"another harvest\.dtype: 'float32' there, 'bfloat16' now"):
        other.up_to_date()
    assert folder.up_to_date() is True
    # a first attempt that failed before writing anything: another setting is simply taken
    empty = StageFolder("regenerate", tmp_path / "early", {"regenerate.backend": "vllm"})
    with pytest.raises(RuntimeError, match="no vllm"), empty.handed_off():
        raise RuntimeError("no vllm")
    fixed = StageFolder("regenerate", empty.folder, {"regenerate.backend": "hf"})
    with fixed.handed_off() as state:
        assert state is None
    assert fixed.up_to_date() is True
    (folder.folder / "recipe.json").write_text("{not json")
    with pytest.raises(PipelineError, match=r"recipe\.json: not readable JSON"):
        folder.up_to_date()


def test_a_pool_built_otherwise_is_refused_before_it_is_rewritten(tmp_path: Path) -> None:
    """The pools stage reuses a pool built with the same settings (also after the folder moved) and
    refuses one built with others, naming the key, instead of rebuilding it under the later stages."""
    from data_gen.pools import pools_config_of
    from recipes.pipeline import stage_pools

    cfg = _config(tmp_path)
    folder = _pools(tmp_path / "pools")
    counts = {"train": 24, "val": 8, "train_by_domain": {}, "train_by_source": {}, "train_by_language": {},
              "eval": {"mtbench": 4}}
    manifest = {"config": pools_config_of(cfg.pools), "counts": counts, "seconds": 1, "skipped": {}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    before = (folder / "train.jsonl").read_bytes()
    assert stage_pools(cfg)["train"] == 24
    moved = tmp_path / "moved"
    folder.rename(moved)
    cfg.pools.out_dir = str(moved)
    assert stage_pools(cfg)["train"] == 24  # the folder's place is not a setting
    cfg.pools.val_fraction = 0.05
    with pytest.raises(PipelineError, match=r"pools: .*moved was made with another pools\.val_fraction: "
                                            r"0\.02 there, 0\.05 now; set it back to resume, or delete"):
        stage_pools(cfg)
    assert (moved / "train.jsonl").read_bytes() == before
    cfg.pools.val_fraction = 0.02
    del manifest["config"]["eval_alpaca"]  # a manifest written before that setting existed
    (moved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PipelineError, match=r"built by an earlier version \(its manifest has no pools\.eval_alpaca\)"):
        stage_pools(cfg)
    cfg.pools.user_files = [UserFileConfig(path=str(tmp_path / "gone.jsonl"), domain="coding")]
    with pytest.raises(PipelineError, match=r"pools\.user_files: .*gone\.jsonl does not exist"):
        stage_pools(cfg)
