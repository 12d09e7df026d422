#!/usr/bin/env bash
# `make test-image`: build the proxy and worker images and run them as the manifests do
# (tests/image/test_image.py). What it does, in order, saying each step:
#   1. A Docker engine: the running one, or dockerd started here (installing docker.io
#      with apt-get first when it is missing and this runs as root). Where none can be
#      had, it prints "test-image skipped: <why>" and exits 0. A dockerd started here is
#      stopped on exit, whatever the outcome.
#   2. The base image: RELAY_IMAGE_BASE (e.g. python:3.11-slim-bookworm where a registry
#      is reachable), or by default the local one scripts/base-image.sh makes with
#      debootstrap (installed with apt-get when missing) and caches under .cache/image.
#   3. The CPU torch wheel linked into wheels/ from pip's find-links directory, where it
#      is there: the worker image installs it from the build context.
#   4. Both images with the classic builder (DOCKER_BUILDKIT=0): BuildKit would pull its
#      Dockerfile frontend from a registry. RUN steps use the host's network (--network
#      host) to reach the package index.
#   5. The tests, with the images' tags in RELAY_TEST_IMAGE_PROXY/RELAY_TEST_IMAGE_WORKER.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
CACHE="$REPO/.cache/image"
BASE="${RELAY_IMAGE_BASE:-rollout-relay-base:bookworm}"
PROXY_TAG="${RELAY_IMAGE_PROXY:-rollout-relay:test}"
WORKER_TAG="${RELAY_IMAGE_WORKER:-rollout-relay-worker:test}"
TORCH_VERSION=2.13.0
ENGINE_WAIT=60
export DOCKER_BUILDKIT=0
mkdir -p "$CACHE"

say() { echo "test-image: $*"; }
skip() {
    echo "test-image skipped: $*"
    exit 0
}

DOCKERD_PID=""
stop_dockerd() {
    [ -n "$DOCKERD_PID" ] || return 0
    say "stopping the dockerd started here (pid $DOCKERD_PID)"
    kill -TERM "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 60); do
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 0.5
    done
    if kill -0 "$DOCKERD_PID" 2>/dev/null; then
        say "dockerd still running after 30 s: killed"
        kill -KILL "$DOCKERD_PID" 2>/dev/null || true
    fi
    wait "$DOCKERD_PID" 2>/dev/null || true
    DOCKERD_PID=""
}
trap stop_dockerd EXIT
trap 'exit 130' INT TERM

apt_install() {
    say "apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
        >"$CACHE/apt.log" 2>&1 && return 0
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >>"$CACHE/apt.log" 2>&1 || return 1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
        >>"$CACHE/apt.log" 2>&1
}

can_install() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; }

# ---- 1. the engine ----
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    say "using the running Docker engine"
else
    if ! command -v dockerd >/dev/null; then
        can_install || skip "no Docker engine, and installing one needs root and apt-get"
        apt_install docker.io || skip "apt-get could not install docker.io (see $CACHE/apt.log)"
    fi
    [ "$(id -u)" = 0 ] || skip "dockerd is not running and starting it needs root"
    say "starting dockerd (log: $CACHE/dockerd.log)"
    dockerd >"$CACHE/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq $((ENGINE_WAIT * 2))); do
        docker info >/dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 0.5
    done
    if ! docker info >/dev/null 2>&1; then
        tail -5 "$CACHE/dockerd.log" || true
        skip "dockerd did not start within ${ENGINE_WAIT}s (see $CACHE/dockerd.log)"
    fi
fi
docker version --format 'test-image: engine {{.Server.Version}}, client {{.Client.Version}}'

# ---- 2. the base image ----
if [ -z "${RELAY_IMAGE_BASE:-}" ]; then
    if ! docker image inspect "$BASE" >/dev/null 2>&1 && [ ! -s "$CACHE/base-bookworm.tar.gz" ] \
        && ! command -v debootstrap >/dev/null; then
        can_install || skip "the local base image needs debootstrap, and installing it needs root"
        apt_install debootstrap || skip "apt-get could not install debootstrap (see $CACHE/apt.log)"
    fi
    start=$(date +%s)
    scripts/base-image.sh "$BASE"
    say "base image ready in $(($(date +%s) - start)) s"
fi

# ---- 3. the torch wheel ----
shopt -s nullglob
have=(wheels/torch-"$TORCH_VERSION"*.whl)
if [ "${#have[@]}" -eq 0 ]; then
    for dir in ${PIP_FIND_LINKS:-} $(pip3 config get global.find-links 2>/dev/null || true); do
        found=("$dir"/torch-"$TORCH_VERSION"*cpu*.whl)
        if [ "${#found[@]}" -gt 0 ]; then
            say "torch wheel from $dir"
            ln -f "${found[0]}" wheels/ 2>/dev/null || cp "${found[0]}" wheels/
            break
        fi
    done
fi

# ---- 4. the images ----
build() {
    local target=$1 tag=$2 start
    start=$(date +%s)
    say "docker build --target $target -t $tag (base $BASE; log: $CACHE/build-$target.log)"
    if ! docker build --network host --build-arg PYTHON_IMAGE="$BASE" --target "$target" \
        -t "$tag" . >"$CACHE/build-$target.log" 2>&1; then
        tail -30 "$CACHE/build-$target.log"
        say "the $target image did not build"
        exit 1
    fi
    say "$target image built in $(($(date +%s) - start)) s: $(docker image inspect \
        --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}')"
}
build proxy "$PROXY_TAG"
build worker "$WORKER_TAG"
# The images these tags named before, if a change rebuilt them (only this project's).
docker image prune --force --filter label=org.opencontainers.image.title=rollout-relay >/dev/null

# ---- 5. the tests ----
RELAY_TEST_IMAGE_PROXY="$PROXY_TAG" RELAY_TEST_IMAGE_WORKER="$WORKER_TAG" \
    .venv/bin/pytest -q -p no:cacheprovider --durations=0 tests/image
