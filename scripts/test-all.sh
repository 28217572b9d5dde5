#!/usr/bin/env bash
# Runs every test of sandirect: formatting, lints, unit and property tests, the deterministic
# simulation (SIM_SEEDS seeds, default 1000), the fuzz-corpus replay, the dependency-direction
# and exported-symbol checks, the integration suites, and the benchmark's short mode (figures
# recorded, regressions flagged, never failing on noise). CI runs exactly this (.ci/run).
#
#   scripts/test-all.sh [--containers | --no-containers]
#
# Where a Docker Engine answers, the run also builds the container image and the Debian package
# and tests them in containers (integration/tests/containers.rs, ignored by a plain `cargo
# test`): about 6 minutes on 2 cores the first time, under a minute with every layer cached.
# Where none answers, one line says that stage is skipped and why, and the run goes on.
# --containers makes that stage required (no engine is a failure, told before anything runs);
# --no-containers skips it even where an engine answers.
set -euo pipefail
cd "$(dirname "$0")/.."

# containers: 1 required, 0 where an engine answers, -1 never.
containers=0
for arg in "$@"; do
  case "$arg" in
    --containers) containers=1 ;;
    --no-containers) containers=-1 ;;
    *) echo "test-all: unknown argument: $arg (usage: scripts/test-all.sh [--containers | --no-containers])" >&2; exit 2 ;;
  esac
done

# The Docker Engine that answers (its version), or why none does; fails in the second case.
docker_engine() {
  local version why rc=0
  if ! command -v docker >/dev/null 2>&1; then
    echo "no docker command"
    return 1
  fi
  why="$(mktemp)"
  version="$(timeout 30 docker version --format '{{.Server.Version}}' 2>"$why")" || rc=$?
  if [ "$rc" -eq 0 ] && [ -n "$version" ]; then
    rm -f "$why"
    echo "Docker Engine $version"
    return 0
  fi
  if [ "$rc" -eq 124 ]; then
    echo "\`docker version\` had no answer after 30 s"
  else
    # The client's last line says why (no daemon running, the socket not permitted, ...).
    echo "\`docker version\`: $(sed '/^[[:space:]]*$/d' "$why" | tail -n 1)"
  fi
  rm -f "$why"
  return 1
}
if [ "$containers" -eq 1 ] && ! engine="$(docker_engine)"; then
  echo "test-all: --containers needs a Docker Engine: $engine" >&2
  exit 1
fi

bash scripts/bootstrap.sh --apps
if [ -x "$HOME/.cargo/bin/cargo" ]; then export PATH="$HOME/.cargo/bin:$PATH"; fi

export CARGO_TERM_COLOR=never
export SIM_SEEDS="${SIM_SEEDS:-1000}"

stage() {
  local name="$1"; shift
  local start=$SECONDS
  echo "=== stage: $name"
  "$@"
  echo "=== stage: $name: ok ($((SECONDS - start)) s)"
}

# A test suite that hangs fails its stage after MINUTES (every test bounds its own waits, so
# this catches a harness that waits for ever) instead of holding the run until CI's limit.
bounded() {
  local minutes="$1"; shift
  local rc=0
  timeout --kill-after=30 "$((minutes * 60))" "$@" || rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "test-all: still running after $minutes minutes, stopped: $*" >&2
  fi
  return "$rc"
}

stage "format" cargo fmt --all -- --check
stage "clippy" cargo clippy --workspace --all-targets -- -D warnings
stage "dependency direction" bash scripts/check-deps.sh
stage "docs" env RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
# The cdylibs (libsandirect.so, libsandirect_verbs.so) are what several tests load: build them
# first, as a user would.
stage "build" cargo build --workspace
stage "tests" bounded 30 cargo test --workspace
# The intra-host SAN path is the default, so the stage above ran every application over it
# (each connection between preloaded programs asserted on SAN-shm). Run them once more with it
# turned off, every connection asserted on the interposer's TCP path.
stage "applications with the SAN off" bounded 20 env SANDIRECT_SAN=0 cargo test -p integration --test 'apps_*'
# Every wait while SAN sockets are alive is cut into slices after which all of them are
# serviced: a safety net that would hide a lost wake-up as a 239 ms stall. Run the SAN and
# application suites once more with the slices ten minutes long: every wake-up must come from
# the mirrors, the doorbells and the nudges (a test's own deadline then catches a hang).
stage "SAN without the safety-net wait slices" bounded 30 env SANDIRECT_WAIT_SLICE_MS=600000 cargo test -p integration
if [ -x .ci/check-exports.sh ]; then
  stage "exported symbols" bash .ci/check-exports.sh
fi
# The benchmark's short mode records this run's figures (target/bench/bench-quick.json and
# .svg) and prints a warning for a ratio more than 20% below the committed baseline in every
# round; it fails only when it cannot build or run at all, never on noise.
stage "benchmark, quick (records figures, warns on a regression)" bash scripts/bench.sh --quick
# The container image and the Debian package, built as users build them and tested in containers
# (the tests are ignored by a plain `cargo test`: they take minutes and need an engine).
containers_stage="image and package in containers"
if [ "$containers" -lt 0 ]; then
  echo "=== stage: $containers_stage: skipped (--no-containers)"
elif engine="$(docker_engine)"; then
  echo "test-all: $engine answers"
  stage "$containers_stage" bounded 30 cargo test -p integration --test containers -- --ignored
elif [ "$containers" -eq 1 ]; then
  echo "test-all: --containers needs a Docker Engine: $engine" >&2
  exit 1
else
  echo "=== stage: $containers_stage: skipped, no Docker Engine answers here ($engine)"
fi
# The verbs provider's device tests need an RDMA device: they run inside a nested QEMU guest
# with soft-RoCE (rxe) and then soft-iWARP (siw), which the harness sets up by itself.
stage "verbs over rxe and siw (nested VM)" bash integration/softroce/test-verbs.sh rxe siw
# Two guests, two kernels, one RDMA device each, joined by a virtual link: with no provider
# setting, preloaded redis and iperf3 across them must go over verbs by themselves.
stage "two hosts over rxe and siw, no settings (nested VMs)" bash integration/softroce/test-two-hosts.sh rxe siw
# Descriptor numbers above 65536 need a hard RLIMIT_NOFILE that CI's container cannot raise
# (no CAP_SYS_RESOURCE); root in the same guest can.
stage "descriptors above 65536 (nested VM)" bash integration/softroce/test-high-fds.sh
echo "=== all stages passed"
