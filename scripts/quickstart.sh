#!/usr/bin/env bash
# The main job: install if needed, then run the default pipeline on the embedded target.
# Extra arguments are hydra overrides, e.g. `bash scripts/quickstart.sh out_dir=runs/try2`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/bootstrap.sh")"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$root"
exec "$venv/bin/eagle3-run" "$@"
