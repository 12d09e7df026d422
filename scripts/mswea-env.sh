#!/usr/bin/env bash
# mini-swe-agent in a side environment (.cache/mswea-venv) for the end-to-end agent test.
# It pins litellm, which pins openai<3 and an older filelock, so it cannot share .venv.
# `mcp` is needed by litellm's tool-call path (without it the agent loops on an import).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.cache/mswea-venv
VERSION="${MSWEA_VERSION:-2.4.6}"
if [ -x "$VENV/bin/mini" ] && "$VENV/bin/python" -c \
    "from importlib.metadata import version; import sys; sys.exit(version('mini-swe-agent') != '$VERSION')"; then
    exit 0
fi
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "mini-swe-agent==$VERSION" "mcp==${MCP_VERSION:-2.3.0}"
