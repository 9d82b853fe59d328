#!/usr/bin/env bash
# A separate venv with the speculators peer (vllm-project/speculators), for the benchmark race.
# It pins its own transformers, so it does not share the main .venv. Prints the venv path.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EAGLE3_SPECULATORS_VENV:-$root/.venv-speculators}"
version="${EAGLE3_SPECULATORS_VERSION:-0.9.0}"
python="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
stamp="$venv/.eagle3-installed"
if [ "$(cat "$stamp" 2>/dev/null)" != "speculators==$version" ]; then
  "${pip[@]}" install -q "torch==${EAGLE3_TORCH_VERSION:-2.13.0}" >&2
  "${pip[@]}" install -q "speculators==$version" >&2
  # Pulled in by speculators but unused by its EAGLE-3 trainer; PyPI's builds do not import beside CPU torch.
  "${pip[@]}" uninstall -q -y torchvision torchaudio >&2 || true
  echo "speculators==$version" > "$stamp"
fi
echo "$venv"
