#!/usr/bin/env bash
# The switch is sans-IO: its normal dependency tree must hold no OS or RDMA crate.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(cargo tree -p switch -e normal --prefix none)
bad=$(printf '%s\n' "$tree" | grep -E '^(libc|nix|rdma-sys|rustix|mio|tokio|std) ' || true)
if [ -n "$bad" ]; then
  echo "switch must not depend on OS crates, but its tree contains:" >&2
  printf '%s\n' "$bad" >&2
  exit 1
fi
for crate in switch san-api; do
  tree=$(cargo tree -p "$crate" -e normal --prefix none)
  printf '%s\n' "$tree" | grep -qE '^(libc|rdma-sys) ' && { echo "$crate pulls an OS crate" >&2; exit 1; }
done
echo "switch and san-api depend on no OS crate:"
cargo tree -p switch -e normal
