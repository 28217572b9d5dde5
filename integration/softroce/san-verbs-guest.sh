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

# run_case NAME SERVER_PRELOADED CLIENT_PRELOADED EXPECTED_PATH [CLIENT_WRITE_SIZE]
# (a 4 MiB write size makes the client's sends rendezvous transfers: asserted by counters)
run_case() {
  local name=$1 spre=$2 cpre=$3 want=$4 chunk=${5:-24000} sv=() cv=() start took port out sout
  [[ $spre == 1 ]] && sv=("${pre[@]}")
  [[ $cpre == 1 ]] && cv=("${pre[@]}")
  start=$(date +%s.%N)
  timeout 120 "${sv[@]}" "$X" server "$S" >"$LOGS/$name.server.out" 2>"$LOGS/$name.server.err" &
  local srv_pid=$!
  for _ in $(seq 600); do grep -q '^port ' "$LOGS/$name.server.out" 2>/dev/null && break; sleep 0.1; done
  port=$(sed -n 's/^port //p' "$LOGS/$name.server.out")
  [[ -n $port ]] || { echo "san-verbs: $name FAIL (server did not start)"; cat "$LOGS/$name.server.err"; fail=$((fail+1)); kill "$srv_pid" 2>/dev/null; return; }
  out=$(timeout 120 "${cv[@]}" "$X" client "$S:$port" "$C" "$BYTES" "$chunk" 2>"$LOGS/$name.client.err"); local crc=$?
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
  local cpath spath csan ssan
  cpath=$(sed -n 's/.* path=\([^ ]*\).*/\1/p' <<<"$out"); spath=$(sed -n 's/.* path=\([^ ]*\).*/\1/p' <<<"$sout")
  csan=$(sed -n 's/.* san=\([0-9]*\)\/\([0-9]*\).*/\1 \2/p' <<<"$out"); ssan=$(sed -n 's/.* san=\([0-9]*\)\/\([0-9]*\).*/\1 \2/p' <<<"$sout")
  [[ $cpre == 0 || $cpath == "$want" ]] || ok=0
  [[ $spre == 0 || $spath == "$want" ]] || ok=0
  # The counters say where the bytes went: all of the stream over the SAN, or none of it.
  local cs_ cr_ ss_ sr_; read -r cs_ cr_ <<<"${csan:-0 0}"; read -r ss_ sr_ <<<"${ssan:-0 0}"
  if [[ $want == san-verbs ]]; then
    (( cs_ >= BYTES && cr_ >= BYTES && ss_ >= BYTES && sr_ >= BYTES )) || ok=0
    if (( chunk >= 1048576 )); then
      # Large blocking sends: most of the client's stream went by rendezvous (RDMA).
      local crdv; crdv=$(sed -n 's/.* rdv=\([0-9]*\)\/.*/\1/p' <<<"$out")
      (( ${crdv:-0} >= BYTES / 2 )) || ok=0
    fi
  else
    (( cs_ + cr_ + ss_ + sr_ == 0 )) || ok=0
  fi
  if [[ $ok == 1 ]]; then
    echo "san-verbs: $name ok (client ${out#* checksum=* } | server ${sout#* checksum=* }; $BYTES bytes each way, ${took} s)"
    pass=$((pass+1))
  else
    echo "san-verbs: $name FAIL (client rc=$crc: $out | server rc=$src: $sout, want $want)"
    echo "--- client stderr"; tail -n 40 "$LOGS/$name.client.err"
    echo "--- server stderr"; tail -n 40 "$LOGS/$name.server.err"
    fail=$((fail+1))
  fi
}

