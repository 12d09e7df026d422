#!/usr/bin/env bash
# Create .venv and install rollout-relay.
#   scripts/setup.sh        everything the tests need (`make test`)
#   scripts/setup.sh demo   only what `rollout-relay demo` runs (`make demo`): the `demo` extra
# torch is installed first, pinned to the CPU build, so that nothing pulls a CUDA build.
# Each step that can take a while says what it does, and how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE="${1:-all}"
case "$PROFILE" in
    all | demo) ;;
    *)
        echo "usage: scripts/setup.sh [demo]" >&2
        exit 2
        ;;
esac

# step "what": say what the next step does; done_step: how long it took.
step() {
    STEP_STARTED=$SECONDS
    echo "setup: $*"
}
done_step() { echo "setup:   done in $((SECONDS - STEP_STARTED)) s"; }

PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))'; then
    echo "rollout-relay needs Python >= 3.11 (found $("$PYTHON" --version))" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    step "creating .venv"
    "$PYTHON" -m venv .venv
    done_step
fi
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    step "installing torch ${TORCH_VERSION:-2.13.0}, CPU build (about 190 MB; the longest step)"
    .venv/bin/pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
    done_step
fi
if [ "$PROFILE" = demo ]; then
    step "installing rollout-relay and what the demo runs (transformers, aiohttp, openai)"
    .venv/bin/pip install --quiet -e ".[demo]"
    done_step
    exit 0
fi
step "installing rollout-relay with everything the tests need (.[dev]: verl's, Ray's," \
    "Kubernetes', Playwright's dependencies and more; minutes on a fresh machine)"
.venv/bin/pip install --quiet -e ".[dev]"
done_step
# verl for the `remote_agent` loop and the verl backend, without its dependency pins (see
# the `verl` extra in pyproject.toml, which carries what importing its agent loop needs).
if ! .venv/bin/python -c 'import verl' 2>/dev/null; then
    step "installing verl (without its dependency pins)"
    .venv/bin/pip install --quiet --no-deps "verl==${VERL_VERSION:-0.9.1}"
    done_step
fi
# mini-swe-agent (the end-to-end third-party agent test) pins openai<3 through litellm,
# so it gets its own environment under .cache/ instead of the dev extra.
step "checking mini-swe-agent's side environment (.cache/mswea-venv)"
./scripts/mswea-env.sh
done_step
# Debian's chromium for the viewer's browser test: Playwright drives it as it is and
# downloads no browser of its own.
if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        step "installing Debian's chromium for the viewer's browser test (apt-get)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
        done_step
    else
        echo "the viewer test needs Debian's chromium: apt-get install chromium" >&2
    fi
fi
