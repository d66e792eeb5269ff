"""vLLM side of ``benchmarks/acceptance_peer.py``: runs in vLLM's own virtual environment.

    VENV/bin/python benchmarks/acceptance_peer_vllm.py REQUEST.json RESULT.json

REQUEST.json: ``{"target", "draft" (or null), "k", "prompts" (token ids), "max_tokens", "dtype",
"max_model_len", "seed"}``. Greedy decoding of every prompt with ``ignore_eos`` (each output is
exactly ``max_tokens`` long, so outputs of two engines compare token by token); with a draft,
EAGLE-3 speculative decoding with ``k`` draft tokens. RESULT.json: the output token ids, vLLM's
spec-decode counters (``LLM.get_metrics()``: drafts, draft tokens, accepted tokens, accepted per
position), the seconds spent generating and the vLLM version.

Only the standard library and vLLM are imported: this file is not part of eagle3 and never runs
in eagle3's environment or in CI.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
         "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}


def spec_counters(metrics: list[Any]) -> dict[str, Any]:
    """vLLM's spec-decode counters from ``LLM.get_metrics()`` (summed over label sets)."""
    out: dict[str, Any] = {v: 0 for v in SPEC_COUNTERS.values()}
    per_pos: list[int] = []
    for m in metrics:
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            per_pos = [a + b for a, b in zip(per_pos + [0] * (len(vals) - len(per_pos)), vals, strict=False)] \
                if per_pos else vals
    out["accepted_per_pos"] = per_pos
    return out


def main(argv: list[str]) -> int:
    req = json.loads(open(argv[1], encoding="utf-8").read())
    # Before vLLM is imported: a small KV cache (GiB) and no thread pinning on a shared machine.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(req.get("kv_cache_gib", 1)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": req["target"], "tokenizer": req["target"], "dtype": req.get("dtype", "bfloat16"),
        "max_model_len": req["max_model_len"], "seed": req.get("seed", 0), "enforce_eager": True,
        "disable_log_stats": False, "max_num_seqs": req.get("max_num_seqs", 8),
    }
    if req.get("draft"):
        kwargs["speculative_config"] = {"method": "eagle3", "model": req["draft"],
                                        "num_speculative_tokens": req["k"]}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    t_load = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    t_gen = time.perf_counter() - t0
    result = {
        "engine": "vllm", "vllm_version": vllm.__version__, "target": req["target"], "draft": req.get("draft"),
        "k": req["k"] if req.get("draft") else 0, "seconds_load": round(t_load, 3), "seconds_generate": round(t_gen, 3),
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "spec": spec_counters(llm.get_metrics()) if req.get("draft") else None,
    }
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
