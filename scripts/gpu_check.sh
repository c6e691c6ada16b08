#!/usr/bin/env bash
# The check on an accelerator, one command of at most 8 minutes: the device tests (every attention
# backend against the float64 formula, each family's training step and generate() against the
# CPU's) and three side-by-side benchmarks (attention against SDPA at 4k-64k tokens, generate()
# against GPT-2 with a StaticCache, NPRF-BERT against BertModel in training), with their ratios.
# What it runs: hf_kernattn/bench/gpu_check.py.
#
#   bash scripts/gpu_check.sh                  # on the default CUDA device
#   bash scripts/gpu_check.sh --device cuda:1  # another accelerator
#   bash scripts/gpu_check.sh --dry-run        # print the commands and their time limits only
#
# It installs nothing: it uses $PYTHON, else the active virtual or conda environment, else the
# project's .venv (bash scripts/run.sh setup makes one), else python3. Without the accelerator it
# stops at once, saying so (exit status 2).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd -P)"
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -n "${VIRTUAL_ENV:-}" ] || [ -n "${CONDA_PREFIX:-}" ]; then
    PY="$(command -v python || command -v python3)"
elif [ -x "$ROOT/.venv/bin/python" ]; then
    PY="$ROOT/.venv/bin/python"
else
    PY="$(command -v python3)"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# run as a file: the plan (--dry-run) needs neither torch nor the package imported
exec "$PY" "$ROOT/hf_kernattn/bench/gpu_check.py" "$@"
