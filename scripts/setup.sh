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
# verl for the `remote_agent` loop and the verl backend, without its dependency pins (see
# the `verl` extra in pyproject.toml, which carries what importing its agent loop needs).
if ! .venv/bin/python -c 'import verl' 2>/dev/null; then
    .venv/bin/pip install --quiet --no-deps "verl==${VERL_VERSION:-0.9.1}"
fi
# mini-swe-agent (the end-to-end third-party agent test) pins openai<3 through litellm,
# so it gets its own environment under .cache/ instead of the dev extra.
./scripts/mswea-env.sh
# Debian's chromium for the viewer's browser test: Playwright drives it as it is and
# downloads no browser of its own.
if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "the viewer test needs Debian's chromium: apt-get install chromium" >&2
    fi
fi
