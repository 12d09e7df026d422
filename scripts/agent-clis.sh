#!/usr/bin/env bash
# Claude Code and Codex, the real CLIs, from npm for the end-to-end agent tests (their
# native binaries ship inside the packages). Pinned: the tests know what these versions
# send. Two Claude Code versions, since they tell a gateway different things: 2.1.197 with
# Codex under .cache/npm, and the newer one (the gateway hint headers) under
# .cache/npm-claude-next.
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX=.cache/npm
NEXT_PREFIX=.cache/npm-claude-next
CLAUDE_CODE="${CLAUDE_CODE_VERSION:-2.1.197}"
CLAUDE_CODE_NEXT="${CLAUDE_CODE_NEXT_VERSION:-2.1.332}"
CODEX="${CODEX_VERSION:-0.171.0}"

have() { # have PREFIX BIN PATTERN: the prefix holds that version
    [ -x "$1/bin/$2" ] && "$1/bin/$2" --version 2>/dev/null | grep -q "$3"
}
need_npm() {
    if ! command -v npm >/dev/null; then
        echo "npm is needed for the agent CLI tests (Debian: apt-get install npm)" >&2
        exit 1
    fi
}
if ! have "$PREFIX" claude "^$CLAUDE_CODE " || ! have "$PREFIX" codex " $CODEX$"; then
    need_npm
    npm install --global --prefix "$PREFIX" --no-fund --no-audit --loglevel=error \
        "@anthropic-ai/claude-code@$CLAUDE_CODE" "@openai/codex@$CODEX"
fi
if ! have "$NEXT_PREFIX" claude "^$CLAUDE_CODE_NEXT "; then
    need_npm
    npm install --global --prefix "$NEXT_PREFIX" --no-fund --no-audit --loglevel=error \
        "@anthropic-ai/claude-code@$CLAUDE_CODE_NEXT"
fi
