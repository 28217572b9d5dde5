#!/usr/bin/env bash
# The first side-by-side benchmark of sandirect (acceptance 17), in release mode:
#   1. bench_sockets: ping-pong RTT and streaming (64 B .. 4 MiB) for kernel TCP, sandirect
#      (both ends preloaded), the fallback path (client preloaded, server plain) and a raw
#      shared-memory ring, interleaved rounds, median per-round ratios against the targets;
#   2. redis-benchmark, TCP vs sandirect (server and client preloaded), interleaved rounds,
#      median ratio of the summed SET+GET throughput (target >= 1.5x).
#
#   scripts/bench.sh                 ~60 s socket benchmark + ~5 redis rounds
#   scripts/bench.sh --quick         ~10 s smoke run + 2 short redis rounds
#   scripts/bench.sh --seconds N     socket benchmark budget
#   scripts/bench.sh --no-redis      skip the redis comparison
#
# The benchmark prints; it never fails a build: a target that is not met is reported as such,
# and only a failure to build or to start the benchmark makes this script exit non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
# The `sandirect` variant measures the intra-host SAN path, the default (SANDIRECT_SAN=0 here
# measures the hooks over TCP instead).
if [ -x "$HOME/.cargo/bin/cargo" ]; then export PATH="$HOME/.cargo/bin:$PATH"; fi

quick=0
seconds=""
redis=1
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --seconds) seconds="${2:?--seconds needs a value}"; shift ;;
    --no-redis) redis=0 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "bench.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

echo "=== building (release)"
cargo build --release --quiet -p sandirect-preload -p sandirect-cli
cargo build --release --quiet -p integration --bin bench_sockets
target_dir="${CARGO_TARGET_DIR:-target}/release"
library="$target_dir/libsandirect.so"
sandirect="$target_dir/sandirect"

scratch="$(mktemp -d "${TMPDIR:-/tmp}/sandirect-bench.XXXXXX")"
chmod 700 "$scratch"
mkdir -m 700 "$scratch/stat" "$scratch/segments"
export SANDIRECT_STAT_DIR="$scratch/stat" SANDIRECT_SHM_DIR="$scratch/segments"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$scratch"
}
trap cleanup EXIT

echo "=== sockets: TCP vs sandirect vs fallback vs raw ring"
bench_args=(--preload "$library")
[ "$quick" -eq 1 ] && bench_args+=(--quick)
[ -n "$seconds" ] && bench_args+=(--seconds "$seconds")
"$target_dir/bench_sockets" "${bench_args[@]}" || echo "bench.sh: bench_sockets failed (see above)"

[ "$redis" -eq 1 ] || exit 0
echo
echo "=== redis-benchmark: TCP vs sandirect"
if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then
  echo "redis comparison skipped: redis-server/redis-benchmark missing (scripts/bootstrap.sh --apps)"
  exit 0
fi

# A loopback port nobody listens on (a refused connection means free).
free_port() {
  local port
  for _ in $(seq 100); do
    port=$((20000 + RANDOM % 30000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then echo "$port"; return 0; fi
  done
  return 1
}
wait_port() {
  for _ in $(seq 200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  return 1
}

redis_args=(--bind 127.0.0.1 --save "" --appendonly no --daemonize no --dir "$scratch")
tcp_port="$(free_port)"
redis-server "${redis_args[@]}" --port "$tcp_port" >"$scratch/redis-tcp.log" 2>&1 &
pids+=($!)
san_port="$(free_port)"
"$sandirect" run redis-server "${redis_args[@]}" --port "$san_port" >"$scratch/redis-san.log" 2>&1 &
pids+=($!)
if ! wait_port "$tcp_port" || ! wait_port "$san_port"; then
  echo "redis comparison skipped: a redis-server did not start"; exit 0
fi

if [ "$quick" -eq 1 ]; then rounds=2; requests=20000; else rounds=5; requests=200000; fi
# Summed requests/s of the SET and GET phases (redis-benchmark --csv: "TEST","RPS",...).
redis_rps() {
  "$@" -h 127.0.0.1 -c 50 -P 16 --threads 2 -t set,get -n "$requests" -q --csv 2>/dev/null \
    | awk -F'"' 'NR > 1 && ($2 == "SET" || $2 == "GET") { sum += $4 } END { printf "%.0f", sum }'
}
# Sample the data path of the preloaded connections while the rounds run.
( while :; do "$sandirect" stat 2>/dev/null | awk 'NR > 1 { print $7 }'; sleep 0.2; done ) \
  >"$scratch/paths" &
pids+=($!)
ratios=()
for round in $(seq "$rounds"); do
  # Alternate which variant goes first, so warm-up and drift hit both alike.
  if [ $((round % 2)) -eq 1 ]; then
    tcp="$(redis_rps redis-benchmark -p "$tcp_port")"
    san="$(redis_rps "$sandirect" run redis-benchmark -p "$san_port")"
  else
    san="$(redis_rps "$sandirect" run redis-benchmark -p "$san_port")"
    tcp="$(redis_rps redis-benchmark -p "$tcp_port")"
  fi
  if [ "${tcp:-0}" -gt 0 ] && [ "${san:-0}" -gt 0 ]; then
    ratio="$(awk -v s="$san" -v t="$tcp" 'BEGIN { printf "%.3f", s / t }')"
    ratios+=("$ratio")
    printf "round %d: TCP %8d req/s   sandirect %8d req/s   ratio %s\n" "$round" "$tcp" "$san" "$ratio"
  else
    echo "round $round: a redis-benchmark run failed (TCP '$tcp', sandirect '$san')"
  fi
done
if [ "${#ratios[@]}" -gt 0 ]; then
  printf "%s\n" "${ratios[@]}" | sort -g | awk '
    { v[NR] = $1 }
    END {
      m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
      printf "redis-benchmark SET+GET (-c 50 -P 16 --threads 2) sandirect/TCP median: %.2f (>= 1.5 %s)\n",
        m, (m >= 1.5) ? "met" : "NOT met"
    }'
fi
path_seen="$(sort -u "$scratch/paths" | tr '\n' ' ')"
echo "data path of the preloaded redis connections (sampled): ${path_seen:-none seen}"
