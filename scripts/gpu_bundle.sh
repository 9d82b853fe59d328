#!/usr/bin/env bash
# Bundle what the GPU check needs on a GPU machine that has torch but no network (e.g. a cluster node
# without internet access; the image seen so far: Python 3.12, torch, transformers, accelerate, no DeepSpeed): wheels of the missing packages
# (.gpu/wheels), transformers at this venv's version (.gpu/tf: older 5.x lacks StaticLayer.crop only,
# which the static cache works around, but the check should run what CI runs), speculators 0.9.0 for
# the trainer's race, and the embedded target's tokenizer (.gpu/tokenizer). .gpu/ is git-ignored:
# carry it with the call, then run `bash scripts/gpu_offline.sh` there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-.venv/bin/python}"
pyver="${GPU_PYTHON_VERSION:-3.12}"
rm -rf .gpu/wheels .gpu/tf  # one version of each: pip refuses two
mkdir -p .gpu/wheels .gpu/tf
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
get() { "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
          --python-version "$pyver" --implementation cp "${platforms[@]}" -d "$1" "${@:2}"; }
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
# ours: DeepSpeed (a pure-Python wheel, built here from its sdist when pip has none), the server's
# stack, datasets for speculators' data; pinned to what this venv runs where it has them
ds="$(version deepspeed)"
get .gpu/wheels "deepspeed==$ds" 2>/dev/null || "$py" -m pip wheel -q --no-deps --no-build-isolation \
  -w .gpu/wheels "deepspeed==$ds"
get .gpu/wheels hjson "pydantic==$(version pydantic)" "pydantic_core==$(version pydantic_core)" annotated-types \
  typing-inspection "fastapi==$(version fastapi)" starlette uvicorn opentelemetry-api dill multiprocess \
  "datasets==5.1.0" "fsspec<=2026.7.0" "speculators==0.9.0" "hs-connectors==0.9.0" loguru pydantic-settings \
  python-dotenv openai jiter distro sniffio httpx2 httpcore2 truststore
get .gpu/tf "transformers==$(version transformers)"
"$py" tools/gpu_check.py --save-tokenizer .gpu/tokenizer >/dev/null
du -sh .gpu
