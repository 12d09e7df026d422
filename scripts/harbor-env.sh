#!/usr/bin/env bash
# Create a side venv with Harbor (Python >= 3.12) for the Harbor launcher tests:
#
#     scripts/harbor-env.sh [VENV]        # default: .cache/harbor-venv in the repo
#
# Harbor 0.24.0 is the release that installs here (0.25.0 does not). It cannot share .venv
# (Python 3.11). ~9 min on 2 cores the first time; a second run only checks the stamp.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$REPO/.cache/harbor-venv}"
HARBOR_VERSION=0.24.0
STAMP="harbor==$HARBOR_VERSION"

find_python() {
    for candidate in "${HARBOR_PYTHON:-}" python3.13 python3.12; do
        [ -n "$candidate" ] || continue
        if command -v "$candidate" >/dev/null 2>&1 \
            && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -rV); do
            if PYENV_VERSION="$version" python3 -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' 2>/dev/null; then
                echo "$(PYENV_VERSION="$version" pyenv which python3)"
                return 0
            fi
        done
    fi
    return 1
}

if [ ! -f "$VENV/.harbor-env.stamp" ] || [ "$(cat "$VENV/.harbor-env.stamp")" != "$STAMP" ]; then
    PYTHON="$(find_python)" || { echo "harbor-env: needs Python >= 3.12 (set HARBOR_PYTHON)" >&2; exit 1; }
    mkdir -p "$(dirname "$VENV")"
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    echo '*' >"$VENV/.gitignore"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "harbor==$HARBOR_VERSION"
    echo "$STAMP" >"$VENV/.harbor-env.stamp"
fi
echo "harbor-env: ready: $VENV (harbor $HARBOR_VERSION)"
