"""Wall time of tree steps against the chain through ``LLM`` on the CPU (torch reference, eager).

Generates the trained tiny pair's GSM8K-style questions greedily with the chain (k = S) and with
each tree shape ``K,S,N`` and each draft, and reports per configuration the best of ``--repeats``
generations (seconds, output tokens per second, mean accepted tokens per verify). A cost check
for changes to the tree path (run it on both commits, on the same quiet machine): CPU reference
kernels, not a speed measurement of trees on a GPU. JSON to stdout.

    eagle3 make-tiny ./tiny --only kimi-k2.5-trained --only kimi-k2.5-trained-eagle3 \\
        --only kimi-k2.5-trained-eagle3.1-mla
    .venv/bin/python benchmarks/tree_step_time.py ./tiny/kimi-k2.5-trained \\
        --drafts ./tiny/kimi-k2.5-trained-eagle3 ./tiny/kimi-k2.5-trained-eagle3.1-mla --shapes 4,3,16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _shape(text: str) -> tuple[int, int, int]:
    k, s, n = (int(x) for x in text.split(","))
    return k, s, n


def _best_time(make_llm, prompts: list[list[int]], params, repeats: int) -> dict[str, float]:
    """Best wall time of ``repeats`` generations, each on a fresh engine after a short warm-up."""
    from eagle3.runtime.sampling import SamplingParams

    best, tokens, accept = float("inf"), 0, 0.0
    for _ in range(repeats):
        llm = make_llm()
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        best = min(best, time.perf_counter() - t0)
        tokens = sum(len(o.token_ids) for o in outs)
        accept = llm.stats.mean_acceptance_length
    return {"s": round(best, 3), "tok_per_s": round(tokens / best, 1), "accept": round(accept, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("--drafts", nargs="+", type=Path, required=True)
    ap.add_argument("--shapes", nargs="+", type=_shape, default=[(4, 3, 16)])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from eagle3.runtime.engine.llm import LLM
    from eagle3.runtime.sampling import SamplingParams
    from eagle3.testing import tiny, trained

    torch.set_num_threads(1)
    tok = tiny.build_tokenizer()
    prompts = [tok.encode(trained.gsm8k_style_prompt(q)).ids for q in trained.QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = {"num_blocks": 512, "max_num_seqs": 4, "tokenizer": None, "dtype": args.dtype, "block_size": 16}
    steps = args.shapes[0][1]
    runs = []
    for draft in args.drafts:
        configs = [(1, steps, steps + 1)] + list(args.shapes)
        for k, s, n in configs:
            tree = {} if k == 1 else {"speculative_eagle_topk": k, "speculative_num_draft_tokens": n}

            def make(draft: Path = draft, s: int = s, tree: dict = tree) -> LLM:
                return LLM(args.target, draft, num_speculative_tokens=s, **engine, **tree)

            runs.append({"draft": draft.name, "topk": k, "steps": s, "num_draft_tokens": n,
                         **_best_time(make, prompts, params, args.repeats)})
    json.dump({"dtype": args.dtype, "max_tokens": args.max_tokens, "runs": runs}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
