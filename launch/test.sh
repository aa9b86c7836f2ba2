#!/usr/bin/env bash
# The test command: set-up, lint, then the whole suite (CPU, offline).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
export HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Two workers (TEST_WORKERS): the end-to-end tests wait on their processes' start-ups and
# teardowns, so one worker left 40 % of two cores idle; tests are handed out one at a time
# as workers free up (worksteal), so a long one does not hold a queue of short ones.
.venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist worksteal "$@"
