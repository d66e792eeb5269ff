"""The OpenAI-compatible API on loopback, over the real engine with toy models.

Outputs are checked against the toy target's cache-free greedy reference
(:func:`eagle3.testing.toy_models.toy_reference_greedy`) decoded with the tiny Kimi tokenizer, so a
wrong token, a lost stream chunk or a stop string cut in the wrong place shows up as a text
difference.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from eagle3.testing.toy_models import ToyTarget, toy_reference_greedy
from tests.serve.fakes import toy_llm
from tests.serve.servers import serve_llm

PROMPT = "Question: Natalia sold clips to 48 of her friends. How many clips did she sell?\nAnswer:"


@pytest.fixture(scope="module")
def client(toy_server: tuple[str, Any]) -> httpx.Client:
    with httpx.Client(base_url=toy_server[0], timeout=60, trust_env=False) as c:
        yield c


def reference(tok: Any, llm: Any, prompt: str | list[int], max_tokens: int) -> tuple[list[int], str]:
    ids = prompt if isinstance(prompt, list) else tok(prompt, add_special_tokens=False)["input_ids"]
    out = toy_reference_greedy(ToyTarget(vocab_size=len(tok)), ids, max_tokens, stop_ids=llm.eos_ids)
    return out, tok.decode(out, skip_special_tokens=True)


def sse(lines: Any) -> list[Any]:
    """The JSON payloads of an SSE stream, and "[DONE]"."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_health_models_version(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "toy"
    assert models["data"][0]["max_model_len"] == 4096
    assert "version" in client.get("/version").json()


def test_completion_matches_reference(client: httpx.Client, toy_server: Any, tiny_tokenizer: Any) -> None:
    ids, text = reference(tiny_tokenizer, toy_server[1], PROMPT, 12)
    r = client.post("/v1/completions", json={"model": "toy", "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "toy"
    choice = body["choices"][0]
    assert choice["text"] == text and choice["index"] == 0
    assert choice["finish_reason"] == ("length" if len(ids) == 12 else "stop")
    n_prompt = len(tiny_tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": len(ids),
                             "total_tokens": n_prompt + len(ids)}


@pytest.mark.parametrize("form", ["texts", "ids", "id_lists"])
def test_prompt_forms(client: httpx.Client, toy_server: Any, tiny_tokenizer: Any, form: str) -> None:
    texts = [PROMPT, "Question: What is 7 times 6?\nAnswer:", "Hello"]
    id_lists = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    prompt = {"texts": texts, "ids": id_lists[0], "id_lists": id_lists}[form]
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    expect = id_lists[:1] if form == "ids" else id_lists
    assert [c["index"] for c in choices] == list(range(len(expect)))
    for c, ids in zip(choices, expect, strict=True):
        assert c["text"] == reference(tiny_tokenizer, toy_server[1], ids, 6)[1]
    assert r.json()["usage"]["prompt_tokens"] == sum(len(i) for i in expect)


def test_stream_equals_non_stream(client: httpx.Client, toy_server: Any, tiny_tokenizer: Any) -> None:
    ids, text = reference(tiny_tokenizer, toy_server[1], PROMPT, 20)
    body = {"prompt": [PROMPT, "Hello"], "max_tokens": 20, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    parts: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str] = {}
    for e in events[:-2]:
        assert e["usage"] is None and e["object"] == "text_completion"
        (c,) = e["choices"]
        parts[c["index"]] += c["text"]
        if c["finish_reason"]:
            finish[c["index"]] = c["finish_reason"]
    assert parts[0] == text
    assert parts[1] == reference(tiny_tokenizer, toy_server[1], "Hello", 20)[1]
    assert set(finish) == {0, 1}
    assert usage["usage"]["completion_tokens"] == len(ids) + len(reference(tiny_tokenizer, toy_server[1], "Hello", 20)[0])


def _stop_from(text: str) -> tuple[str, int]:
    """A 3-character stop string whose first occurrence is inside ``text``, past its start."""
    for i in range(4, len(text) - 3):
        s = text[i:i + 3]
        if "\ufffd" not in s and text.find(s) == i:
            return s, i
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(client: httpx.Client, toy_server: Any, tiny_tokenizer: Any, stream: bool, include: bool) -> None:
    ids, text = reference(tiny_tokenizer, toy_server[1], PROMPT, 30)
    stop, at = _stop_from(text)
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stop": ["@@never@@", stop],
            "include_stop_str_in_output": include, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    if stream:
        with client.stream("POST", "/v1/completions", json=body) as r:
            events = sse(r.iter_lines())
        got = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"])
        reason = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e["choices"]][-1]
        n = events[-2]["usage"]["completion_tokens"]
    else:
        c = client.post("/v1/completions", json=body).json()
        got, reason, n = c["choices"][0]["text"], c["choices"][0]["finish_reason"], c["usage"]["completion_tokens"]
        assert c["choices"][0]["stop_reason"] == stop
    assert got == text[: at + len(stop) if include else at]
    assert reason == "stop"
    # completion_tokens counts up to the token that completes the stop string
    need = next(j for j in range(1, len(ids) + 1)
                if stop in tiny_tokenizer.decode(ids[:j], skip_special_tokens=True))
    assert n == need


def test_echo(client: httpx.Client, toy_server: Any, tiny_tokenizer: Any) -> None:
    _, text = reference(tiny_tokenizer, toy_server[1], PROMPT, 5)
    c = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True}).json()
    assert c["choices"][0]["text"] == PROMPT + text
    ids = tiny_tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    c = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "temperature": 0, "echo": True}).json()
    assert c["choices"][0]["text"].startswith("Hello world")


