#!/usr/bin/env bash
# bench-rsocket-guest.sh - runs inside the soft-RDMA guest (see bench-rsocket.sh): kernel TCP,
# rsocket's preload (librspreload.so) and sandirect over verbs, side by side across the guest's
# two addresses. First a "runs it?" probe of each program under rsocket and sandirect, then
# interleaved rounds of the figures, then the tables (bench-rsocket-table.py).
#
#   usage: bench-rsocket-guest.sh TARGET_PROFILE_DIR OUT_DIR [--quick]
set -uo pipefail
T=$1; OUT=$2; QUICK=${3:-}
HERE=$(cd "$(dirname "$0")" && pwd)
S=${SANDIRECT_TEST_SERVER_IP:-192.0.2.1}; C=${SANDIRECT_TEST_CLIENT_IP:-192.0.2.2}
B=$T/bench_sockets
RSPRELOAD=${SANDIRECT_RSPRELOAD:-/usr/lib/x86_64-linux-gnu/rsocket/librspreload.so}
mkdir -p "$OUT"; LOGS=$OUT/logs; mkdir -p "$LOGS"
RAW=$OUT/raw.txt; RUNS=$OUT/runs.txt; : >"$RAW"; : >"$RUNS"

# Every program runs under `timeout` (LIMIT seconds): a system that cannot run it shows up as a
# hang bounded here (exit 124), not as a stuck benchmark.
if [[ $QUICK == --quick ]]; then
  ROUNDS=${SANDIRECT_BENCH_ROUNDS:-1}; SLICE_MS=150; WARMUP_MS=200; IPERF_SECONDS=2; REDIS_SECONDS=3; LIMIT=20
else
  ROUNDS=${SANDIRECT_BENCH_ROUNDS:-4}; SLICE_MS=300; WARMUP_MS=600; IPERF_SECONDS=3; REDIS_SECONDS=5; LIMIT=30
fi

VARIANTS=(tcp rsocket sandirect)
# (A subset, e.g. SANDIRECT_BENCH_VARIANTS=sandirect, while investigating one system.)
read -ra MEASURED <<<"${SANDIRECT_BENCH_VARIANTS:-${VARIANTS[*]}}"
# sandirect logs at debug level in the probes (their logs explain an outcome), not in the rounds.
SANDIRECT_LOG_LEVEL=debug
# with_variant VARIANT CMD...: runs CMD as that system runs it (nothing preloaded for tcp).
with_variant() {
  local variant=$1; shift
  case $variant in
    tcp) env -u LD_PRELOAD "$@" ;;
    rsocket) env LD_PRELOAD="$RSPRELOAD" "$@" ;;
    sandirect) env LD_PRELOAD="$T/libsandirect.so" SANDIRECT_SAN=1 SANDIRECT_SAN_PROVIDER=verbs \
                 SANDIRECT_VERBS_LIBRARY="$T/libsandirect_verbs.so" \
                 ${SANDIRECT_LOG_LEVEL:+SANDIRECT_LOG=$SANDIRECT_LOG_LEVEL} "$@" ;;
  esac
}

# Packets the RDMA devices sent so far (rxe has counters; siw has none: "n/a").
rdma_packets() {
  rdma statistic show 2>/dev/null | awk '{ for (i = 1; i < NF; i++) if ($i == "sent_pkts") { n += $(i + 1); seen = 1 } }
    END { if (seen) print n; else print "n/a" }'
}
packets_since() { local now; now=$(rdma_packets); [[ $1 == n/a || $now == n/a ]] && echo n/a || echo $((now - $1)); }

