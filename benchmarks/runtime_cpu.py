"""CPU throughput of the bundled runtime on the tiny Kimi-K2.5 target, measured side by side.

Three runs in one process, same prompts, greedy, the same number of new tokens per request
(``ignore_eos``), each after a warm-up:

* ``hf``: transformers ``generate`` on the same checkpoint (INT4 experts dequantized at load);
* ``eagle3``: the runtime without a draft;
* ``eagle3+spec``: the runtime with the EAGLE-3 draft (``--draft``), ``k`` speculative tokens.

Prints tokens/s and the ratios (goal: eagle3 / hf >= 2), the acceptance line, checks that the
speculative output equals the plain output token for token, and writes a JSON report.

    .venv/bin/python benchmarks/runtime_cpu.py [--tiny-dir DIR] [--batch 8] [--max-tokens 64] [--out runtime_cpu.json]

The tiny draft has random weights, so its acceptance is low and speculation costs time here; the
number that speculation buys on a real draft is the acceptance line, not this ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "Question: what is 12 + 30? Answer:",
    "Once upon a time, in a small village by the sea, there lived",
    "def add(a, b):\n    return",
    "The capital of France is",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "A train travels 60 miles per hour for 3 hours. How far",
    "In speculative decoding, a small draft model proposes tokens that",
]


def _prompt_ids(tokenizer: Any, batch: int) -> list[list[int]]:
    return [tokenizer(PROMPTS[i % len(PROMPTS)], add_special_tokens=False)["input_ids"] for i in range(batch)]


def bench_hf(target_dir: Path, prompts: list[list[int]], max_tokens: int, dtype: torch.dtype,
             pad_id: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForImageTextToText, CompressedTensorsConfig

    model = AutoModelForImageTextToText.from_pretrained(
        target_dir, dtype=dtype, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    for p in model.parameters():  # dequantized INT4 experts stay bf16 whatever dtype= says
        p.data = p.data.to(dtype)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=pad_id)
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
        dt = time.perf_counter() - t0
    return dt, out[:, width:].tolist()


def bench_eagle3(target: Any, draft: Any, prompts: list[list[int]], max_tokens: int,
                 dtype: torch.dtype, k: int) -> tuple[float, list[list[int]], str | None]:
    from eagle3.runtime.engine.llm import LLM
    from eagle3.runtime.sampling import SamplingParams

    llm = LLM(target, draft, num_speculative_tokens=k, dtype=dtype, tokenizer=None, max_num_seqs=len(prompts))
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    llm.reset_stats()  # count the timed run only
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    return dt, [o.token_ids for o in outs], (llm.stats_line() if draft is not None else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny-dir", type=Path, help="make_tiny output (default: written to a temp dir)")
    ap.add_argument("--target", default="kimi-k2.5")
    ap.add_argument("--draft", default="kimi-k2.5-eagle3")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both sides (0: torch default); tiny GEMMs only lose from threads on a busy box")
    ap.add_argument("--out", type=Path, default=Path("runtime_cpu.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    with tempfile.TemporaryDirectory() as tmp:
        tiny = args.tiny_dir
        if tiny is None:
            from eagle3.testing.tiny import make_tiny

            tiny = Path(tmp) / "tiny"
            make_tiny(tiny, seed=0, only=[args.target, args.draft])
        target, draft = tiny / args.target, tiny / args.draft
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target)
        prompts = _prompt_ids(tok, args.batch)
        n_new = args.batch * args.max_tokens

        runs: dict[str, dict[str, Any]] = {}
        dt, hf_ids = bench_hf(target, prompts, args.max_tokens, dtype, tok.pad_token_id or 0)
        runs["hf"] = {"seconds": dt, "tokens_per_s": n_new / dt}
        dt, plain_ids, _ = bench_eagle3(target, None, prompts, args.max_tokens, dtype, args.num_speculative_tokens)
        runs["eagle3"] = {"seconds": dt, "tokens_per_s": n_new / dt}
        dt, spec_ids, line = bench_eagle3(target, draft, prompts, args.max_tokens, dtype,
                                          args.num_speculative_tokens)
        runs["eagle3+spec"] = {"seconds": dt, "tokens_per_s": n_new / dt, "acceptance": line}
        # Upper bound of what speculation can buy in this engine: a draft that is always right
        # (it replays the plain run's outputs) and costs almost nothing.
        from eagle3.runtime.interfaces import default_aux_layer_ids
        from eagle3.runtime.loader import load_target
        from eagle3.testing.toy_models import ReplayDraft

        tgt = load_target(target, dtype=dtype)
        perfect = ReplayDraft([p + o for p, o in zip(prompts, plain_ids, strict=True)], tgt.vocab_size,
                              default_aux_layer_ids(tgt.num_layers))
        dt, perfect_ids, perfect_line = bench_eagle3(tgt, perfect, prompts, args.max_tokens, dtype,
                                                     args.num_speculative_tokens)
        runs["eagle3+spec(perfect draft)"] = {"seconds": dt, "tokens_per_s": n_new / dt, "acceptance": perfect_line}

    same_as_hf = sum(a == b for a, b in zip(plain_ids, hf_ids, strict=True))
    report = {
        "target": args.target, "draft": args.draft, "batch": args.batch, "max_tokens": args.max_tokens,
        "num_speculative_tokens": args.num_speculative_tokens, "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
        "runs": runs,
        "ratio_eagle3_vs_hf": runs["eagle3"]["tokens_per_s"] / runs["hf"]["tokens_per_s"],
        "ratio_spec_vs_plain": runs["eagle3+spec"]["tokens_per_s"] / runs["eagle3"]["tokens_per_s"],
        "ratio_spec_vs_hf": runs["eagle3+spec"]["tokens_per_s"] / runs["hf"]["tokens_per_s"],
        "ratio_perfect_spec_vs_plain": runs["eagle3+spec(perfect draft)"]["tokens_per_s"] / runs["eagle3"]["tokens_per_s"],
        "spec_output_equals_plain": spec_ids == plain_ids and perfect_ids == plain_ids,
        "requests_equal_to_hf": f"{same_as_hf}/{args.batch}",
    }
    for name, r in runs.items():
        print(f"{name:28s} {r['tokens_per_s']:9.1f} tok/s  ({r['seconds']:.2f} s for {n_new} tokens)")
    print(f"{'eagle3 / hf':28s} {report['ratio_eagle3_vs_hf']:9.2f}x  (goal >= 2x)")
    print(f"{'eagle3+spec / eagle3':28s} {report['ratio_spec_vs_plain']:9.2f}x  ({line})")
    print(f"{'eagle3+spec / hf':28s} {report['ratio_spec_vs_hf']:9.2f}x")
    print(f"{'perfect-draft spec / eagle3':28s} {report['ratio_perfect_spec_vs_plain']:9.2f}x  ({perfect_line})")
    print(f"speculative outputs == plain output: {report['spec_output_equals_plain']}; "
          f"requests identical to hf: {report['requests_equal_to_hf']}")
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {args.out}")


if __name__ == "__main__":
    main()
