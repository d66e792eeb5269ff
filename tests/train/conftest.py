"""Fixtures of the train-draft tests: data files in the formats train-draft reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.testing.tiny import corpus_text


@pytest.fixture(scope="session")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Prose and arithmetic lines of the tiny tokenizer's own corpus, as {"text": ...} rows."""
    lines = [ln for ln in corpus_text().split("\n") if len(ln) > 40][:24]
    p = tmp_path_factory.mktemp("train-data") / "data.jsonl"
    p.write_text("".join(json.dumps({"text": ln}) + "\n" for ln in lines), encoding="utf-8")
    return p


@pytest.fixture(scope="session")
def gsm8k_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GSM8K-layout directory (train.jsonl + test.jsonl) of the corpus's GSM8K-style problems."""
    rows = []
    for block in corpus_text().split("Question: ")[1:]:
        q, rest = block.split("\nAnswer: ", 1)
        rows.append({"question": q, "answer": rest.strip()})
    d = tmp_path_factory.mktemp("gsm8k")
    for name, part in (("train.jsonl", rows[:40]), ("test.jsonl", rows[40:50])):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
    return d
