"""The bridge between asyncio request handlers and the engine's synchronous ``step()`` loop.

One background thread owns the engine: it loops on :meth:`LLM.step` while requests are
unfinished and sleeps on an event otherwise. Handlers call :meth:`AsyncEngine.generate`, which
queues the request through the engine's thread-safe inbox (``LLM.add_request`` / ``LLM.abort``)
and receives the per-step outputs on an ``asyncio.Queue`` fed with
``loop.call_soon_threadsafe``. Leaving the generator early (client disconnect, stop string,
error) aborts the request, which frees its sequence and KV blocks at the next step.

No request waits on a thread that is gone: when the engine thread ends (shutdown, or an error
outside ``step()`` that kills it) every request still registered is failed at once (503 / 500),
a request that arrives after that is refused (503), and ``/health`` answers 503.

Stop *strings* are handled here, on the detokenized text, the way vLLM's output processor does
it: the engine knows token ids only. While streaming, the last ``max(len(stop)) - 1`` characters
are held back so that a stop string split across steps is never sent. Logprobs follow the text: a
delta carries the entries of the tokens whose text it completes (an engine step's tokens once the
step's text is sent), and after a stop string exactly those of the tokens counted in usage.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from eagle3.errors import Eagle3Error
from eagle3.runtime.engine.config import EngineConfig
from eagle3.serve.metrics import ServerMetrics
from eagle3.serve.protocol import APIError

logger = logging.getLogger("eagle3.serve")

_IDLE_WAIT_S = 1.0


@dataclass
class Delta:
    """What one engine step means for one request, as the client sees it."""

    text: str  # new text to send (never beyond a stop string)
    num_output_tokens: int  # output tokens so far; at the end, tokens up to the stop point
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" when finished
    stop_reason: str | int | None = None  # the matched stop string (vLLM's field)
    # With SamplingParams.logprobs: the entries of the output tokens this delta completes (the
    # deltas of a request add up to one per counted output token); else None
    logprobs: list[Any] | None = None
    # With SamplingParams.prompt_logprobs: the prompt's entries, on the request's first delta only
    prompt_logprobs: list[Any] | None = None
    # The output token ids this delta counts (the deltas of a request add up to its counted tokens):
    # vLLM's and SGLang's ``return_token_ids``
    token_ids: list[int] | None = None


class OutputTracker:
    """Turns one request's engine outputs into stop-string-safe text deltas."""

    def __init__(self, stops: Sequence[str], include_stop: bool, decode: Callable[[list[int]], str]) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.decode = decode
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.num_tokens = 0
        self.done = False
        self.engine_done = False
        self.reason: str | None = None
        self.stop_reason: str | int | None = None
        self.entries: list[Any] | None = None  # the engine's logprob entries, every output token
        self.marks: list[tuple[int, int]] = []  # (output tokens, text length) after each step
        self.entries_sent = 0
        self.prompt_entries: list[Any] | None = None  # until the first delta takes them
        self.ids: list[int] = []  # every output token id so far
        self.ids_sent = 0

    def feed(self, out: Any) -> Delta:
        prev_len = len(self.text)
        ids = list(out.token_ids)
        self.ids = ids
        prev_tokens = len(ids) - len(out.new_token_ids)
        self.text += out.new_text
        self.num_tokens = len(ids)
        if getattr(out, "logprobs", None) is not None:
            self.entries = out.logprobs
            self._mark(ids, prev_tokens, prev_len)
        if self.prompt_entries is None:
            self.prompt_entries = getattr(out, "prompt_logprobs", None)
        if out.finished:
            self.engine_done = True
        hit = self._find_stop(max(0, prev_len - self.hold)) if self.stops else None
        if hit is not None:
            pos, stop = hit
            self.num_tokens = self._tokens_through(ids, prev_tokens, stop, max(0, prev_len - self.hold))
            self.text = self.text[: pos + len(stop) if self.include_stop else pos]
            self.done, self.reason, self.stop_reason = True, "stop", stop
            return self._emit(len(self.text))
        if out.finished:
            self.done, self.reason = True, out.finish_reason
            if out.finish_reason == "stop" and ids:
                self.stop_reason = ids[-1]
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self.hold)

    def _mark(self, ids: list[int], prev_tokens: int, prev_len: int) -> None:
        """Where each new token's text ends. Held-back text (stop strings) can end inside a step,
        so then per token: the step's tokens decoded after a few tokens of context (as the
        engine's incremental detokenizer does); otherwise the step's text end for all of them."""
        if not self.hold:
            self.marks.append((len(ids), len(self.text)))
            return
        ctx = max(prev_tokens - 4, 0)
        base = len(self.decode(ids[ctx:prev_tokens]))
        for j in range(max(prev_tokens, 0) + 1, len(ids) + 1):
            self.marks.append((j, prev_len + len(self.decode(ids[ctx:j])) - base))

    def _emit(self, upto: int) -> Delta:
        upto = max(upto, self.sent)
        text = self.text[self.sent: upto]
        self.sent = upto
        ids, self.ids_sent = self.ids[self.ids_sent: self.num_tokens], max(self.ids_sent, self.num_tokens)
        return Delta(text, self.num_tokens, self.done, self.reason, self.stop_reason, self._release(upto),
                     self._prompt(), ids)

    def _release(self, upto: int) -> list[Any] | None:
        """The entries of the tokens whose text is now sent: every counted token when done, else
        those of the steps whose text ends within ``upto``."""
        if self.entries is None:
            return None
        n = self.num_tokens if self.done else max([t for t, end in self.marks if end <= upto], default=0)
        n = max(n, self.entries_sent)
        self.marks = [m for m in self.marks if m[0] > n]
        out, self.entries_sent = self.entries[self.entries_sent: n], n
        return out

    def _prompt(self) -> list[Any] | None:
        entries, self.prompt_entries = self.prompt_entries, []  # [] from now on: handed out once
        return entries if entries else None

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _tokens_through(self, ids: list[int], prev_tokens: int, stop: str, start: int) -> int:
        """Output tokens up to the one whose text completes the stop string (vLLM counts so)."""
        for j in range(max(prev_tokens, 0) + 1, len(ids) + 1):
            if self.decode(ids[:j]).find(stop, start) != -1:
                return j
        return len(ids)


