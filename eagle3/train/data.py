"""Training data: prompts and texts -> token sequences (train) and held-out prompts (acceptance).

Sources (``--data``):

* ``gsm8k``: the GSM8K train split, one sequence per problem, ``"Question: {q}\\nAnswer: {a}"`` (the
  lm-eval format that ``eagle3 serve --validate gsm8k`` prompts with), from ``--dataset DIR``
  (``train.jsonl`` + ``test.jsonl``, the ``serve --validate`` convention), the copy eagle3 ships
  (the default) or the Hub (``--dataset hub``). Held-out
  prompts are lm-eval's few-shot prompts of the first test problems: the distribution the draft
  is measured on (test problems: never a training problem). ``fewshot`` > 0 puts that many solved
  train problems (seeded per problem, never the problem itself) before each training problem, so
  the draft also learns at the context lengths it serves; ``context_loss=False`` then trains only
  on the problem itself (the exemplars are context).
* ``FILE.jsonl``: one JSON object per line with ``"text"``, or ``"prompt"`` and ``"completion"``.
  The last ``num_heldout`` rows are held out; a held-out (or, with ``--regenerate``, a training)
  prompt is the row's ``prompt``, or the first half of its ``text``'s tokens.

The training set is lazy (:class:`TrainSet`): an example is built and tokenized when the trainer
asks for it, so the steps' examples cost time and memory, not the whole data set's. Texts are
tokenized without special tokens, as the runtime tokenizes prompts. A sequence longer than
``max_len`` loses few-shot context from its start first (the problem and its answer are what the
loss is on), then its end.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.errors import UsageError
from eagle3.validate import gsm8k


@dataclass
class Example:
    prompt_ids: list[int]  # what generation continues from (--regenerate); at most max_len - regen tokens
    ids: list[int]  # the training sequence (prompt + completion), at most max_len tokens
    loss_start: int = 0  # first token whose prediction is trained (the few-shot context is before it)


class TrainSet:
    """``len`` examples, each built on demand by ``make(i)`` (a pure function of ``i``)."""

    def __init__(self, n: int, make: Callable[[int], Example]) -> None:
        self._n = n
        self._make = make

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> Example:
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._make(i)


@dataclass
class TrainData:
    train: TrainSet
    heldout: list[list[int]]  # held-out prompts (token ids)
    source: str


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _fit(prompt: list[int], completion: list[int], context: int, max_len: int, regen: int | None,
         context_loss: bool) -> Example:
    """Cut ``prompt`` (whose first ``context`` tokens are few-shot context) and ``completion`` to
    ``max_len``: context from the start first, then the end. With ``regen`` the prompt leaves room
    for that many generated tokens."""
    budget = max_len - (regen if regen is not None else len(completion))
    cut = min(max(len(prompt) - max(budget, 1), 0), context)
    prompt, context = prompt[cut:], context - cut
    ids = (prompt + completion)[:max_len]
    gen_prompt = prompt[: max(1, min(len(prompt), max_len - (regen or 0), max_len - 1))]
    return Example(gen_prompt, ids, 0 if context_loss else context)


def _row_ok(row: Any) -> bool:
    return isinstance(row, dict) and (isinstance(row.get("text"), str) or (
        isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str)))


def _shots(n_docs: int, i: int, fewshot: int, seed: int) -> list[int]:
    """Problem ``i``'s exemplars: ``fewshot`` other train problems drawn with a generator of its own
    (seed, index), so any example is built without the ones before it."""
    if not fewshot:
        return []
    others = random.Random(seed * 1_000_003 + i).sample(range(n_docs - 1), fewshot)
    return [j + (j >= i) for j in others]  # skip index i


def _gsm8k_example(tokenizer: Any, docs: list[gsm8k.Doc], i: int, fewshot: int, seed: int, max_len: int,
                   regen: int | None, context_loss: bool) -> Example:
    shots = [docs[j] for j in _shots(len(docs), i, fewshot, seed)]
    head = "".join(gsm8k.exemplar(d) for d in shots)
    prompt = _encode(tokenizer, head + gsm8k.doc_to_text(docs[i]))
    context = _common_prefix(_encode(tokenizer, head), prompt) if head else 0
    completion = _encode(tokenizer, gsm8k.TARGET_DELIMITER + docs[i].answer)
    return _fit(prompt, completion, context, max_len, regen, context_loss)


def _row_example(tokenizer: Any, row: dict[str, Any], max_len: int, regen: int | None) -> Example:
    if isinstance(row.get("text"), str):
        ids = _encode(tokenizer, row["text"])[:max_len]
        half = ids[: max(1, len(ids) // 2)]
        return Example(half[: max(1, max_len - (regen or 0))], ids)
    return _fit(_encode(tokenizer, row["prompt"]), _encode(tokenizer, row["completion"]), 0, max_len, regen, True)


def load_data(data: str, tokenizer: Any, *, dataset: Path | None = None, max_len: int = 512,
              num_train: int | None = None, num_heldout: int = 8, num_fewshot: int = 5,
              fewshot: int = 0, seed: int = 0, regen_tokens: int | None = None,
              context_loss: bool = True) -> TrainData:
    """Training examples (lazy) and held-out prompts from ``data`` (``gsm8k`` or a ``.jsonl`` file);
    ``fewshot``: solved train problems before each gsm8k training problem (``num_fewshot``: in the
    held-out prompts); ``regen_tokens``: the tokens ``--regenerate`` will add (the prompt leaves room)."""
    if tokenizer is None:
        raise UsageError("train-draft needs the target's tokenizer (tokenizer.json beside its config)")
    if max_len < 4:
        raise UsageError(f"--max-len must be >= 4, got {max_len}")
    if fewshot < 0:
        raise UsageError(f"--fewshot must be >= 0, got {fewshot}")
    if regen_tokens is not None and regen_tokens >= max_len:
        raise UsageError(f"--regen-tokens {regen_tokens} must be below --max-len {max_len}")
    if data == "gsm8k":
        train_docs, test_docs = gsm8k.load_dataset(dataset)
        if fewshot >= len(train_docs):
            raise UsageError(f"--fewshot {fewshot} needs more than {fewshot} train rows, got {len(train_docs)}")
        n = len(train_docs) if num_train is None else min(num_train, len(train_docs))
        train = TrainSet(n, lambda i: _gsm8k_example(tokenizer, train_docs, i, fewshot, seed, max_len, regen_tokens,
                                                     context_loss))
        prompts = gsm8k.build_prompts(train_docs, test_docs, num_fewshot=num_fewshot, limit=num_heldout)
        heldout = [_encode(tokenizer, p) for p in prompts]
        shots = f"{fewshot}-shot " if fewshot else ""
        src = f"gsm8k ({gsm8k.dataset_name(dataset)}): {n} {shots}train problems, {len(heldout)} held-out " \
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
    train_rows = rows[:cut] if num_train is None else rows[:cut][:num_train]
    # (a row of fewer than 2 tokens has no position to learn from: its loss mask is empty)
    train = TrainSet(len(train_rows), lambda i: _row_example(tokenizer, train_rows[i], max_len, regen_tokens))
    heldout = [_row_example(tokenizer, r, max_len, None).prompt_ids for r in rows[cut:]]
    return TrainData(train, heldout, f"{path}: {len(train_rows)} train rows, {num_heldout} held-out")
