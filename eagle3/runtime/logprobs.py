"""Token log-probabilities under the target (``SamplingParams.logprobs`` / ``prompt_logprobs``).

What is computed, and from what (vLLM's default "raw" logprobs):

* ``log_softmax`` in float32 of the target's raw logits, before temperature, top-k and top-p: the
  model's distribution, not the one a request samples from. The draft's logits are never used, so
  speculative decoding (chains, trees, ``k = auto``) and plain decoding give the same numbers for
  the same tokens: each emitted token's entry comes from the target logits row that produced it
  (an accepted draft's row, or the row of the recovered / bonus token).
* Prompt logprobs: prompt token ``p >= 1`` is scored by the logits of row ``p - 1`` (the prefix
  before it); position 0 has no entry (``None``, as vLLM).
* Every entry holds the chosen token's logprob, its rank (1 = most likely; vLLM counts the tokens
  whose logprob is >= the chosen one's) and the ``N`` most likely tokens with their logprobs.

Bits: the logits rows are batch invariant (the kernels' contract, ``kernels/base.py``) and
``torch.log_softmax`` reduces each row on its own (one row per thread block / CPU loop, whatever
the number of rows), so a token's entry does not depend on which other rows share the call:
speculative and plain decoding return bit-identical logprobs on a batch-invariant backend.

Only sequences that asked pay: the engine calls these functions for them alone, on the logits rows
it already has (output logprobs) or on the prompt rows of their prefill chunks (prompt logprobs,
at most :data:`PROMPT_ROWS` rows per vocabulary projection to bound memory; which rows a scheduled
chunk scores is the engine's business: ``engine/prompt_logprobs.py``). This module knows no engine
type: the engine and ``sampling.py`` import it, never the other way.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eagle3.errors import UsageError

# Prompt rows projected onto the vocabulary at once: 512 rows x 164k vocabulary x fp32 is 320 MiB
# per tensor (logits, then logprobs) for Kimi-K2.5.
PROMPT_ROWS = 512


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's entry: its id and logprob, its rank in the vocabulary (1 = most likely) and
    the ``N`` most likely tokens as ``(token id, logprob)``, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


def check_counts(params: Any, max_logprobs: int) -> None:
    """``logprobs`` / ``prompt_logprobs`` of a request against the engine's cap (a UsageError
    naming the field); their types and signs are ``SamplingParams.validate``'s."""
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(params, name, None)
        if n is not None and n > max_logprobs:
            raise UsageError(f"SamplingParams.{name}={n} exceeds this engine's max_logprobs={max_logprobs} "
                             f"(EngineConfig.max_logprobs, serve --max-logprobs)")


def valid_count(value: Any) -> bool:
    """None (off) or an integer >= 0 (0: the chosen token's own logprob only)."""
    return value is None or (not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= 0)


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprob]:
    """Entries for ``R`` rows of ``logits`` ``[R, V]``: row ``r`` scores ``token_ids[r]`` and
    lists its ``num_top[r]`` most likely tokens. One transfer to the host for all rows."""
    if not token_ids:
        return []
    lp = logits.float().log_softmax(dim=-1)
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids[:, None])
    rank = (lp >= chosen).sum(dim=-1)
    k = min(max(num_top), lp.shape[-1])
    if k > 0:
        top_lp, top_ids = lp.topk(k, dim=-1)
        tops_lp, tops_ids = top_lp.tolist(), top_ids.tolist()
    else:
        tops_lp = tops_ids = [[] for _ in token_ids]
    return [TokenLogprob(int(t), c, r, tuple(zip(ti[:n], tl[:n], strict=True)))
            for t, c, r, ti, tl, n in zip(token_ids, chosen[:, 0].tolist(), rank.tolist(), tops_ids, tops_lp,
                                          num_top, strict=True)]


def emitted_logprobs(logits: torch.Tensor, rows: Sequence[Sequence[int]], emitted: Sequence[Sequence[int]],
                     params: Sequence[Any]) -> list[list[TokenLogprob] | None]:
    """Per verified sequence: the entries of its emitted tokens, ``emitted[b][j]`` scored by row
    ``rows[b][j]`` of ``logits`` (None for sequences that did not ask)."""
    want = [b for b, p in enumerate(params) if p.logprobs is not None]
    out: list[list[TokenLogprob] | None] = [None] * len(emitted)
    if not want:
        return out
    idx = [r for b in want for r in rows[b][: len(emitted[b])]]
    toks = [t for b in want for t in emitted[b]]
    tops = [params[b].logprobs for b in want for _ in emitted[b]]
    entries = token_logprobs(logits[torch.tensor(idx, dtype=torch.int64, device=logits.device)], toks, tops)
    at = 0
    for b in want:
        out[b] = entries[at: at + len(emitted[b])]
        at += len(emitted[b])
    return out
