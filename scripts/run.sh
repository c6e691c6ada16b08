#!/usr/bin/env bash
# One entry point for a fresh machine: `bash scripts/run.sh demo` or `bash scripts/run.sh test`.
# It installs what is missing (never replacing a torch the user already has), then runs the job.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

ensure_installed() {
    # Keep an installed torch: CUDA users keep theirs; without one, take the pinned release
    # (on CPU-only machines with a local wheel cache this avoids gigabytes of CUDA wheels).
    if ! "$PY" -c "import torch" >/dev/null 2>&1; then
        "$PY" -m pip install -q "torch==2.13.0"
    fi
    # (Re)install in editable mode unless this very checkout is already the installed one.
    local here
    here="$(pwd -P)"
    if ! (cd / && "$PY" -c "import sys, hf_kernattn, pytest, xdist, matplotlib; sys.exit(0 if hf_kernattn.__file__.startswith('$here/') else 1)") >/dev/null 2>&1; then
        "$PY" -m pip install -q -e ".[dev]"
    fi
}

cmd="${1:-}"
shift || true
case "$cmd" in
    demo)
        ensure_installed
        "$PY" -m hf_kernattn.cli demo "$@"
        ;;
    test)
        ensure_installed
        # 2 workers on a 2-core machine; the suite is sized for well under 10 minutes.
        OMP_NUM_THREADS=1 "$PY" -m pytest -n "${PYTEST_WORKERS:-2}" -q "$@"
        ;;
    *)
        echo "usage: bash scripts/run.sh {demo|test} [args...]" >&2
        exit 2
        ;;
esac
