#!/usr/bin/env bash
# The main job on the embedded default (the intra-host shared-memory SAN): builds sandirect in
# release mode and runs unmodified programs through `sandirect run`, printing which path every
# connection took (SAN-shm, or TCP with the fallback reason) and how fast each variant was
# against kernel TCP, measured side by side in one run. It starts with a short run of the
# switch's session protocol over the simulated fabric, which shows the protocol at work
# (inline vs rendezvous traffic, credits) without any preload involved.
#
#   scripts/demo.sh            about 2 minutes after the build
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --apps
if [ -x "$HOME/.cargo/bin/cargo" ]; then export PATH="$HOME/.cargo/bin:$PATH"; fi

echo "=== 1/2  session protocol over the simulated SAN fabric (switch + san-sim)"
cargo bench --quiet -p switch --bench session_throughput -- --quick

echo
echo "=== 2/2  unmodified programs through 'sandirect run' vs kernel TCP"
bash scripts/bench.sh --quick
