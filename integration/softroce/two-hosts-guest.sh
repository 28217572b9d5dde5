#!/usr/bin/env bash
# two-hosts-guest.sh - runs inside each of the two guests of test-two-hosts.sh (run-in-vm.sh
# --mode link): host 1 (192.0.2.1) serves a preloaded redis-server and iperf3, host 2
# (192.0.2.2) runs the preloaded clients. No provider setting is given to any program: the
# preload must pick RDMA verbs by itself for a peer on another host reached through an RDMA
# device. One line per case ("two-hosts: NAME ok|FAIL (…)"), then
# "two-hosts: host N: P passed, F failed".
#
#   usage: two-hosts-guest.sh TARGET_PROFILE_DIR RUN_DIR
#
# The guests meet through files in RUN_DIR (in the shared checkout, seen by both): every wait
# for the other guest is bounded, and a guest that gives up says so in a file the other one
# watches, so neither waits out its whole bound for a peer that already failed.
#   a.ready     host 1: redis-server and iperf3 listen
#   b.holding   host 2: its value connections are open and verified, held for host 1 to see
#   a.seen      host 1: it took its `sandirect stat` of them
#   b.iperf-held, a.iperf-seen: the same for the iperf3 stream (host 2 stops its client)
#   a.done, b.done: that host is through (whatever its results); a.failed, b.failed: it
#               stopped early
set -uo pipefail
T=$1; RUN=$2
HOST=${SANDIRECT_VM_HOST:?run by run-in-vm.sh --mode link}
S=${SANDIRECT_TEST_SERVER_IP:-192.0.2.1}; C=${SANDIRECT_TEST_CLIENT_IP:-192.0.2.2}
REDIS_PORT=6390; IPERF_PORT=5301
BENCH_N=${SANDIRECT_TWO_HOSTS_REDIS_N:-300}
LOGS=$(mktemp -d)
# The preload as a user starts it: no provider, library or SAN setting (anything the caller's
# environment carried is dropped), the verbs provider found beside libsandirect.so.
pre=(env -u SANDIRECT_SAN_PROVIDER -u SANDIRECT_VERBS_LIBRARY -u SANDIRECT_SAN -u SANDIRECT_MODE
     -u SANDIRECT_CONFIG LD_PRELOAD="$T/libsandirect.so")
pass=0; fail=0
me=$([[ $HOST == 1 ]] && echo a || echo b)
other=$([[ $HOST == 1 ]] && echo b || echo a)

