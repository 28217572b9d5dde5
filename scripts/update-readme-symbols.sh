#!/usr/bin/env bash
# Regenerates README.md's coverage table (between the symbols:begin/end markers) from the hook
# table, through `sandirect symbols`. CI (.ci/check-exports.sh) fails when the two differ.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --quiet -p sandirect-cli
table="$("${CARGO_TARGET_DIR:-target}/debug/sandirect" symbols)"
python3 - "$table" <<'PY'
import sys
table = sys.argv[1]
text = open("README.md").read()
begin, end = "<!-- symbols:begin -->", "<!-- symbols:end -->"
head, rest = text.split(begin, 1)
_, tail = rest.split(end, 1)
open("README.md", "w").write(head + begin + "\n" + table + "\n" + end + tail)
PY
