"""CI's real-Slurm check (run by scripts/ci/slurm.sh once the daemons are up): the tiny pipeline's
harvest array (2 shards) and 2-task training job submitted with submitit to Slurm, chained by
afterok, waited for, and their outputs checked; then the same pipeline trained online (a producer
job beside the training job, one CPU each), whose draft must equal an offline run's, bit for bit."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from eagle3.store.shards import HarvestStore, verify_store  # noqa: E402
from recipes.launch import submit  # noqa: E402
from tests.helpers import tiny_pipeline  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cfg = tiny_pipeline(work, kind="slurm")
    cfg = replace(cfg, launcher=replace(cfg.launcher, cpus_per_task=1, timeout_min=20))
    started = time.time()
    out = submit(cfg, cfg.launcher, wait=True)
    print(json.dumps({"slurm_jobs": out["jobs"], "seconds": round(time.time() - started, 1)}), flush=True)
    store = HarvestStore(work / "harvest")
    verify_store(work / "harvest")
    workers = {r["worker"] for r in out["results"]["harvest"]}
    summary = json.loads((work / "train" / "summary.json").read_text())
    ok = (len(store) == 24 and workers == {"0/2", "1/2"} and summary["world_size"] == 2
          and (work / "train" / "final" / "model.safetensors").is_file())
    print(json.dumps({"store_samples": len(store), "harvest_workers": sorted(workers),
                      "train_world_size": summary["world_size"], "ok": ok}), flush=True)
    return 0 if ok and online(work / "online") else 1


def online(work: Path) -> bool:
    """A producer array task and the training job, started together on Slurm, against the same
    pipeline trained offline in this process."""
    from recipes.pipeline import run_pipeline

    base = tiny_pipeline(work, kind="slurm")
    train = replace(base.train, data="online", shard_window=1, eval_fraction=0.0, steps=4, spool_wait_s=600)
    cfg = replace(base, train=train, harvest=replace(base.harvest, spool_budget_mb=0.5),
                  launcher=replace(base.launcher, cpus_per_task=1, timeout_min=20, tasks_per_node=1, harvest_shards=1))
    started = time.time()
    out = submit(cfg, cfg.launcher, wait=True)
    print(json.dumps({"slurm_jobs": out["jobs"], "seconds": round(time.time() - started, 1)}), flush=True)
    offline = replace(cfg, train=replace(train, data="offline", store=str(work / "offline" / "harvest"),
                                         out_dir=str(work / "offline" / "train")),
                      harvest=replace(cfg.harvest, out_dir=str(work / "offline" / "harvest")),
                      launcher=replace(cfg.launcher, kind="none"))
    run_pipeline(offline)
    produced = out["results"]["produce"][0]
    same = ((work / "train" / "final" / "model.safetensors").read_bytes()
            == (work / "offline" / "train" / "final" / "model.safetensors").read_bytes())
    ok = same and produced["stopped"] == "the trainer is done" and not (work / "harvest" / "manifest.json").exists()
    print(json.dumps({"online_equals_offline": same, "producer": produced, "ok": ok}), flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main())
