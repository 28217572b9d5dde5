#!/usr/bin/env bash
# Checks that libsandirect.so exports exactly the hook table: the dynamic symbols defined by
# the shared object must equal the inventory generated from the table (`sandirect symbols
# --names`). A symbol exported by accident (or a hook lost from the exports) fails CI.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --quiet -p sandirect-preload -p sandirect-cli
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

# The README's coverage table is the same inventory: it must not drift from the code.
readme_table="$(mktemp)"
generated_table="$(mktemp)"
trap 'rm -f "$expected" "$actual" "$readme_table" "$generated_table"' EXIT
sed -n '/<!-- symbols:begin -->/,/<!-- symbols:end -->/p' README.md | sed '1d;$d' > "$readme_table"
"$target/sandirect" symbols > "$generated_table"
if ! diff -u "$generated_table" "$readme_table"; then
  echo "check-exports: README.md's coverage table differs from 'sandirect symbols' (- generated, + README)" >&2
  echo "check-exports: regenerate it between the symbols:begin/end markers" >&2
  exit 1
fi
echo "check-exports: README coverage table matches the hook table"
