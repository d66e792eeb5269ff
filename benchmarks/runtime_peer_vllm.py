"""vLLM side of ``benchmarks/runtime_peer.py``: runs in vLLM's own virtual environment.

    VENV/bin/python benchmarks/runtime_peer_vllm.py REQUEST.json RESULT.json

REQUEST.json: ``{"target", "draft" (or null), "k", "prompts" (token ids), "batches", "max_tokens",
"dtype", "max_model_len", "seed", "threads"}``. One engine (plain, or EAGLE-3 with ``k`` drafts);
one untimed warm-up, then for each batch size ``b`` the first ``b`` prompts submitted at once,
greedy with ``ignore_eos`` (every output exactly ``max_tokens`` long), timed around ``generate``.
RESULT.json: per batch the seconds, the output token ids and the spec-decode counters of that
run (differences of ``LLM.get_metrics()``), and the vLLM version.

Only the standard library and vLLM are imported: this file is not part of eagle3 and never runs in
eagle3's environment or in CI.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

# The counters are read as acceptance_peer's driver reads them (this directory is sys.path[0] when the
# driver runs as a script in vLLM's environment).
from acceptance_peer_vllm import SPEC_COUNTERS, spec_counters  # noqa: E402


def _minus(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out = {k: now[k] - before[k] for k in SPEC_COUNTERS.values()}
    b = before["accepted_per_pos"] + [0] * len(now["accepted_per_pos"])
    out["accepted_per_pos"] = [x - y for x, y in zip(now["accepted_per_pos"], b, strict=False)]
    return out


def main(argv: list[str]) -> int:
    req = json.loads(open(argv[1], encoding="utf-8").read())
    # Before vLLM is imported: a small KV cache (GiB), the thread count, no pinning on a shared machine.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(req.get("kv_cache_gib", 2)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(req.get("threads", 2)))
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": req["target"], "tokenizer": req["target"], "dtype": req.get("dtype", "bfloat16"),
        "max_model_len": req["max_model_len"], "seed": req.get("seed", 0), "enforce_eager": True,
        "disable_log_stats": False, "max_num_seqs": max(req["batches"]),
    }
    if req.get("draft"):
        kwargs["speculative_config"] = {"method": "eagle3", "model": req["draft"], "num_speculative_tokens": req["k"]}
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    runs = []
    for b in req["batches"]:
        before = spec_counters(llm.get_metrics()) if req.get("draft") else None
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:b], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        spec = _minus(spec_counters(llm.get_metrics()), before) if before is not None else None
        runs.append({"batch": b, "seconds": seconds, "outputs": [list(o.outputs[0].token_ids) for o in outs],
                     "spec": spec})
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump({"engine": "vllm", "vllm_version": vllm.__version__, "runs": runs}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
