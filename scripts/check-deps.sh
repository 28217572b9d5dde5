#!/usr/bin/env bash
# Dependency direction, between crates and inside them:
# - the switch is sans-IO: its normal dependency tree must hold no OS or RDMA crate;
# - the module graphs of preload-core and san-verbs have no circle: no file reaches, directly
#   or through others, code of a file that reaches its own (see scripts/check-layering.py).
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

python3 scripts/check-layering.py --self-test
python3 scripts/check-layering.py preload/core/src providers/verbs/src providers/shm/src
