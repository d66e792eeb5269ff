"""One request's state inside the engine: tokens, KV bookkeeping, pending drafts, stop checks.

Positions ``0 .. num_computed_tokens - 1`` have committed KV in both the target's and the
draft's cache (the draft's entry at position ``p`` pairs token ``p + 1`` with the target's hidden
state at ``p``). The last token of ``token_ids`` is never computed yet: it is the input of the next
forward. Rejected speculative positions are "rolled back" by not counting them; their slots are
overwritten by the next forward (nothing is copied).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from eagle3.runtime.logprobs import TokenLogprob
from eagle3.runtime.sampling import SamplingParams
from eagle3.runtime.spec.stats import SpecStats

_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"  # failed inside a step (``Sequence.error`` says why); the others carry on


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 generator: torch.Generator | None, num_speculative_tokens: int,
                 prompt: str | None = None) -> None:
        self.request_id = request_id
        self.seq_no = next(_counter)  # arrival order, for stable sorting
        self.prompt = prompt
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # Proposals waiting for verification (target ids), and the distribution each one was
        # sampled from (float32 [len(draft_token_ids), V], None for greedy / point-mass drafts).
        self.draft_token_ids: list[int] = []
        self.draft_probs: torch.Tensor | None = None
        # A draft tree's parents (root -1 first, then one per draft token), None for a chain.
        self.draft_parents: list[int] | None = None
        self.stats = SpecStats(num_speculative_tokens)
        self.num_preemptions = 0
        self.num_returned_tokens = 0  # output tokens already handed out by LLM.step()
        self.returned_text = ""
        # Incremental detokenization window (output-token offsets): text is decoded from
        # prefix_offset, and what read_offset..end adds is the delta (see LLM._output).
        self.prefix_offset = 0
        self.read_offset = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.error: str | None = None  # why it failed, with FinishReason.ERROR
        # Logprob entries (runtime/logprobs.py), None when not asked for: one per output token, and
        # one per prompt token (position 0's None first) once the prefill is done.
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None if params.prompt_logprobs is None else []

    # -- sizes -----------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def max_new_tokens(self, max_model_len: int) -> int:
        """Output tokens this request may still produce."""
        room = max_model_len - self.num_tokens
        if self.params.max_tokens is not None:
            room = min(room, self.params.max_tokens - self.num_output_tokens)
        return room

    # -- state changes ---------------------------------------------------------------------
    def append_checked(self, new_tokens: list[int], eos_ids: frozenset[int], max_model_len: int) -> int:
        """Append tokens one by one, stopping at the first that ends the request (EOS, a stop
        id, max_tokens, max_model_len). Returns how many were appended. Checking inside the
        accepted run matters: tokens after an EOS must never be emitted."""
        appended = 0
        for tok in new_tokens:
            self.token_ids.append(int(tok))
            appended += 1
            if self.first_token_time is None:
                self.first_token_time = time.monotonic()
            reason = self._stop_reason(int(tok), eos_ids, max_model_len)
            if reason is not None:
                self.finish(reason)
                break
        return appended

    def add_logprobs(self, prompt: list[TokenLogprob | None] | None, output: list[TokenLogprob] | None,
                     appended: int) -> None:
        """Record a step's entries: its prompt entries, and those of the ``appended`` output tokens
        (a stop inside the step drops the entries of the tokens after it, as it drops the tokens)."""
        if prompt and self.prompt_logprobs is not None:
            self.prompt_logprobs += prompt
        if output and self.logprobs is not None:
            self.logprobs += output[:appended]

    def _stop_reason(self, tok: int, eos_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
        if tok in self.params.stop_token_ids or (not self.params.ignore_eos and tok in eos_ids):
            return FinishReason.STOP
        if self.params.max_tokens is not None and self.num_output_tokens >= self.params.max_tokens:
            return FinishReason.LENGTH
        if self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finished_time = time.monotonic()
        self.clear_drafts()

    def fail(self, err: BaseException) -> None:
        """End this request with an error of its own (see ``LLM._step``)."""
        self.error = f"{type(err).__name__}: {err}"
        self.finish(FinishReason.ERROR)

    def clear_drafts(self) -> None:
        self.draft_token_ids = []
        self.draft_probs = None
        self.draft_parents = None

    def reset_for_recompute(self) -> None:
        """Preemption by recomputation: forget all KV; the next prefill covers every token."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.clear_drafts()
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1


@dataclass
class ScheduledSeq:
    """What one sequence contributes to a step's forward: ``num_tokens`` real tokens from
    position ``start`` (= its ``num_computed_tokens``), then ``draft_ids`` when the chunk reaches
    the end of the sequence (only then is a token sampled)."""

    seq: Sequence
    start: int
    num_tokens: int
    draft_ids: list[int]
    samples: bool = field(init=False)  # the chunk reaches the end: a token is sampled

    def __post_init__(self) -> None:
        # Frozen now: committing the step appends tokens and would change the answer.
        self.samples = self.start + self.num_tokens == self.seq.num_tokens

    @property
    def num_query_tokens(self) -> int:
        return self.num_tokens + len(self.draft_ids)

    def input_ids(self) -> list[int]:
        return self.seq.token_ids[self.start: self.start + self.num_tokens] + self.draft_ids
