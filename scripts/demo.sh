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

echo "== convert: the K2.5 target to its text stack in bf16, the EAGLE-3 draft to the eagle3 layout"
eagle3 convert "$OUT/tiny/kimi-k2.5" "$OUT/kimi-k2.5-bf16" --text-only --dequantize bf16 --quiet
eagle3 convert "$OUT/tiny/kimi-k2.5-eagle3" "$OUT/kimi-k2.5-eagle3" --engine eagle3 --target "$OUT/tiny/kimi-k2.5" --quiet
echo "== quantize: W4A8 target, INT4 draft (AMD Quark export format)"
eagle3 quantize "$OUT/kimi-k2.5-bf16" "$OUT/kimi-k2.5-w4a8" --recipe w4a8 --quiet
eagle3 quantize "$OUT/kimi-k2.5-eagle3" "$OUT/kimi-k2.5-eagle3-int4" --recipe int4-draft --quiet
echo "== vLLM / SGLang / ATOM would serve the pair with:"
for engine in vllm sglang atom; do
  eagle3 serve "$OUT/kimi-k2.5-w4a8" --draft "$OUT/kimi-k2.5-eagle3-int4" --engine "$engine" --tensor-parallel-size 8 --kv-cache-dtype fp8 --dry-run 2>/dev/null
done
# GSM8K from GSM8K_DIR, else shared/data/gsm8k beside the clone, else the Hub (openai/gsm8k).
GSM8K_DIR=${GSM8K_DIR:-$(cd "$(dirname "$0")/.." && pwd)/../shared/data/gsm8k}
DATASET=()
if [ -f "$GSM8K_DIR/test.jsonl" ]; then DATASET=(--dataset "$GSM8K_DIR"); fi
# 5-shot by default, as lm-eval's gsm8k (~1,600-token prompts with the tiny tokenizer); FEWSHOT=0 for shorter ones.
echo "== serve --validate gsm8k: W4A8 target + INT4 draft through the OpenAI API, then the same prompts without speculation"
eagle3 serve "$OUT/kimi-k2.5-w4a8" --draft "$OUT/kimi-k2.5-eagle3-int4" --validate gsm8k \
  --limit "${LIMIT:-8}" --num-fewshot "${FEWSHOT:-5}" --max-tokens "${MAX_TOKENS:-32}" --concurrency 8 \
  "${DATASET[@]}" --report "$OUT/gsm8k_report.json"
echo "== done: $OUT/gsm8k_report.json, $OUT/gsm8k_report.png"