# death_case NAME VICTIM(server|client): a preloaded flood client and sink server; once
# bytes flow over the SAN, kill -9 the victim; the survivor must stop within 15 s (EOF or
# ECONNRESET, never a hang).
death_case() {
  local name=$1 victim=$2 port spid cpid survivor start took
  # No `timeout` wrapper: $! must be the program itself (env execs it) for kill -9 to hit
  # it; both are killed below if still running.
  "${pre[@]}" "$X" sink "$S" >"$LOGS/$name.server.out" 2>"$LOGS/$name.server.err" &
  spid=$!
  for _ in $(seq 600); do grep -q '^port ' "$LOGS/$name.server.out" 2>/dev/null && break; sleep 0.1; done
  port=$(sed -n 's/^port //p' "$LOGS/$name.server.out")
  "${pre[@]}" "$X" flood "$S:$port" "$C" >"$LOGS/$name.client.out" 2>"$LOGS/$name.client.err" &
  cpid=$!
  # Until the client switched (set-up under emulation: up to a few seconds), then a moment
  # of SAN traffic.
  local switched=0
  for _ in $(seq 75); do grep -q "SAN client switched" "$LOGS/$name.client.err" && { switched=1; break; }; sleep 0.2; done
  sleep 1
  if [[ $victim == server ]]; then kill -9 "$spid"; survivor=$cpid; else kill -9 "$cpid"; survivor=$spid; fi
  start=$(date +%s.%N)
  local waited=0
  while kill -0 "$survivor" 2>/dev/null && (( waited < 150 )); do sleep 0.1; waited=$((waited+1)); done
  took=$(echo "$(date +%s.%N) - $start" | bc)
  local how; how=$(cat "$LOGS/$name.server.out" "$LOGS/$name.client.out" | grep stopped)
  kill -9 "$spid" "$cpid" 2>/dev/null
  wait "$spid" "$cpid" 2>/dev/null
  if [[ $switched == 1 ]] && (( waited < 150 )) && [[ -n $how ]]; then
    echo "san-verbs: $name ok ($how after ${took} s)"
    pass=$((pass+1))
  else
    echo "san-verbs: $name FAIL (switched=$switched, survivor still running=$(( waited >= 150 )), '$how', ${took} s)"
    echo "--- client stderr"; tail -n 30 "$LOGS/$name.client.err"
    echo "--- server stderr"; tail -n 30 "$LOGS/$name.server.err"
    kill -9 "$survivor" 2>/dev/null
    fail=$((fail+1))
  fi
}

run_case preloaded-pair 1 1 san-verbs
run_case preloaded-client-plain-server 0 1 tcp
run_case plain-client-preloaded-server 1 0 tcp
# The pair again: a fresh server process has no negative-cache entry.
run_case preloaded-pair-again 1 1 san-verbs
# Large blocking sends: the rendezvous (READ or WRITE mode per device) and the registration
# cache of the verbs domain.
run_case preloaded-pair-rendezvous 1 1 san-verbs 4194304
# iperf3 -P 2 across the two addresses, both preloaded: a control connection and two data
# streams (nonblocking sockets, select()). While it runs `sandirect stat` must show the
# streams on SAN-verbs with SAN bytes moving; iperf3 must finish with bytes received.
iperf3_case() {
  local name=iperf3-P2 srv cli stat rc rows
  command -v iperf3 >/dev/null || { echo "san-verbs: $name skipped (no iperf3)"; return; }
  timeout 120 "${pre[@]}" iperf3 -s -B "$S" -p 5301 -1 >"$LOGS/$name.server.out" 2>"$LOGS/$name.server.err" &
  srv=$!
  # (iperf3's stdout is a buffered file here: wait for the listening socket instead)
  for _ in $(seq 100); do [[ -n $(ss -Hltn "sport = :5301") ]] && break; sleep 0.2; done
  timeout 120 "${pre[@]}" iperf3 -c "$S" -B "$C" -p 5301 -P 2 -t 8 -J >"$LOGS/$name.client.json" 2>"$LOGS/$name.client.err" &
  cli=$!
  # Sample `sandirect stat` until the streams show up (the programs start slowly under
  # emulation), at most while the client runs.
  for _ in $(seq 40); do
    sleep 0.5
    "$T/sandirect" stat >"$LOGS/$name.stat" 2>&1
    (( $(awk '$7 == "SAN-verbs" && $10 > 0' "$LOGS/$name.stat" | wc -l) >= 4 )) && break
    kill -0 "$cli" 2>/dev/null || break
  done
  wait "$cli"; rc=$?
  wait "$srv"
  rows=$(grep -c "SAN-verbs" "$LOGS/$name.stat")
  local moved; moved=$(awk '$7 == "SAN-verbs" && $10 > 0' "$LOGS/$name.stat" | wc -l)
  local received; received=$(sed -n '/"sum_received"/,/}/s/.*"bytes":[[:space:]]*\([0-9]*\).*/\1/p' "$LOGS/$name.client.json" | head -n 1)
  if [[ $rc == 0 && ${received:-0} -gt 0 && $rows -ge 6 && $moved -ge 4 ]]; then
    echo "san-verbs: $name ok ($rows SAN-verbs rows in sandirect stat, $moved moving SAN bytes; $received bytes received)"
    pass=$((pass+1))
  else
    echo "san-verbs: $name FAIL (client rc=$rc, received=${received:-?}, SAN-verbs rows=$rows, moving=$moved)"
    cat "$LOGS/$name.stat"; tail -n 20 "$LOGS/$name.client.err" "$LOGS/$name.server.err" "$LOGS/$name.server.out"
    fail=$((fail+1))
  fi
}
iperf3_case

