"""Acceptance of draft trees against the chain, on the CPU, with the reference tree driver.

Runs ``eagle3.runtime.engine.tree_driver.tree_generate`` (one request at a time, torch reference
backend, greedy unless ``--temperature``) for each tree shape ``K,S,N`` (``speculative_eagle_topk``,
``num_speculative_tokens``, ``speculative_num_draft_tokens``; ``1,S,S+1`` is the chain) over the
same prompts and reports the mean acceptance length (tokens per target verify, bonus included),
whether every output equals plain greedy decoding (``--temperature 0``), and the wall time (CPU, reference kernels: not a
speed measurement of trees). JSON to stdout.

Example, on the trained tiny pair (GSM8K-style prompts):

    eagle3 make-tiny ./tiny --only kimi-k2.5-trained kimi-k2.5-trained-eagle3
    .venv/bin/python benchmarks/tree_acceptance.py ./tiny/kimi-k2.5-trained ./tiny/kimi-k2.5-trained-eagle3 \\
        --shapes 1,3,4 2,3,8 4,3,16 4,5,24 --max-tokens 48
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

# the trained pair's GSM8K-style questions (eagle3.testing.trained.QUESTIONS), and one more
EXTRA_QUESTIONS = ("Lisa bakes 36 cookies and packs them into boxes of 4. How many boxes does she fill?",)
NUM_QUESTIONS = 4


def _shape(text: str) -> tuple[int, int, int]:
    k, s, n = (int(x) for x in text.split(","))
    return k, s, n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("draft", type=Path)
    ap.add_argument("--shapes", nargs="+", type=_shape, default=[(1, 3, 4), (2, 3, 8), (4, 3, 16)])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=NUM_QUESTIONS)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sampled decoding (seeded per prompt; 'lossless' then only means 'not checked')")
    args = ap.parse_args(argv)

    from eagle3.runtime.engine.config import EngineConfig
    from eagle3.runtime.engine.llm import LLM
    from eagle3.runtime.engine.model_runner import ModelRunner
    from eagle3.runtime.engine.tree_driver import tree_generate
    from eagle3.runtime.loader import load_draft, load_target
    from eagle3.runtime.sampling import SamplingParams
    from eagle3.testing import tiny, trained

    torch.set_num_threads(1)
    target = load_target(args.target, dtype=torch.float32)
    draft = load_draft(args.draft, target)
    tok = tiny.build_tokenizer()
    questions = (*trained.QUESTIONS, *EXTRA_QUESTIONS)[: args.prompts]
    prompts = [tok.encode(trained.gsm8k_style_prompt(q)).ids for q in questions]
    blocks = -(-(max(len(p) for p in prompts) + args.max_tokens + 2 * max(k * s + n for k, s, n in args.shapes)) // 16)

    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def sampling(i: int) -> SamplingParams:
        return SamplingParams(temperature=args.temperature, seed=1000 + i)
    plain = [o.token_ids for o in LLM(target, None, tokenizer=None, num_blocks=4 * blocks).generate(prompts, greedy)]
    results = []
    for k, s, n in args.shapes:
        runner = ModelRunner(target, draft, EngineConfig(num_speculative_tokens=s, block_size=16), blocks)
        t0 = time.perf_counter()
        runs = [tree_generate(runner, p, args.max_tokens, k, s, n, sampling(i)) for i, p in enumerate(prompts)]
        dt = time.perf_counter() - t0
        accepted = [a for r in runs for a in r.accepted]
        results.append({
            "topk": k, "steps": s, "num_draft_tokens": n,
            "mean_acceptance_length": round(sum(a + 1 for a in accepted) / len(accepted), 4),
            "verify_steps": len(accepted),
            "lossless": (all(r.token_ids == want for r, want in zip(runs, plain, strict=True))
                         if args.temperature == 0 else None),
            "wall_s_cpu_reference": round(dt, 2),
        })
        print(json.dumps(results[-1]), file=sys.stderr)
    print(json.dumps({"target": str(args.target), "draft": str(args.draft), "prompts": len(prompts),
                      "temperature": args.temperature,
                      "max_tokens": args.max_tokens, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
