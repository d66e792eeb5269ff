"""A live ``eagle3 serve`` of the tiny Kimi-K2.5 target + EAGLE-3 draft (the real runtime) on
loopback: the ``openai`` client, and lm-eval's ``local-completions`` scoring GSM8K the same as
eagle3's own validator, document by document.

0-shot prompts: the reference CPU kernels make 5-shot prefills too slow for the test budget (the
5-shot prompts are compared with lm-eval's in tests/validate/test_gsm8k.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from eagle3.cli import main
from eagle3.serve.launcher import EngineOptions, ServerThread, build_app, build_llm
from tests.validate import lmeval

LIMIT, MAX_TOKENS = 20, 16


@pytest.fixture(scope="module")
def kimi_server(tiny_dir: Path) -> Iterator[tuple[str, Any]]:
    llm = build_llm(tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.5-eagle3", EngineOptions(num_speculative_tokens=3))
    with ServerThread(build_app(llm, "kimi-k2.5", root=str(tiny_dir / "kimi-k2.5"))) as url:
        yield url, llm


def test_openai_client(kimi_server: Any) -> None:
    url, llm = kimi_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
    c = client.completions.create(model="kimi-k2.5", prompt="Question: What is 2 + 3?\nAnswer:", max_tokens=6,
                                  temperature=0)
    direct = llm.generate(["Question: What is 2 + 3?\nAnswer:"], _greedy(6))[0]
    assert c.choices[0].text == direct.text and c.usage.completion_tokens == len(direct.token_ids)
    chat = client.chat.completions.create(model="kimi-k2.5", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.prompt_tokens > 3


def _greedy(n: int) -> Any:
    from eagle3.runtime.sampling import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n)


def test_lm_eval_local_completions_scores_equal_eagle3s(kimi_server: Any, tiny_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = kimi_server
    data = lmeval.need_gsm8k()
    report = tmp_path / "ours.json"
    with pytest.raises(SystemExit) as e:
        main(["validate", "--base-url", url, "--limit", str(LIMIT), "--num-fewshot", "0", "--max-tokens",
              str(MAX_TOKENS), "--concurrency", "4", "--dataset", str(data), "--report", str(report)])
    out = capsys.readouterr()
    assert e.value.code == 0, out.out + out.err
    ours = json.loads(report.read_text())
    assert ours["speculative"]["num_drafts"] > 0
    theirs = lmeval.run(tmp_path, model="local-completions", limit=LIMIT, num_fewshot=0, model_args=(
        f"base_url={url}/v1/completions,model=kimi-k2.5,tokenizer_backend=huggingface,"
        f"tokenizer={tiny_dir / 'kimi-k2.5'},max_gen_toks={MAX_TOKENS},num_concurrent=1,max_retries=1"))
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
