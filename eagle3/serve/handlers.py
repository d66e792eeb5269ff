"""The OpenAI-compatible endpoints' handlers: one object per app holding the engine, the metrics
and the served name, with small methods for the shared steps (tokenize off the event loop, check
the model and token ids, build sampling params, run or stream a request). Routes are wired in
:func:`eagle3.serve.app.create_app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagle3.serve.async_engine import AsyncEngine, Delta, now
from eagle3.serve.logprobs import CompletionLogprobs, TokenText, chat_logprobs, prompt_logprobs, require
from eagle3.serve.metrics import CONTENT_TYPE, ServerMetrics
from eagle3.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    error_type_for,
    validation_message,
)


@dataclass
class _Prepared:
    """One prompt of a request, tokenized and checked, ready for the engine."""

    index: int
    ids: list[int]
    text: str | None  # the prompt as text (for echo), None for token-id prompts until decoded
    params: Any


@dataclass
class _Outcome:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    ttft: float | None = None
    deltas: list[Delta] = field(default_factory=list)
    logprobs: list[Any] | None = None  # the deltas' entries, one per counted output token
    prompt_logprobs: list[Any] | None = None
    token_ids: list[int] = field(default_factory=list)  # the counted output tokens


class SSEResponse(StreamingResponse):
    """A streaming response that always listens for the client going away and always closes
    its iterator, so the request's ``finally`` (abort: free the sequence and KV blocks) runs at
    once, not whenever the garbage collector finalizes the generator."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                async def listen() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(listen)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def _gather_or_cancel(coros: list[Awaitable[Any]]) -> list[Any]:
    """``asyncio.gather`` that cancels the siblings when one fails (or when it is cancelled
    itself), so that no engine request outlives the HTTP request that made it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIHandlers:
    """Handlers for one served model; every error becomes an OpenAI-shaped body (``error_response``)."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, model_name: str, root: str | None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.root = root
        self.token_text = TokenText(engine.tokenizer)  # token strings of logprobs, cached

    def error_response(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                       code: str | None = None) -> JSONResponse:
        self.metrics.observe_error(status)
        return JSONResponse(error_body(message, type_ or error_type_for(status), param, code), status_code=status)

    async def api_error(self, _: Request, err: APIError) -> JSONResponse:
        return self.error_response(err.status_code, err.message, err.param, err.type, err.code)

    async def invalid(self, _: Request, err: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(err.errors()))
        return self.error_response(400, message, param)

    async def http_error(self, _: Request, err: StarletteHTTPException) -> JSONResponse:
        return self.error_response(err.status_code, str(err.detail))

    async def unexpected(self, _: Request, err: Exception) -> JSONResponse:
        return self.error_response(500, f"internal error: {type(err).__name__}: {err}", type_="server_error")

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` in a worker thread: tokenizing a multi-megabyte prompt (or rendering a long
        chat) takes seconds, and on the event loop it would stall every other request and
        ``/health`` for that long."""
        return await anyio.to_thread.run_sync(fn, *args)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self.off_loop(self.engine.encode, text, add_special_tokens)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.root):
            raise APIError(f"The model `{name}` does not exist (this server serves `{self.model_name}`).", 404,
                           param="model", code="model_not_found")

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                        logprobs: int | None = None, prompt_logprobs: int | None = None) -> Any:
        from eagle3.errors import Eagle3Error
        from eagle3.runtime.sampling import SamplingParams

        stop_ids = list(req.stop_token_ids or [])
        self.check_ids(stop_ids, "stop_token_ids")
        try:
            return SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k in (None, -1) else req.top_k,
                max_tokens=max_tokens, stop_token_ids=stop_ids,
                ignore_eos=req.ignore_eos, seed=req.seed, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        except Eagle3Error as err:  # the API's own checks should have caught it: name the field anyway
            field_name = str(err).removeprefix("SamplingParams.").split(" ", 1)[0]
            raise APIError(str(err), 400, param=field_name) from err

    def check_logprob_counts(self, **counts: int | None) -> None:
        """Each requested logprob count against the engine's cap (400 naming the field)."""
        cap = self.engine.max_logprobs
        for name, n in counts.items():
            if n is not None and n > cap:
                raise APIError(f"{name}={n} is more than this server returns (at most {cap}; "
                               f"eagle3 serve --max-logprobs)", 400, param=name)

    def resolve_max_tokens(self, num_prompt: int, requested: int | None, what: str) -> int:
        limit = self.engine.context_limit
        if requested is None:
            room = limit - num_prompt
            if room < 1:
                raise APIError(f"the {what} has {num_prompt} tokens; this server's context length is {limit} "
                               f"tokens, which leaves no room to generate", 400, param=what,
                               code="context_length_exceeded")
            return room
        if num_prompt + requested > limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{num_prompt + requested} tokens ({num_prompt} in the {what}, {requested} in the "
                           f"completion). Please reduce the length of the {what} or completion.", 400,
                           param="max_tokens" if num_prompt < limit else what, code="context_length_exceeded")
        return requested

    def check_ids(self, ids: list[int], param: str) -> None:
        vocab = int(getattr(getattr(self.engine.llm, "target", None), "vocab_size", 0) or 0)
        if vocab and any(t >= vocab for t in ids):
            raise APIError(f"{param}: token ids must be in [0, {vocab})", 400, param=param)

    async def collect(self, prep: _Prepared, stops: list[str], include_stop: bool) -> _Outcome:
        """Run one prompt to the end (non-streaming) and record its metrics."""
        out = _Outcome()
        t0 = now()
        try:
            gen = self.engine.generate(prep.ids, prep.params, stops=stops, include_stop=include_stop)
            async with contextlib.aclosing(gen):
                async for d in gen:
                    if out.ttft is None and d.num_output_tokens > 0:
                        out.ttft = now() - t0
                    out.text += d.text
                    out.num_tokens = d.num_output_tokens
                    if d.logprobs is not None:
                        out.logprobs = out.logprobs if out.logprobs is not None else []
                        out.logprobs += d.logprobs
                    if d.prompt_logprobs is not None:
                        out.prompt_logprobs = d.prompt_logprobs
                    out.token_ids += d.token_ids or []
                    if d.finished:
                        out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
        finally:
            self.metrics.observe_request(prompt_tokens=len(prep.ids), completion_tokens=out.num_tokens,
                                    finish_reason=out.finish_reason, ttft=out.ttft, e2e=now() - t0)
        return out

    async def until_disconnect(self, request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def run_or_abort(self, request: Request, work: Awaitable[Any]) -> Any:
        """Await ``work`` unless the client goes away first; then cancel it (which aborts the
        self.engine requests and frees their KV blocks)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(self.until_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, APIError):
            await task
        return None

    async def stream_events(self, request_id: str, object_name: str, preps: list[_Prepared], stops: list[str],
                            include_stop: bool, include_usage: bool,
                            make_choice: Callable[[int, Delta], dict[str, Any]],
                            first: Callable[[_Prepared], dict[str, Any] | None],
                            count_output: bool = True) -> AsyncIterator[str]:
        """SSE chunks for every prompt of a request, interleaved as the engine produces them.
        ``count_output=False``: the output is not returned (echo with max_tokens 0), usage says 0."""
        created = int(time.time())
        queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            c: dict[str, Any] = {"id": request_id, "object": object_name, "created": created,
                                 "model": self.model_name, "choices": choices}
            if include_usage:
                c["usage"] = None
            return c

        async def produce(prep: _Prepared) -> None:
            t0, ttft, n, reason = now(), None, 0, None
            try:
                gen = self.engine.generate(prep.ids, prep.params, stops=stops, include_stop=include_stop)
                async with contextlib.aclosing(gen):
                    async for d in gen:
                        if ttft is None and d.num_output_tokens > 0:
                            ttft = now() - t0
                        n = d.num_output_tokens
                        reason = d.finish_reason if d.finished else None
                        await queue.put((prep.index, d))
                await queue.put((prep.index, None))
            except APIError as err:
                await queue.put((prep.index, err))
            finally:
                self.metrics.observe_request(prompt_tokens=len(prep.ids), completion_tokens=n, finish_reason=reason,
                                        ttft=ttft, e2e=now() - t0)

        tasks = [asyncio.ensure_future(produce(p)) for p in preps]
        usage = {"prompt_tokens": sum(len(p.ids) for p in preps), "completion_tokens": 0}
        tokens = [0] * len(preps)
        try:
            for p in preps:
                head = first(p)
                if head is not None:
                    yield _sse(chunk([head]))
            remaining = len(preps)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    err = item if isinstance(item, APIError) else APIError(str(item), 500)
                    self.metrics.observe_error(err.status_code)
                    yield _sse(err.body())
                    break
                progressed = item.num_output_tokens > tokens[index]
                tokens[index] = item.num_output_tokens
                # A chunk per engine step that produced tokens, even when they add no text yet
                # (special tokens, a held-back stop-string prefix): clients time tokens, as vLLM's do.
                if item.text or item.finished or progressed:
                    yield _sse(chunk([make_choice(index, item)]))
            else:
                if include_usage:
                    usage["completion_tokens"] = sum(tokens) if count_output else 0
                    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                    yield _sse({"id": request_id, "object": object_name, "created": created, "model": self.model_name,
                                "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    # -- endpoints (routed in eagle3.serve.app.create_app) -----------------------------------
    async def health(self) -> Response:
        if not self.engine.alive:
            return self.error_response(503, "the engine thread is not running", type_="service_unavailable")
        broken = getattr(self.engine.llm, "broken", None)  # e.g. a dead tensor-parallel worker
        if isinstance(broken, str):
            return self.error_response(503, broken, type_="service_unavailable")
        body: dict[str, Any] = {"status": "ok"}
        bm = getattr(self.engine.llm, "block_manager", None)
        if bm is not None:  # for load tests: blocks all free again once idle = nothing leaked
            body["kv_blocks_free"], body["kv_blocks_total"] = int(bm.num_free_blocks), int(bm.num_blocks)
        kv_info = getattr(self.engine.llm, "kv_cache_info", None)
        if callable(kv_info):  # the KV cache's dtype and tokens (fp8: about twice bf16's)
            body.update(kv_info())
        return JSONResponse(body)

    async def version(self) -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as pkg_version

        try:
            return {"version": pkg_version("eagle3")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "eagle3",
            "root": self.root or self.model_name, "parent": None, "max_model_len": self.engine.context_limit,
            "tensor_parallel_size": int(getattr(self.engine.llm, "tensor_parallel_size", 1)),
            "kernel_backend": str(getattr(self.engine.llm, "kernel_backend", "torch")),
            "cuda_graphs": bool(getattr(self.engine.llm, "cuda_graphs", False))}]}

    async def server_info(self) -> dict[str, Any]:
        """SGLang's endpoint, which its benchmark reads the acceptance length from."""
        stats = getattr(self.engine.llm, "stats", None)
        accept = stats.mean_acceptance_length if stats is not None and self.engine.num_speculative_tokens else None
        adaptive = getattr(self.engine.llm, "policy", None) is not None  # auto: k above is the ceiling
        return {"model_path": self.root or self.model_name, "num_speculative_tokens": self.engine.num_speculative_tokens,
                "speculative_adaptive": adaptive,
                "max_model_len": self.engine.context_limit, "internal_states": [{"avg_spec_accept_length": accept}]}

    async def tokenizer_info(self) -> dict[str, Any]:
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError("this server has no tokenizer", 404)
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "unk_token": getattr(tok, "unk_token", None),
                "chat_template": getattr(tok, "chat_template", None), "model_max_length": self.engine.context_limit}

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if req.messages is not None:
            text = await self.render_chat([m.as_template_dict() for m in req.messages], req.add_generation_prompt,
                                     False, {})
            ids = await self.encode(text, False)
        else:
            ids = await self.encode(req.prompt or "", req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.engine.context_limit, "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        self.check_ids(req.tokens, "tokens")
        if self.engine.tokenizer is None:
            raise APIError("this server has no tokenizer", 400)
        return {"prompt": await self.off_loop(self.engine.tokenizer.decode, req.tokens)}

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool, continue_final: bool,
                          kwargs: dict[str, Any]) -> str:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError("this model has no chat template; use /v1/completions", 400, param="messages")
        try:
            return await self.off_loop(lambda: tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final, **kwargs))
        except Exception as err:  # jinja TemplateError, TypeError from bad kwargs, ValueError, ...
            raise APIError(f"the chat template failed on these messages: {type(err).__name__}: {err}", 400,
                           param="messages") from err

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        lp, echo = req.logprobs, req.echo
        # vLLM's rules: echo with logprobs scores the prompt with the same N unless prompt_logprobs
        # says otherwise; max_tokens 0 (echo only) generates one token and drops it.
        prompt_n = req.prompt_logprobs if req.prompt_logprobs is not None else (lp if echo else None)
        self.check_logprob_counts(logprobs=lp, prompt_logprobs=req.prompt_logprobs)
        echo_only = echo and req.max_tokens == 0
        preps: list[_Prepared] = []
        for i, p in enumerate(req.prompts()):
            if isinstance(p, str):
                ids, text = await self.encode(p, req.add_special_tokens), p
                if not ids:
                    raise APIError("prompt is empty after tokenization", 400, param="prompt")
            else:
                ids, text = list(p), None
                self.check_ids(ids, "prompt")
            max_tokens = self.resolve_max_tokens(len(ids), 1 if echo_only else req.max_tokens, "prompt")
            preps.append(_Prepared(i, ids, text, self.sampling_params(req, max_tokens, lp, prompt_n)))
        stops, request_id = req.stop_list(), f"cmpl-{uuid.uuid4().hex}"
        fmt = _CompletionFormat(self, req, echo_only)
        fmt.prompt_ids = {p.index: p.ids for p in preps}
        if req.stream:
            return SSEResponse(self.stream_events(request_id, "text_completion", preps, stops,
                                                  req.include_stop_str_in_output, req.include_usage(), fmt.chunk,
                                                  fmt.head, count_output=not echo_only))

        outcomes = await self.run_or_abort(request, _gather_or_cancel(
            [self.collect(p, stops, req.include_stop_str_in_output) for p in preps]))
        if outcomes is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        choices = [fmt.choice(p, o) for p, o in zip(preps, outcomes, strict=True)]
        completion_tokens = 0 if echo_only else sum(o.num_tokens for o in outcomes)
        prompt_tokens = sum(len(p.ids) for p in preps)
        return JSONResponse({"id": request_id, "object": "text_completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices,
                             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                       "total_tokens": prompt_tokens + completion_tokens}})

    async def chat_completions(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        num_top = req.top_logprobs or 0
        self.check_logprob_counts(top_logprobs=num_top)
        text = await self.render_chat([m.as_template_dict() for m in req.messages], req.add_generation_prompt,
                                 req.continue_final_message, dict(req.chat_template_kwargs or {}))
        ids = await self.encode(text, False)
        if not ids:
            raise APIError("the rendered conversation is empty", 400, param="messages")
        max_tokens = self.resolve_max_tokens(len(ids), req.max_new_tokens(), "messages")
        prep = _Prepared(0, ids, text, self.sampling_params(req, max_tokens, num_top if req.logprobs else None))
        stops, request_id = req.stop_list(), f"chatcmpl-{uuid.uuid4().hex}"

        def logprobs(entries: list[Any] | None) -> dict[str, Any] | None:
            if not req.logprobs:
                return None
            return {"content": chat_logprobs(require(entries, "logprobs"), num_top, self.token_text,
                                             req.return_tokens_as_token_ids)}

        if req.stream:
            def choice(index: int, d: Delta) -> dict[str, Any]:
                delta = {"content": d.text} if d.text else {}
                return {"index": index, "delta": delta, "logprobs": logprobs(d.logprobs),
                        "finish_reason": d.finish_reason if d.finished else None}

            def first(p: _Prepared) -> dict[str, Any]:
                return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}

            return SSEResponse(self.stream_events(request_id, "chat.completion.chunk", [prep], stops,
                                             req.include_stop_str_in_output, req.include_usage(), choice, first))

        outcome = await self.run_or_abort(request, self.collect(prep, stops, req.include_stop_str_in_output))
        if outcome is None:
            return Response(status_code=499)
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": outcome.text},
                         "logprobs": logprobs(outcome.logprobs), "finish_reason": outcome.finish_reason,
                         "stop_reason": outcome.stop_reason}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": outcome.num_tokens,
                      "total_tokens": len(ids) + outcome.num_tokens}})


class _CompletionFormat:
    """A completion request's choices: text (with the echoed prompt) and logprobs, whole or as
    stream chunks. With echo and logprobs the prompt waits for the engine's first output (its
    logprobs come with it) and goes out in the first chunk; without logprobs it goes first, at once."""

    def __init__(self, handlers: OpenAIHandlers, req: CompletionRequest, echo_only: bool) -> None:
        self.h, self.req, self.echo_only = handlers, req, echo_only
        self.streams: dict[int, CompletionLogprobs] = {}
        self.pending: dict[int, _Prepared] = {}  # streamed prompts still to echo
        self.prompt_ids: dict[int, list[int]] = {}  # return_token_ids: each prompt's ids, for its first chunk
        self.ids_started: set[int] = set()

    def prompt_text(self, p: _Prepared) -> str:
        return p.text if p.text is not None else self.h.engine.decode(p.ids)

    def logprobs(self, p: _Prepared, stream: CompletionLogprobs | None, entries: list[Any] | None,
                 prompt: list[Any] | None, echo: bool) -> dict[str, Any] | None:
        """The ``logprobs`` object of (the echoed prompt and) these output entries."""
        if self.req.logprobs is None:
            return None
        fmt = stream or CompletionLogprobs(self.h.token_text, self.req.logprobs, self.req.return_tokens_as_token_ids)
        out = [] if self.echo_only else require(entries, "logprobs")
        ids, lps = [e.token_id for e in out], out
        if echo:
            ids, lps = list(p.ids) + ids, require(prompt, "prompt logprobs") + lps
        return fmt(ids, lps)

    def choice(self, p: _Prepared, o: _Outcome) -> dict[str, Any]:
        req = self.req
        text = (self.prompt_text(p) if req.echo else "") + ("" if self.echo_only else o.text)
        c: dict[str, Any] = {"index": p.index, "text": text,
                             "logprobs": self.logprobs(p, None, o.logprobs, o.prompt_logprobs, req.echo),
                             "finish_reason": "length" if self.echo_only else o.finish_reason,
                             "stop_reason": None if self.echo_only else o.stop_reason}
        if req.prompt_logprobs is not None:
            c["prompt_logprobs"] = prompt_logprobs(require(o.prompt_logprobs, "prompt logprobs"), self.h.token_text)
        if req.return_token_ids:
            c["prompt_token_ids"] = list(p.ids)
            c["token_ids"] = [] if self.echo_only else list(o.token_ids)
        return c

    def head(self, p: _Prepared) -> dict[str, Any] | None:
        """The stream's first chunk of a prompt: its echo, unless it waits for its logprobs."""
        if not self.req.echo:
            return None
        if self.req.logprobs is not None:
            self.pending[p.index] = p
            return None
        return {"index": p.index, "text": self.prompt_text(p), "logprobs": None, "finish_reason": None}

    def chunk(self, index: int, d: Delta) -> dict[str, Any]:
        p = self.pending.pop(index, None)
        stream = self.streams.setdefault(index, CompletionLogprobs(
            self.h.token_text, self.req.logprobs or 0, self.req.return_tokens_as_token_ids))
        text = (self.prompt_text(p) if p is not None else "") + ("" if self.echo_only else d.text)
        reason = ("length" if self.echo_only else d.finish_reason) if d.finished else None
        c: dict[str, Any] = {"index": index, "text": text,
                             "logprobs": self.logprobs(p, stream, d.logprobs, d.prompt_logprobs, p is not None),
                             "finish_reason": reason}
        if self.req.return_token_ids:  # vLLM: the prompt's ids in the first chunk, each chunk its new ids
            if index not in self.ids_started:
                self.ids_started.add(index)
                c["prompt_token_ids"] = list(self.prompt_ids[index])
            c["token_ids"] = [] if self.echo_only else list(d.token_ids or [])
        return c
