"""lm-eval's ``local-completions`` / ``local-chat-completions`` and ``eagle3 validate`` against
the same server give the same GSM8K scores, document by document.

The server runs a scripted engine that answers most questions correctly, some only in a form that
``flexible-extract`` accepts and some wrongly, and runs on into a new "Question:" that the server
must cut at lm-eval's stop string: so both scores are strictly between 0 and 1 and differ.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eagle3.cli import main
from eagle3.validate import gsm8k
from tests.serve.fakes import ScriptedLLM, gsm8k_oracle, load_tiny_tokenizer
from tests.serve.servers import serve_llm
from tests.validate import lmeval

# 8 documents hold all three of the oracle's answer kinds (right, flexible-extract only, wrong: 2 / 2 / 4
# of them), so both scores stay strictly between 0 and 1 and differ; 20 only repeated them.
LIMIT = 8


@pytest.fixture(scope="module")
def oracle_server(tiny_dir: Path) -> Iterator[tuple[str, ScriptedLLM]]:
    _, test = gsm8k.load_dataset(lmeval.gsm8k_dir())
    gold = {d.question.strip(): d.answer.split("####")[-1].strip() for d in test}
    llm = ScriptedLLM(load_tiny_tokenizer(tiny_dir), gsm8k_oracle(gold), tokens_per_step=4)
    with serve_llm(llm, "tiny-oracle") as url:
        yield url, llm


def _validate(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    report = tmp_path / "ours.json"
    with pytest.raises(SystemExit) as e:
        main(["validate", "--base-url", url, "--limit", str(LIMIT), "--dataset", str(lmeval.gsm8k_dir()),
              "--report", str(report), "--concurrency", "4", *extra])
    out = capsys.readouterr()
    assert e.value.code == 0, out.out + out.err
    assert "exact_match strict-match" in out.out
    return json.loads(report.read_text())


def test_local_completions_scores_equal_eagle3s(oracle_server: Any, tiny_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    url, llm = oracle_server
    ours = _validate(url, tmp_path, capsys)
    n_ours = len(llm.requests_seen)
    theirs = lmeval.run(tmp_path, model="local-completions", limit=LIMIT, model_args=(
        f"base_url={url}/v1/completions,model=tiny-oracle,tokenizer_backend=huggingface,"
        f"tokenizer={tiny_dir / 'kimi-k2.5'},max_length=8192,num_concurrent=1,max_retries=1"))
    # lm-eval sent token ids (its default), we sent text: the server saw the same prompts (max_length
    # lifts lm-eval's default left-truncation to 2048 - 256 tokens, which cuts a few 5-shot prompts)
    lm_prompts = llm.requests_seen[n_ours:]
    assert len(lm_prompts) == LIMIT
    tok = llm.tokenizer
    ours_ids = sorted(tok(s["prompt"], add_special_tokens=False)["input_ids"] for s in _prompts(ours))
    assert sorted(lm_prompts) == ours_ids

    res = theirs["results"]
    strict, flexible = res["exact_match,strict-match"], res["exact_match,flexible-extract"]
    assert 0 < strict < flexible < 1, res  # the oracle makes the two filters differ
    assert ours["accuracy"]["strict-match"]["exact_match"] == pytest.approx(strict)
    assert ours["accuracy"]["flexible-extract"]["exact_match"] == pytest.approx(flexible)
    assert ours["accuracy"]["strict-match"]["stderr"] == pytest.approx(res["exact_match_stderr,strict-match"])
    by_filter = {(s["doc_id"], s["filter"]): s for s in theirs["samples"]}
    for sample in ours["samples"]:
        i = sample["doc_id"]
        assert by_filter[(i, "strict-match")]["resps"][0][0] == sample["completion"]
        assert by_filter[(i, "strict-match")]["filtered_resps"][0] == sample["strict"]
        assert by_filter[(i, "flexible-extract")]["filtered_resps"][0] == sample["flexible"]
        assert "Question:" not in sample["completion"]  # the server honoured the stop string


def _prompts(report: dict[str, Any]) -> list[dict[str, str]]:
    """The prompts eagle3 sent, rebuilt the way validate built them."""
    train, test = gsm8k.load_dataset(lmeval.gsm8k_dir())
    return [{"prompt": p} for p in gsm8k.build_prompts(train, test, report["num_fewshot"], report["n_samples"])]


def test_local_chat_completions_runs_unchanged(oracle_server: Any, tmp_path: Path) -> None:
    url, _ = oracle_server
    theirs = lmeval.run(tmp_path, model="local-chat-completions", limit=6, apply_chat_template=True,
                        model_args=f"base_url={url}/v1/chat/completions,model=tiny-oracle,max_retries=1")
    res = theirs["results"]
    assert len(theirs["samples"]) == 12
    assert res["exact_match,flexible-extract"] > 0
    assert all(s["resps"][0][0] and "Question:" not in s["resps"][0][0] for s in theirs["samples"])