# wait_for FILE PATTERN PID: until FILE has a line matching PATTERN (bounded: 30 s, or until
# process PID has ended).
wait_for() {
  for _ in $(seq 300); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    kill -0 "$3" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

# kernel_listener PORT: "yes" when a kernel TCP socket listens on PORT (rsocket's listeners
# live in rdma_cm, not in the kernel's TCP table, on rxe).
kernel_listener() { [[ -n $(ss -Hltn "sport = :$1" 2>/dev/null) ]] && echo yes || echo no; }

# bounded CMD...: runs CMD in the background and waits for it at most LIMIT + 15 s; its exit
# status, or 200 when it is still there (a process stuck in the kernel survives even the
# SIGKILL of `timeout -k`, and waiting for it would stall the whole run).
bounded() {
  "$@" &
  local pid=$!
  for _ in $(seq $(( (LIMIT + 15) * 10 ))); do
    kill -0 "$pid" 2>/dev/null || { wait "$pid"; return; }
    sleep 0.1
  done
  return 200
}

# stop PID: SIGTERM, then up to 3 s to exit (redis-server shuts down, it does not just die).
stop() {
  kill "$1" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$1" 2>/dev/null || wait "$1" 2>/dev/null
}

# leftovers: kills (-9) what a run left behind — a fork child the client's `timeout` does not
# know, a server stuck past its kill — and prints what it was ("" when nothing).
leftovers() {
  local pid found=""
  for pid in $(pgrep -f "^$B |^iperf3 |^redis-server |^redis-benchmark " 2>/dev/null); do
    found+="$(ps -o pid=,stat=,wchan:24=,args= -p "$pid" | tr -s ' ' | cut -c1-80); "
    kill -9 "$pid" 2>/dev/null
  done
  echo "$found"
}

# pair NAME VARIANT CLIENT_ARGS...: one bench_sockets server/client pair; sets PAIR_RC,
# PAIR_OUT (client stdout), PAIR_PACKETS, PAIR_LISTENER, PAIR_SECONDS.
pair() {
  local name=$1 variant=$2; shift 2
  local server_args=(--role server --address "$S")
  [[ " $* " == *" --c-sockets "* ]] && server_args+=(--c-sockets)
  local before; before=$(rdma_packets)
  local start; start=$(date +%s.%N)
  with_variant "$variant" timeout -k 5 "$LIMIT" "$B" "${server_args[@]}" >"$LOGS/$name.server.out" 2>"$LOGS/$name.server.err" &
  local server=$!
  PAIR_LISTENER=n/a; PAIR_OUT=""; PAIR_RC=125; PAIR_QPS=0
  if wait_for "$LOGS/$name.server.out" '^port ' "$server"; then
    local port; port=$(sed -n 's/^port //p' "$LOGS/$name.server.out")
    PAIR_LISTENER=$(kernel_listener "$port")
    # The user queue pairs that exist while the client runs (`rdma resource`; nothing else
    # runs meanwhile): the evidence of an RDMA path on siw too, which has no packet counters.
    # Probes only: a measured round runs alone (under TCG each `rdma` run costs a vCPU for
    # a good part of a second, which a ping-pong pays in its round trip).
    local sampler=
    if [[ $name == probe-* ]]; then
      ( while :; do rdma resource show qp 2>/dev/null | grep -c ' pid '; sleep 0.5; done ) \
        >"$LOGS/$name.qps" &
      sampler=$!
    else
      echo n/a >"$LOGS/$name.qps"
    fi
    bounded with_variant "$variant" timeout -k 5 "$LIMIT" "$B" --role client --address "$S" --port "$port" "$@" \
      >"$LOGS/$name.client.out" 2>"$LOGS/$name.client.err"
    PAIR_RC=$?
    [[ -n $sampler ]] && { kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null; }
    PAIR_QPS=$(sort -n "$LOGS/$name.qps" | tail -n 1)
    PAIR_OUT=$(cat "$LOGS/$name.client.out")
    # What is still running after a client timed out (a fork child, a stuck server), and where.
    [[ $PAIR_RC == 124 || $PAIR_RC == 137 ]] && for pid in $(pgrep -f "$B" 2>/dev/null); do
      echo "still running after the client's limit: $(ps -o pid=,stat=,wchan:24=,args= -p "$pid")"
    done >>"$LOGS/$name.client.err"
  fi
  # The server ends with the session; one the client never reached would wait for the limit.
  for _ in $(seq 50); do kill -0 "$server" 2>/dev/null || break; sleep 0.1; done
  stop "$server"
  PAIR_LEFT=$(leftovers)
  PAIR_PACKETS=$(packets_since "$before")
  PAIR_SECONDS=$(echo "$(date +%s.%N) - $start" | bc)
}

# pair_figures ROUND VARIANT: the socket figures of one pair (C-style sockets, bound source).
pair_figures() {
  local round=$1 variant=$2
  # Each test first runs unmeasured for WARMUP_MS: under TCG a new process's code is
  # translated anew (address-space randomization), which slows its first few hundred
  # milliseconds several-fold, more for a larger code path (bench_sockets' `warm_up`).
  pair "r$round-$variant-sockets" "$variant" --c-sockets --source "$C" --slice-ms "$SLICE_MS" \
    --warmup-ms "$WARMUP_MS" --tests rtt,65536,1048576
  local results; results=$(grep -c '^result ' <<<"$PAIR_OUT")
  if [[ $PAIR_RC != 0 || $results != 3 ]]; then
    echo "round $round: $variant sockets pair failed (exit $PAIR_RC, $results of 3 results)"
    tail -n 5 "$LOGS/r$round-$variant-sockets.client.err"
    return
  fi
  # result CODE SIZE COUNT ELAPSED_NS CLIENT_CPU_NS SERVER_CPU_NS
  awk -v r="$round" -v v="$variant" '$1 == "result" {
      if ($2 == 1) printf "%s %s rtt64 %.3f\n", r, v, $5 / $4 / 1000
      else printf "%s %s stream%s %.3f\n", r, v, $3, $3 * $4 * 1000 / $5
      printf "%s %s cpu-%s %.3f\n", r, v, ($2 == 1 ? "rtt64" : "stream" $3), ($6 + $7) / $4 / 1000
    }' <<<"$PAIR_OUT" >>"$RAW"
  echo "$round $variant path $(sed -n 's/^path //p' <<<"$PAIR_OUT") $PAIR_PACKETS" >>"$RAW"
}

