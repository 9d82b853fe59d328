#!/usr/bin/env bash
# The GPU check on a GPU machine without network, in two parts so that the figures that matter
# most come first: (1) the pipeline up to train, the race against speculators, the trainer's phases
# and profiles; (2) the serving loop (graphs included), the server, the families. Needs what
# scripts/gpu_bundle.sh put in .gpu/. Output: $OUT (or runs/gpu_offline).
# PART1_S and TOTAL_S (seconds, optional) cap the first part and the whole on a machine held for a
# limited time; what finished is kept when one runs out.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-runs/gpu_offline}"
mkdir -p "$out"
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gpu-site .gpu/wheels/*.whl \
  && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gpu-tf .gpu/tf/*.whl \
  || { echo "gpu_offline: installing the bundled wheels failed" >&2; exit 3; }
# speculators pins transformers <= 5.19: it runs on the image's own, with the bundle's other wheels
printf '#!/bin/sh\nPYTHONPATH=/tmp/gpu-site exec python3 "$@"\n' > /tmp/gpu-speculators-python
chmod +x /tmp/gpu-speculators-python
export PYTHONPATH="/tmp/gpu-tf:/tmp/gpu-site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -V
  python3 -c "import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__, deepspeed.__version__)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
check=(python3 tools/gpu_check.py --tokenizer .gpu/tokenizer --out /tmp/gpu-check
       --speculators-python /tmp/gpu-speculators-python)
timeout "${PART1_S:-0}" "${check[@]}" --stages target regenerate harvest val train \
  --skip export loop server families 2> /tmp/gpu-part1.err | tee "$out/part1.jsonl"
echo "part 1 done at $(( $(date +%s) - t0 )) s"
tail -c 40000 /tmp/gpu-part1.err > "$out/part1.err"
left=$(( ${TOTAL_S:-0} - ($(date +%s) - t0) ))
if [ -z "${TOTAL_S:-}" ] || [ "$left" -gt 30 ]; then
  timeout "$([ -n "${TOTAL_S:-}" ] && echo "$left" || echo 0)" "${check[@]}" --skip pipeline profile race 2> /tmp/gpu-part2.err | tee "$out/part2.jsonl"
  tail -c 40000 /tmp/gpu-part2.err > "$out/part2.err"
fi
cp /tmp/gpu-check/run/train/metrics.jsonl "$out/train_metrics.jsonl" 2>/dev/null
for f in /tmp/gpu-check/speculators-*.log; do [ -f "$f" ] && tail -c 20000 "$f" > "$out/$(basename "$f")"; done
echo "gpu_offline: $(( $(date +%s) - t0 )) s"
