"""Training data: prompts and texts -> token sequences (train) and held-out prompts (acceptance).

Sources (``--data``):

* ``gsm8k``: the GSM8K train split, one sequence per problem, ``"Question: {q}\\nAnswer: {a}"`` (the
  lm-eval format that ``eagle3 serve --validate gsm8k`` prompts with), from ``--dataset DIR``
  (``train.jsonl`` + ``test.jsonl``, the ``serve --validate`` convention) or the Hub. Held-out
  prompts are lm-eval's few-shot prompts of the first test problems: the distribution the draft
  is measured on.
* ``FILE.jsonl``: one JSON object per line with ``"text"``, or ``"prompt"`` and ``"completion"``.
  The last ``num_heldout`` rows are held out; a held-out (or, with ``--regenerate``, a training)
  prompt is the row's ``prompt``, or the first half of its ``text``'s tokens.

Texts are tokenized without special tokens, as the runtime tokenizes prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.errors import UsageError
from eagle3.validate import gsm8k


@dataclass
class Example:
    prompt_ids: list[int]  # what generation continues from (--regenerate)
    ids: list[int]  # the training sequence (prompt + completion), at most max_len tokens


@dataclass
class TrainData:
    train: list[Example]
    heldout: list[list[int]]  # held-out prompts (token ids)
    source: str


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _example(tokenizer: Any, prompt: str | None, completion: str | None, text: str | None,
             max_len: int) -> Example:
    if text is not None:
        ids = _encode(tokenizer, text)[:max_len]
        return Example(ids[: max(1, len(ids) // 2)], ids)
    p = _encode(tokenizer, prompt or "")
    ids = (p + _encode(tokenizer, completion or ""))[:max_len]
    return Example(p[: max(1, min(len(p), max_len - 1))], ids)


def _row_ok(row: Any) -> bool:
    return isinstance(row, dict) and (isinstance(row.get("text"), str) or (
        isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str)))


def load_data(data: str, tokenizer: Any, *, dataset: Path | None = None, max_len: int = 512,
              num_train: int | None = None, num_heldout: int = 8, num_fewshot: int = 5) -> TrainData:
    """Training sequences and held-out prompts from ``data`` (``gsm8k`` or a ``.jsonl`` file)."""
    if tokenizer is None:
        raise UsageError("train-draft needs the target's tokenizer (tokenizer.json beside its config)")
    if max_len < 4:
        raise UsageError(f"--max-len must be >= 4, got {max_len}")
    if data == "gsm8k":

        train_docs, test_docs = gsm8k.load_dataset(dataset)
        docs = train_docs if num_train is None else train_docs[:num_train]
        train = [_example(tokenizer, gsm8k.doc_to_text(d), gsm8k.TARGET_DELIMITER + d.answer, None, max_len)
                 for d in docs]
        prompts = gsm8k.build_prompts(train_docs, test_docs, num_fewshot=num_fewshot, limit=num_heldout)
        heldout = [_encode(tokenizer, p) for p in prompts]
        src = f"gsm8k ({dataset or gsm8k.HUB_REPO}): {len(train)} train problems, {len(heldout)} held-out " \
              f"{num_fewshot}-shot test prompts"
        return TrainData(train, heldout, src)
    path = Path(data)
    if path.suffix != ".jsonl" or not path.is_file():
        raise UsageError(f"--data {data}: expected 'gsm8k' or an existing .jsonl file")
    rows = gsm8k.read_jsonl(path, _row_ok, 'an object with "text", or "prompt" and "completion"')
    if len(rows) <= num_heldout:
        raise UsageError(f"{path}: {len(rows)} rows, but {num_heldout} are held out for acceptance "
                         f"(--eval-prompts): nothing left to train on")
    cut = len(rows) - num_heldout
    ex = [_example(tokenizer, r.get("prompt"), r.get("completion"), r.get("text"), max_len) for r in rows]
    train = ex[:cut] if num_train is None else ex[:cut][:num_train]
    train = [e for e in train if len(e.ids) >= 2]
    if not train:
        raise UsageError(f"{path}: no training row has 2 or more tokens")
    return TrainData(train, [e.prompt_ids for e in ex[cut:]], f"{path}: {len(train)} train rows, "
                                                                 f"{num_heldout} held-out")
