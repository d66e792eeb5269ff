"""Held-out loss of smoothed n-gram models of GSM8K, in the tiny tokenizer's tokens: the yardstick
for ``kimi-k2.5-trained``'s held-out loss (docs/trained_target.md). A transformer that does not
beat the bigram line is not using its context.

Counts come from every GSM8K train problem in lm-eval's exemplar format; each test token's
probability is (count(context, token) + 2 p_unigram) / (count(context) + 2), with an add-one
unigram, so no token has probability zero. Run::

    python scripts/ngram_baseline.py --dataset $GSM8K_DIR --heldout 64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagle3.testing import tiny  # noqa: E402
from eagle3.validate import gsm8k  # noqa: E402


def ngram_loss(train: list[list[int]], test: list[list[int]], n: int) -> float:
    ctx: Counter[tuple[int, ...]] = Counter()
    joint: Counter[tuple[tuple[int, ...], int]] = Counter()
    uni: Counter[int] = Counter()
    for s in train:
        for i, t in enumerate(s):
            c = tuple(s[max(0, i - n + 1):i])
            uni[t] += 1
            joint[(c, t)] += 1
            ctx[c] += 1
    total_uni = sum(uni.values())
    nll, count = 0.0, 0
    for s in test:
        for i in range(1, len(s)):
            c, t = tuple(s[max(0, i - n + 1):i]), s[i]
            p_uni = (uni[t] + 1) / (total_uni + tiny.VOCAB_SIZE)
            nll -= math.log((joint[(c, t)] + 2 * p_uni) / (ctx[c] + 2))
            count += 1
    return nll / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", type=Path, default=os.environ.get("GSM8K_DIR"),
                    required=os.environ.get("GSM8K_DIR") is None,
                    help="GSM8K directory with train.jsonl + test.jsonl (default: $GSM8K_DIR)")
    ap.add_argument("--heldout", type=int, default=64, help="GSM8K test problems scored (the first N; train_tiny_kimi.py uses 64)")
    args = ap.parse_args()
    tok = tiny.build_tokenizer()
    train, test = gsm8k.load_dataset(args.dataset)
    tr = [tok.encode(gsm8k.exemplar(d)).ids for d in train]
    te = [tok.encode(gsm8k.exemplar(d)).ids for d in test[: args.heldout]]
    chars = sum(len(gsm8k.exemplar(d)) for d in train) / sum(map(len, tr))
    out = {"chars_per_token": round(chars, 3), "heldout_problems": len(te),
           **{f"{n}-gram_nats_per_token": round(ngram_loss(tr, te, n), 3) for n in (1, 2, 3)}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
