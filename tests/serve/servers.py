"""The one place where tests start eagle3 servers.

``serve_llm(llm, name)``: the FastAPI app over an engine, in a thread of the test process
(:class:`eagle3.serve.launcher.ServerThread`, port 0: uvicorn binds an OS-chosen port itself).

``serve_cli(args, workdir)``: the real ``eagle3 serve`` CLI in a subprocess, started with
``--port 0 --ready-file``: the server binds a port the OS picks before it loads anything and
writes ``{"url", "pid"}`` once it answers. The helper checks that pid is its own child's, so a test
can never end up talking to another test's (or another xdist worker's) server. Picking a "free"
port in the test and passing it on is racy: the port is free only until someone else binds it,
and a server that loads a model for seconds gives everyone plenty of time to.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from eagle3.serve.launcher import ServerThread, build_app

START_TIMEOUT_S = 180.0  # model load on a busy 2-core machine, with a wide margin
# Per-test limit for every test under tests/serve and tests/validate (their conftests apply it to
# tests without a timeout mark of their own): a server that stops answering fails the test in
# minutes, with pytest-timeout's stack dump, instead of at the suite-wide 600 s.
SERVER_TEST_TIMEOUT_S = 180


def add_default_timeout(item: pytest.Item) -> None:
    if item.get_closest_marker("timeout") is None:
        item.add_marker(pytest.mark.timeout(SERVER_TEST_TIMEOUT_S))


@contextlib.contextmanager
def serve_llm(llm: Any, name: str, **app_kw: Any) -> Iterator[str]:
    """Serve ``llm`` (the runtime LLM or a fake with its incremental API) as model ``name``;
    yields the base URL."""
    with ServerThread(build_app(llm, name, **app_kw)) as url:
        yield url


@dataclass
class ServeProcess:
    """A running ``eagle3 serve`` subprocess: its base URL, process, combined stdout/stderr log
    and ``--ready-file``."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    ready: Path

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self, timeout: float = 30.0) -> int:
        """Ctrl-C, as a user would; kill if it does not stop. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return int(self.proc.returncode)


def _wait_ready(server: ServeProcess, ready: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if server.proc.poll() is not None:
            pytest.fail(f"eagle3 serve exited with status {server.proc.returncode} before it was ready:\n"
                        f"{server.log_tail()}")
        if time.monotonic() > deadline:
            pytest.fail(f"eagle3 serve was not ready after {timeout:.0f} s:\n{server.log_tail()}")
        time.sleep(0.1)
    info = json.loads(ready.read_text())
    # The ready file is written by the server process itself: its pid says the URL is ours.
    assert info["pid"] == server.proc.pid, (info, server.proc.pid)
    server.url = info["url"]
    r = httpx.get(server.url + "/health", trust_env=False, timeout=30)
    assert r.status_code == 200, r.text


@contextlib.contextmanager
def serve_cli(args: list[str], workdir: Path, *, timeout: float = START_TIMEOUT_S) -> Iterator[ServeProcess]:
    """``python -m eagle3.cli serve ARGS --port 0 --ready-file ...``; yields it once it answers
    ``/health``, and stops it (Ctrl-C, then kill) on the way out. The log is ``workdir/serve.log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    log, ready = workdir / "serve.log", workdir / "ready.json"
    with log.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "eagle3.cli", "serve", *args, "--port", "0",
                                 "--ready-file", str(ready)], stdout=f, stderr=subprocess.STDOUT)
    server = ServeProcess("", proc, log, ready)
    try:
        _wait_ready(server, ready, timeout)
        yield server
    finally:
        server.stop()
