#!/usr/bin/env bash
# test-two-hosts.sh - the preload across two soft-RDMA guests (two kernels, one RDMA device
# each, joined by a QEMU datagram link on 127.0.0.1), with no provider setting: a preloaded
# redis-server and iperf3 server in guest 1, their preloaded clients in guest 2
# (two-hosts-guest.sh). The connections must be on SAN-verbs with SAN bytes moving, and the
# values and bytes intact. One line per case, a summary per fabric, then
# "two-hosts: N passed, M failed"; exit status 0 only if every fabric passed.
#
#   usage: integration/softroce/test-two-hosts.sh [rxe] [siw]     (default: both)
#
# Each guest gets one vCPU (SANDIRECT_VM_SMP, default 1) and 1 GiB (SANDIRECT_VM_MEM): the two
# run side by side. SANDIRECT_TWO_HOSTS_REDIS_N sets redis-benchmark's -n (300);
# SANDIRECT_TWO_HOSTS_KEEP_LOGS=DIR (in the checkout) keeps every program's output, in
# DIR/FABRIC/hostN.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"
fabrics=("$@"); [[ ${#fabrics[@]} -gt 0 ]] || fabrics=(rxe siw)
for fabric in "${fabrics[@]}"; do
  [[ $fabric == rxe || $fabric == siw ]] || { echo "unknown fabric $fabric" >&2; exit 2; }
done

t0=$(date +%s)
# (Separate calls: `--bin` would restrict every selected package to that binary.)
cargo build ${CARGO_BUILD_FLAGS:-} -p sandirect-preload -p san-verbs -p sandirect-cli >&2
cargo build ${CARGO_BUILD_FLAGS:-} -p integration --bin app_kv >&2
target=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
profile=$(realpath "$target/debug")
[[ -x "$profile/app_kv" && -x "$profile/sandirect" && -f "$profile/libsandirect.so" && -f "$profile/libsandirect_verbs.so" ]] ||
  { echo "test-two-hosts: build products missing in $profile" >&2; exit 1; }
echo "test-two-hosts: built in $(( $(date +%s) - t0 )) s"
case "$profile" in
  "$ROOT"/*) ;;
  *) export SANDIRECT_VM_SHARE="${SANDIRECT_VM_SHARE:+$SANDIRECT_VM_SHARE:}$profile" ;;
esac
# What the guests see of the caller's environment: no provider setting reaches them.
unset SANDIRECT_SAN_PROVIDER SANDIRECT_VERBS_LIBRARY SANDIRECT_SAN SANDIRECT_MODE SANDIRECT_CONFIG
export SANDIRECT_VM_SMP=${SANDIRECT_VM_SMP:-1} SANDIRECT_VM_MEM=${SANDIRECT_VM_MEM:-1024}
export SANDIRECT_VM_TIMEOUT=${SANDIRECT_VM_TIMEOUT:-300}

# free_udp_port: a UDP port of 127.0.0.1 nothing is bound to now.
free_udp_port() {
  local port _
  for _ in $(seq 50); do
    port=$(( 40000 + RANDOM % 20000 ))
    [[ -z $(ss -Hlun "sport = :$port") ]] && { echo "$port"; return; }
  done
  echo "test-two-hosts: no free UDP port" >&2; return 1
}

PIDS=()
RUN=""
cleanup() {
  local p; for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  [[ -n $RUN ]] && rm -rf "$RUN"
  true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

keep=${SANDIRECT_TWO_HOSTS_KEEP_LOGS:-}; unset SANDIRECT_TWO_HOSTS_KEEP_LOGS
total_pass=0; total_fail=0; rc=0
for fabric in "${fabrics[@]}"; do
  flag=(); [[ $fabric == siw ]] && flag=(--siw)
  # The meeting place of the two guests: in the checkout, which both share read-write.
  RUN=$(mktemp -d "$target/two-hosts.$fabric.XXXXXX")
  p1=$(free_udp_port); p2=$(free_udp_port)
  while [[ $p2 == "$p1" ]]; do p2=$(free_udp_port); done
  start=$(date +%s)
  PIDS=()
  for host in 1 2; do
    link="$p1:$p2"; [[ $host == 2 ]] && link="$p2:$p1"
    SANDIRECT_TWO_HOSTS_KEEP_LOGS=${keep:+$keep/$fabric} \
      "$HERE/run-in-vm.sh" "${flag[@]}" --mode link --host "$host" --link "$link" -- \
      bash "$HERE/two-hosts-guest.sh" "$profile" "$RUN" >"$RUN/host$host.log" 2>&1 &
    PIDS+=($!)
  done
  status=()
  for p in "${PIDS[@]}"; do set +e; wait "$p"; status+=($?); set -e; done
  PIDS=()
  took=$(( $(date +%s) - start ))
  passed=0; failed=0
  for host in 1 2; do
    sed -n 's/^two-hosts: \([^ ]* \(ok\|FAIL\) .*\)/two-hosts: '"$fabric"': host '"$host"' \1/p' "$RUN/host$host.log"
    p=$(grep -c '^two-hosts: [^ ]* ok ' "$RUN/host$host.log" || true)
    f=$(grep -c '^two-hosts: [^ ]* FAIL ' "$RUN/host$host.log" || true)
    s=${status[$((host - 1))]}
    # A guest that failed without a FAIL line of its own (harness, timeout) is one failure.
    [[ $s == 0 || $f != 0 ]] || f=1
    if [[ $s != 0 ]]; then
      echo "--- host $host (exit $s), its output:"
      grep -v '^two-hosts: [^ ]* ok ' "$RUN/host$host.log" | tail -n 60
    fi
    passed=$((passed + p)); failed=$((failed + f))
  done
  [[ ${status[0]} == 0 && ${status[1]} == 0 ]] || rc=1
  # Six cases in all (two on host 1, four on host 2): fewer ok lines is a failure too.
  (( passed + failed >= 6 )) || { failed=$((failed + 6 - passed - failed)); rc=1; }
  echo "test-two-hosts: $fabric: $passed passed, $failed failed, ${took} s (exit ${status[0]}/${status[1]})"
  total_pass=$((total_pass + passed)); total_fail=$((total_fail + failed))
  rm -rf "$RUN"; RUN=""
done
echo "test-two-hosts: total $(( $(date +%s) - t0 )) s"
echo "two-hosts: $total_pass passed, $total_fail failed"
[[ $total_fail == 0 ]] || rc=1
exit "$rc"
