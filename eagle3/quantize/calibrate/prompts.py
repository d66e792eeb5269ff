"""Calibration token sequences: GSM8K training problems (the packaged copy) or a user's JSONL file.

GSM8K: each sequence is what the served model sees in a ``validate --gsm8k`` run, built from the
*train* split so that the held-out evaluation (test split) never meets its own questions: five
solved problems drawn with a fixed seed, then a training question and its worked answer (the
continuation the model is asked to write). A JSONL file: one JSON object per line with a ``text``
field, or ``prompt`` (+ optional ``completion``), or GSM8K's ``question`` + ``answer``.

Sequences are tokenized as the server tokenizes a completion prompt (no special tokens added)
and cut at ``max_tokens``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.errors import UsageError
from eagle3.validate import gsm8k

GSM8K = "gsm8k"
CALIB_SEED = 4321  # not lm-eval's few-shot seed: the calibration draws differ from the evaluation's
DEFAULT_SAMPLES = 16
DEFAULT_MAX_TOKENS = 2048


@dataclass(frozen=True)
class CalibrationSet:
    """Token ids of each calibration sequence, and where they came from."""

    sequences: tuple[tuple[int, ...], ...]
    source: str

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def _row_text(row: Any) -> str | None:
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("text"), str):
        return row["text"]
    if isinstance(row.get("prompt"), str):
        return row["prompt"] + (row["completion"] if isinstance(row.get("completion"), str) else "")
    if isinstance(row.get("question"), str) and isinstance(row.get("answer"), str):
        return gsm8k.exemplar(gsm8k.Doc(row["question"], row["answer"]))
    return None


def gsm8k_texts(samples: int, seed: int = CALIB_SEED) -> list[str]:
    """``samples`` five-shot GSM8K training problems with their answers (module docstring)."""
    train, _ = gsm8k.load_dataset()
    rnd = random.Random(seed)
    picks = rnd.sample(range(len(train)), samples)
    texts = []
    for i in picks:
        shots = [train[j] for j in rnd.sample([j for j in range(len(train)) if j != i], gsm8k.NUM_FEWSHOT)]
        doc = train[i]
        texts.append(gsm8k.fewshot_prompt(shots, doc) + gsm8k.TARGET_DELIMITER + doc.answer)
    return texts


def file_texts(path: Path, samples: int) -> list[str]:
    """The first ``samples`` texts of a JSONL file (rows described in the module docstring)."""
    if not path.is_file():
        raise UsageError(f"--calibrate {path}: no such file (give 'gsm8k' or a JSONL file)")
    rows = gsm8k.read_jsonl(path, lambda r: _row_text(r) is not None,
                            "a JSON object with 'text', 'prompt' (+ 'completion') or 'question' + 'answer'")
    if not rows:
        raise UsageError(f"{path}: no rows")
    return [str(_row_text(r)) for r in rows[:samples]]


def load_calibration(source: str | Path, tokenizer: Any, samples: int = DEFAULT_SAMPLES,
                     max_tokens: int = DEFAULT_MAX_TOKENS) -> CalibrationSet:
    """Token sequences from ``source`` ("gsm8k" or a JSONL path) with ``tokenizer`` (a transformers
    tokenizer, as the server loads it)."""
    if samples < 1 or max_tokens < 2:
        raise UsageError(f"calibration needs at least 1 sample of at least 2 tokens, got {samples} x {max_tokens}")
    if tokenizer is None:
        raise UsageError("calibration needs the source model's tokenizer (tokenizer.json beside config.json)")
    texts = gsm8k_texts(samples) if str(source) == GSM8K else file_texts(Path(source), samples)
    seqs = []
    for t in texts:
        ids = list(tokenizer(t, add_special_tokens=False)["input_ids"])[:max_tokens]
        if len(ids) >= 2:
            seqs.append(tuple(int(i) for i in ids))
    if not seqs:
        raise UsageError(f"--calibrate {source}: no text of at least 2 tokens")
    return CalibrationSet(tuple(seqs), gsm8k.PACKAGED if str(source) == GSM8K else str(source))
