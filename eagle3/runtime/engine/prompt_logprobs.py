"""Prompt logprobs of one engine step: which query rows of each scheduled prefill chunk score
which prompt tokens, and their entries (``runtime/logprobs.py`` says what an entry holds and why
its bits do not depend on the batch). Here, not in ``runtime/logprobs.py``, because it reads the
engine's :class:`ScheduledSeq`: the runtime's shared modules never depend on the engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from eagle3.runtime.engine.sequence import ScheduledSeq
from eagle3.runtime.logprobs import PROMPT_ROWS, TokenLogprob, token_logprobs


def prompt_rows(item: ScheduledSeq, row0: int) -> tuple[list[int], list[int]]:
    """(query rows, prompt tokens they score) of one scheduled chunk: rows of prompt positions
    ``p`` whose next token ``p + 1`` is a prompt token not scored yet (a preempted sequence
    recomputes its prefill; its prompt logprobs are not computed twice)."""
    seq = item.seq
    done = len(seq.prompt_logprobs)  # entries so far, position 0's None included
    lo = max(item.start, done - 1)
    hi = min(item.start + item.num_tokens, seq.num_prompt_tokens - 1)
    return ([row0 + p - item.start for p in range(lo, hi)], seq.token_ids[lo + 1: hi + 1])


def step_prompt_logprobs(scheduled: Sequence[ScheduledSeq], row_starts: Sequence[int],
                         logits_at: Callable[[torch.Tensor], torch.Tensor]) -> list[list[TokenLogprob] | None]:
    """Per scheduled sequence: the prompt entries its chunk adds (None when it did not ask).
    The first chunk of a prompt also adds position 0's ``None``. ``logits_at(rows)``: the
    target's logits of those rows of the step's hidden states."""
    out: list[list[Any] | None] = [None] * len(scheduled)
    jobs: list[tuple[int, int, int]] = []  # (sequence, query row, token)
    for i, item in enumerate(scheduled):
        if item.seq.params.prompt_logprobs is None:
            continue
        out[i] = [None] if not item.seq.prompt_logprobs else []
        rows, toks = prompt_rows(item, row_starts[i])
        jobs += [(i, r, t) for r, t in zip(rows, toks, strict=True)]
    for s in range(0, len(jobs), PROMPT_ROWS):
        part = jobs[s: s + PROMPT_ROWS]
        rows_t = torch.tensor([r for _, r, _ in part], dtype=torch.int64)
        entries = token_logprobs(logits_at(rows_t), [t for *_, t in part],
                                 [scheduled[i].seq.params.prompt_logprobs for i, _, _ in part])
        for (i, _, _), e in zip(part, entries, strict=True):
            out[i].append(e)  # type: ignore[union-attr]
    return out
