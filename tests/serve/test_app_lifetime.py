"""A server that stops lets its LLM go: ``serve --validate`` and ``quantize --eval`` serve one model,
stop, and load the next, which must not sit in memory beside the first (on a GPU at TP=1: two
models' weights at once)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import httpx

from tests.serve.fakes import toy_llm
from tests.serve.servers import serve_llm


def test_a_stopped_server_keeps_no_reference_to_its_llm(tiny_tokenizer: Any) -> None:
    llm = toy_llm(tiny_tokenizer)
    gone = weakref.ref(llm)
    with serve_llm(llm, "toy") as url, httpx.Client(base_url=url, timeout=60) as c:
        # every endpoint answers once (FastAPI classifies an endpoint on its first request)
        for path in ("/health", "/version", "/metrics", "/v1/models", "/get_server_info", "/tokenizer_info"):
            assert c.get(path).status_code == 200, path
        assert c.post("/tokenize", json={"model": "toy", "prompt": "hi"}).status_code == 200
        assert c.post("/detokenize", json={"model": "toy", "tokens": [5, 6]}).status_code == 200
        assert c.post("/v1/completions", json={"model": "toy", "prompt": "hi", "max_tokens": 2}).status_code == 200
        chat = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert c.post("/v1/chat/completions", json=chat).status_code == 200
        assert c.post("/v1/completions", json={"model": "nope", "prompt": "hi"}).status_code == 404
    del llm
    gc.collect()
    assert gone() is None
