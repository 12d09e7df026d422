#!/usr/bin/env bash
# Claude Code and Codex, the real CLIs, from npm into .cache/npm for the end-to-end agent
# tests (their native binaries ship inside the packages). Pinned: the tests know what
# these versions send.
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX=.cache/npm
CLAUDE_CODE="${CLAUDE_CODE_VERSION:-2.1.197}"
CODEX="${CODEX_VERSION:-0.169.0}"
if [ -x "$PREFIX/bin/claude" ] && [ -x "$PREFIX/bin/codex" ] \
    && "$PREFIX/bin/claude" --version 2>/dev/null | grep -q "^$CLAUDE_CODE " \
    && "$PREFIX/bin/codex" --version 2>/dev/null | grep -q " $CODEX$"; then
    exit 0
fi
if ! command -v npm >/dev/null; then
    echo "npm is needed for the agent CLI tests (Debian: apt-get install npm)" >&2
    exit 1
fi
npm install --global --prefix "$PREFIX" --no-fund --no-audit --loglevel=error \
    "@anthropic-ai/claude-code@$CLAUDE_CODE" "@openai/codex@$CODEX"