class AsyncEngine:
    """Owns an :class:`eagle3.runtime.engine.llm.LLM` (or anything with its incremental API:
    ``add_request``, ``step``, ``abort``, ``has_unfinished``, ``tokenizer``, ``max_model_len``)."""

    def __init__(self, llm: Any, metrics: ServerMetrics | None = None) -> None:
        self.llm = llm
        self.metrics = metrics
        self.tokenizer = getattr(llm, "tokenizer", None)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._closed = False  # set (under _lock) when the engine thread ends: no more requests
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # last step failure (the loop keeps running)

    # -- facts the handlers need ------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return int(self.llm.max_model_len)

    @property
    def max_logprobs(self) -> int:
        """The most logprobs / prompt_logprobs a request may ask for (EngineConfig.max_logprobs)."""
        return int(getattr(getattr(self.llm, "config", None), "max_logprobs", EngineConfig.max_logprobs))

    @property
    def num_speculative_tokens(self) -> int:
        return int(getattr(self.llm, "k", 0) or 0)

    @property
    def context_limit(self) -> int:
        """Prompt + output tokens one request may use, the limit the server enforces and the one
        ``/v1/models`` reports: the model's context length, or less when the KV cache is smaller.

        A request at the limit needs ``limit + k - 1`` KV slots at most (its last verify step
        writes up to ``k`` drafts past its committed tokens, of which it keeps at most
        ``limit - 1``, then ``k - 1`` draft-model slots), so ``k`` slots are reserved, as
        ``LLM`` does when it fits ``max_model_len`` to the cache. (This used to reserve ``2k``
        here while ``/v1/models`` reported the engine's ``max_model_len``: off by ``k``.)"""
        limit = self.max_model_len
        bm = getattr(self.llm, "block_manager", None)
        if bm is not None:
            limit = min(limit, bm.num_blocks * bm.block_size - self.num_speculative_tokens)
        return limit

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise APIError("this server has no tokenizer: send token ids", 400, param="prompt")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- the engine thread ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="eagle3-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        reason: APIError = APIError("the server is shutting down", 503, type_="service_unavailable")
        try:
            self._loop()
        except BaseException as err:  # the thread dies: say so, and fail everyone waiting on it
            logger.critical("the engine thread died; failing every request", exc_info=True)
            self.error = err
            reason = APIError(f"the engine thread died: {type(err).__name__}: {err}", 500, type_="server_error")
        finally:
            with self._lock:
                self._closed = True
                rids = list(self._streams)
            for rid in rids:
                self._dispatch(rid, reason)

    def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()  # before the check: an add between check and wait sets it again
            if not self.llm.has_unfinished():
                if self.metrics is not None:
                    try:
                        self.metrics.update_gauges(self.llm)
                    except Exception:
                        logger.exception("updating the metrics failed")
                self._wake.wait(_IDLE_WAIT_S)
                continue
            try:
                outputs = self.llm.step()
            except Exception as err:  # keep serving: fail what is in flight, not the server
                logger.exception("engine step failed; failing the requests in flight")
                self.error = err
                self._fail_all(err)
                continue
            # Counters first, then the outputs: a client that scrapes /metrics as soon as its last
            # token arrives (a benchmark's before/after delta) must see the step that produced it.
            # Dispatched first, a short request's final verify could be missing from the scrape.
            if self.metrics is not None:
                try:
                    self.metrics.engine_steps.inc()
                    self.metrics.observe_engine(self.llm)
                except Exception:  # metrics must never stop the engine thread
                    logger.exception("updating the metrics failed")
            for out in outputs:
                self._dispatch(out.request_id, out)

    def _dispatch(self, rid: str, item: Any) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is None:
            return
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the request's loop is closed: nobody is listening any more
            pass

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self.llm.abort(rid)
            self._dispatch(rid, err)

    # -- requests -----------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: Any, *, stops: Sequence[str] = (),
                       include_stop: bool = False, request_id: str | None = None) -> AsyncIterator[Delta]:
        """Run one request; yields a :class:`Delta` per engine step that touched it.

        Raises :class:`APIError` (400) when the engine refuses the request (too long, bad ids)."""
        if not self.alive:
            raise APIError("the engine is not running", 503)
        rid = request_id or f"req-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            # checked under the lock the engine thread takes when it ends, so a request is
            # either refused here or failed by that thread: never left waiting on nobody
            if self._closed:
                raise APIError("the engine is not running", 503)
            self._streams[rid] = (loop, queue)
        tracker = OutputTracker(stops, include_stop, self.decode)
        added = False
        try:
            try:
                self.llm.add_request(prompt_ids, params, request_id=rid)
            except Eagle3Error as err:
                raise APIError(str(err), 400, param="prompt") from err
            added = True
            self._wake.set()
            while True:
                item = await queue.get()
                if isinstance(item, APIError):  # one instance for many requests: raise a copy
                    raise APIError(item.message, item.status_code, type_=item.type)
                if isinstance(item, BaseException):
                    raise APIError(f"engine error: {item}", 500, type_="server_error")
                if getattr(item, "error", None):  # this request (alone) failed inside a step
                    tracker.engine_done = True
                    raise APIError(f"the request failed inside the engine: {item.error}", 500,
                                   type_="server_error")
                delta = tracker.feed(item)
                yield delta
                if tracker.done:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if added and not tracker.engine_done:
                # Stop string, client gone or error: free the sequence and its KV blocks.
                self.llm.abort(rid)
                self._wake.set()


def now() -> float:
    """The clock every server-side latency uses."""
    return time.perf_counter()
