"""Load, disconnects and aborts against the real engine (toy models) on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import httpx

from eagle3.validate.metrics_client import _samples

PROMPTS = ["Question: What is 3 plus 4?\nAnswer:", "Hello there", "Question: A farmer has 12 cows.\nAnswer:",
           "Once upon a time"]


def _wait_idle(llm: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not llm.has_unfinished() and llm.block_manager.num_free_blocks == llm.block_manager.num_blocks:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: unfinished={llm.has_unfinished()} "
                         f"free={llm.block_manager.num_free_blocks}/{llm.block_manager.num_blocks}")


def test_200_mixed_requests_at_16_concurrency(toy_server: tuple[str, Any]) -> None:
    url, llm = toy_server

    async def one(client: httpx.AsyncClient, i: int) -> tuple[bool, str]:
        body = {"prompt": PROMPTS[i % 4], "max_tokens": 4 + i % 5, "temperature": 0 if i % 3 else 0.8,
                "seed": i, "stream": i % 2 == 0, "stream_options": {"include_usage": True}}
        if i % 2 == 0:
            text, usage = "", None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return False, f"status {r.status_code}"
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        e = json.loads(line[6:])
                        if "error" in e:
                            return False, str(e)
                        text += "".join(c["text"] for c in e["choices"])
                        usage = e.get("usage") or usage
            return usage is not None and 1 <= usage["completion_tokens"] <= body["max_tokens"], text
        r = await client.post("/v1/completions", json={k: v for k, v in body.items() if k != "stream_options"})
        ok = r.status_code == 200 and 1 <= r.json()["usage"]["completion_tokens"] <= body["max_tokens"]
        return ok, r.text

    async def main() -> list[tuple[bool, str]]:
        sem = asyncio.Semaphore(16)
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, trust_env=False) as client:
            async def guarded(i: int) -> tuple[bool, str]:
                async with sem:
                    return await one(client, i)
            return await asyncio.gather(*(guarded(i) for i in range(200)))

    results = asyncio.run(main())
    failures = [r for r in results if not r[0]]
    assert not failures, failures[:3]
    # greedy requests with the same prompt and length give the same text, streamed or not
    assert results[1][1] != "" and results[13][0]
    _wait_idle(llm)
    metrics = _samples(httpx.get(url + "/metrics", trust_env=False).text)
    assert sum(v for _, v in metrics["eagle3:request_success_total"]) >= 200
    assert metrics["eagle3:num_free_kv_blocks"][0][1] == llm.block_manager.num_blocks


def _aborted(url: str) -> float:
    rows = _samples(httpx.get(url + "/metrics", trust_env=False).text)["eagle3:request_success_total"]
    return sum(v for labels, v in rows if labels["finished_reason"] == "abort")


def test_disconnect_mid_stream_frees_blocks(toy_server: tuple[str, Any]) -> None:
    url, llm = toy_server
    _wait_idle(llm)
    aborted = _aborted(url)
    for _ in range(4):
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
            body = {"prompt": PROMPTS[0], "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"]
                assert llm.has_unfinished()
            # leaving both blocks closes the connection mid-stream
    _wait_idle(llm)
    assert _aborted(url) == aborted + 4  # cut short, not run to max_tokens


def test_disconnect_during_non_streaming_request_frees_blocks(toy_server: tuple[str, Any]) -> None:
    url, llm = toy_server
    _wait_idle(llm)
    aborted = _aborted(url)
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": PROMPTS[1], "max_tokens": 3000, "ignore_eos": True, "temperature": 0}).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 20
    while not llm.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.has_unfinished()
    s.close()
    _wait_idle(llm)
    assert _aborted(url) == aborted + 1
    # and the engine still answers
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 3}, trust_env=False)
    assert r.status_code == 200


def test_engine_failure_fails_only_the_requests_in_flight(tiny_tokenizer: Any) -> None:
    from tests.serve.fakes import ScriptedLLM
    from tests.serve.servers import serve_llm

    class Flaky(ScriptedLLM):
        def step(self) -> Any:
            if any(len(r) == 1 for r in self.requests_seen[-1:]) and not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("kernel exploded")
            return super().step()

    llm = Flaky(tiny_tokenizer, lambda prompt: " fine, thanks")
    with serve_llm(llm, "flaky") as url, httpx.Client(base_url=url, trust_env=False) as c:
        r = c.post("/v1/completions", json={"prompt": [7], "max_tokens": 5})
        assert r.status_code == 500 and "kernel exploded" in r.json()["error"]["message"]
        ok = c.post("/v1/completions", json={"prompt": "How are you?", "max_tokens": 5})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == " fine, thanks"
        assert c.get("/health").status_code == 200