ok() { echo "two-hosts: $1 ok ($2)"; pass=$((pass+1)); }
bad() {
  local name=$1 detail=$2; shift 2
  echo "two-hosts: $name FAIL ($detail)"
  local f; for f in "$@"; do [[ -s $f ]] && { echo "--- $(basename "$f")"; tail -n 30 "$f"; }; done
  fail=$((fail+1))
}
finish() {
  echo "two-hosts: host $HOST: $pass passed, $fail failed"
  rm -f "$LOGS"/*.fifo
  [[ -n ${SANDIRECT_TWO_HOSTS_KEEP_LOGS:-} ]] && mkdir -p "$SANDIRECT_TWO_HOSTS_KEEP_LOGS/host$HOST" &&
    cp -r "$LOGS"/. "$SANDIRECT_TWO_HOSTS_KEEP_LOGS/host$HOST"/
  [[ $fail == 0 ]]; exit
}
give_up() { touch "$RUN/$me.failed"; finish; }
# However this script ends, the other guest stops waiting for it.
trap 'touch "$RUN/$me.done"' EXIT
# wait_for FILE SECONDS: until FILE exists (true), the other guest is through, or SECONDS pass.
wait_for() {
  local i
  for ((i = 0; i < $2 * 5; i++)); do
    [[ -e $RUN/$1 ]] && return 0
    [[ -e $RUN/$other.failed || -e $RUN/$other.done ]] && return 1
    sleep 0.2
  done
  return 1
}
wait_listening() { local i; for ((i = 0; i < 150; i++)); do [[ -n $(ss -Hltn "sport = :$1") ]] && return 0; sleep 0.2; done; return 1; }
# (Ahead of the programs it watches: on one vCPU a reader that polls before it sleeps could
# otherwise hold the sample off until the stream is over.)
stat_to() { nice -n -10 "$T/sandirect" stat >"$1" 2>&1; }
# rows STAT ROLE ADDR:PORT MIN: rows of a saved `sandirect stat` for connections to (client)
# or accepted at (server) ADDR:PORT that are on SAN-verbs with at least MIN bytes over the SAN
# (inline + rendezvous, both ways as this end counts them).
rows() {
  awk -v role="$2" -v at="$3" -v min="$4" \
    '$4 == role && ((role == "client" && $6 == at) || (role == "server" && $5 == at)) &&
     $7 == "SAN-verbs" && $10 + $11 >= min' "$1" | wc -l
}
# all_rows STAT ROLE ADDR:PORT: every row of such connections, whatever their path.
all_rows() {
  awk -v role="$2" -v at="$3" \
    '$4 == role && ((role == "client" && $6 == at) || (role == "server" && $5 == at))' "$1" | wc -l
}

for knob in SANDIRECT_SAN_PROVIDER SANDIRECT_VERBS_LIBRARY; do
  [[ -z ${!knob:-} ]] || echo "two-hosts: note: $knob is set in the guest; the programs run without it"
done

if [[ $HOST == 1 ]]; then
  # ---------------------------------------------------------------- host 1: the servers
  "${pre[@]}" redis-server --bind "$S" --port "$REDIS_PORT" --protected-mode no --save "" \
    --appendonly no >"$LOGS/redis-server.out" 2>"$LOGS/redis-server.err" &
  redis_pid=$!
  "${pre[@]}" timeout 240 iperf3 -s -1 -B "$S" -p "$IPERF_PORT" >"$LOGS/iperf3-server.out" 2>"$LOGS/iperf3-server.err" &
  iperf_pid=$!
  if ! wait_listening "$REDIS_PORT" || ! wait_listening "$IPERF_PORT"; then
    bad servers-listen "redis-server or iperf3 did not listen" "$LOGS/redis-server.err" "$LOGS/iperf3-server.err"
    kill "$redis_pid" "$iperf_pid" 2>/dev/null
    give_up
  fi
  touch "$RUN/a.ready"
  # The value connections, held open by host 2 until we looked.
  if wait_for b.holding 240; then
    stat_to "$LOGS/values.stat"
    touch "$RUN/a.seen"
    n=$(rows "$LOGS/values.stat" server "$S:$REDIS_PORT" 1)
    all=$(all_rows "$LOGS/values.stat" server "$S:$REDIS_PORT")
    if [[ $n == 4 && $all == 4 ]]; then
      ok server-values-san-verbs "redis-server: the 4 value connections accepted on SAN-verbs with SAN bytes"
    else
      bad server-values-san-verbs "redis-server: $n of $all accepted connections on SAN-verbs with SAN bytes, want 4 of 4" "$LOGS/values.stat" "$LOGS/redis-server.err"
    fi
  else
    bad server-values-san-verbs "host 2 never held its value connections" "$LOGS/redis-server.err"
  fi
  # iperf3: its stream, held by host 2 (its client stopped mid-stream) until we looked.
  best=0; n=0
  if wait_for b.iperf-held 180; then
    stat_to "$LOGS/iperf3.stat"
    touch "$RUN/a.iperf-seen"
    best=$(awk -v at="$S:$IPERF_PORT" '$4 == "server" && $5 == at && $7 == "SAN-verbs" { n = $10 + $11; if (n > m) m = n } END { print m + 0 }' "$LOGS/iperf3.stat")
    n=$(all_rows "$LOGS/iperf3.stat" server "$S:$IPERF_PORT")
  fi
  wait_for b.done 180
  kill "$redis_pid" 2>/dev/null
  wait "$redis_pid" 2>/dev/null
  # iperf3 -s -1 ends with its one test; should the client never have come, it is stopped.
  for ((i = 0; i < 100; i++)); do kill -0 "$iperf_pid" 2>/dev/null || break; sleep 0.2; done
  kill "$iperf_pid" 2>/dev/null
  wait "$iperf_pid"; src=$?
  # Its two connections (control and stream) both on SAN-verbs, the stream's server end with at
  # least 64 KiB over the SAN (more than the control connection ever carries).
  sv=$(rows "$LOGS/iperf3.stat" server "$S:$IPERF_PORT" 0)
  if [[ $src == 0 && $n == 2 && $sv == 2 ]] && (( best >= 65536 )); then
    ok server-iperf3-san-verbs "iperf3 -s: control and stream accepted on SAN-verbs, $best SAN bytes on the stream when held"
  else
    bad server-iperf3-san-verbs "iperf3 -s rc=$src; $sv of $n connections on SAN-verbs (want 2 of 2), SAN bytes on the stream: $best, want >= 65536" "$LOGS/iperf3.stat" "$LOGS/iperf3-server.err"
  fi
  finish
fi

# -------------------------------------------------------------------- host 2: the clients
SP=$S:$REDIS_PORT
if ! wait_for a.ready 240; then
  bad servers-ready "host 1's servers never became ready"
  give_up
fi

# Values: app_kv (the application tests' verifying client) writes 8 values on each of 4
# connections (1 B to 256 KiB) and reads each back on another connection, comparing bytes,
# then holds its connections while both hosts take `sandirect stat`.
rm -f "$LOGS/values.fifo"; mkfifo "$LOGS/values.fifo"
timeout 300 "${pre[@]}" "$T/app_kv" redis "$REDIS_PORT" 4 8 7 "$S" <"$LOGS/values.fifo" \
  >"$LOGS/values.out" 2>"$LOGS/values.err" &
kv_pid=$!
exec 9>"$LOGS/values.fifo"
for ((i = 0; i < 1200; i++)); do
  grep -q '^holding' "$LOGS/values.out" 2>/dev/null && break
  kill -0 "$kv_pid" 2>/dev/null || break
  sleep 0.1
done
stat_to "$LOGS/values.stat"
seen=0
if grep -q '^holding' "$LOGS/values.out"; then
  touch "$RUN/b.holding"
  wait_for a.seen 120 && seen=1
fi
exec 9>&-
wait "$kv_pid"; kv_rc=$?
n=$(rows "$LOGS/values.stat" client "$SP" 1); all=$(all_rows "$LOGS/values.stat" client "$SP")
if [[ $kv_rc == 0 && $n == 4 && $all == 4 && $seen == 1 ]] &&
   grep -q "^holding: 4 connections, wrote and verified 32 values" "$LOGS/values.out"; then
  ok values "app_kv: 32 values written and read back intact; its 4 connections on SAN-verbs with SAN bytes"
else
  bad values "app_kv rc=$kv_rc, $n of $all connections on SAN-verbs with SAN bytes (want 4 of 4), host 1 looked: $seen" \
    "$LOGS/values.out" "$LOGS/values.err" "$LOGS/values.stat"
fi

# redis-cli: three keys set by one client process and read back by another.
set_cmds=""; declare -A want
for k in 1 2 3; do
  want[$k]=$(head -c $((1000 * k)) /dev/urandom | base64 -w0)
  set_cmds+="SET two-hosts:$k ${want[$k]}"$'\n'
done
set_out=$(printf '%s' "$set_cmds" | timeout 120 "${pre[@]}" redis-cli -h "$S" -p "$REDIS_PORT" 2>"$LOGS/redis-cli.err")
got_ok=1
for k in 1 2 3; do
  got=$(timeout 120 "${pre[@]}" redis-cli -h "$S" -p "$REDIS_PORT" GET "two-hosts:$k" 2>>"$LOGS/redis-cli.err")
  [[ $got == "${want[$k]}" ]] || { got_ok=0; echo "key $k: ${#got} bytes back, ${#want[$k]} set" >>"$LOGS/redis-cli.err"; }
done
if [[ $set_out == $'OK\nOK\nOK' && $got_ok == 1 ]]; then
  ok redis-cli "3 keys (1-4 KB) set by one redis-cli and read back intact by three others"
else
  bad redis-cli "SET answered '$(tr '\n' ' ' <<<"$set_out")', values intact: $got_ok" "$LOGS/redis-cli.err"
fi

# redis-benchmark, bounded by -n; `sandirect stat` sampled until its connection shows SAN bytes.
timeout 180 "${pre[@]}" redis-benchmark -h "$S" -p "$REDIS_PORT" -c 1 -n "$BENCH_N" -t set,get -q \
  >"$LOGS/bench.out" 2>"$LOGS/bench.err" &
bench_pid=$!
moved=0
for ((i = 0; i < 600; i++)); do
  stat_to "$LOGS/bench.stat"
  moved=$(rows "$LOGS/bench.stat" client "$SP" 1)
  (( moved >= 1 )) && break
  kill -0 "$bench_pid" 2>/dev/null || break
  sleep 0.1
done
wait "$bench_pid"; brc=$?
results=$(tr '\r' '\n' <"$LOGS/bench.out" | grep -c '^[A-Z]*: [0-9.]* requests per second')
rates=$(tr '\r' '\n' <"$LOGS/bench.out" | sed -n 's/^\([A-Z]*\): \([0-9.]*\) requests per second.*/\1 \2 req\/s/p' | paste -sd, -)
if [[ $brc == 0 && $results == 2 ]] && (( moved >= 1 )); then
  ok redis-benchmark "-n $BENCH_N SET and GET: $rates; its connection on SAN-verbs with SAN bytes while it ran"
else
  bad redis-benchmark "rc=$brc, $results results, SAN-verbs connections with SAN bytes seen: $moved" \
    "$LOGS/bench.out" "$LOGS/bench.err" "$LOGS/bench.stat"
fi

# iperf3, 3 s. Once its stream runs (two connections established: control and stream) and has
# for half a second, the client is stopped (SIGSTOP) while both hosts take `sandirect stat`, then
# let go (SIGCONT): a sample of a 3 s stream under emulation, slow when the machine is busy,
# could otherwise come before the stream or after it. Both connections must be on
# SAN-verbs, the stream with 64 KiB at least over the SAN (more than the control connection
# carries); iperf3 must end well with the server having received bytes, no more than were
# sent. (iperf3's two counts differ by what was still in flight when the server stopped
# counting at the end of the test, over kernel TCP as well: the bytes themselves are compared
# by the value cases above.)
# Nothing but shell builtins from here to the stop: a program started under emulation takes
# about a second (a third of the stream) before it does anything.
rm -f "$LOGS/pause.fifo"; mkfifo "$LOGS/pause.fifo"; exec 7<>"$LOGS/pause.fifo"
pause() { read -r -t "$1" -u 7 _; }
port_hex=$(printf '%04X' "$IPERF_PORT")
# established: how many kernel TCP connections to the iperf3 port are established, in $est.
established() {
  local _sl _local remote state _rest
  est=0
  while read -r _sl _local remote state _rest; do
    [[ $remote == *":$port_hex" && $state == 01 ]] && est=$((est + 1))
  done </proc/net/tcp
}
timeout 120 "${pre[@]}" iperf3 -c "$S" -B "$C" -p "$IPERF_PORT" -t 3 -J >"$LOGS/iperf3.json" 2>"$LOGS/iperf3.err" &
ipid=$!
best=0; n=0; sv=0; held=0; client=""
for ((i = 0; i < 600; i++)); do
  kill -0 "$ipid" 2>/dev/null || break
  established
  (( est >= 2 )) && { held=1; break; }
  pause 0.1
done
# iperf3 itself: `timeout`'s child (env execs it).
[[ -r /proc/$ipid/task/$ipid/children ]] && read -r client _ <"/proc/$ipid/task/$ipid/children"
if [[ $held == 1 && -n $client ]]; then
  pause 0.5
  kill -STOP "$client"
  echo "$SECONDS s: stopped half a second after the stream was established" >"$LOGS/iperf3.hold"
  stat_to "$LOGS/iperf3.stat"
  echo "$SECONDS s: stat taken" >>"$LOGS/iperf3.hold"
  touch "$RUN/b.iperf-held"
  wait_for a.iperf-seen 120
  kill -CONT "$client"
  best=$(awk -v at="$S:$IPERF_PORT" '$4 == "client" && $6 == at && $7 == "SAN-verbs" { n = $10 + $11; if (n > m) m = n } END { print m + 0 }' "$LOGS/iperf3.stat")
  n=$(all_rows "$LOGS/iperf3.stat" client "$S:$IPERF_PORT")
  sv=$(rows "$LOGS/iperf3.stat" client "$S:$IPERF_PORT" 0)
fi
wait "$ipid"; irc=$?
read -r sent received <<<"$(python3 -c '
import json, sys
try:
    end = json.load(open(sys.argv[1]))["end"]
    print(end["sum_sent"]["bytes"], end["sum_received"]["bytes"])
except Exception:
    print(0, -1)' "$LOGS/iperf3.json")"
if [[ $irc == 0 && $n == 2 && $sv == 2 ]] && (( received > 0 && received <= sent && best >= 65536 )); then
  ok iperf3 "-t 3: $sent bytes sent, $received received; control and stream on SAN-verbs, $best SAN bytes on the stream when held"
else
  bad iperf3 "rc=$irc, sent $sent received $received; held: $held, $sv of $n connections on SAN-verbs (want 2 of 2), SAN bytes on the stream $best (want >= 65536)" \
    "$LOGS/iperf3.err" "$LOGS/iperf3.stat" "$LOGS/iperf3.hold"
fi
finish
