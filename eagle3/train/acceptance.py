"""Held-out acceptance of a draft beside a target, measured by the runtime.

What ``train-draft`` reports before and after training (``--init-from``), and what ``eagle3
quantize --target`` reports for a draft before and after quantization: the draft served with the
target by the runtime's ``LLM`` (greedy, ``k`` speculative tokens, ``max_tokens`` new tokens per
prompt, stopping at the target's end-of-sequence tokens only), the engine's acceptance counters
(mean accept length = tokens per target forward, bonus included), and whether the speculative
output equals plain greedy decoding of the same prompts (``lossless``). The plain run is made once
(:func:`plain_outputs`) and shared by every draft measured against the same target.

The default prompts are lm-eval's GSM8K 5-shot prompts of the first test problems
(:func:`gsm8k_prompts`): what ``eagle3 serve --validate gsm8k`` sends, and never a training
problem (``train-draft`` trains on the train split).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from eagle3.train.progress import PhaseBar


def kv_blocks(prompts: list[list[int]], max_tokens: int, k: int, block_size: int = 16) -> int:
    """KV blocks for every prompt at full length at once: the runtime's default (256 MiB of zeros
    on CPU) costs seconds to allocate, far more than these small runs need."""
    return sum(-(-(len(p) + max_tokens + 2 * k + 1) // block_size) for p in prompts) + 2


def gsm8k_prompts(tokenizer: Any, n: int, num_fewshot: int = 5, dataset: Path | None = None) -> list[list[int]]:
    """Token ids of lm-eval's ``num_fewshot``-shot prompts of the first ``n`` GSM8K test problems."""
    from eagle3.validate import gsm8k

    train, test = gsm8k.load_dataset(dataset)
    return [list(tokenizer(p, add_special_tokens=False)["input_ids"])
            for p in gsm8k.build_prompts(train, test, num_fewshot=num_fewshot, limit=n)]


def _run(llm: Any, prompts: list[list[int]], max_tokens: int, label: str, progress: bool) -> list[list[int]]:
    """Greedy outputs of ``prompts`` (the engine stepped here, so the bar follows the tokens)."""
    from eagle3.runtime.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    rids = [llm.add_request(p, params) for p in prompts]
    outs: dict[str, list[int]] = {}
    seen: dict[str, int] = {}
    with PhaseBar(label, len(prompts) * max_tokens, progress) as bar:
        while len(outs) < len(rids):
            for o in llm.step():
                n = len(o.token_ids)
                bar.advance(max(n - seen.get(o.request_id, 0), 0) + (max_tokens - n if o.finished else 0))
                seen[o.request_id] = n
                if o.finished and o.finish_reason == "error":
                    raise RuntimeError(f"held-out generation failed: {o.error}")
                if o.finished:
                    outs[o.request_id] = list(o.token_ids)
    return [outs[r] for r in rids]


def plain_outputs(target: Any, prompts: list[list[int]], max_tokens: int, progress: bool = False) -> dict[str, Any]:
    """Plain greedy decoding of ``prompts``: the lossless reference (token ids) and its time."""
    from eagle3.runtime.engine.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(target, None, tokenizer=None, num_blocks=kv_blocks(prompts, max_tokens, 0))
    out = _run(llm, prompts, max_tokens, "plain", progress)
    return {"token_ids": out, "seconds": time.perf_counter() - t0}


def measure(target: Any, draft: Path, prompts: list[list[int]], *, k: int, max_tokens: int,
            plain: dict[str, Any] | None = None, label: str = "held-out", progress: bool = False) -> dict[str, Any]:
    """Acceptance of ``draft`` with ``target`` on ``prompts`` (greedy, ``k`` speculative tokens);
    ``lossless`` compares with ``plain`` (:func:`plain_outputs`, computed here when None)."""
    from eagle3.runtime.engine.llm import LLM
    from eagle3.runtime.loader import load_draft

    if plain is None:
        plain = plain_outputs(target, prompts, max_tokens, progress)
    t0 = time.perf_counter()
    llm = LLM(target, load_draft(draft, target), num_speculative_tokens=k, tokenizer=None,
              num_blocks=kv_blocks(prompts, max_tokens, k))
    out = _run(llm, prompts, max_tokens, label, progress)
    t_spec = time.perf_counter() - t0
    return {**llm.stats.as_dict(), "num_prompts": len(prompts), "max_tokens": max_tokens,
            "output_tokens": sum(len(o) for o in out), "lossless": out == plain["token_ids"],
            "seconds_speculative": round(t_spec, 3), "seconds_plain": round(plain["seconds"], 3)}


def summary_line(h: dict[str, Any]) -> str:
    """``mean accept length 3.10, acceptance 70.1%, per position 0.85/0.71/0.54, lossless PASS``."""
    per = "/".join(f"{p:.2f}" for p in h.get("per_position_acceptance", []))
    return (f"mean accept length {h['mean_acceptance_length']:.2f}, acceptance {100 * h['acceptance_rate']:.1f}%, "
            f"per position {per}, lossless {'PASS' if h['lossless'] else 'FAIL'}")
