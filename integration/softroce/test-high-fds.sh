#!/usr/bin/env bash
# test-high-fds.sh - sockets numbered above 65536 under the preload ("fds >= 65536
# work"), run inside the soft-RDMA QEMU guest: raising RLIMIT_NOFILE past the hard limit
# needs CAP_SYS_RESOURCE, which root has in the guest but not in CI's container.
#
#   usage: integration/softroce/test-high-fds.sh
#
# Builds libsandirect.so and the high_fds program on the host, then in the guest runs
# `high_fds 70000 4` natively and under the preload (listener and 8 connected sockets from
# fd 70000 on, 2 MiB each way per connection, poll, epoll, dup2 to a higher number) and
# checks that both runs print the same, except that every connection under the preload
# is on the SAN. Exit status 0 only if it all held.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"

exe=$(cargo build -p integration --bin high_fds --message-format=json ${CARGO_BUILD_FLAGS:-} 2>/dev/null |
      sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
cargo build -p sandirect-preload ${CARGO_BUILD_FLAGS:-} 2>/dev/null
[[ -n "$exe" && -x "$exe" ]] || { echo "test-high-fds: could not build high_fds" >&2; exit 1; }
lib="$(dirname "$exe")/libsandirect.so"
[[ -f "$lib" ]] || { echo "test-high-fds: no $lib" >&2; exit 1; }
case "$(realpath "$exe")" in
  "$ROOT"/*) ;;
  *) export SANDIRECT_VM_SHARE="${SANDIRECT_VM_SHARE:+$SANDIRECT_VM_SHARE:}$(dirname "$(realpath "$exe")")" ;;
esac
start=$(date +%s)
set +e
SANDIRECT_VM_TIMEOUT=${SANDIRECT_VM_TIMEOUT:-300} "$HERE/run-in-vm.sh" --mode single -- \
  bash "$HERE/high-fds-guest.sh" "$(realpath "$exe")" "$(realpath "$lib")"
status=$?
set -e
echo "test-high-fds: exit $status, $(( $(date +%s) - start )) s"
exit "$status"
