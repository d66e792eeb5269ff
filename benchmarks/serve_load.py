"""Load test of ``eagle3 serve``: N requests at concurrency C, a mix of completions, chat
completions and streamed completions, reporting ok / failed, latency percentiles, and the KV
cache blocks free before and after (equal: nothing leaked).

By default it makes the tiny models (``eagle3 make-tiny``), starts the real CLI on them
(``eagle3 serve TARGET --draft DRAFT --port 0 --ready-file``), runs the load and stops the
server; ``--base-url`` runs against a server that is already up (KV figures need an eagle3
server: they come from its ``/health``).

    .venv/bin/python benchmarks/serve_load.py [-n 1000] [-c 32] [--max-tokens 16] [--out serve_load.json]
    .venv/bin/python benchmarks/serve_load.py --base-url http://127.0.0.1:8000 -n 200 -c 8

A request counts as ok when it answers 200 with as many completion tokens as asked for (every
request sets ``ignore_eos``) and, when streamed, ends with ``[DONE]`` and no error event.
Latency is end to end per request, measured by the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "Question: what is 12 + 30? Answer:",
    "Once upon a time, in a small village by the sea, there lived",
    "def add(a, b):\n    return",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "In speculative decoding, a small draft model proposes tokens that",
]
KINDS = ("completion", "chat", "stream")


@contextmanager
def _served(target: Path, draft: Path | None, extra: list[str], workdir: Path) -> Any:
    """The real ``eagle3 serve`` CLI in a subprocess; yields its base URL."""
    ready, log = workdir / "ready.json", workdir / "serve.log"
    argv = [sys.executable, "-m", "eagle3.cli", "serve", str(target), "--port", "0", "--ready-file", str(ready),
            "--log-level", "warning", *(["--draft", str(draft)] if draft else []), *extra]
    with log.open("wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"eagle3 serve did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        yield json.loads(ready.read_text())["url"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _kv(client: httpx.Client) -> dict[str, Any]:
    body = client.get("/health").json()
    return {"free": body.get("kv_blocks_free"), "total": body.get("kv_blocks_total")}


def _kv_settled(client: httpx.Client, want_free: int | None, timeout: float = 30.0) -> dict[str, Any]:
    """KV blocks once the engine has settled: aborted / finished requests free their blocks at
    the next engine step, which may come a moment after the last response."""
    deadline = time.monotonic() + timeout
    kv = _kv(client)
    while want_free is not None and kv["free"] != want_free and time.monotonic() < deadline:
        time.sleep(0.2)
        kv = _kv(client)
    return kv


async def _one(client: httpx.AsyncClient, i: int, max_tokens: int, model: str | None) -> dict[str, Any]:
    kind = KINDS[i % len(KINDS)]
    prompt = f"{PROMPTS[i % len(PROMPTS)]} (request {i})"
    common: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0 if i % 2 else 0.8,
                              "seed": i}
    if model:
        common["model"] = model
    t0 = time.perf_counter()
    ok, status, detail = False, 0, ""
    try:
        if kind == "stream":
            body = {**common, "prompt": prompt, "stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                status = r.status_code
                usage, done, error = None, False, None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    event = json.loads(line[6:])
                    error = event.get("error") or error
                    usage = event.get("usage") or usage
                ok = status == 200 and done and error is None and bool(usage) \
                    and usage["completion_tokens"] == max_tokens
                detail = str(error or usage)
        else:
            if kind == "chat":
                r = await client.post("/v1/chat/completions",
                                      json={**common, "messages": [{"role": "user", "content": prompt}]})
            else:
                r = await client.post("/v1/completions", json={**common, "prompt": prompt})
            status = r.status_code
            ok = status == 200 and r.json()["usage"]["completion_tokens"] == max_tokens
            detail = "" if ok else r.text[:300]
    except httpx.HTTPError as err:
        detail = f"{type(err).__name__}: {err}"
    return {"i": i, "kind": kind, "ok": ok, "status": status, "latency_s": time.perf_counter() - t0,
            "detail": "" if ok else detail}


async def _load(url: str, n: int, concurrency: int, max_tokens: int, model: str | None,
                api_key: str | None) -> tuple[list[dict[str, Any]], float]:
    sem = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, headers=headers,
                                 trust_env=False) as client:
        async def guarded(i: int) -> dict[str, Any]:
            async with sem:
                return await _one(client, i, max_tokens, model)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(i) for i in range(n)))
        return list(results), time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize(results: list[dict[str, Any]], wall: float, kv_before: dict[str, Any],
              kv_after: dict[str, Any]) -> dict[str, Any]:
    lat = sorted(r["latency_s"] for r in results if r["ok"])
    by_kind = {k: {"ok": sum(r["ok"] for r in results if r["kind"] == k),
                   "failed": sum(not r["ok"] for r in results if r["kind"] == k)} for k in KINDS}
    return {"requests": len(results), "ok": sum(r["ok"] for r in results),
            "failed": sum(not r["ok"] for r in results), "by_kind": by_kind,
            "latency_p50_s": _pct(lat, 50), "latency_p99_s": _pct(lat, 99), "latency_max_s": lat[-1] if lat else None,
            "wall_s": wall, "requests_per_s": len(results) / wall if wall else None,
            "kv_blocks_free_before": kv_before["free"], "kv_blocks_free_after": kv_after["free"],
            "kv_blocks_total": kv_before["total"],
            "first_failures": [r for r in results if not r["ok"]][:5]}


def table(s: dict[str, Any], n: int, c: int) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    rows = [("requests", str(s["requests"])), ("concurrency", str(c)), ("ok", str(s["ok"])),
            ("failed", str(s["failed"])),
            ("by kind (ok/failed)", ", ".join(f"{k} {v['ok']}/{v['failed']}" for k, v in s["by_kind"].items())),
            ("latency p50 (s)", f(s["latency_p50_s"])), ("latency p99 (s)", f(s["latency_p99_s"])),
            ("wall (s)", f(s["wall_s"])), ("requests/s", f(s["requests_per_s"])),
            ("KV blocks free before", f"{s['kv_blocks_free_before']} / {s['kv_blocks_total']}"),
            ("KV blocks free after", f"{s['kv_blocks_free_after']} / {s['kv_blocks_total']}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k:<{width}} | {v} |" for k, v in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--num-requests", type=int, default=1000)
    ap.add_argument("-c", "--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16, help="new tokens per request (ignore_eos)")
    ap.add_argument("--base-url", help="a running server (default: start eagle3 serve on the tiny models)")
    ap.add_argument("--tiny-dir", type=Path, help="existing make-tiny output (default: make one in a temp dir)")
    ap.add_argument("--no-draft", action="store_true", help="serve the tiny target without its EAGLE-3 draft")
    ap.add_argument("--model", help="model name to send (default: none, the server's own)")
    ap.add_argument("--api-key", default=os.environ.get("EAGLE3_API_KEY"))
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    args = ap.parse_args()

    def run(url: str, server: str) -> dict[str, Any]:
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
            kv_before = _kv(c)
            results, wall = asyncio.run(_load(url, args.num_requests, args.concurrency, args.max_tokens,
                                              args.model, args.api_key))
            kv_after = _kv_settled(c, kv_before["free"])
        s = summarize(results, wall, kv_before, kv_after)
        s.update({"server": server, "num_requests": args.num_requests, "concurrency": args.concurrency,
                  "max_tokens": args.max_tokens, "machine": {"platform": platform.platform(),
                                                             "cpus": os.cpu_count(),
                                                             "loadavg_after": os.getloadavg()}})
        return s

    if args.base_url:
        summary = run(args.base_url, args.base_url)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            tiny = args.tiny_dir
            if tiny is None:
                from eagle3.testing.tiny import make_tiny

                tiny = Path(tmp) / "tiny"
                make_tiny(tiny, seed=0)
            draft = None if args.no_draft else tiny / "kimi-k2.5-eagle3"
            with _served(tiny / "kimi-k2.5", draft, [], Path(tmp)) as url:
                summary = run(url, f"eagle3 serve tiny/kimi-k2.5{'' if draft is None else ' --draft tiny/kimi-k2.5-eagle3'}")
    print(table(summary, args.num_requests, args.concurrency))
    for r in summary["first_failures"]:
        print(f"failed: #{r['i']} {r['kind']} status {r['status']}: {r['detail']}", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"report: {args.out}")
    if summary["failed"] or summary["kv_blocks_free_after"] != summary["kv_blocks_free_before"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
