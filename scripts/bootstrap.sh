#!/usr/bin/env bash
# Installs what building and testing sandirect needs on a Debian 12 machine, and nothing when it
# is already there (every step checks first, so CI and repeated runs pay only a few `command -v`).
#
#   scripts/bootstrap.sh            build + unit-test prerequisites (Rust, a C toolchain)
#   scripts/bootstrap.sh --apps     also the real applications the integration tests drive
#   scripts/bootstrap.sh --bench    the applications, plus node and a JDK for the benchmark
#                                   (scripts/bench.sh); CI's test run does not need them
set -euo pipefail

want_apps=0
want_bench=0
for arg in "$@"; do
  case "$arg" in
    --apps) want_apps=1 ;;
    --bench) want_apps=1; want_bench=1 ;;
    *) echo "bootstrap: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

apt_updated=0
apt_install() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  if [ "$apt_updated" -eq 0 ]; then
    $SUDO apt-get update -qq
    apt_updated=1
  fi
  echo "bootstrap: installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# libclang-dev, libibverbs-dev and librdmacm-dev build the verbs provider (rdma-sys runs bindgen);
# only libsandirect_verbs.so links them, the preload itself loads on hosts without rdma-core.
apt_install ca-certificates build-essential pkg-config iproute2 procps python3 \
  libclang-dev libibverbs-dev librdmacm-dev

# Rust: use the machine's toolchain when there is one (rustup or distribution); otherwise
# Debian 12's security-updated `rustc-web`/`cargo-web` (a current stable release: the plain
# `rustc` package of Debian 12 is 1.63, too old for this workspace).
if [ -x "$HOME/.cargo/bin/cargo" ]; then export PATH="$HOME/.cargo/bin:$PATH"; fi
if ! command -v cargo >/dev/null 2>&1; then
  apt_install rustc-web cargo-web
fi
if ! cargo clippy --version >/dev/null 2>&1 || ! cargo fmt --version >/dev/null 2>&1; then
  if command -v rustup >/dev/null 2>&1; then
    rustup component add clippy rustfmt >/dev/null 2>&1 || true
  else
    apt_install rust-web-clippy rustfmt-web
  fi
fi

if [ "$want_apps" -eq 1 ]; then
  apt_install redis-server redis-tools iperf3 nginx-light memcached libmemcached-tools wrk curl python3
fi

# The benchmark's event-loop echo servers: node (libuv) and a Java NIO selector (javac builds it).
if [ "$want_bench" -eq 1 ]; then
  command -v node >/dev/null 2>&1 || apt_install nodejs
  command -v javac >/dev/null 2>&1 || apt_install default-jdk-headless
fi
