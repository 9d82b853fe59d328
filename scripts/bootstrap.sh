#!/usr/bin/env bash
# Create the project venv (default .venv, or $EAGLE3_VENV) and install the project into it, every
# dependency at the version constraints.lock names (the versions CI tested; scripts/lock.sh rewrites it).
# A no-op once installed, until pyproject.toml or constraints.lock changes. Prints the venv path on stdout.
#
# torch: installs torch==${EAGLE3_TORCH_VERSION:-2.13.0} from pip's configured sources unless the
# venv already has a torch (the build pip finds: this project's machines offer a CPU wheel; PyPI's
# default Linux build bundles CUDA libraries and runs on CPU too). EAGLE3_TORCH_INDEX picks the
# index, e.g. https://download.pytorch.org/whl/cpu for the small CPU build. CUDA users may also
# install their torch build into the venv first (see README), and this script keeps it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EAGLE3_VENV:-$root/.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "error: $python is not Python >= 3.11; set PYTHON=/path/to/python3.11+" >&2
    exit 1
  fi
  echo "creating $venv" >&2
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
want="$(cat "$root/pyproject.toml" "$root/constraints.lock" | sha256sum | cut -d' ' -f1)"
stamp="$venv/.eagle3-installed"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    echo "installing torch==${EAGLE3_TORCH_VERSION:-2.13.0}" >&2
    "${pip[@]}" install -q ${EAGLE3_TORCH_INDEX:+--index-url "$EAGLE3_TORCH_INDEX"} \
      "torch==${EAGLE3_TORCH_VERSION:-2.13.0}" >&2
  fi
  echo "installing the project and its dependencies into $venv" >&2
  "${pip[@]}" install -q -c "$root/constraints.lock" -e "$root[dev,serve,slurm,nvfp4]" >&2
  echo "$want" > "$stamp"
fi
echo "$venv"
