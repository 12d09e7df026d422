#!/usr/bin/env bash
# Create a side venv in which vLLM's Python types import on a CPU machine, so that the
# vllm backend's translation can be tested against the real classes:
#
#     scripts/vllm-types-env.sh [VENV]        # default: .cache/vllm-venv in the repo
#     VENV/bin/pytest tests/worker_client/backends/test_vllm.py -p no:cacheprovider  # repo root
#
# vLLM cannot go into the main .venv (it pins transformers<5.20 and needs CUDA packages),
# and no engine can start here without a GPU. So vLLM is installed with --no-deps, with
# only the pure-Python/CPU packages that importing its types, platform detection and
# scheduler really needs (found by trial), torch pinned first to the CPU build, and
# xgrammar without its dependency on triton (about 1 GB, never imported here).
# Idempotent: a second run with the same package set only checks the stamp.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$REPO/.cache/vllm-venv}"
PYTHON="${PYTHON:-python3}"

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
# Specifiers copied from vllm 0.32.0's metadata where it has one.
DEPS=(
    "transformers>=5.16.1,<5.20.0"
    "pydantic>=2.12.0"
    msgspec
    cbor2
    psutil
    "pyzmq>=25.0.0"
    "aiohttp>=3.14.3"
    "requests>=2.33.0"
    "oss-harmony>=0.0.11"
    "openai>=2.25.0"
    cloudpickle
    "pillow>=12.3.0"
    pybase64
    cachetools
    uvloop
    py-cpuinfo
    "prometheus_client>=0.18.0"
    "fastapi>=0.133.0,<0.137.0"
    partial-json-parser
    "llguidance>=1.7.0,<1.8.0"
    "apache-tvm-ffi==0.1.11"
    "pytest>=8"
    "pytest-asyncio>=0.24"
)
NO_DEPS=("vllm==$VLLM_VERSION" "xgrammar==0.2.8")
STAMP="torch==$TORCH_VERSION ${DEPS[*]} ${NO_DEPS[*]} repo=$REPO"

LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
run() {
    if ! "$@" >>"$LOG" 2>&1; then
        cat "$LOG" >&2
        echo "vllm-types-env: failed: $*" >&2
        exit 1
    fi
}

if [ ! -f "$VENV/.vllm-types-env.stamp" ] || [ "$(cat "$VENV/.vllm-types-env.stamp")" != "$STAMP" ]; then
    mkdir -p "$(dirname "$VENV")"
    [ -x "$VENV/bin/python" ] || run "$PYTHON" -m venv "$VENV"
    # Keep the venv out of git wherever it is (Python 3.11's venv writes no .gitignore).
    echo '*' >"$VENV/.gitignore"
    PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check --no-compile)
    # torch first, so that nothing after it resolves a CUDA build.
    run "${PIP[@]}" "torch==$TORCH_VERSION"
    run "${PIP[@]}" "${DEPS[@]}"
    run "${PIP[@]}" --no-deps "${NO_DEPS[@]}"
    run "${PIP[@]}" --no-deps -e "$REPO"
    run "$VENV/bin/python" -W ignore -c '
import vllm.outputs, vllm.logprobs, vllm.inputs, vllm.sampling_params
import vllm.v1.core.sched.scheduler, worker_client.backends.vllm'
    echo "$STAMP" >"$VENV/.vllm-types-env.stamp"
fi
echo "vllm-types-env: ready: $VENV (vllm $VLLM_VERSION types, no engine)"
