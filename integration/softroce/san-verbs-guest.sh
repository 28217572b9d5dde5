#!/usr/bin/env bash
# san-verbs-guest.sh - runs inside the soft-RDMA guest (see test-san-verbs.sh): the preloaded
# SAN path across the guest's two addresses over verbs, and the mixed pairs that must stay on
# plain TCP. One line per case, then "san-verbs: N passed, M failed".
#
#   usage: san-verbs-guest.sh TARGET_PROFILE_DIR [BYTES]
set -uo pipefail
T=$1; BYTES=${2:-8388608}
S=${SANDIRECT_TEST_SERVER_IP:-192.0.2.1}; C=${SANDIRECT_TEST_CLIENT_IP:-192.0.2.2}
X=$T/san_xhost
LOGS=$(mktemp -d)
pre=(env LD_PRELOAD="$T/libsandirect.so" SANDIRECT_SAN=1 SANDIRECT_SAN_PROVIDER=verbs
     SANDIRECT_VERBS_LIBRARY="$T/libsandirect_verbs.so" SANDIRECT_LOG="${SANDIRECT_LOG:-debug}")
pass=0; fail=0

# run_case NAME SERVER_PRELOADED CLIENT_PRELOADED EXPECTED_PATH
run_case() {
  local name=$1 spre=$2 cpre=$3 want=$4 sv=() cv=() start took port out sout
  [[ $spre == 1 ]] && sv=("${pre[@]}")
  [[ $cpre == 1 ]] && cv=("${pre[@]}")
  start=$(date +%s.%N)
  timeout 120 "${sv[@]}" "$X" server "$S" >"$LOGS/$name.server.out" 2>"$LOGS/$name.server.err" &
  local srv_pid=$!
  for _ in $(seq 600); do grep -q '^port ' "$LOGS/$name.server.out" 2>/dev/null && break; sleep 0.1; done
  port=$(sed -n 's/^port //p' "$LOGS/$name.server.out")
  [[ -n $port ]] || { echo "san-verbs: $name FAIL (server did not start)"; cat "$LOGS/$name.server.err"; fail=$((fail+1)); kill "$srv_pid" 2>/dev/null; return; }
  out=$(timeout 120 "${cv[@]}" "$X" client "$S:$port" "$C" "$BYTES" 2>"$LOGS/$name.client.err"); local crc=$?
  wait "$srv_pid"; local src=$?
  sout=$(grep '^server ' "$LOGS/$name.server.out")
  took=$(echo "$(date +%s.%N) - $start" | bc)
  local ok=1
  [[ $crc == 0 && $src == 0 ]] || ok=0
  [[ $out == "client ok bytes=$BYTES "* ]] || ok=0
  [[ $sout == "server ok bytes=$BYTES "* ]] || ok=0
  # Same bytes both ways: equal checksums (each side checksums what it received).
  local cs=${out#*checksum=}; cs=${cs%% *}; local ss=${sout#*checksum=}; ss=${ss%% *}
  [[ -n $cs && $cs == "$ss" ]] || ok=0
  local cpath=${out##*path=} spath=${sout##*path=}
  cpath=${cpath,,}; spath=${spath,,}
  [[ $cpre == 0 || $cpath == "$want" ]] || ok=0
  [[ $spre == 0 || $spath == "$want" ]] || ok=0
  if [[ $ok == 1 ]]; then
    echo "san-verbs: $name ok (client path=$cpath, server path=$spath, $BYTES bytes each way, ${took} s)"
    pass=$((pass+1))
  else
    echo "san-verbs: $name FAIL (client rc=$crc: $out | server rc=$src: $sout, want $want)"
    echo "--- client stderr"; tail -n 40 "$LOGS/$name.client.err"
    echo "--- server stderr"; tail -n 40 "$LOGS/$name.server.err"
    fail=$((fail+1))
  fi
}

run_case preloaded-pair 1 1 san-verbs
run_case preloaded-client-plain-server 0 1 tcp
run_case plain-client-preloaded-server 1 0 tcp
# The pair again: a fresh server process has no negative-cache entry.
run_case preloaded-pair-again 1 1 san-verbs
echo "san-verbs: $pass passed, $fail failed"
[[ $fail == 0 ]]
