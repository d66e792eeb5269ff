"""GSM8K prompts, extraction and scoring against lm-evaluation-harness's own code."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from eagle3.errors import DownloadError, UsageError
from eagle3.validate import gsm8k
from tests.validate import lmeval


@pytest.fixture(scope="module")
def data() -> tuple[list[gsm8k.Doc], list[gsm8k.Doc]]:
    return gsm8k.load_dataset(lmeval.gsm8k_dir())


def test_dataset_sizes(data: Any) -> None:
    train, test = data
    assert (len(train), len(test)) == (7473, 1319)
    assert test[0].answer.endswith("#### 18")


def test_prompts_equal_lm_evals(data: Any, tmp_path: Path) -> None:
    """lm-eval builds its 5-shot contexts from its installed gsm8k.yaml; ours must be identical,
    including the few-shot sampling (one Random(1234) over the documents in order)."""
    got = lmeval.run(tmp_path, mode="contexts", limit=12)
    train, test = data
    ours = gsm8k.build_prompts(train, test, 5, 12)
    assert got["contexts"] == ours
    gen = got["gen_kwargs"]
    assert list(gen["until"]) == list(gsm8k.STOP) and gen["temperature"] == 0.0 and gen["do_sample"] is False
    assert ours[0].endswith("Question: " + test[0].question + "\nAnswer:")
    assert ours[0].count("Question: ") == 6
    zero = gsm8k.build_prompts(train, test, 0, 2)
    assert zero == [f"Question: {d.question}\nAnswer:" for d in test[:2]]


TRICKY = [
    "Natalia sold 48 + 24 = 72 clips.\n#### 72",
    "#### 1,234",
    "#### -5.5",
    "#### $100",
    "So 3 + 4 = 7. Then $1,000.50 in total",
    "She has 18 dollars.",
    "5",
    "Answer: 10.",
    "#### 7\n#### 8",
    "-3 apples",
    "no numbers here",
    "",
    "#### 12.\n",
    "1,2,3",
    "The value is 0.5",
    "costs $$ a lot",
    "#### \n5",
    "#### 1e5",
    "  #### 9  ",
    "The answer is 42. Question: what about 43?",
    "x=-0.75, so -0.75.",
    "#### .5",
    "…٣ and 4",
    "#### 2,000,000.",
]
REFERENCES = ["Some work\n#### 72", "#### 1234", "#### -5.5", "#### 100", "#### 1000.50", "#### 18", "#### 5",
              "#### 10", "#### 7", "#### -3", "#### 1", "#### 0", "#### 12", "#### 123", "#### 0.5", "#### 0",
              "#### 5", "#### 1", "#### 9", "#### 43", "#### -0.75", "#### .5", "#### 4", "#### 2000000"]


def test_extraction_matches_lm_eval_regex_filter() -> None:
    from lm_eval.filters.extraction import RegexFilter

    strict = RegexFilter(regex_pattern=r"#### (\-?[0-9\.\,]+)", group_select=0)
    flexible = RegexFilter(regex_pattern=r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1)
    expect_strict = [x[0] for x in strict.apply([[t] for t in TRICKY], [{}] * len(TRICKY))]
    expect_flex = [x[0] for x in flexible.apply([[t] for t in TRICKY], [{}] * len(TRICKY))]
    assert [gsm8k.strict_match(t) for t in TRICKY] == expect_strict
    assert [gsm8k.flexible_extract(t) for t in TRICKY] == expect_flex
    assert "[invalid]" in expect_strict and len(set(expect_flex)) > 10  # the table is not trivial


def test_exact_match_matches_lm_eval() -> None:
    from lm_eval.api.metrics import exact_match_hf_evaluate

    kw = {"regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"], "ignore_case": True, "ignore_punctuation": False}
    hits = 0
    for text, ref in zip(TRICKY, REFERENCES, strict=True):
        for pred in (gsm8k.strict_match(text), gsm8k.flexible_extract(text)):
            expect = bool(exact_match_hf_evaluate(predictions=[pred], references=[ref], **kw)["exact_match"])
            assert gsm8k.exact_match(pred, ref) is expect, (text, pred, ref)
            hits += expect
    assert 5 < hits < 2 * len(TRICKY)


def test_accuracy_and_stderr_match_lm_eval() -> None:
    from lm_eval.api.metrics import mean_stderr

    docs = [gsm8k.Doc("q", r) for r in REFERENCES]
    scored = [gsm8k.score_one(t, d) for t, d in zip(TRICKY, docs, strict=True)]
    acc = gsm8k.accuracy(scored)
    strict = [1.0 if s.strict_correct else 0.0 for s in scored]
    assert acc["strict-match"]["exact_match"] == sum(strict) / len(strict)
    assert math.isclose(acc["strict-match"]["stderr"], mean_stderr(strict))
    assert math.isnan(gsm8k.mean_stderr([1.0]))


def test_request_body_is_lm_evals() -> None:
    body = gsm8k.request_body("P", "m", 64)
    assert body == {"prompt": "P", "model": "m", "max_tokens": 64, "temperature": 0.0,
                    "stop": ["Question:", "</s>", "<|im_end|>"], "seed": 1234}


def test_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a directory"):
        gsm8k.load_dataset(tmp_path / "nope")
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    with pytest.raises(UsageError, match="missing test.jsonl"):
        gsm8k.load_dataset(tmp_path)
    (tmp_path / "test.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(UsageError, match="test.jsonl:1"):
        gsm8k.load_dataset(tmp_path)
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "q2", "answer": "#### 2"}) + "\n\n")
    train, test = gsm8k.load_dataset(tmp_path)
    assert test == [gsm8k.Doc("q2", "#### 2")]
    with pytest.raises(UsageError, match="exceeds"):
        gsm8k.build_prompts(train, test, 5)


def test_hub_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {}
    for split in ("train", "test"):
        p = tmp_path / f"{split}.parquet"
        pq.write_table(pa.table({"question": [f"{split} q"], "answer": ["#### 3"]}), p)
        files[gsm8k.HUB_FILES[split]] = p

    def fake_download(repo: str, filename: str, repo_type: str) -> str:
        assert repo == "openai/gsm8k" and repo_type == "dataset"
        return str(files[filename])

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    train, test = gsm8k.load_dataset("hub")
    assert train[0].question == "train q" and test[0].answer == "#### 3"

    def offline(*a: Any, **k: Any) -> str:
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(DownloadError, match="--dataset"):
        gsm8k.load_dataset("hub")


def test_packaged_copy_is_the_upstream_files_and_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default data set is the copy inside the package: the upstream files byte for byte (their
    published sha256), read without the Hub (a Hub call would fail here)."""
    import gzip
    import hashlib

    import huggingface_hub

    def no_hub(*a: Any, **k: Any) -> str:
        raise AssertionError("the packaged copy must not touch the Hub")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_hub)
    sha = {"train": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
           "test": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"}
    for split, path in gsm8k.packaged_files().items():
        assert hashlib.sha256(gzip.decompress(path.read_bytes())).hexdigest() == sha[split]
    train, test = gsm8k.load_dataset(None)
    assert (len(train), len(test)) == (7473, 1319)
    assert test[0].answer.endswith("#### 18") and gsm8k.dataset_name(None) == gsm8k.PACKAGED
