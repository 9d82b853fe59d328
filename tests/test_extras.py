"""The core install trains and harvests: with the extras' packages hidden ([serve]: fastapi,
uvicorn, prometheus-client, matplotlib; [slurm]: submitit; [nvfp4]: compressed-tensors), a
regeneration, a harvest and a training run go through, and each extra's entry point names the
extra it needs in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HIDDEN = ("fastapi", "uvicorn", "prometheus_client", "matplotlib", "submitit", "compressed_tensors", "starlette")

SCRIPT = textwrap.dedent('''
    import importlib.abc, sys
    HIDDEN = {hidden!r}

    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HIDDEN:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Hide())
    from pathlib import Path
    out = Path(sys.argv[1])
    from data_gen.harvest import run as harvest
    from data_gen.regenerate import run as regenerate
    from data_gen.config import HarvestConfig, RegenerateConfig
    from eagle3.config import TargetConfig
    from eagle3.train.config import train_config
    from eagle3.train.loop import train
    from tests.helpers import lively_target, regenerated_data

    target = lively_target()
    lively = TargetConfig(name_or_path="lively")
    regenerate(RegenerateConfig(pool=str(regenerated_data(out / "pool.jsonl", 8)), out_dir=str(out / "regen"),
                                max_new_tokens=8, batch_size=4), lively, target=target, progress=False)
    harvest(HarvestConfig(data=str(out / "regen" / "dataset" / "regenerated.jsonl"), out_dir=str(out / "store"),
                          dtype="float32"), lively, target=target, progress=False)
    summary = train(train_config(dict(data=dict(store=str(out / "store"), micro_batch_tokens=256, eval_fraction=0.0),
                                      draft=dict(vocab_size=64), log=dict(wandb_mode="disabled", progress=False),
                                      out_dir=str(out / "train"), steps=2, eval_every=0, save_every=0, device="cpu")),
                    target=target)
    assert summary["steps"] == 2 and (out / "train" / "final" / "model.safetensors").is_file()
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in HIDDEN)
    assert not loaded, loaded
    for module, extra in (("serve_eval.server", "[serve]"), ("recipes.launch", None)):
        try:
            __import__(module)
        except ImportError as err:
            assert extra and extra in str(err), err
    from data_gen.nvfp4 import NVFP4Error, quantization_config
    try:
        quantization_config("w4a4", ["lm_head"])
    except NVFP4Error as err:
        assert "[nvfp4]" in str(err)
    else:
        raise AssertionError("the NVFP4 conversion ran without compressed-tensors")
    print("core ok")
''').format(hidden=HIDDEN)


def test_the_core_install_trains_and_harvests_without_the_extras(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}, timeout=600)
    assert done.returncode == 0 and "core ok" in done.stdout, (done.stdout + done.stderr)[-3000:]
