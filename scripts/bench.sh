#!/usr/bin/env bash
# The benchmark, in release mode: real unmodified programs (redis + redis-benchmark, nginx + wrk,
# redis with 1,000 connections at once (every reply checked), memcached + memcslap, iperf3,
# a node echo server, a Java NIO echo server, connection churn,
# redis -c 1 with both ends on one CPU and beside a CPU hog) and the socket micro-benchmarks, each as kernel TCP vs sandirect (both ends preloaded) vs the
# fallback path (client preloaded, server plain), interleaved over rounds. Per workload it
# prints the median per-round ratio against TCP with its min-max spread, p50/p99 latency and
# CPU time per operation of both ends, writes every round's raw figures as JSON and draws an
# SVG chart of the ratios.
#
#   scripts/bench.sh                   the full run (5 rounds, several minutes)
#   scripts/bench.sh --quick           the short run CI can record (~2-3 minutes)
#   scripts/bench.sh --rounds N        rounds per workload
#   scripts/bench.sh --only redis,nginx  only the workloads whose name contains one of the words
#   scripts/bench.sh --save-baseline   also store this run as the baseline (docs/bench/)
#
# Output: target/bench/bench-{quick,full}.{json,svg}. Each run compares its ratios with the
# committed baseline of its mode (docs/bench/baseline-{quick,full}.json) and prints a
# "warning: regression" line for a ratio whose every round is more than 20% below the
# baseline's median (a "note:" line when only the median is); that never fails the run: the
# exit status is non-zero only when the benchmark cannot build or run at all.
# Programs that are not installed are reported as "skipped: not installed"
# (scripts/bootstrap.sh --bench installs them all).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x "$HOME/.cargo/bin/cargo" ]; then export PATH="$HOME/.cargo/bin:$PATH"; fi

for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
  esac
done

echo "=== building (release)"
cargo build --release --quiet -p sandirect-preload -p sandirect-cli
cargo build --release --quiet -p integration --bin bench --bin bench_sockets
target_dir="${CARGO_TARGET_DIR:-target}"

exec "$target_dir/release/bench" --preload "$target_dir/release/libsandirect.so" \
  --out "$target_dir/bench" "$@"
