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

if [ "$(id -u)" -ne 0 ]; then
  echo "base-image: debootstrap needs root" >&2
  exit 1
fi
if ! command -v debootstrap >/dev/null 2>&1; then
  echo "base-image: installing debootstrap" >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >&2
fi

rootfs="$(mktemp -d "${TMPDIR:-/var/tmp}/sandirect-rootfs.XXXXXX")"
trap 'rm -rf "$rootfs"' EXIT
echo "base-image: debootstrap bookworm (minbase) from $mirror" >&2
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >&2

# The security suite carries the current Rust toolchain (rustc-web) that the builder stage
# installs, and the fixes a shipped image should have.
security="${mirror%/debian}/debian-security"
cat >"$rootfs/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security bookworm-security main
SOURCES
# What the official Debian images set: no recommends, no docs or man pages beyond the packages'
# own, apt lists removed after each install.
cat >"$rootfs/etc/apt/apt.conf.d/90container" <<'APT'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
APT
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb

echo "base-image: importing as $tag" >&2
tar -C "$rootfs" --numeric-owner -c . |
  docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --message "Debian 12 minbase (debootstrap)" \
    - "$tag" >&2
echo "$tag"
