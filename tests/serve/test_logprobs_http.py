"""Logprobs over HTTP (OpenAI's shapes as vLLM writes them) from ``eagle3 serve``'s app on loopback,
serving the trained tiny pair three ways: plain, a chain draft and a tree draft.

What is checked: speculative and plain servers answer the same logprobs (bit for bit: JSON floats
round-trip exactly); the numbers are the model's own log_softmax (one independent prefill of the
target over prompt + output, fp32, within 1e-5); echo with max_tokens 0 scores the prompt alone;
``return_tokens_as_token_ids``; streamed chunks add up to the non-streamed answer and, with a stop
string, cover exactly the tokens counted in usage; chat's shape; the 400s.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from eagle3.runtime.engine.llm import LLM
from eagle3.testing import tiny, trained
from eagle3.testing.numerics import forced_logits
from eagle3.validate.endpoint import client_options
from tests.runtime.model_kit import single_thread
from tests.serve.servers import serve_llm

PROMPT = trained.gsm8k_style_prompt(trained.QUESTIONS[0])
CHAT = [{"role": "user", "content": trained.QUESTIONS[1]}]
TOP = 5
_threads = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def servers(trained_pair: Path) -> Iterator[dict[str, tuple[str, LLM]]]:
    """name -> (base URL, LLM): the trained target plain, with its draft as chains (k = 3) and as
    trees (top-k 2, depth 3); each its own loaded model."""
    target, draft = trained_pair / trained.NAME, trained_pair / f"{trained.NAME}-eagle3"
    llms = {"plain": LLM(target, None, dtype="float32", num_blocks=128),
            "chain": LLM(target, draft, dtype="float32", num_blocks=128, num_speculative_tokens=3),
            "tree": LLM(target, draft, dtype="float32", num_blocks=128, num_speculative_tokens=3,
                        speculative_eagle_topk=2)}
    with contextlib.ExitStack() as stack:
        yield {name: (stack.enter_context(serve_llm(llm, "m")), llm) for name, llm in llms.items()}


@pytest.fixture(scope="module")
def reference(trained_pair: Path) -> Any:
    """The target loaded on its own, for log_softmax over one prefill (``forced_logits``)."""
    from eagle3.runtime.loader import load_target

    return load_target(trained_pair / trained.NAME, dtype=torch.float32)


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + path, json={"model": "m", **body}, timeout=120, **client_options(url))
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", url + path, json={"model": "m", "stream": True, **body}, timeout=120,
                      trust_env=False) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_speculative_servers_answer_plains_logprobs_bit_for_bit(servers: dict[str, tuple[str, LLM]]) -> None:
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": TOP, "echo": True,
            "return_tokens_as_token_ids": True}
    chat = {"messages": CHAT, "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": TOP}
    answers = {name: (_post(url, "/v1/completions", body)["choices"][0],
                      _post(url, "/v1/chat/completions", chat)["choices"][0]) for name, (url, _) in servers.items()}
    for name in ("chain", "tree"):
        assert servers[name][1].stats.num_accepted_tokens > 0  # drafts were verified and kept
        assert answers[name] == answers["plain"], name
    lp = answers["plain"][0]["logprobs"]
    assert len(lp["tokens"]) == len(tiny.build_tokenizer().encode(PROMPT).ids) + 24


def test_served_logprobs_are_the_models_log_softmax(servers: dict[str, tuple[str, LLM]], reference: Any) -> None:
    url, _ = servers["chain"]
    prompt_ids = tiny.build_tokenizer().encode(PROMPT).ids
    choice = _post(url, "/v1/completions", {"prompt": prompt_ids, "max_tokens": 12, "temperature": 0.8,
                                            "seed": 5, "logprobs": TOP, "return_tokens_as_token_ids": True,
                                            "ignore_eos": True})["choices"][0]
    lp = choice["logprobs"]
    out_ids = _ids(lp["tokens"])
    ref = forced_logits(reference, prompt_ids + out_ids).log_softmax(-1)[len(prompt_ids) - 1:]
    for i, (tid, got, top) in enumerate(zip(out_ids, lp["token_logprobs"], lp["top_logprobs"], strict=True)):
        assert got == pytest.approx(ref[i, tid].item(), abs=1e-5)  # raw: not the temperature-0.8 one
        want_lp, want_ids = ref[i].topk(TOP)
        # the chosen token first, then the top N (N + 1 entries when it is not among them)
        keys = _ids(list(top))
        assert keys[0] == tid and set(keys) == {tid, *want_ids.tolist()}
        for t, v in zip(want_ids.tolist(), want_lp.tolist(), strict=True):
            assert top[f"token_id:{t}"] == pytest.approx(v, abs=1e-5)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(out_ids))]


def test_echo_with_max_tokens_0_scores_the_prompt(servers: dict[str, tuple[str, LLM]], reference: Any) -> None:
    """lm-eval's loglikelihood request shape (token-id prompts, a batch of two), prompt only."""
    url, _ = servers["tree"]
    tok = tiny.build_tokenizer()
    prompts = [tok.encode(PROMPT).ids, tok.encode("Question: What is 2 + 3?\nAnswer: 5").ids]
    res = _post(url, "/v1/completions", {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1,
                                         "temperature": 0, "return_tokens_as_token_ids": True})
    assert res["usage"]["completion_tokens"] == 0
    for ids, choice in zip(prompts, res["choices"], strict=True):
        assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert _ids(lp["tokens"]) == ids
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = forced_logits(reference, ids).log_softmax(-1)
        want = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), want, rtol=0, atol=1e-5)
        assert all(len(t) in (1, 2) for t in lp["top_logprobs"][1:])
    # without token ids the tokens are decoded one by one; the text is the prompt
    plain = _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert plain["choices"][0]["text"] == PROMPT and "".join(plain["choices"][0]["logprobs"]["tokens"]) == PROMPT
    # vLLM's prompt_logprobs: the prompt token and the top N per position, by token id
    pl = _post(url, "/v1/completions", {"prompt": prompts[1], "max_tokens": 1, "prompt_logprobs": 2,
                                        "temperature": 0})["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(prompts[1])
    for tid, entry in zip(prompts[1][1:], pl[1:], strict=True):
        assert str(tid) in entry and 2 <= len(entry) <= 3
        assert {1, 2} <= {e["rank"] for e in entry.values()}  # the top 2, the prompt token possibly one


def _joined(chunks: list[dict[str, Any]]) -> tuple[str, dict[str, list[Any]]]:
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in chunks:
        for c in ch["choices"]:
            text += c["text"]
            for k in lp:
                lp[k] += c["logprobs"][k]
    return text, lp


@pytest.mark.parametrize("stop", [None, ["<<"]], ids=["no-stop", "stop-string"])
def test_streamed_logprobs_add_up_to_the_answer(servers: dict[str, tuple[str, LLM]], stop: list[str] | None) -> None:
    url, _ = servers["chain"]
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "logprobs": 2, "echo": True, "stop": stop}
    whole = _post(url, "/v1/completions", body)
    chunks = _stream(url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    text, lp = _joined([c for c in chunks if c["choices"]])
    choice = whole["choices"][0]
    assert text == choice["text"] and lp == choice["logprobs"]
    n_prompt = whole["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) - n_prompt == whole["usage"]["completion_tokens"] == chunks[-1]["usage"]["completion_tokens"]
    if stop:  # the trained model writes calculator annotations: the stop string cuts the output
        assert choice["finish_reason"] == "stop" and "<<" not in text[len(PROMPT):]
        # the tokens counted (and scored) end with the one that completes "<<"
        out = lp["tokens"][n_prompt:]
        assert "".join(out).startswith(text[len(PROMPT):]) and "<<" in "".join(out)
        assert "<<" not in "".join(out[:-1])


def test_chat_logprobs(servers: dict[str, tuple[str, LLM]]) -> None:
    url, _ = servers["tree"]
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    choice = _post(url, "/v1/chat/completions", body)["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    for c in content:
        assert c["bytes"] == list(c["token"].encode()) and len(c["top_logprobs"]) == 3
        tops = [t["logprob"] for t in c["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and c["top_logprobs"][0]["token"] == c["token"]  # greedy
        assert c["logprob"] == tops[0]
    streamed = [c for ch in _stream(url, "/v1/chat/completions", body) for c in ch["choices"]]
    assert [x for c in streamed if c["logprobs"] for x in c["logprobs"]["content"]] == content
    only = _post(url, "/v1/chat/completions", {**body, "top_logprobs": None})["choices"][0]["logprobs"]["content"]
    assert [c["top_logprobs"] for c in only] == [[]] * len(content)  # logprobs alone: no alternatives
    oai = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
    parsed = oai.chat.completions.create(model="m", messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                         top_logprobs=2)
    assert [c.logprob for c in parsed.choices[0].logprobs.content] == [c["logprob"] for c in content[:4]]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": True, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
])
def test_bad_logprob_requests_are_400_naming_the_field(servers: dict[str, tuple[str, LLM]], path: str,
                                                       body: dict[str, Any], param: str) -> None:
    url, _ = servers["plain"]
    r = httpx.post(url + path, json=body, timeout=60, **client_options(url))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error", err


def test_max_logprobs_is_the_servers_cap(tiny_tokenizer: Any, tiny_dir: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    from eagle3.cli import main
    from tests.serve.fakes import toy_llm

    with serve_llm(toy_llm(tiny_tokenizer, None, max_logprobs=2), "m") as url:
        ok = _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 2})
        assert all(len(t) in (2, 3) for t in ok["choices"][0]["logprobs"]["top_logprobs"])
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "logprobs": 3}, trust_env=False)
        assert r.status_code == 400 and "at most 2" in r.json()["error"]["message"]
    with pytest.raises(SystemExit) as e:  # refused before anything loads
        main(["serve", str(tiny_dir / "kimi-k2.5"), "--max-logprobs", "-1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--max-logprobs must be an integer >= 0" in err and "Traceback" not in err
