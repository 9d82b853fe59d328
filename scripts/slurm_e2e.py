"""CI's real-Slurm check (run by scripts/ci_slurm.sh once the daemons are up): the tiny pipeline's
harvest array (2 shards) and 2-task training job submitted with submitit to Slurm, chained by
afterok, waited for, and their outputs checked."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle3.shards import HarvestStore, verify_store  # noqa: E402
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
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