# iperf3_run NAME VARIANT SECONDS: one iperf3 client/server run; sets IPERF_RC, IPERF_MBITS,
# IPERF_PACKETS.
iperf3_run() {
  local name=$1 variant=$2 seconds=$3 port=$((5400 + RANDOM % 500))
  local before; before=$(rdma_packets)
  with_variant "$variant" timeout -k 5 "$LIMIT" iperf3 -s -B "$S" -p "$port" -1 --forceflush \
    >"$LOGS/$name.server.out" 2>"$LOGS/$name.server.err" &
  local server=$!
  IPERF_RC=125; IPERF_MBITS=""
  if wait_for "$LOGS/$name.server.out" 'Server listening' "$server"; then
    bounded with_variant "$variant" timeout -k 5 "$LIMIT" iperf3 -c "$S" -B "$C" -p "$port" -t "$seconds" -O 1 -J \
      >"$LOGS/$name.client.json" 2>"$LOGS/$name.client.err"
    IPERF_RC=$?
    IPERF_MBITS=$(/usr/bin/python3 -c 'import json,sys
try: print("%.1f" % (json.load(open(sys.argv[1]))["end"]["sum_received"]["bits_per_second"] / 1e6))
except Exception: pass' "$LOGS/$name.client.json")
  fi
  # A server that never got its test ends at the limit; do not wait that long for it.
  stop "$server"
  IPERF_LEFT=$(leftovers)
  IPERF_PACKETS=$(packets_since "$before")
}

# redis_run NAME VARIANT SECONDS: redis-server and a redis-benchmark SET load (4 clients) for
# SECONDS; the rate is the mean of the benchmark's 250 ms rates over the second half of the
# window (connection set-up excluded). Sets REDIS_RC, REDIS_RPS, REDIS_PACKETS.
redis_run() {
  local name=$1 variant=$2 seconds=$3 port=$((6400 + RANDOM % 500))
  local before; before=$(rdma_packets)
  with_variant "$variant" timeout -k 5 "$LIMIT" redis-server --bind "$S" --port "$port" --protected-mode no \
    --save "" --appendonly no >"$LOGS/$name.server.out" 2>"$LOGS/$name.server.err" &
  local server=$!
  REDIS_RC=125; REDIS_RPS=""
  if wait_for "$LOGS/$name.server.out" 'Ready to accept connections' "$server"; then
    bounded with_variant "$variant" timeout -k 5 -s INT "$seconds" redis-benchmark -h "$S" -p "$port" -c 4 -n 100000000 \
      -t set -q >"$LOGS/$name.client.out" 2>"$LOGS/$name.client.err"
    REDIS_RC=$?
    REDIS_RPS=$(tr '\r' '\n' <"$LOGS/$name.client.out" | sed -n 's/^SET: rps=\([0-9.]*\) .*/\1/p' |
      awk '{ v[NR] = $1 } END { if (NR < 2) exit; for (i = int(NR / 2) + 1; i <= NR; i++) { s += v[i]; n++ } printf "%.1f", s / n }')
  fi
  stop "$server"
  REDIS_LEFT=$(leftovers)
  REDIS_PACKETS=$(packets_since "$before")
}

started=$(date +%s)
echo "bench-rsocket: fabric ${SANDIRECT_VM_FABRIC:-?}, $ROUNDS rounds, slice ${SLICE_MS} ms after ${WARMUP_MS} ms unmeasured, iperf3 ${IPERF_SECONDS} s, redis ${REDIS_SECONDS} s; rsocket = $RSPRELOAD"

# verdict EXIT_OK(0/1) PACKETS [QPS [PATH]]: "yes" when it ran and the RDMA devices carried packets,
# "TCP" when it ran on kernel TCP only, else "no". rxe counts packets; siw does not, and there
# "yes" only means it ran. QPS (user queue pairs sampled while a pair ran) is shown in the detail
# but not trusted: on siw the sampler saw none even for sandirect's SAN-verbs pairs.
verdict() {
  if [[ $1 != 1 ]]; then echo no
  elif [[ ${4:-} == SAN-verbs ]]; then echo yes   # sandirect's own record of the path
  elif [[ $2 == 0 ]]; then echo TCP
  else echo yes; fi
}
hung_note() {
  case $1 in
    124|137) echo " = hung, killed after ${LIMIT} s" ;;
    200) echo " = still there $((LIMIT + 15)) s on, even after SIGKILL (stuck in the kernel)" ;;
  esac
}
positive() { [[ -n $1 ]] && awk -v x="$1" 'BEGIN { exit !(x > 0) }'; }