# redis-server and redis-benchmark (an unbound client: the preload binds it to the route's
# source address before the SYN), both preloaded: while the benchmark runs, sandirect stat
# must show its connections on SAN-verbs with SAN bytes moving; every request must complete.
redis_case() {
  local name=redis-benchmark srv rc rows moved
  command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null ||
    { echo "san-verbs: $name skipped (no redis)"; return; }
  "${pre[@]}" redis-server --bind "$S" --port 6390 --protected-mode no --save "" --appendonly no \
    >"$LOGS/$name.server.out" 2>"$LOGS/$name.server.err" &
  srv=$!
  for _ in $(seq 100); do [[ -n $(ss -Hltn "sport = :6390") ]] && break; sleep 0.2; done
  timeout 120 "${pre[@]}" redis-benchmark -h "$S" -p 6390 -c 4 -n 4000 -t set,get -q \
    >"$LOGS/$name.client.out" 2>"$LOGS/$name.client.err" &
  local cli=$!
  sleep 4
  "$T/sandirect" stat >"$LOGS/$name.stat" 2>&1
  wait "$cli"; rc=$?
  kill "$srv" 2>/dev/null; wait "$srv" 2>/dev/null
  rows=$(grep -c "SAN-verbs" "$LOGS/$name.stat")
  moved=$(awk '$7 == "SAN-verbs" && $10 > 0' "$LOGS/$name.stat" | wc -l)
  local done_; done_=$(tr '\r' '\n' <"$LOGS/$name.client.out" | grep -c "requests per second")
  if [[ $rc == 0 && $done_ -ge 2 && $rows -ge 2 && $moved -ge 2 ]]; then
    echo "san-verbs: $name ok ($rows SAN-verbs rows, $moved moving; $(tr '\r' '\n' <"$LOGS/$name.client.out" | grep "requests per second" | tr '\n' ' '))"
    pass=$((pass+1))
  else
    echo "san-verbs: $name FAIL (rc=$rc, results=$done_, SAN-verbs rows=$rows, moving=$moved)"
    cat "$LOGS/$name.stat"; tail -n 20 "$LOGS/$name.client.out" "$LOGS/$name.client.err" "$LOGS/$name.server.err"
    fail=$((fail+1))
  fi
}
# Known problem (not yet in the default run): over verbs redis-benchmark makes progress but at
# ~13 requests/s with ~260 ms per request (a wake-up that only the 239 ms wait slices deliver).
if [[ ${SANDIRECT_SAN_VERBS_REDIS:-0} == 1 ]]; then redis_case; fi

death_case server-killed server
death_case client-killed client
echo "san-verbs: $pass passed, $fail failed"
[[ $fail == 0 ]]
