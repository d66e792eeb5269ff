"""Fixtures of the train-draft tests: data files in the formats train-draft reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.testing.tiny import corpus_text
from tests.train.helpers import FAST, cli


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


# One uninterrupted train-draft run, the reference of every --resume test (after a crash in the
# teacher phase, after a crash in the loop, after SIGKILL): its options cover what each of them
# interrupts (--regenerate: Teacher.generate per group of 4; 6 groups of the 24 rows; a
# checkpoint every 2 of 16 steps). checkpoint_every is not part of a run's fingerprint and writes
# nothing that stays, so the interrupted runs are compared with this one run bit for bit.
RESUME_OPTIONS = ["--regenerate", "--regen-tokens", "5", "--steps", "16", "--checkpoint-every", "2",
                  "--eval-prompts", "0", "--seed", "3", *FAST]


@pytest.fixture(scope="session")
def uninterrupted(tiny_dir: Path, data_file: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """(the uninterrupted run's output, its options after the target and output)."""
    options = ["--data", str(data_file), *RESUME_OPTIONS]
    out = tmp_path_factory.mktemp("resume") / "whole"
    cli("train-draft", tiny_dir / "kimi-k2.5", out, *options)
    return out, options