# ------------------------------------------------------------------ runs it?
# One line per (program, system) in $RUNS: "program|variant|verdict|detail".
runs_it() { echo "$1|$2|$3|$4" >>"$RUNS"; echo "runs it? $1 under $2: $3 ($4)"; }
CAN_SOCKETS=(); CAN_IPERF=(); CAN_REDIS=()
# Kernel TCP runs them all (it is the control, and its probes would cost a minute under TCG).
for variant in "${MEASURED[@]}"; do
  [[ $variant == tcp ]] && { CAN_SOCKETS+=(tcp); CAN_IPERF+=(tcp); CAN_REDIS+=(tcp); }
done
# Every 15 s, what runs and where it waits: the record of a stuck run (the guest's limit ends it).
( while sleep 15; do date +%T; ps -eo pid,ppid,stat,wchan:28,etimes,args --sort=pid | awk '$1 != 2 && $2 != 2'; done ) \
  >"$LOGS/ps-every-15s.txt" 2>&1 &
watcher=$!
trap 'kill "$watcher" 2>/dev/null' EXIT
for variant in "${MEASURED[@]}"; do
  [[ $variant == tcp ]] && continue
  # C-style sockets pair (the figures' program): does it run, and over what?
  pair "probe-$variant-sockets" "$variant" --c-sockets --source "$C" --slice-ms 20 --tests rtt,65536
  detail="exit $PAIR_RC$(hung_note "$PAIR_RC"), $(grep -c '^result ' <<<"$PAIR_OUT")/2 results, path $(sed -n 's/^path //p' <<<"$PAIR_OUT"), kernel listener $PAIR_LISTENER, rdma packets $PAIR_PACKETS, most QPs held ${PAIR_QPS:-0}, ${PAIR_SECONDS%.*} s${PAIR_LEFT:+, still running at the end, killed: $PAIR_LEFT}"
  if [[ $PAIR_RC == 0 ]]; then runs_it "C sockets pair" "$variant" "$(verdict 1 "$PAIR_PACKETS" "$PAIR_QPS" "$(sed -n 's/^path //p' <<<"$PAIR_OUT")")" "$detail"; CAN_SOCKETS+=("$variant")
  else runs_it "C sockets pair" "$variant" no "$detail; $(tail -n 1 "$LOGS/probe-$variant-sockets.client.err")"; fi

  # Rust std::net: SOCK_CLOEXEC sockets, accept4 (a std::net listener; the client socket made
  # as std::net makes it, bound to the client address).
  pair "probe-$variant-stdnet" "$variant" --source "$C" --slice-ms 20 --tests rtt,65536
  detail="exit $PAIR_RC$(hung_note "$PAIR_RC"), $(grep -c '^result ' <<<"$PAIR_OUT")/2 results, path $(sed -n 's/^path //p' <<<"$PAIR_OUT"), kernel listener $PAIR_LISTENER, rdma packets $PAIR_PACKETS, most QPs held ${PAIR_QPS:-0}, ${PAIR_SECONDS%.*} s${PAIR_LEFT:+, still running at the end, killed: $PAIR_LEFT}"
  runs_it "Rust std::net pair" "$variant" "$(verdict "$([[ $PAIR_RC == 0 ]] && echo 1)" "$PAIR_PACKETS" "$PAIR_QPS" "$(sed -n 's/^path //p' <<<"$PAIR_OUT")")" "$detail"

  # A forked client: the first test in the parent, the rest in its fork child.
  pair "probe-$variant-fork" "$variant" --c-sockets --source "$C" --slice-ms 20 --tests rtt,65536,rtt --fork-after-first
  detail="exit $PAIR_RC$(hung_note "$PAIR_RC"), $(grep -c '^result ' <<<"$PAIR_OUT")/3 results, child's path $(sed -n 's/^path //p' <<<"$PAIR_OUT"), rdma packets $PAIR_PACKETS, most QPs held ${PAIR_QPS:-0}, ${PAIR_SECONDS%.*} s${PAIR_LEFT:+, still running at the end, killed: $PAIR_LEFT}"
  if [[ $PAIR_RC == 0 ]]; then runs_it "forked client" "$variant" "$(verdict 1 "$PAIR_PACKETS" "$PAIR_QPS")" "$detail"
  else runs_it "forked client" "$variant" no "$detail; $(grep -v '^$' "$LOGS/probe-$variant-fork.client.err" | tail -n 1)"; fi

  iperf3_run "probe-$variant-iperf3" "$variant" 2
  detail="exit $IPERF_RC$(hung_note "$IPERF_RC"), ${IPERF_MBITS:-no} Mbit/s received, rdma packets $IPERF_PACKETS${IPERF_LEFT:+, still running at the end, killed: $IPERF_LEFT}"
  if [[ $IPERF_RC == 0 ]] && positive "$IPERF_MBITS"; then runs_it iperf3 "$variant" "$(verdict 1 "$IPERF_PACKETS")" "$detail"; CAN_IPERF+=("$variant")
  else runs_it iperf3 "$variant" no "$detail; $(grep -hv '^$' "$LOGS/probe-$variant-iperf3.client.err" "$LOGS/probe-$variant-iperf3.server.err" 2>/dev/null | tail -n 1)"; fi

  redis_run "probe-$variant-redis" "$variant" 4
  detail="benchmark exit $REDIS_RC (124 = stopped at the window's end, as meant), ${REDIS_RPS:-no} SET/s, rdma packets $REDIS_PACKETS${REDIS_LEFT:+, still running at the end, killed: $REDIS_LEFT}"
  if positive "$REDIS_RPS"; then runs_it redis-benchmark "$variant" "$(verdict 1 "$REDIS_PACKETS")" "$detail"; CAN_REDIS+=("$variant")
  else runs_it redis-benchmark "$variant" no "$detail; $(grep -hv '^$' "$LOGS/probe-$variant-redis.client.err" "$LOGS/probe-$variant-redis.server.err" 2>/dev/null | tail -n 1)"; fi
