#!/usr/bin/env bash
# Builds the Debian 12 base image that sandirect's Dockerfile and package tests start from,
# without any registry: debootstrap a minbase rootfs and `docker import` it. The result is kept
# under a stable tag and reused when present, so only the first run pays for debootstrap.
#
#   scripts/container/base-image.sh            print the tag, building the image if missing
#   scripts/container/base-image.sh --rebuild  build it again even when the tag exists
#
# Environment: SANDIRECT_BASE_IMAGE (tag, default sandirect/debian-base:12),
# DEBIAN_MIRROR (default http://deb.debian.org/debian).
# Progress goes to stderr; the only line on stdout is the tag.
set -euo pipefail

tag="${SANDIRECT_BASE_IMAGE:-sandirect/debian-base:12}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
rebuild=0
for arg in "$@"; do
  case "$arg" in
    --rebuild) rebuild=1 ;;
    *) echo "base-image: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

if [ "$rebuild" -eq 0 ] && docker image inspect "$tag" >/dev/null 2>&1; then
  echo "$tag"
  exit 0
fi

# debootstrap, and reading the tree it makes, need root: as the other scripts, sudo otherwise.
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if ! sudo -n true 2>/dev/null; then
    echo "base-image: debootstrap needs root (or passwordless sudo)" >&2
    exit 1
  fi
  SUDO="sudo"
fi
if ! command -v debootstrap >/dev/null 2>&1 && [ ! -x /usr/sbin/debootstrap ]; then
  echo "base-image: installing debootstrap" >&2
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends debootstrap >&2
fi

rootfs="$(mktemp -d "${TMPDIR:-/var/tmp}/sandirect-rootfs.XXXXXX")"
trap '$SUDO rm -rf "$rootfs"' EXIT
echo "base-image: debootstrap bookworm (minbase) from $mirror" >&2
$SUDO env PATH="/usr/sbin:/sbin:$PATH" debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >&2

# The security suite carries the current Rust toolchain (rustc-web) that the builder stage
# installs, and the fixes a shipped image should have.
security="${mirror%/debian}/debian-security"
$SUDO tee "$rootfs/etc/apt/sources.list" >/dev/null <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security bookworm-security main
SOURCES
# What the official Debian images set: no recommends, no docs or man pages beyond the packages'
# own, apt lists removed after each install.
$SUDO tee "$rootfs/etc/apt/apt.conf.d/90container" >/dev/null <<'APT'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
APT
$SUDO sh -c 'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/archives/*.deb' sh "$rootfs"

echo "base-image: importing as $tag" >&2
$SUDO tar -C "$rootfs" --numeric-owner -c . |
  docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --message "Debian 12 minbase (debootstrap)" \
    - "$tag" >&2
echo "$tag"
