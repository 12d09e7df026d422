#!/usr/bin/env bash
# Create .venv and install rollout-relay with its test and demo dependencies.
# torch is installed first, pinned to the CPU build, so that nothing pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))'; then
    echo "rollout-relay needs Python >= 3.11 (found $("$PYTHON" --version))" >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    .venv/bin/pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/pip install --quiet -e ".[dev]"
# mini-swe-agent (the end-to-end third-party agent test) pins openai<3 through litellm,
# so it gets its own environment under .cache/ instead of the dev extra.
./scripts/mswea-env.sh
