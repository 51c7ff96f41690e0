#!/usr/bin/env bash
# Build the deviceplane image (Dockerfile) with buildah, without any image registry:
# the Debian bookworm base (python3, python3-venv) is made with debootstrap from the Debian mirror and imported
# as localhost/deviceplane-base:bookworm. Python packages come from PyPI during the build.
#   scripts/build-image.sh [TAG]     (default localhost/deviceplane:<version>)
# Needs root, buildah and debootstrap (Debian packages). Set BASE=<image> to use an existing base instead.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VERSION=$(python3 -c "import tomllib,sys;print(tomllib.load(open('$ROOT/pyproject.toml','rb'))['project']['version'])")
TAG=${1:-localhost/deviceplane:$VERSION}
BASE=${BASE:-localhost/deviceplane-base:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}  # works inside containers and without fuse

if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  rootfs=$(mktemp -d /tmp/deviceplane-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  echo "debootstrap bookworm into $rootfs" >&2
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$MIRROR" >&2
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin
  ctr=$(buildah from scratch)
  mnt=$(buildah mount "$ctr")
  tar -C "$rootfs" -cf - . | tar -C "$mnt" -xf -
  buildah umount "$ctr" >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/sh "$ctr"
  buildah commit --rm "$ctr" "$BASE" >&2
fi
# The build's RUN steps reach PyPI with the build machine's CA bundle (mounted, not copied into the image): behind a
# TLS-intercepting proxy the base's own bundle does not verify pypi.org.
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
volumes=()
[ -r "$CA_BUNDLE" ] && volumes+=(--volume "$CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro")
# chroot isolation and host networking: no runc/netavark setup needed on the build machine.
buildah bud --isolation chroot --network host "${volumes[@]}" --build-arg "BASE=$BASE" -t "$TAG" "$ROOT" >&2
echo "$TAG"
