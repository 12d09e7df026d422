#!/usr/bin/env bash
# Make a Python base image for the Dockerfile from Debian's own packages, for a Docker
# engine that cannot pull from a registry:
#
#     scripts/base-image.sh [TAG]       # default: rollout-relay-base:bookworm
#     docker build --build-arg PYTHON_IMAGE=rollout-relay-base:bookworm --target proxy .
#
# The Dockerfile needs of its base what the official python:3.11-slim-bookworm has:
# `python` 3.11 with venv and pip, useradd, CA certificates. Debian bookworm's python3 is
# 3.11, so `debootstrap --variant=minbase` with python3, python3-venv, python-is-python3
# and ca-certificates makes an equivalent root filesystem from deb.debian.org, which
# `docker import` turns into an image.
#
# The host's own certificate authorities (/usr/local/share/ca-certificates) are added to
# the image's bundle, and pip is told to use that bundle: where outbound HTTPS passes an
# inspecting proxy, the build's pip installs then verify as the host's pip does. The
# official image is not touched by any of this.
#
# Cached: an image already in the engine's store is kept; otherwise the root filesystem's
# tarball in .cache/image/ is imported (debootstrap runs once per checkout, ~2-4 min).
# Needs root and debootstrap for the first run only.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
TAG="${1:-rollout-relay-base:bookworm}"
CACHE="${RELAY_IMAGE_CACHE:-$REPO/.cache/image}"
TARBALL="$CACHE/base-bookworm.tar.gz"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "base image $TAG: already in the engine's store"
    exit 0
fi

if [ ! -s "$TARBALL" ]; then
    if [ "$(id -u)" != 0 ] || ! command -v debootstrap >/dev/null; then
        echo "base-image.sh: making $TAG needs root and debootstrap (apt-get install debootstrap)" >&2
        exit 1
    fi
    mkdir -p "$CACHE"
    ROOTFS="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
    trap 'rm -rf "$ROOTFS"' EXIT
    echo "base image: debootstrap --variant=minbase bookworm into $ROOTFS"
    debootstrap --variant=minbase \
        --include=python3,python3-venv,python-is-python3,ca-certificates \
        bookworm "$ROOTFS" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 || {
        tail -20 "$CACHE/debootstrap.log" >&2
        exit 1
    }
    shopt -s nullglob
    extra=(/usr/local/share/ca-certificates/*.crt)
    if [ "${#extra[@]}" -gt 0 ]; then
        echo "base image: adding the host's certificate authorities: ${extra[*]}"
        cp "${extra[@]}" "$ROOTFS/usr/local/share/ca-certificates/"
        chroot "$ROOTFS" update-ca-certificates >/dev/null 2>&1
    fi
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$ROOTFS/etc/pip.conf"
    # What an image does not need: apt's downloads and lists, documentation, man pages.
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* \
        "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
        "$ROOTFS"/var/log/*.log "$ROOTFS"/var/cache/debconf/*-old
    tar -C "$ROOTFS" --numeric-owner -czf "$TARBALL.tmp" .
    mv "$TARBALL.tmp" "$TARBALL"
    echo "base image: root filesystem cached in $TARBALL ($(du -h "$TARBALL" | cut -f1))"
fi

# An imported image has no environment: give it the PATH and locale the official image has.
docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    "$TARBALL" "$TAG" >/dev/null
echo "base image $TAG: imported from $TARBALL"
