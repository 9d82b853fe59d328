#!/usr/bin/env bash
# A separate venv with the speculators peer (vllm-project/speculators), for the benchmark race.
# It pins its own transformers, so it does not share the main .venv. Prints the venv path.
#
# speculators declares torchvision and torchaudio as dependencies; resolving them lets pip
# replace torch==2.13.0 (a CPU wheel here) with a multi-GB CUDA build. Its EAGLE-3 trainer
# imports neither, so we install speculators without dependencies and then its declared
# dependencies minus torch/torchvision/torchaudio, with torch held at the version we chose.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EAGLE3_SPECULATORS_VENV:-$root/.venv-speculators}"
version="${EAGLE3_SPECULATORS_VERSION:-0.9.0}"
torch_version="${EAGLE3_TORCH_VERSION:-2.13.0}"
python="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
stamp="$venv/.eagle3-installed"
want="speculators==$version torch==$torch_version"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing $want into $venv" >&2
  "${pip[@]}" install -q "torch==$torch_version" >&2
  "${pip[@]}" install -q --no-deps "speculators==$version" >&2
  constraints="$(mktemp)"
  trap 'rm -f "$constraints"' EXIT
  echo "torch==$torch_version" > "$constraints"
  # speculators' own requirements (no extras), without the torch family.
  mapfile -t deps < <("$venv/bin/python" - <<'EOF'
import re
from importlib.metadata import requires
for req in requires("speculators") or []:
    if "extra ==" in req:
        continue
    name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower()
    if name in {"torch", "torchvision", "torchaudio", "torchcodec"}:
        continue
    print(req.split(";")[0].strip())
EOF
  )
  # (--no-warn-conflicts: pip would report the torchvision/torchaudio we leave out on purpose)
  "${pip[@]}" install -q --no-warn-conflicts -c "$constraints" "${deps[@]}" >&2
  # In case an older install of this venv brought them in: they do not import beside CPU torch.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$venv/bin/python" -c "import torch, speculators; print('speculators venv: torch', torch.__version__)" >&2
  echo "$want" > "$stamp"
fi
echo "$venv"
