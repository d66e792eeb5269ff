"""A live ``eagle3 serve TARGET --draft DRAFT`` (the CLI, in a subprocess) of the tiny Kimi-K2.5
target + EAGLE-3 draft on loopback: the ``openai`` client, and lm-eval's ``local-completions``
scoring GSM8K the same as eagle3's own validator, document by document; Ctrl-C stops it cleanly.

1-shot prompts (~400 tokens each with the tiny tokenizer): the comparison is the same at any shot
count, and the prefills are most of the test's CPU (lm-eval's default 5-shot, ~1,600 tokens each, made
it ~25 s of CPU; 1-shot ~10 s). Longer prompts through the real engine are the bf16 case of
``tests/validate/test_serve_validate.py`` (3-shot); lm-eval's 5-shot contexts equal eagle3's in
``tests/validate/test_gsm8k.py``.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from eagle3.cli import main
from tests.serve.servers import serve_cli
from tests.validate import lmeval

# 2 documents: each is compared on its own (prompt, greedy completion, both extractions), and the two
# are in flight together (num_concurrent / --concurrency 4), so batching is covered as with 4
LIMIT, MAX_TOKENS = 2, 12
SHOTS = 1

# A hang fails in minutes, not at the suite's 10-minute limit (the first test also pays for the
# server's start-up: the fixture counts towards it).
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def kimi_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    """``eagle3 serve`` of the tiny Kimi target + draft on an OS-chosen port (--port 0 --ready-file)."""
    with serve_cli([str(tiny_dir / "kimi-k2.5"), "--draft", str(tiny_dir / "kimi-k2.5-eagle3"),
                    "--log-level", "warning"], tmp_path_factory.mktemp("serve")) as server:
        yield server.url, server


def test_openai_client(kimi_server: Any) -> None:
    url, _ = kimi_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == ["kimi-k2.5"]
    prompt = "Question: What is 2 + 3?\nAnswer:"
    c = client.completions.create(model="kimi-k2.5", prompt=prompt, max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model="kimi-k2.5", prompt=prompt, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
    assert chunks[-1].usage.completion_tokens == c.usage.completion_tokens > 0
    chat = client.chat.completions.create(model="kimi-k2.5", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.prompt_tokens > 3
    metrics = httpx.get(url + "/metrics", trust_env=False).text
    assert "eagle3:spec_decode_num_drafts_total" in metrics


def test_lm_eval_local_completions_scores_equal_eagle3s(kimi_server: Any, tiny_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = kimi_server
    data = lmeval.gsm8k_dir()
    report = tmp_path / "ours.json"
    with pytest.raises(SystemExit) as e:
        main(["validate", "--base-url", url, "--limit", str(LIMIT), "--max-tokens", str(MAX_TOKENS),
              "--num-fewshot", str(SHOTS), "--concurrency", "4", "--dataset", str(data), "--report", str(report)])
    out = capsys.readouterr()
    assert e.value.code == 0, out.out + out.err
    ours = json.loads(report.read_text())
    assert ours["speculative"]["num_drafts"] > 0 and ours["num_fewshot"] == SHOTS
    # num_concurrent=4: the runtime's reference kernels are batch invariant, so batching lm-eval's
    # requests together does not change their greedy output
    # (max_length lifts lm-eval's default left-truncation of prompts to 2048 - max_gen_toks tokens)
    theirs = lmeval.run(tmp_path, model="local-completions", limit=LIMIT, num_fewshot=SHOTS, model_args=(
        f"base_url={url}/v1/completions,model=kimi-k2.5,tokenizer_backend=huggingface,"
        f"tokenizer={tiny_dir / 'kimi-k2.5'},max_gen_toks={MAX_TOKENS},max_length=8192,num_concurrent=4,"
        "max_retries=1"))
    res = theirs["results"]
    assert ours["accuracy"]["strict-match"]["exact_match"] == pytest.approx(res["exact_match,strict-match"])
    assert ours["accuracy"]["flexible-extract"]["exact_match"] == pytest.approx(res["exact_match,flexible-extract"])
    by_filter = {(s["doc_id"], s["filter"]): s for s in theirs["samples"]}
    assert len(by_filter) == 2 * LIMIT
    for sample in ours["samples"]:
        i = sample["doc_id"]
        # same prompt (lm-eval sends token ids, eagle3 text), same greedy completion, same extraction
        assert by_filter[(i, "strict-match")]["resps"][0][0] == sample["completion"]
        assert by_filter[(i, "strict-match")]["filtered_resps"][0] == sample["strict"]
        assert by_filter[(i, "flexible-extract")]["filtered_resps"][0] == sample["flexible"]


def test_ctrl_c_stops_the_server(kimi_server: Any) -> None:
    url, server = kimi_server
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(30) == 130  # graceful shutdown, then the conventional Ctrl-C status
    text = server.log.read_text()
    assert "Traceback" not in text and f"serving kimi-k2.5 on {url}/v1" in text  # the real port
    assert not server.ready.exists()  # "ready" no longer: the file goes with the server
