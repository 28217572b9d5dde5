#!/usr/bin/env bash
# test-san-verbs.sh - the preload's cross-host SAN path over verbs, inside the soft-RDMA VM,
# over soft-RoCE (rxe) and then soft-iWARP (siw): a preloaded echo pair across the guest's two
# addresses (checksummed stream both ways, the SAN path asserted through the published
# counters), and preloaded/plain mixes that must stay on TCP with the bytes intact.
#
#   usage: integration/softroce/test-san-verbs.sh [rxe] [siw]     (default: both)
#
# Builds libsandirect.so, libsandirect_verbs.so, san_xhost, san_hijack, san_memory, app_stdnet and app_kv
# on the host; the guest runs san-verbs-guest.sh, then san-verbs-memory-guest.sh (the
# registration cache under mapping changes, ENOBUFS under RLIMIT_MEMLOCK). Exit status 0 only if every fabric passed.
# SANDIRECT_SAN_VERBS_BYTES sets the stream size (default 8 MiB).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"
fabrics=("$@"); [[ ${#fabrics[@]} -gt 0 ]] || fabrics=(rxe siw)

t0=$(date +%s)
# (Separate calls: `--bin` would restrict every selected package to that binary.)
cargo build ${CARGO_BUILD_FLAGS:-} -p sandirect-preload -p san-verbs -p sandirect-cli >&2
cargo build ${CARGO_BUILD_FLAGS:-} -p integration --bin san_xhost --bin san_hijack --bin san_memory --bin app_stdnet --bin app_kv >&2
target=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
profile="$target/debug"
[[ -x "$profile/san_xhost" && -x "$profile/san_hijack" && -x "$profile/san_memory" && -x "$profile/app_stdnet" && -x "$profile/app_kv" && -f "$profile/libsandirect.so" && -f "$profile/libsandirect_verbs.so" ]] ||
  { echo "test-san-verbs: build products missing in $profile" >&2; exit 1; }
echo "test-san-verbs: built in $(( $(date +%s) - t0 )) s"
case "$(realpath "$profile")" in
  "$ROOT"/*) ;;
  *) export SANDIRECT_VM_SHARE="${SANDIRECT_VM_SHARE:+$SANDIRECT_VM_SHARE:}$(realpath "$profile")" ;;
esac

total_pass=0; total_fail=0; rc=0
for fabric in "${fabrics[@]}"; do
  case "$fabric" in rxe) flag=() ;; siw) flag=(--siw) ;; *) echo "unknown fabric $fabric" >&2; exit 2 ;; esac
  log=$(mktemp)
  start=$(date +%s)
  set +e
  SANDIRECT_VM_TIMEOUT=${SANDIRECT_VM_TIMEOUT:-600} "$HERE/run-in-vm.sh" "${flag[@]}" -- \
    bash -c 'bash "$1" "$3" "$4"; a=$?; bash "$2" "$3"; b=$?; exit $(( a != 0 || b != 0 ))' guest \
    "$HERE/san-verbs-guest.sh" "$HERE/san-verbs-memory-guest.sh" \
    "$(realpath "$profile")" "${SANDIRECT_SAN_VERBS_BYTES:-8388608}" 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  set -e
  took=$(( $(date +%s) - start ))
  # Both guest scripts' summaries (san-verbs-guest.sh, san-verbs-memory-guest.sh), added up.
  passed=$(sed -n 's/^san-verbs\(-memory\)\{0,1\}: \([0-9]*\) passed, \([0-9]*\) failed.*/\2/p' "$log" | awk '{n += $1} END {print n + 0}')
  failed=$(sed -n 's/^san-verbs\(-memory\)\{0,1\}: \([0-9]*\) passed, \([0-9]*\) failed.*/\3/p' "$log" | awk '{n += $1} END {print n + 0}')
  rm -f "$log"
  passed=${passed:-0}; failed=${failed:-0}
  [[ $status == 0 || $failed != 0 ]] || failed=1
  [[ $status == 0 ]] || rc=1
  echo "test-san-verbs: $fabric: $passed passed, $failed failed, ${took} s (exit $status)"
  total_pass=$((total_pass + passed)); total_fail=$((total_fail + failed))
done
echo "test-san-verbs: total $(( $(date +%s) - t0 )) s"
echo "san-verbs: $total_pass passed, $total_fail failed"
exit "$rc"