done
echo "bench-rsocket: probes done in $(( $(date +%s) - started )) s"

# ------------------------------------------------------------------ rounds
SANDIRECT_LOG_LEVEL=
can() { local want=$1; shift; for v in "$@"; do [[ $v == "$want" ]] && return 0; done; return 1; }
for round in $(seq "$ROUNDS"); do
  # Rotate the order, so warm-up and drift hit every system alike.
  order=()
  for i in 0 1 2; do order+=("${VARIANTS[$(( (round + i) % 3 ))]}"); done
  for variant in "${order[@]}"; do
    can "$variant" "${CAN_SOCKETS[@]}" && pair_figures "$round" "$variant"
    if can "$variant" "${CAN_IPERF[@]}"; then
      iperf3_run "r$round-$variant-iperf3" "$variant" "$IPERF_SECONDS"
      [[ $IPERF_RC == 0 ]] && positive "$IPERF_MBITS" && echo "$round $variant iperf3 $IPERF_MBITS" >>"$RAW" ||
        echo "round $round: $variant iperf3 failed (exit $IPERF_RC)"
    fi
    if can "$variant" "${CAN_REDIS[@]}"; then
      redis_run "r$round-$variant-redis" "$variant" "$REDIS_SECONDS"
      positive "$REDIS_RPS" && echo "$round $variant redis-set $REDIS_RPS" >>"$RAW" ||
        echo "round $round: $variant redis-benchmark gave no rate (exit $REDIS_RC)"
    fi
  done
  echo "bench-rsocket: round $round done at $(( $(date +%s) - started )) s"
done

/usr/bin/python3 "$HERE/bench-rsocket-table.py" "$RAW" "$RUNS"
echo "bench-rsocket: guest total $(( $(date +%s) - started )) s"
