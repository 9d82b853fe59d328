#!/usr/bin/env bash
# Source this before running vLLM on CPU from .venv-vllm: the settings vLLM's CPU backend needs here.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"   # GiB of KV cache
export VLLM_TARGET_DEVICE="${VLLM_TARGET_DEVICE:-cpu}"
# vLLM advises preloading Intel OpenMP (shipped as the intel-openmp wheel) on x86 CPUs.
_venv="${EAGLE3_VLLM_VENV:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv-vllm}"
_iomp="$(ls "$_venv"/lib/libiomp5.so 2>/dev/null | head -n1 || true)"
if [ -n "$_iomp" ]; then export LD_PRELOAD="$_iomp${LD_PRELOAD:+:$LD_PRELOAD}"; fi
unset _venv _iomp
