"""Servers on loopback for the HTTP tests (module-scoped: one engine thread per test module)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.serve.fakes import toy_llm
from tests.serve.servers import add_default_timeout, serve_llm


def pytest_itemcollected(item: pytest.Item) -> None:
    add_default_timeout(item)  # (called for the tests below this directory only)


@pytest.fixture(scope="module")
def toy_server(tiny_tokenizer: Any) -> Iterator[tuple[str, Any]]:
    """(base URL, LLM): the real engine over toy models with a noisy EAGLE draft, k = 3."""
    llm = toy_llm(tiny_tokenizer)
    with serve_llm(llm, "toy") as url:
        yield url, llm
