#!/usr/bin/env bash
# One entry point for a fresh machine: `bash scripts/run.sh demo` or `bash scripts/run.sh test`.
#
# Which Python: an active virtual environment or conda environment is used as it is. Otherwise
# the project's own virtual environment `.venv` (created on first use) is used, so nothing is
# ever pip-installed into a system Python (Debian and Ubuntu refuse that: PEP 668). A new
# `.venv` sees the system site-packages only when the system Python already has torch, so a
# CUDA torch you installed there is kept; without one, the pinned torch release is installed.
# What is already installed is checked without importing it, so a second run starts at once.
#
# Commands: `setup` (only install), `demo`, `test` (pytest; extra arguments go to pytest).
#
# Options and environment:
#   --dry-run                    print the commands that would install things, run nothing
#   PYTHON=/path/to/python       the interpreter to use (or to create `.venv` from)
#   HF_KERNATTN_VENV=DIR         use (create) the virtual environment DIR instead, even when
#                                another one is active (CI uses this for a second environment)
#   HF_KERNATTN_TRANSFORMERS=V   install exactly transformers==V there (CI: the oldest supported)
#   PYTEST_WORKERS=N             pytest-xdist workers for `test` (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd -P)"
TORCH_PIN="torch==2.13.0"

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    shift
fi

die() {
    echo "run.sh: error: $*" >&2
    exit 1
}

# Print a command, then run it (or only print it under --dry-run).
step() {
    echo "+ $*" >&2
    if [ "$DRY_RUN" = 0 ]; then
        "$@"
    fi
}

has_module() {  # has_module PYTHON MODULE: importable, checked without importing it
    (cd / && "$1" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$2') is None)") >/dev/null 2>&1
}

in_environment() {  # a virtual environment (venv/virtualenv) or a conda environment
    (cd / && "$1" -c "import os, sys; sys.exit(not (sys.prefix != sys.base_prefix or os.path.isdir(os.path.join(sys.prefix, 'conda-meta'))))") >/dev/null 2>&1
}

# Sets PY (the interpreter that runs everything) and NEW_VENV (1 if it has yet to be created).
choose_python() {
    local base="${PYTHON:-python3}" venv=""
    command -v "$base" >/dev/null 2>&1 || die "no Python interpreter '$base' found (set PYTHON=/path/to/python3)"
    NEW_VENV=0
    SYSTEM_SITE=0
    if [ -n "${HF_KERNATTN_VENV:-}" ]; then
        venv="$HF_KERNATTN_VENV"
    elif in_environment "$base"; then
        PY="$(command -v "$base")"
        return
    else
        venv=".venv"
    fi
    case "$venv" in /*) ;; *) venv="$ROOT/$venv" ;; esac
    PY="$venv/bin/python"
    if [ ! -x "$PY" ]; then
        NEW_VENV=1
        # Keep a torch the base Python already has (e.g. a CUDA build): let the venv see it.
        if has_module "$base" torch; then
            SYSTEM_SITE=1
        fi
        BASE="$base"
        VENV_DIR="$venv"
    fi
}

create_venv() {
    local opts=()
    if [ "$SYSTEM_SITE" = 1 ]; then
        opts+=(--system-site-packages)
    fi
    echo "run.sh: creating the project virtual environment $VENV_DIR" >&2
    step "$BASE" -m venv ${opts[@]+"${opts[@]}"} "$VENV_DIR" || die "could not create $VENV_DIR with '$BASE -m venv' \
(on Debian/Ubuntu: apt install python3-venv), or activate a virtual environment and run again"
}

# Exit 0 when the package (this checkout, editable, with the entry points and modules pyproject.toml
# declares), its dependencies at the versions pyproject.toml asks for (extra "dev" included: the test
# suite's packages, ONNX export's among them) and a
# pinned transformers, if any, are installed. Reads metadata only: imports nothing heavy.
installed_ok() {
    (cd / && HF_KERNATTN_ROOT="$ROOT" "$PY" - <<'EOF') >/dev/null 2>&1
import importlib.metadata as md, importlib.util, os, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

root = os.environ["HF_KERNATTN_ROOT"]
spec = importlib.util.find_spec("hf_kernattn")
assert spec is not None and spec.origin and os.path.realpath(spec.origin).startswith(root + os.sep)
installed = md.distribution("hf-kernattn").requires or []
try:
    import tomllib
except ImportError:  # Python 3.10: skip the comparison with pyproject.toml
    tomllib = None
if tomllib is not None:
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        pyproject = tomllib.load(f)
    project = pyproject["project"]
    wanted = [str(Requirement(r)) for r in project["dependencies"]]
    for extra, reqs in project["optional-dependencies"].items():  # the metadata lists every extra's
        wanted += [str(Requirement(r)) + f' ; extra == "{extra}"' for r in reqs]
    norm = lambda rs: sorted(str(Requirement(r)).replace(" ", "") for r in rs)
    assert norm(wanted) == norm(installed), "pyproject.toml changed since the install"
    scripts = {e.name: e.value for e in md.distribution("hf-kernattn").entry_points if e.group == "console_scripts"}
    assert scripts == project.get("scripts", {}), "entry points changed since the install"
    for name in pyproject.get("tool", {}).get("setuptools", {}).get("py-modules", []):
        mod = importlib.util.find_spec(name)
        assert mod is not None and os.path.realpath(mod.origin).startswith(root + os.sep), name
for line in installed:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": "dev"}):
        continue
    assert req.specifier.contains(md.version(canonicalize_name(req.name)), prereleases=True), line
pin = os.environ.get("HF_KERNATTN_TRANSFORMERS")
if pin:
    from packaging.version import Version
    assert Version(md.version("transformers")) == Version(pin)
EOF
}

ensure_installed() {
    choose_python
    if [ "$NEW_VENV" = 1 ]; then
        create_venv
    fi
    if [ -x "$PY" ] && installed_ok; then
        return
    fi
    # Keep an installed torch; without one take the pinned release (on CPU-only machines with a
    # local wheel cache this avoids gigabytes of CUDA wheels).
    if { [ "$NEW_VENV" = 1 ] && [ "$SYSTEM_SITE" = 0 ]; } || { [ "$NEW_VENV" = 0 ] && ! has_module "$PY" torch; }; then
        step "$PY" -m pip install -q "$TORCH_PIN"
    fi
    local pins=()
    if [ -n "${HF_KERNATTN_TRANSFORMERS:-}" ]; then
        pins+=("transformers==$HF_KERNATTN_TRANSFORMERS")
    fi
    step "$PY" -m pip install -q -e ".[dev]" ${pins[@]+"${pins[@]}"}
}

cmd="${1:-}"
shift || true
case "$cmd" in
    setup)
        ensure_installed
        echo "run.sh: using $PY" >&2
        ;;
    demo)
        ensure_installed
        step "$PY" -m hf_kernattn.cli demo "$@"
        ;;
    test)
        ensure_installed
        if [ "$DRY_RUN" = 0 ]; then  # which versions this run tests (CI runs two environments)
            (cd / && "$PY" -c "import importlib.metadata as md, platform; print('run.sh: Python', platform.python_version(), \
'| torch', md.version('torch'), '| transformers', md.version('transformers'))") >&2 || true
        fi
        # 2 workers on a 2-core machine; the suite is sized for well under 10 minutes.
        OMP_NUM_THREADS=1 step "$PY" -m pytest -n "${PYTEST_WORKERS:-2}" -q -p no:cacheprovider "$@"
        ;;
    *)
        echo "usage: bash scripts/run.sh [--dry-run] {setup|demo|test} [args...]" >&2
        exit 2
        ;;
esac
