#!/usr/bin/env bash
# One short check on a CUDA machine with the project's packages: two islands of DeepSpeed
# ZeRO-3 (model_configs/llama-1b.json, model_configs/deepspeed/zero3_gpu.json) on the GPUs
# present, a few hundred steps as plain ZeRO-3 and then as ds_diloco islands; prints the
# step time with and without ds_diloco, tokens/s, peak GPU memory against plain ZeRO-3 and
# the merges done. Sized to finish within 8 minutes on one H200 (a deadline stops it).
#
# Usage: launch/gpu_check.sh [extra flags for python -m ds_diloco.bench.gpu_check]
#   GPU_CHECK_STEPS=N   inner steps per island (default 200 on a GPU, 4 on the CPU)
#   PYTHON=...          interpreter (default .venv/bin/python, else python3)
#
# Without CUDA it falls back to the tiny model on the CPU for a few steps, and says so:
# that run only shows the script works; its figures say nothing about a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
command -v "$PY" >/dev/null || PY=python3 # a path or a command on PATH
"$PY" -c 'import torch' 2>/dev/null ||
  { echo "gpu_check.sh: $PY has no torch: run launch/setup.sh, or set PYTHON" >&2; exit 1; }
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
WORKDIR=${GPU_CHECK_WORKDIR:-runs/gpu-check}
[[ -f model_configs/llama-1b.json && -f model_configs/deepspeed/zero3_gpu.json ]] ||
  { echo "gpu_check.sh: model_configs/llama-1b.json or deepspeed/zero3_gpu.json missing" >&2; exit 1; }

if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  exec "$PY" -m ds_diloco.bench.gpu_check \
    --model model_configs/llama-1b.json \
    --deepspeed-config model_configs/deepspeed/zero3_gpu.json \
    --steps "${GPU_CHECK_STEPS:-200}" --micro-batch 4 --seq-len 512 \
    --fragments 16 --sync-every 64 --deadline-s 450 --workdir "$WORKDIR" "$@"
fi

echo "gpu_check.sh: no CUDA device here: CPU FALLBACK with the tiny model for a few steps" \
  "(checks that the script runs; the figures say nothing about a GPU)"
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m ds_diloco.bench.gpu_check \
  --model model_configs/tiny-llama.json \
  --deepspeed-config model_configs/deepspeed/zero3_cpu.json \
  --steps "${GPU_CHECK_STEPS:-4}" --warmup 1 --micro-batch 2 --seq-len 128 \
  --fragments 2 --sync-every 4 --deadline-s 300 --workdir "$WORKDIR" "$@"