def test_seeded_sampling_is_reproducible(client: httpx.Client) -> None:
    def sample(seed: int) -> str:
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "top_k": 50, "seed": seed}
        return client.post("/v1/completions", json=body).json()["choices"][0]["text"]

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_chat_uses_the_chat_template(client: httpx.Client, toy_server: Any, tiny_tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is 6 times 7?"}]}]
    rendered = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 times 7?"}],
        tokenize=False, add_generation_prompt=True)
    assert "<|im_user|>" in rendered
    ids, text = reference(tiny_tokenizer, toy_server[1], rendered, 10)
    r = client.post("/v1/chat/completions", json={"model": "toy", "messages": messages, "max_tokens": 10,
                                                  "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["usage"]["prompt_tokens"] == len(tiny_tokenizer(rendered, add_special_tokens=False)["input_ids"])
    with client.stream("POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 10,
                                                             "temperature": 0, "stream": True}) as r:
        events = sse(r.iter_lines())
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == text
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


def test_tokenizer_endpoints(client: httpx.Client, tiny_tokenizer: Any) -> None:
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == tiny_tokenizer.eos_token and info["chat_template"]
    tok = client.post("/tokenize", json={"prompt": PROMPT}).json()
    assert tok["tokens"] == tiny_tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert tok["count"] == len(tok["tokens"])
    assert client.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == PROMPT
    eos = client.post("/tokenize", json={"prompt": tiny_tokenizer.eos_token}).json()["tokens"]
    assert eos == [tiny_tokenizer.eos_token_id]


def test_metrics_count_requests_and_speculation(client: httpx.Client) -> None:
    from eagle3.validate.metrics_client import parse_spec_counters

    before = parse_spec_counters(client.get("/metrics").text)
    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 20, "temperature": 0})
    text = client.get("/metrics").text
    after = parse_spec_counters(text)
    assert after.source == "eagle3" and len(after.accepted_per_pos) == 3
    assert after.num_drafts > before.num_drafts
    assert after.num_draft_tokens - before.num_draft_tokens >= after.num_drafts - before.num_drafts
    assert 0 <= after.num_accepted_tokens - before.num_accepted_tokens <= after.num_draft_tokens - before.num_draft_tokens
    for name in ("eagle3:request_success_total", "eagle3:generation_tokens_total",
                 "eagle3:time_to_first_token_seconds_bucket", "eagle3:time_per_output_token_seconds_bucket",
                 "eagle3:e2e_request_latency_seconds_count", "eagle3:kv_cache_usage_perc",
                 "eagle3:spec_decode_num_accepted_tokens_per_pos_total"):
        assert name in text, name


def test_metrics_include_a_response_s_last_step_when_it_arrives(client: httpx.Client, toy_server: tuple[str, Any],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that scrapes /metrics as soon as its response arrives (a benchmark's before/after
    delta) sees every step that produced it: the engine thread updates the counters before it hands
    a step's outputs over. Updating them slowly (a delay here) must not let a response overtake."""
    import time

    from eagle3.serve.metrics import ServerMetrics
    from eagle3.validate.metrics_client import parse_spec_counters

    observe = ServerMetrics.observe_engine

    def slow(self: ServerMetrics, llm: Any) -> None:
        time.sleep(0.2)
        observe(self, llm)

    llm = toy_server[1]
    before, drafts = parse_spec_counters(client.get("/metrics").text), llm.stats.num_drafts
    monkeypatch.setattr(ServerMetrics, "observe_engine", slow)
    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    after = parse_spec_counters(client.get("/metrics").text)
    assert llm.stats.num_drafts > drafts
    assert after.num_drafts - before.num_drafts == llm.stats.num_drafts - drafts


# -- errors ------------------------------------------------------------------------------------
LONG = list(range(1, 5000))
BAD: list[tuple[str, str, Any, int, str | None]] = [
    # (method, path, body (str: raw), status, param)
    ("POST", "/v1/completions", "{not json", 400, None),
    ("POST", "/v1/completions", "[1, 2]", 400, None),
    ("POST", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "x", "frobnicate": True}, 400, "frobnicate"),
    ("POST", "/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("POST", "/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 10 ** 6}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": LONG, "max_tokens": 1}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": [5, 99999]}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 2}, 400, None),
    ("POST", "/v1/completions", {"prompt": "x", "logprobs": 100}, 400, "logprobs"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("POST", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "x", "seed": "abc"}, 400, "seed"),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 6},
     400, "max_tokens"),
    ("GET", "/v1/completions", None, 405, None),
    ("GET", "/v1/nothing-here", None, 404, None),
]


def test_malformed_requests_get_openai_errors(client: httpx.Client, toy_server: Any) -> None:
    assert len(BAD) >= 20
    for method, path, body, status, param in BAD:
        kw: dict[str, Any] = {}
        if isinstance(body, str):
            kw = {"content": body, "headers": {"content-type": "application/json"}}
        elif body is not None:
            kw = {"json": body}
        r = client.request(method, path, **kw)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"], body
        assert err["type"] and "\n" not in err["message"]
        if param is not None:
            assert err["param"] == param, (body, err)
    # The engine never saw them and keeps serving.
    assert client.get("/health").status_code == 200
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}).status_code == 200
    llm = toy_server[1]
    assert not llm.has_unfinished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_context_length_message(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": [1] * 4000, "max_tokens": 200})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "4096" in err["message"] and "4200" in err["message"]


def test_api_key(tiny_tokenizer: Any) -> None:
    with (serve_llm(toy_llm(tiny_tokenizer, None), "toy", api_key="s3cret") as url,
          httpx.Client(base_url=url, trust_env=False) as c):
        body = {"prompt": "hi", "max_tokens": 2}
        assert c.post("/v1/completions", json=body).status_code == 401
        r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get("/v1/models").status_code == 401
        ok = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        assert 'status="401"' in c.get("/metrics").text
