"""Servers on loopback for the HTTP tests (module-scoped: one engine thread per test module)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from eagle3.serve.launcher import ServerThread, build_app
from tests.serve.fakes import load_tiny_tokenizer, toy_llm


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir: Any) -> Any:
    return load_tiny_tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def toy_server(tiny_tokenizer: Any) -> Iterator[tuple[str, Any]]:
    """(base URL, LLM): the real engine over toy models with a noisy EAGLE draft, k = 3."""
    llm = toy_llm(tiny_tokenizer)
    with ServerThread(build_app(llm, "toy")) as url:
        yield url, llm
