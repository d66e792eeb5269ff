"""Serving benchmark client: streamed OpenAI requests at a fixed concurrency, measured the way
``vllm bench serve`` measures them.

Per request (``time.perf_counter`` from just before the POST):
- TTFT: the first SSE chunk with a choice (vLLM's definition; the chat opening chunk, which
  only carries the role, does not count). eagle3 sends a chunk for every engine step that made
  tokens, so this is the time of the first token even when its text is empty;
- ITL: the gaps between successive chunks, one entry per chunk (vLLM's convention; a speculative
  server sending several tokens per chunk gets one ITL per verify step, so report TPOT when
  comparing speculative and plain decoding);
- E2EL: time of the last chunk with a choice (the usage chunk does not extend it);
- output tokens: ``usage.completion_tokens`` from the final usage chunk
  (``stream_options.include_usage``), else the number of chunks.

Per run: ``tpot_i = (e2el_i - ttft_i) / (output_i - 1)`` for ``output_i > 1``; throughputs over the
wall time from the first send to the last completion; percentiles with numpy's default (linear)
interpolation, as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from eagle3.errors import UsageError
from eagle3.validate.endpoint import api_root, client_options, headers

PERCENTILES = (50, 90, 99)
_TIMEOUT_S = 6 * 3600.0


@dataclass
class RequestResult:
    ok: bool
    text: str = ""
    error: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    start: float = 0.0  # perf_counter at send, relative to the run's start
    finish_reason: str | None = None
    status: int | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def stream_request(client: Any, url: str, body: dict[str, Any], api_key: str | None) -> RequestResult:
    """POST one streamed completion / chat completion and time it."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    res = RequestResult(ok=False)
    st = time.perf_counter()
    last = st
    parts: list[str] = []
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers(api_key)) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {_error_message(text)}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = f"stream error: {_error_message(json.dumps(obj))}"
                    return res
                if obj.get("usage"):
                    res.output_tokens = int(obj["usage"].get("completion_tokens") or 0)
                    res.prompt_tokens = obj["usage"].get("prompt_tokens")
                for choice in obj.get("choices") or []:
                    delta = choice.get("delta")
                    if delta is not None and "role" in delta:
                        continue  # the chat opening chunk carries no token
                    text = choice.get("text") if delta is None else delta.get("content")
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
                    if text is None and not choice.get("finish_reason"):
                        continue
                    t = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = t - st
                    else:
                        res.itl.append(t - last)
                    last = t
                    chunks += 1
                    parts.append(text or "")
        res.latency = (last if chunks else time.perf_counter()) - st
        res.text = "".join(parts)
        if not res.output_tokens:
            res.output_tokens = chunks
        res.ok = True
    except Exception as err:  # connection refused / reset / bad JSON: a failed request, not a crash
        res.error = f"{type(err).__name__}: {err}"
    return res


def _error_message(text: str) -> str:
    try:
        obj = json.loads(text)
        return str(obj.get("error", {}).get("message") or obj)
    except (json.JSONDecodeError, AttributeError):
        return text[:300]


