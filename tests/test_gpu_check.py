"""The project's GPU check (tools/gpu_check.py) runs tiny on this CPU: every stage it covers on a
GPU (pipeline stages, export and reload, the loop in each variant, the server sampling) passes
here too, so the script a GPU session runs cannot rot unnoticed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.integration
def test_the_gpu_check_passes_tiny_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "tools/gpu_check.py", "--size", "tiny", "--device", "cpu",
                           "--out", str(tmp_path / "check")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"check"')]
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    checks = {r["check"]: r for r in rows}
    stages = ("target", "regenerate", "harvest", "val", "train", "mine", "eval")
    wanted = [*(f"pipeline.{s}" for s in stages), "export.vllm", "export.speculators", "server.t0.8",
              "family.peagle", "family.dflash", "profile.train_micro_batch", "profile.plain_decoding",
              "profile.train_step",
              *(f"loop.{d}.{m}.t{t}" for d in ("float32", "bfloat16") for m in ("chain", "tree") for t in ("0", "1")),
              "loop.float32.chain.graphs", "loop.float32.tree.graphs"]  # bf16 graphs: on CUDA only
    assert [w for w in wanted if w not in checks] == []
    assert all(r["ok"] for r in rows) and checks["summary"]["failed"] == []
    assert checks["loop.float32.chain.t0"]["equal"] == checks["loop.float32.chain.t0"]["prompts"]
    graphs = checks["loop.float32.chain.graphs"]
    assert graphs["equal"] == graphs["of"] > 0 and graphs["cost_model_speedup"] > 0 and graphs["of_cost_model"] > 0
    tree = checks["loop.float32.tree.graphs"]
    assert tree["equal"] == tree["of"] > 0 and tree["spec_tokens_per_s"] > 0
    assert checks["pipeline.eval"]["cost_model"]["break_even_tau"] > 1
    assert checks["server.t0.8"]["completion_tokens"] > 0
    step, plain = checks["profile.train_micro_batch"], checks["profile.plain_decoding"]
    assert step["tokens"] > 0 and step["top_ops"] and step["host_syncs"] is None  # counted on CUDA only
    assert step["ms_unprofiled"] > 0 and step["ms_whole_row_attention"] > 0 and step["documents"] >= 1
    assert 0 < plain["forward_ms_per_token"] <= plain["ms_per_token_profiled"] and plain["top_ops"]
    assert plain["ms_per_token"] > 0 and plain["ms_per_token_cudnn_first"] > 0  # the same path on a CPU
    phases = checks["profile.train_step"]
    assert set(phases["later_mean_ms"]) == {"load", "forward", "backward", "optimizer", "metrics"}
    assert phases["later_tokens_per_s"] > 0 and phases["cudnn_allowed"] is None  # compared on CUDA only
