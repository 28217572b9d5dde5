#!/usr/bin/env bash
# Builds sandirect's Debian package with cargo-deb: `sandirect` in /usr/bin, libsandirect.so and
# the verbs provider libsandirect_verbs.so in /usr/lib/sandirect, a commented default rules file
# in /etc/sandirect/rules.conf and a man page made from `sandirect --help` (the metadata is in
# cli/Cargo.toml, [package.metadata.deb]).
#
#   scripts/package.sh [--out DIR]    the .deb goes to DIR (default target/debian); its path
#                                     is the last line printed
#
# Needs what scripts/bootstrap.sh installs, plus cargo-deb (installed at the pinned version
# below when missing) and help2man (from apt when missing).
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO_DEB_VERSION=3.8.0
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    *) echo "package: unknown argument: $1" >&2; exit 2 ;;
  esac
done

if [ -x "$HOME/.cargo/bin/cargo" ]; then export PATH="$HOME/.cargo/bin:$PATH"; fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
if ! command -v help2man >/dev/null 2>&1; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends help2man >/dev/null
fi
if ! cargo deb --version 2>/dev/null | grep -q "$CARGO_DEB_VERSION"; then
  cargo install --locked cargo-deb --version "$CARGO_DEB_VERSION"
fi

target_dir="$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
release="$target_dir/release"

# The three files the package ships, built as a user would.
cargo build --release --locked -p sandirect-cli -p sandirect-preload -p san-verbs

# The man page: help2man's page from `sandirect --help`, and one section per subcommand from
# its own `--help` (what `man sandirect` should answer without a network).
mkdir -p "$release/package"
extra="$release/package/subcommands.h2m"
{
  echo "[COMMANDS]"
  for sub in run stat check-config symbols; do
    echo ".SS \"sandirect $sub\""
    echo ".nf"
    "$release/sandirect" "$sub" --help | sed 's/\\/\\\\/g; s/^\./\\\&./'
    echo ".fi"
  done
  echo "[FILES]"
  echo ".TP"
  echo ".I /usr/lib/sandirect/libsandirect.so"
  echo "the preload that \\fBsandirect run\\fR sets in LD_PRELOAD"
  echo ".TP"
  echo ".I /usr/lib/sandirect/libsandirect_verbs.so"
  echo "the RDMA verbs provider, loaded only on hosts with RDMA devices"
  echo ".TP"
  echo ".I /etc/sandirect/rules.conf"
  echo "the default rules (every connection \\fBboth\\fR); use it with \\fB--config\\fR or SANDIRECT_CONFIG"
  echo "[SEE ALSO]"
  echo "/usr/share/doc/sandirect/README.md: the settings (SANDIRECT_* variables), rules and containers."
} >"$extra"
help2man --no-info --section 1 --name "Sockets Direct for Linux: carry TCP over a SAN, transparently" \
  --include "$extra" --output "$release/package/sandirect.1" "$release/sandirect"
gzip -9n -f "$release/package/sandirect.1"

out="${out:-$target_dir/debian}"
mkdir -p "$out"
deb="$(cargo deb -p sandirect-cli --no-build --output "$out" | tail -n 1)"
echo "$deb"
