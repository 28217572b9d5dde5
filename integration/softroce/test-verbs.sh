#!/usr/bin/env bash
# test-verbs.sh - run san-verbs' device tests inside the soft-RDMA VM, over soft-RoCE
# (rxe) and then soft-iWARP (siw), and print one summary line per fabric; then the
# preload's cross-host SAN tests over the same fabrics (test-san-verbs.sh).
#
#   usage: integration/softroce/test-verbs.sh [rxe] [siw]     (default: both)
#
# The test binary is built on the host (cargo test --no-run) and run in the guest with
# --ignored --test-threads=1 (the soft drivers are not made for many concurrent QPs).
# Exit status 0 only if every fabric passed. Extra cargo flags: CARGO_TEST_FLAGS.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"
fabrics=("$@"); [[ ${#fabrics[@]} -gt 0 ]] || fabrics=(rxe siw)

t0=$(date +%s)
# The device tests live in the `device` integration-test binary; its path comes from
# cargo's JSON messages (the hash in the file name changes with the build).
exe=$(cargo test -p san-verbs --test device --no-run --message-format=json ${CARGO_TEST_FLAGS:-} 2>/dev/null |
      sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
[[ -n "$exe" && -x "$exe" ]] || { echo "test-verbs: could not build the device tests" >&2; exit 1; }
echo "test-verbs: built $(realpath --relative-to="$ROOT" "$exe") in $(( $(date +%s) - t0 )) s"
# The guest sees the project directory; a target directory elsewhere (CARGO_TARGET_DIR)
# is shared too (the profile directory: the test binary and libsandirect_verbs.so).
case "$(realpath "$exe")" in
  "$ROOT"/*) ;;
  *) export SANDIRECT_VM_SHARE="${SANDIRECT_VM_SHARE:+$SANDIRECT_VM_SHARE:}$(dirname "$(dirname "$(realpath "$exe")")")" ;;
esac

total_pass=0; total_fail=0; rc=0
for fabric in "${fabrics[@]}"; do
  case "$fabric" in rxe) flag=() ;; siw) flag=(--siw) ;; *) echo "unknown fabric $fabric" >&2; exit 2 ;; esac
  log=$(mktemp)
  start=$(date +%s)
  set +e
  SANDIRECT_VM_TIMEOUT=${SANDIRECT_VM_TIMEOUT:-420} "$HERE/run-in-vm.sh" "${flag[@]}" -- \
    "$exe" --ignored --test-threads=1 --nocapture --skip helper_peer_process 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  set -e
  took=$(( $(date +%s) - start ))
  passed=$(sed -n 's/^test result: .*\. \([0-9]*\) passed; \([0-9]*\) failed.*/\1/p' "$log" | tail -n 1)
  failed=$(sed -n 's/^test result: .*\. \([0-9]*\) passed; \([0-9]*\) failed.*/\2/p' "$log" | tail -n 1)
  rm -f "$log"
  passed=${passed:-0}; failed=${failed:-0}
  # A harness failure (timeout, guest crash) without a libtest summary counts as a failure.
  [[ $status == 0 || $failed != 0 ]] || failed=1
  [[ $status == 0 ]] || rc=1
  echo "test-verbs: $fabric: $passed passed, $failed failed, ${took} s (exit $status)"
  total_pass=$((total_pass + passed)); total_fail=$((total_fail + failed))
done
echo "test-verbs: total $(( $(date +%s) - t0 )) s"
echo "verbs: $total_pass passed, $total_fail failed"
# The preload's cross-host SAN path over the same fabrics (its own summary line).
"$HERE/test-san-verbs.sh" "${fabrics[@]}" || rc=1
exit "$rc"
