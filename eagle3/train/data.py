"""Training data: prompts and texts -> token sequences (train) and held-out prompts (acceptance).

Sources (``--data``):

* ``gsm8k``: the GSM8K train split, one sequence per problem, ``"Question: {q}\\nAnswer: {a}"`` (the
  lm-eval format that ``eagle3 serve --validate gsm8k`` prompts with), from ``--dataset DIR``
  (``train.jsonl`` + ``test.jsonl``, the ``serve --validate`` convention), the copy eagle3 ships
  (the default) or the Hub (``--dataset hub``). Held-out
  prompts are lm-eval's few-shot prompts of the first test problems: the distribution the draft
  is measured on. ``fewshot`` > 0 puts that many solved train problems (seeded, never the problem
  itself) before each training problem, so the draft also learns at the context lengths it serves.
* ``FILE.jsonl``: one JSON object per line with ``"text"``, or ``"prompt"`` and ``"completion"``.
  The last ``num_heldout`` rows are held out; a held-out (or, with ``--regenerate``, a training)
  prompt is the row's ``prompt``, or the first half of its ``text``'s tokens.

Texts are tokenized without special tokens, as the runtime tokenizes prompts.
"""

from __future__ import annotations

import random
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


def _train_prompts(docs: list[gsm8k.Doc], n: int, fewshot: int, seed: int) -> list[str]:
    """The first ``n`` train problems, each after ``fewshot`` other solved train problems in lm-eval's
    exemplar format (drawn with ``random.Random(seed)``, excluding the problem itself)."""
    rnd = random.Random(seed)
    prompts = []
    for i in range(n):
        others = rnd.sample(range(len(docs) - 1), fewshot) if fewshot else []
        prompts.append(gsm8k.fewshot_prompt([docs[j + (j >= i)] for j in others], docs[i]))  # skip index i
    return prompts


def load_data(data: str, tokenizer: Any, *, dataset: Path | None = None, max_len: int = 512,
              num_train: int | None = None, num_heldout: int = 8, num_fewshot: int = 5,
              fewshot: int = 0, seed: int = 0) -> TrainData:
    """Training sequences and held-out prompts from ``data`` (``gsm8k`` or a ``.jsonl`` file);
    ``fewshot``: solved train problems before each gsm8k training problem (``num_fewshot``: in the
    held-out prompts)."""
    if tokenizer is None:
        raise UsageError("train-draft needs the target's tokenizer (tokenizer.json beside its config)")
    if max_len < 4:
        raise UsageError(f"--max-len must be >= 4, got {max_len}")
    if fewshot < 0:
        raise UsageError(f"--fewshot must be >= 0, got {fewshot}")
    if data == "gsm8k":
        train_docs, test_docs = gsm8k.load_dataset(dataset)
        if fewshot >= len(train_docs):
            raise UsageError(f"--fewshot {fewshot} needs more than {fewshot} train rows, got {len(train_docs)}")
        n = len(train_docs) if num_train is None else min(num_train, len(train_docs))
        train = [_example(tokenizer, p, gsm8k.TARGET_DELIMITER + d.answer, None, max_len)
                 for p, d in zip(_train_prompts(train_docs, n, fewshot, seed), train_docs[:n], strict=True)]
        prompts = gsm8k.build_prompts(train_docs, test_docs, num_fewshot=num_fewshot, limit=num_heldout)
        heldout = [_encode(tokenizer, p) for p in prompts]
        shots = f"{fewshot}-shot " if fewshot else ""
        src = f"gsm8k ({gsm8k.dataset_name(dataset)}): {len(train)} {shots}train problems, {len(heldout)} held-out " \
              f"{num_fewshot}-shot test prompts"
        return TrainData(train, heldout, src)
    if fewshot:
        raise UsageError(f"--fewshot applies to --data gsm8k, not to {data}")
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
