#!/usr/bin/env bash
# The test command: set-up, lint, then the whole suite (CPU, offline).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
export HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q "$@"
