#!/usr/bin/env bash
# bench-rsocket.sh - sandirect side by side with rsocket (rdma-core's librspreload.so) and
# kernel TCP, in one soft-RDMA guest per fabric: ping-pong and streaming
# (bench_sockets with C-style sockets), iperf3 and redis-benchmark, interleaved rounds, the
# median of per-round ratios; and a "runs it?" table (C sockets, Rust std::net, a forked
# client, iperf3, redis) for each system. Only ratios within one run mean anything: the guest
# runs under software emulation (TCG).
#
#   usage: integration/softroce/bench-rsocket.sh [--quick] [rxe] [siw]   (default: rxe)
#
#   --quick   1 short round (a CI-sized proof that the script works, ~4 min per fabric);
#             the default is 4 rounds (~7 min per fabric)
#
# Builds libsandirect.so, libsandirect_verbs.so and bench_sockets (release) on the host; the
# guest runs bench-rsocket-guest.sh; raw figures and logs stay in
# $CARGO_TARGET_DIR/release/bench-rsocket/FABRIC. It prints; a target not met is reported, not
# failed: exit status non-zero only if the build or a guest run failed.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"
quick=(); fabrics=()
for arg in "$@"; do
  case "$arg" in
    --quick) quick=(--quick) ;;
    rxe|siw) fabrics+=("$arg") ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "bench-rsocket: unknown argument $arg" >&2; exit 2 ;;
  esac
done
[[ ${#fabrics[@]} -gt 0 ]] || fabrics=(rxe)

t0=$(date +%s)
# rsocket's preload comes with Debian's librdmacm1 (run-in-vm.sh installs it for the guest).
rspreload=$(dpkg -L librdmacm1 2>/dev/null | grep '/librspreload\.so$' | head -n 1 || true)
# (Separate calls: `--bin` would restrict every selected package to that binary.)
cargo build --release ${CARGO_BUILD_FLAGS:-} -p sandirect-preload -p san-verbs >&2
cargo build --release ${CARGO_BUILD_FLAGS:-} -p integration --bin bench_sockets >&2
target=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
profile=$(realpath "$target/release")
[[ -x "$profile/bench_sockets" && -f "$profile/libsandirect.so" && -f "$profile/libsandirect_verbs.so" ]] ||
  { echo "bench-rsocket: build products missing in $profile" >&2; exit 1; }
echo "bench-rsocket: built in $(( $(date +%s) - t0 )) s"
case "$profile" in
  "$ROOT"/*) ;;
  *) export SANDIRECT_VM_SHARE="${SANDIRECT_VM_SHARE:+$SANDIRECT_VM_SHARE:}$profile" ;;
esac

rc=0
for fabric in "${fabrics[@]}"; do
  case "$fabric" in rxe) flag=() ;; siw) flag=(--siw) ;; esac
  out="$profile/bench-rsocket/$fabric"
  rm -rf "$out"; mkdir -p "$out"
  start=$(date +%s)
  set +e
  SANDIRECT_RSPRELOAD=${rspreload:-/usr/lib/x86_64-linux-gnu/rsocket/librspreload.so} \
  SANDIRECT_VM_TIMEOUT=${SANDIRECT_VM_TIMEOUT:-$([[ ${#quick[@]} -gt 0 ]] && echo 420 || echo 900)} \
    "$HERE/run-in-vm.sh" "${flag[@]}" -- bash "$HERE/bench-rsocket-guest.sh" "$profile" "$out" "${quick[@]}"
  status=$?
  set -e
  [[ $status == 0 ]] || rc=1
  echo "bench-rsocket: $fabric: $(( $(date +%s) - start )) s (exit $status); raw figures and logs in $out"
done
echo "bench-rsocket: total $(( $(date +%s) - t0 )) s"
exit "$rc"
