#!/usr/bin/env bash
# Builds sandirect's image (scripts/container/Dockerfile) from the work tree, making the local
# Debian base image first when it is missing (scripts/container/base-image.sh).
#
#   scripts/container/build-image.sh [--target builder] [-t TAG]
#
# The build context is the files git tracks or would track (untracked ones not ignored), so
# target/ and other ignored files never reach the Docker daemon. Unchanged sources reuse every
# cached layer; changed sources rebuild from the `COPY . .` step on (the toolchain layers stay).
# Environment: SANDIRECT_IMAGE (tag, default sandirect:latest), SANDIRECT_BASE_IMAGE.
# Progress goes to stderr; the only line on stdout is the tag.
set -euo pipefail
cd "$(dirname "$0")/../.."

tag="${SANDIRECT_IMAGE:-sandirect:latest}"
target=()
while [ $# -gt 0 ]; do
  case "$1" in
    -t) tag="$2"; shift 2 ;;
    --target) target=(--target "$2"); shift 2 ;;
    *) echo "build-image: unknown argument: $1" >&2; exit 2 ;;
  esac
done

base="$(bash scripts/container/base-image.sh)"
# The image the tag names now: once the tag moves to the new build, it is removed (with the
# untagged layers only it used), so rebuilds do not pile up old images.
previous="$(docker image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)"

# The builder downloads crates over HTTPS: it trusts what this host trusts, so builds behind a
# TLS-inspecting proxy work (only the builder stage sees this file; the image does not).
extra="$(mktemp -d)"
trap 'rm -rf "$extra"' EXIT
host_ca=/etc/ssl/certs/ca-certificates.crt
extra_files=()
if [ -s "$host_ca" ]; then
  mkdir -p "$extra/scripts/container/build-ca"
  cp "$host_ca" "$extra/scripts/container/build-ca/host-ca.crt"
  extra_files=(-C "$extra" scripts/container/build-ca/host-ca.crt)
fi

# Tracked and untracked-but-not-ignored files that exist (a deleted tracked file is skipped),
# in a stable order with fixed owners and times so the context's checksums (and so the cache)
# depend only on contents and modes.
git ls-files -z --cached --others --exclude-standard --deduplicate |
  while IFS= read -r -d '' file; do [ -e "$file" ] && printf '%s\0' "$file"; done |
  tar --null -T - "${extra_files[@]}" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -c |
  docker build -f scripts/container/Dockerfile --build-arg "BASE_IMAGE=$base" \
    "${target[@]}" -t "$tag" - >&2
if [ -n "$previous" ] && [ "$previous" != "$(docker image inspect --format '{{.Id}}' "$tag")" ]; then
  # Refused (and left alone) while a container or another tag still uses it.
  docker image rm "$previous" >/dev/null 2>&1 || true
fi
echo "$tag"
