"""The OpenAI shapes of logprobs, as vLLM writes them, from the engine's entries
(:class:`eagle3.runtime.logprobs.TokenLogprob`: token id, logprob, rank, the N most likely).

* ``/v1/completions`` (``logprobs: N``): ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``, one item per token. ``top_logprobs[i]`` maps token text to logprob for the
  chosen token first, then the N most likely (so N + 1 entries when the chosen one is not among
  them: OpenAI's and vLLM's rule). Echoed prompt tokens come first; the prompt's first token has
  ``null`` logprob and ``null`` top entry. ``text_offset`` adds up the token strings' lengths.
* ``/v1/chat/completions`` (``logprobs: true, top_logprobs: N``): ``{"content": [{"token",
  "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``; ``top_logprobs`` are
  the N most likely tokens in order (OpenAI's definition; vLLM lists the sampled token first, the
  same list whenever the sampled token is the most likely one, e.g. greedy).
* vLLM's ``prompt_logprobs: N`` (completions): per prompt token ``null`` (the first) or
  ``{"<id>": {"logprob", "rank", "decoded_token"}}`` for the prompt token then the N most likely.

Token text is ``tokenizer.decode([id])`` (vLLM's), which maps distinct tokens to the same string
(e.g. two halves of UTF-8 characters both decode to U+FFFD): a dict keyed by text then keeps the
first, more likely, entry. ``return_tokens_as_token_ids: true`` writes ``"token_id:<id>"``
instead, which never collides; a server without a tokenizer always does. ``-inf`` becomes
``-9999.0`` (JSON has no infinity; vLLM's convention).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from eagle3.serve.protocol import APIError

_FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, _FLOOR)


class TokenText:
    """Token id -> the string a logprobs field shows for it, cached (one decode per vocabulary
    entry for the server's lifetime; the first request decodes what it needs in one batch)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def prepare(self, ids: Iterable[int]) -> None:
        if self.tokenizer is None:
            return
        missing = sorted({i for i in ids if i not in self._cache})
        if missing:
            for i, s in zip(missing, self.tokenizer.batch_decode([[i] for i in missing]), strict=True):
                self._cache[i] = s or ""

    def __call__(self, token_id: int, as_id: bool) -> str:
        if as_id or self.tokenizer is None:
            return f"token_id:{token_id}"
        if token_id not in self._cache:
            self.prepare([token_id])
        return self._cache[token_id]


def _ids_of(ids: Sequence[int], entries: Sequence[Any]) -> list[int]:
    """Every token id an answer names: the tokens and their top lists."""
    out = list(ids)
    for e in entries:
        if e is not None:
            out += [t for t, _ in e.top]
    return out


def require(entries: Any, what: str) -> list[Any]:
    """The engine's entries, or a 500 when it returned none (an engine without logprobs)."""
    if entries is None:
        raise APIError(f"the engine returned no {what} for a request that asked for them", 500,
                       type_="server_error")
    return list(entries)


class CompletionLogprobs:
    """One completion choice's ``logprobs``, built chunk by chunk: ``text_offset`` continues
    across chunks, so a stream's chunks concatenate to the non-streamed object."""

    def __init__(self, text: TokenText, num_top: int, as_ids: bool) -> None:
        self.text, self.num_top, self.as_ids = text, num_top, as_ids
        self.offset = 0

    def __call__(self, ids: Sequence[int], entries: Sequence[Any]) -> dict[str, Any]:
        if not self.as_ids:
            self.text.prepare(_ids_of(ids, entries))
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, e in zip(ids, entries, strict=True):
            tok = self.text(tid, self.as_ids)
            out["tokens"].append(tok)
            out["text_offset"].append(self.offset)
            self.offset += len(tok)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_lp(e.logprob))
            top = {tok: _lp(e.logprob)}
            for t, lp in e.top[: self.num_top]:
                top.setdefault(self.text(t, self.as_ids), _lp(lp))
            out["top_logprobs"].append(top)
        return out


def chat_logprobs(entries: Sequence[Any], num_top: int, text: TokenText, as_ids: bool) -> list[dict[str, Any]]:
    """``choices[0].logprobs.content`` items for ``entries`` (output tokens)."""
    if not as_ids:
        text.prepare(_ids_of([e.token_id for e in entries], entries))

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        tok = text(token_id, as_ids)
        return {"token": tok, "logprob": _lp(logprob), "bytes": list(tok.encode("utf-8", errors="replace"))}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top[:num_top]]}
            for e in entries]


def prompt_logprobs(entries: Sequence[Any], text: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's ``choices[i].prompt_logprobs`` (token ids as keys, so nothing collides)."""
    text.prepare(_ids_of([e.token_id for e in entries if e is not None], entries))
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token_id): {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": text(e.token_id, False)}}
        for r, (t, lp) in enumerate(e.top, start=1):
            d.setdefault(str(t), {"logprob": _lp(lp), "rank": r, "decoded_token": text(t, False)})
        out.append(d)
    return out
