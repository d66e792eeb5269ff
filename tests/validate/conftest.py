"""Servers for the validation tests: the real engine over toy models (with and without a draft)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.serve.fakes import toy_llm
from tests.serve.servers import add_default_timeout, serve_llm


def pytest_itemcollected(item: pytest.Item) -> None:
    add_default_timeout(item)  # (called for the tests below this directory only)


def _serve(llm: Any, name: str) -> Iterator[tuple[str, Any]]:
    with serve_llm(llm, name) as url:
        yield url, llm


@pytest.fixture(scope="module")
def spec_server(tiny_tokenizer: Any) -> Iterator[tuple[str, Any]]:
    """Toy target + noisy EAGLE draft (k = 3)."""
    yield from _serve(toy_llm(tiny_tokenizer, "noisy"), "toy")


@pytest.fixture(scope="module")
def plain_server(tiny_tokenizer: Any) -> Iterator[tuple[str, Any]]:
    """The same toy target without speculation."""
    yield from _serve(toy_llm(tiny_tokenizer, None), "toy")


@pytest.fixture(scope="module")
def other_server(tiny_tokenizer: Any) -> Iterator[tuple[str, Any]]:
    """A different toy target (another seed): its greedy output differs."""
    yield from _serve(toy_llm(tiny_tokenizer, None, seed=1), "toy")
