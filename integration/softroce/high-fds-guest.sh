#!/usr/bin/env bash
# The guest side of test-high-fds.sh: high-fds-guest.sh HIGH_FDS_EXE LIBSANDIRECT.
set -euo pipefail
exe=$1 lib=$2
ulimit -Hn 200000
ulimit -n 200000
export SANDIRECT_STAT_DIR=/tmp/sandirect-stat SANDIRECT_SHM_DIR=/dev/shm/sandirect-segments
mkdir -m 700 -p "$SANDIRECT_STAT_DIR" "$SANDIRECT_SHM_DIR"
native=$("$exe" 70000 4)
preloaded=$(LD_PRELOAD="$lib" "$exe" 70000 4)
echo "--- native"; echo "$native"
echo "--- preloaded"; echo "$preloaded"
fail=0
grep -qx "lowest socket fd: 70000" <<<"$preloaded" || { echo "FAIL: sockets not from fd 70000 on"; fail=1; }
[[ "$(grep -v '^paths:' <<<"$native")" == "$(grep -v '^paths:' <<<"$preloaded")" ]] ||
  { echo "FAIL: preloaded output differs from native"; fail=1; }
grep -qx "paths: tcp tcp tcp tcp tcp tcp tcp tcp" <<<"$native" || { echo "FAIL: native paths"; fail=1; }
grep -qx "paths: san-shm san-shm san-shm san-shm san-shm san-shm san-shm san-shm" <<<"$preloaded" ||
  { echo "FAIL: not every connection on the SAN"; fail=1; }
[[ $fail == 0 ]] && echo "high fds: ok"
exit "$fail"
