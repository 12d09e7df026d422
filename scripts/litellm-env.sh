#!/usr/bin/env bash
# The LiteLLM proxy in a side environment (.cache/litellm-venv), for `make bench` to run
# side by side with rollout-relay. It pins its own dependencies, so it never shares .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.cache/litellm-venv
VERSION="${LITELLM_VERSION:-1.106.2}"
if [ -x "$VENV/bin/litellm" ] && "$VENV/bin/python" -c \
    "from importlib.metadata import version; import sys; sys.exit(version('litellm') != '$VERSION')"; then
    exit 0
fi
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "litellm[proxy]==$VERSION"
