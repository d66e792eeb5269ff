#!/usr/bin/env bash
# The whole eagle3 pipeline on the built-in tiny models (no network, CPU only).
set -euo pipefail
OUT=${OUT:-demo-out}
rm -rf "$OUT"
echo "== make-tiny: tiny checkpoints in the exact upstream formats"
eagle3 make-tiny "$OUT/tiny"
for d in "$OUT"/tiny/*/; do
  echo "== inspect $d"
  eagle3 inspect "$d"
done
echo "== verify"
eagle3 verify "$OUT/tiny"
