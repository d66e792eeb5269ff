"""The official ``openai`` Python client, unchanged, against the server on loopback."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.serve.test_protocol import PROMPT, reference


@pytest.fixture(scope="module")
def oai(toy_server: tuple[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=toy_server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_and_completions(oai: openai.OpenAI, toy_server: Any, tiny_tokenizer: Any) -> None:
    assert [m.id for m in oai.models.list()] == ["toy"]
    _, text = reference(tiny_tokenizer, toy_server[1], PROMPT, 8)
    c = oai.completions.create(model="toy", prompt=PROMPT, max_tokens=8, temperature=0)
    assert c.choices[0].text == text and c.usage.completion_tokens > 0
    stream = oai.completions.create(model="toy", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == c.usage.completion_tokens


def test_chat(oai: openai.OpenAI, toy_server: Any, tiny_tokenizer: Any) -> None:
    msgs = [{"role": "user", "content": "Say hi."}]
    rendered = tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    _, text = reference(tiny_tokenizer, toy_server[1], rendered, 6)
    c = oai.chat.completions.create(model="toy", messages=msgs, max_tokens=6, temperature=0, seed=3)
    assert c.choices[0].message.content == text and c.choices[0].message.role == "assistant"
    parts = [ch.choices[0].delta.content or "" for ch in
             oai.chat.completions.create(model="toy", messages=msgs, max_tokens=6, temperature=0, stream=True)]
    assert "".join(parts) == text


def test_errors_become_client_exceptions(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.completions.create(model="toy", prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="x", max_tokens=2)
