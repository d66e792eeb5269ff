#!/usr/bin/env bash
# The whole eagle3 pipeline on the built-in trained tiny pair (no network, CPU only): a tiny
# Kimi-K2.5 target pre-trained on GSM8K and the EAGLE-3 draft trained for it with
# `eagle3 train-draft`, so speculation is accepted and pays off (docs/trained_target.md).
set -euo pipefail
OUT=${OUT:-demo-out}
rm -rf "$OUT"
TARGET=kimi-k2.5-trained
DRAFT=${DRAFT:-kimi-k2.5-trained-eagle3}   # or kimi-k2.5-trained-eagle3.1-mla (the MLA EAGLE-3.1 draft)
echo "== make-tiny: the trained tiny Kimi-K2.5 (Moonshot's layout, INT4 experts) and its trained drafts"
eagle3 make-tiny "$OUT/tiny" --only "$TARGET" --only kimi-k2.5-trained-eagle3 --only kimi-k2.5-trained-eagle3.1-mla
for d in "$OUT"/tiny/*/; do
  echo "== inspect $d"
  eagle3 inspect "$d"
done
echo "== verify"
eagle3 verify "$OUT/tiny"

echo "== convert: the K2.5 target to its text stack in bf16, the draft to the eagle3 layout"
eagle3 convert "$OUT/tiny/$TARGET" "$OUT/target-bf16" --text-only --dequantize bf16 --quiet
eagle3 convert "$OUT/tiny/$DRAFT" "$OUT/draft" --engine eagle3 --target "$OUT/tiny/$TARGET" --quiet
echo "== quantize: W4A8 target, INT4 draft (AMD Quark export format)"
eagle3 quantize "$OUT/target-bf16" "$OUT/target-w4a8" --recipe w4a8 --quiet
eagle3 quantize "$OUT/draft" "$OUT/draft-int4" --recipe int4-draft --quiet
echo "== vLLM / SGLang / ATOM would serve the pair with:"
for engine in vllm sglang atom; do
  eagle3 serve "$OUT/target-w4a8" --draft "$OUT/draft-int4" --engine "$engine" --tensor-parallel-size 8 --kv-cache-dtype fp8 --dry-run 2>/dev/null
done
# GSM8K: the copy eagle3 ships (no Hub), or GSM8K_DIR (a directory with train.jsonl + test.jsonl).
DATASET=()
if [ -n "${GSM8K_DIR:-}" ] && [ -f "$GSM8K_DIR/test.jsonl" ]; then DATASET=(--dataset "$GSM8K_DIR"); fi
# 5-shot, as lm-eval's gsm8k (~1,600-token prompts with the tiny tokenizer); k = 3 draft tokens per step.
# --reference: the W4A8 target against its source (the trained INT4 target): the source is served first
# and its greedy tokens and top-20 logprobs recorded, then the W4A8 target is validated and teacher-forced
# through them (KLD, top-1 agreement, first divergence, answer flips, acceptance on source vs W4A8).
echo "== serve --validate gsm8k --reference: W4A8 target + INT4 draft against the source, then without speculation"
eagle3 serve "$OUT/target-w4a8" --draft "$OUT/draft-int4" --validate gsm8k --num-speculative-tokens 3 \
  --reference "$OUT/tiny/$TARGET" --record-reference "$OUT/gsm8k_reference.jsonl.gz" \
  --limit "${LIMIT:-6}" --num-fewshot "${FEWSHOT:-5}" --max-tokens "${MAX_TOKENS:-96}" --concurrency "${CONCURRENCY:-1}" \
  "${DATASET[@]}" --report "$OUT/gsm8k_report.json"
echo "   note on exact_match: the tiny target (a few million parameters) is far too small to solve GSM8K, so"
echo "   an accuracy of 0 is expected here (and no answer can flip). What the demo shows is the acceptance rate"
echo "   and mean accept length, the speedup over the same target without speculation, the lossless check"
echo "   (PASS), and how far W4A8 moved the model from its source (KLD, top-1 agreement, first divergence)."
# A second workload: MT-Bench (the questions ship inside eagle3), through the model's chat template, one
# question per category, both turns (the second after the model's own first answer), acceptance per category.
echo "== serve --validate mtbench: the same pair on chat traffic (one MT-Bench question per category, two turns)"
eagle3 serve "$OUT/target-w4a8" --draft "$OUT/draft-int4" --validate mtbench --num-speculative-tokens 3 \
  --limit "${MTBENCH_LIMIT:-1}" --max-tokens "${MTBENCH_MAX_TOKENS:-32}" --report "$OUT/mtbench_report.json"
echo "   the draft was trained on GSM8K answers only: on chat it is accepted less (compare the mean accept"
echo "   lengths above), as real drafts are (a K2.5 EAGLE-3 draft's card: GSM8K 3.20, MT-Bench 2.69)."
echo "== done: $OUT/gsm8k_report.json, $OUT/gsm8k_report.png, $OUT/mtbench_report.json, $OUT/mtbench_report.png,"
echo "   $OUT/gsm8k_reference.jsonl.gz (the source's recording: compare another target with --reference FILE)"
