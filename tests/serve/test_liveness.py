"""No request waits on an engine thread that is gone, /health tells the truth, and a server never
ends up answering on a port it does not own."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from eagle3.cli import main
from eagle3.serve.async_engine import AsyncEngine
from eagle3.serve.launcher import listen_socket
from eagle3.serve.protocol import APIError
from tests.serve.fakes import ScriptedLLM
from tests.serve.servers import serve_llm


class _DiesOnSecondRequest(ScriptedLLM):
    """Fails *outside* ``step()`` (where the engine thread has no per-step guard) once a second
    request is queued. Every step after the first waits for it, so the first request is surely
    still in flight (and the second waiting) when it dies, however slow the machine."""

    num_steps = 0

    def step(self) -> Any:
        self.num_steps += 1
        deadline = time.monotonic() + 30
        while self.num_steps > 1 and len(self.requests_seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        return super().step()

    def has_unfinished(self) -> bool:
        if len(self.requests_seen) >= 2:
            raise RuntimeError("engine bookkeeping broke")
        return super().has_unfinished()


def test_a_dead_engine_thread_fails_every_request_and_health(tiny_tokenizer: Any) -> None:
    llm = _DiesOnSecondRequest(tiny_tokenizer, lambda prompt: " x" * 200, tokens_per_step=1)
    with serve_llm(llm, "dies") as url, httpx.Client(base_url=url, trust_env=False, timeout=60) as c:
        assert c.get("/health").status_code == 200
        with c.stream("POST", "/v1/completions", json={"prompt": "a", "max_tokens": 150, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # first one is in flight
            second = c.post("/v1/completions", json={"prompt": "b", "max_tokens": 5})
            rest = "\n".join(lines)
        assert second.status_code == 500 and "engine thread died" in second.json()["error"]["message"]
        assert "engine thread died" in rest  # the stream ends with an error event, not silence
        h = c.get("/health")
        assert h.status_code == 503 and "not running" in h.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "c", "max_tokens": 5}).status_code == 503


def test_shutdown_fails_the_requests_in_flight(tiny_tokenizer: Any) -> None:
    class HoldsUntilShutdown(ScriptedLLM):  # after its first step, the request waits for shutdown
        num_steps = 0

        def step(self) -> Any:
            self.num_steps += 1
            deadline = time.monotonic() + 30
            while self.num_steps > 1 and not engine._stopping and time.monotonic() < deadline:
                time.sleep(0.01)
            return super().step()

    engine = AsyncEngine(HoldsUntilShutdown(tiny_tokenizer, lambda prompt: " y" * 50, tokens_per_step=1))
    engine.start()

    async def one() -> str:
        try:
            async for _ in engine.generate([5, 6], _params(40)):
                if engine.alive:
                    threading.Thread(target=engine.shutdown).start()  # from elsewhere, mid-request
            return "finished"
        except APIError as err:
            return f"{err.status_code} {err.message}"

    assert asyncio.run(asyncio.wait_for(one(), 60)) == "503 the server is shutting down"
    assert not engine.alive


def test_serve_refuses_a_taken_port_before_loading(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = listen_socket("127.0.0.1", 0)
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(SystemExit) as e:
            main(["serve", str(tiny_dir / "kimi-k2.5"), "--port", str(port)])
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def _params(max_tokens: int) -> Any:
    from eagle3.runtime.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