@contextlib.asynccontextmanager
async def client(url: str, concurrency: int) -> AsyncIterator[Any]:
    """An ``httpx.AsyncClient`` for ``concurrency`` requests in flight to ``url``'s server."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # Loopback servers must not go through an HTTP(S)_PROXY from the environment (client_options).
    async with httpx.AsyncClient(timeout=httpx.Timeout(_TIMEOUT_S, connect=30.0), limits=limits,
                                 **client_options(url)) as http:
        yield http


async def run_requests(url: str, bodies: Sequence[dict[str, Any]], concurrency: int,
                       api_key: str | None = None) -> tuple[list[RequestResult], float]:
    """Send every body with at most ``concurrency`` in flight; results in body order, and the
    wall time from the first send to the last completion."""
    if concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1, got {concurrency}")
    sem = asyncio.Semaphore(concurrency)
    async with client(url, concurrency) as http:
        t0 = time.perf_counter()

        async def one(body: dict[str, Any]) -> RequestResult:
            async with sem:
                start = time.perf_counter() - t0
                r = await stream_request(http, url, body, api_key)
                r.start = start
                return r

        results = await asyncio.gather(*(one(b) for b in bodies))
        duration = time.perf_counter() - t0
    return list(results), duration


# -- metrics -------------------------------------------------------------------------------------
def summarize(values_s: Sequence[float], percentiles: Sequence[int] = PERCENTILES) -> dict[str, float | None]:
    """mean / median / std / pNN of seconds, in milliseconds."""
    import numpy as np

    if not values_s:
        out: dict[str, float | None] = {"mean": None, "median": None, "std": None}
        out.update({f"p{p}": None for p in percentiles})
        return out
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    out.update({f"p{p}": float(np.percentile(a, p)) for p in percentiles})
    return out


def compute_metrics(results: Sequence[RequestResult], duration: float,
                    input_lens: Sequence[int] | None = None) -> dict[str, Any]:
    """vLLM's ``calculate_metrics`` over the successful requests."""
    ok = [r for r in results if r.ok]
    total_out = sum(r.output_tokens for r in ok)
    ins = [r.prompt_tokens if r.prompt_tokens is not None else (input_lens[i] if input_lens else 0)
           for i, r in enumerate(results) if r.ok]
    total_in = sum(int(x or 0) for x in ins)
    dur = max(duration, 1e-9)
    itls = [x for r in ok for x in r.itl]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "concurrency": sum(r.latency for r in ok) / dur,
        "ttft_ms": summarize([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": summarize([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": summarize(itls),
        "e2el_ms": summarize([r.latency for r in ok]),
        "itl_convention": "per chunk (vLLM)",
        "errors": sorted({r.error for r in results if not r.ok and r.error})[:10],
    }


# -- datasets ------------------------------------------------------------------------------------
def random_prompts(tokenizer: Any, num_prompts: int, input_len: int, seed: int = 0) -> list[str]:
    """Text prompts of about ``input_len`` tokens: random non-special token ids, decoded (as
    ``vllm bench serve --dataset-name random`` does), each re-encoded and trimmed to length."""
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    vocab = [i for i in range(len(tokenizer)) if i not in special and i not in added]
    if not vocab:
        raise UsageError("the tokenizer has no ordinary tokens to build random prompts from")
    prompts = []
    for _ in range(num_prompts):
        ids = [rng.choice(vocab) for _ in range(input_len)]
        text = tokenizer.decode(ids)
        ids2 = tokenizer(text, add_special_tokens=False)["input_ids"][:input_len]
        prompts.append(tokenizer.decode(ids2))
    return prompts


# -- the benchmark -------------------------------------------------------------------------------
@dataclass
class BenchOptions:
    dataset: str = "random"  # random | gsm8k
    dataset_path: Any = None  # GSM8K directory (train.jsonl, test.jsonl); None: the packaged copy; "hub"
    input_len: int = 256
    output_len: int = 128
    num_prompts: int = 32
    concurrency: tuple[int, ...] = (1,)
    seed: int = 0
    ignore_eos: bool = True  # random prompts: fixed output lengths make TPOT comparable
    model: str | None = None
    api_key: str | None = None

    def check(self) -> None:
        if self.dataset not in ("random", "gsm8k"):
            raise UsageError(f"--dataset must be random or gsm8k, got {self.dataset!r}")
        for name in ("input_len", "output_len", "num_prompts"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
        if not self.concurrency or min(self.concurrency) < 1:
            raise UsageError("--concurrency needs levels >= 1, e.g. 1,4,16")


def parse_levels(text: str) -> tuple[int, ...]:
    """``"1,4,16"`` -> (1, 4, 16)."""
    try:
        levels = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError as err:
        raise UsageError(f"--concurrency {text!r}: expected integers such as 1,4,16") from err
    if not levels or min(levels) < 1:
        raise UsageError(f"--concurrency {text!r}: expected integers >= 1")
    return levels


def bench_prompts(opts: BenchOptions, tokenizer: Any | None) -> list[str]:
    if opts.dataset == "gsm8k":
        from eagle3.validate import gsm8k

        train, test = gsm8k.load_dataset(opts.dataset_path)
        return gsm8k.build_prompts(train, test, gsm8k.NUM_FEWSHOT, opts.num_prompts)
    if tokenizer is None:
        raise UsageError("--dataset random needs a tokenizer: pass --tokenizer DIR (or a model directory)")
    return random_prompts(tokenizer, opts.num_prompts, opts.input_len, opts.seed)


def run_bench(base_url: str, opts: BenchOptions, tokenizer: Any | None = None) -> dict[str, Any]:
    """Every concurrency level over the same prompts; speculative counters from ``/metrics``."""
    from eagle3.validate import gsm8k, metrics_client
    from eagle3.validate.endpoint import served_model

    opts.check()
    prompts = bench_prompts(opts, tokenizer)
    model = opts.model or served_model(base_url, opts.api_key)
    url = api_root(base_url) + "/v1/completions"
    bodies = []
    for p in prompts:
        body: dict[str, Any] = {"prompt": p, "max_tokens": opts.output_len, "temperature": 0.0}
        if model:
            body["model"] = model
        if opts.dataset == "random" and opts.ignore_eos:
            body["ignore_eos"] = True
        if opts.dataset == "gsm8k":
            body["stop"] = list(gsm8k.STOP)
        bodies.append(body)
    input_lens = ([len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
                  if tokenizer is not None else None)
    levels = []
    for c in opts.concurrency:
        before = metrics_client.scrape(base_url, opts.api_key)
        results, duration = asyncio.run(run_requests(url, bodies, c, opts.api_key))
        after = metrics_client.scrape(base_url, opts.api_key)
        m = compute_metrics(results, duration, input_lens)
        m["max_concurrency"] = c
        m["speculative"] = metrics_client.spec_delta(before, after)
        levels.append(m)
    return {"base_url": base_url, "model": model, "dataset": opts.dataset, "num_prompts": len(prompts),
            "input_len": opts.input_len if opts.dataset == "random" else None, "output_len": opts.output_len,
            "ignore_eos": opts.dataset == "random" and opts.ignore_eos, "temperature": 0.0,
            "metric_definitions": "vllm bench serve (TTFT: first text chunk; TPOT: (E2EL-TTFT)/(out-1); "
                                  "ITL: per chunk)", "levels": levels}


def _f(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def bench_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"benchmark {result['base_url']} model {result['model']}: {result['num_prompts']} {result['dataset']} "
             f"prompts, output {result['output_len']} tokens" + (" (ignore_eos)" if result["ignore_eos"] else ""),
             f"{'conc':>5} {'ok':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} {'TTFT ms':>15} {'TPOT ms':>15} "
             f"{'ITL ms':>15} {'E2EL ms':>9} {'accept':>6} {'acc.len':>7}",
             f"{'':>5} {'':>5} {'':>4} {'':>7} {'':>9} {'mean/p99':>15} {'mean/p99':>15} {'mean/p99':>15} "
             f"{'mean':>9} {'rate':>6} {'':>7}"]
    for m in result["levels"]:
        spec = m.get("speculative") or {}
        lines.append(
            f"{m['max_concurrency']:>5} {m['completed']:>5} {m['failed']:>4} {m['request_throughput']:>7.2f} "
            f"{m['output_throughput']:>9.1f} {_f(m['ttft_ms']['mean']) + '/' + _f(m['ttft_ms']['p99']):>15} "
            f"{_f(m['tpot_ms']['mean']) + '/' + _f(m['tpot_ms']['p99']):>15} "
            f"{_f(m['itl_ms']['mean']) + '/' + _f(m['itl_ms']['p99']):>15} {_f(m['e2el_ms']['mean'], '.1f'):>9} "
            f"{_f(spec.get('acceptance_rate'), '.3f'):>6} {_f(spec.get('mean_acceptance_length')):>7}")
        if spec.get("chosen_k_histogram"):
            lines.append("      chosen k (auto) 0..: " + "/".join(f"{n:g}" for n in spec["chosen_k_histogram"]) + " steps")
        for e in m["errors"][:3]:
            lines.append(f"      error: {e}")
    return lines
