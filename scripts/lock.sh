#!/usr/bin/env bash
# Rewrite constraints.lock: the versions a fresh install of the project and all its extras resolves
# today (torch excepted: scripts/bootstrap.sh pins it, and CUDA users bring their own build). The
# README's two commands install under it, so a fresh clone gets the versions CI tested; the ranges in
# pyproject.toml stay loose for users who install the package into their own environment.
# Takes a few minutes (a throw-away venv); commit the new file with the change that needed it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$python" -m venv "$tmp/venv"
pip=("$tmp/venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q ${EAGLE3_TORCH_INDEX:+--index-url "$EAGLE3_TORCH_INDEX"} "torch==${EAGLE3_TORCH_VERSION:-2.13.0}"
"${pip[@]}" install -q "$root[dev,serve,slurm,nvfp4]"
{
  echo "# pip constraints: what scripts/bootstrap.sh installs. Rewritten by scripts/lock.sh; do not edit."
  echo "# $(date -u +%Y-%m-%d), Python $("$tmp/venv/bin/python" -c 'import platform; print(platform.python_version())')"
  "${pip[@]}" freeze --exclude eagle3-forge | grep -v '^torch=='
} > "$root/constraints.lock.tmp"
mv "$root/constraints.lock.tmp" "$root/constraints.lock"
echo "wrote $root/constraints.lock ($(grep -vc '^#' "$root/constraints.lock") packages)" >&2
