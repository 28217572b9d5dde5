#!/usr/bin/env bash
# Checks that libsandirect.so exports exactly the hook table: the dynamic symbols defined by
# the shared object must equal the inventory generated from the table (`sandirect symbols
# --names`). A symbol exported by accident (or a hook lost from the exports) fails CI.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --quiet --locked -p sandirect-preload -p sandirect-cli
target="${CARGO_TARGET_DIR:-target}/debug"

expected="$(mktemp)"
actual="$(mktemp)"
trap 'rm -f "$expected" "$actual"' EXIT

"$target/sandirect" symbols --names | LC_ALL=C sort > "$expected"
nm -D --defined-only "$target/libsandirect.so" | awk '{ print $3 }' | sed 's/@.*//' | LC_ALL=C sort > "$actual"

if ! diff -u "$expected" "$actual"; then
  echo "check-exports: libsandirect.so exports differ from the hook table (- table, + exported)" >&2
  exit 1
fi
echo "check-exports: $(wc -l < "$actual") symbols, exactly the hook table"
