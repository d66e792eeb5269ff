"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health,
Prometheus metrics, and vLLM's tokenizer endpoints (``/tokenizer_info``, ``/tokenize``,
``/detokenize``) so that lm-eval's ``local-completions`` can use the server's own tokenizer.

Every error is answered in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``)
with a 4xx status for client mistakes; a bad request never reaches the engine, and a failing
request never stops the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagle3.serve.async_engine import AsyncEngine, Delta, now
from eagle3.serve.limits import BodyGuard, ServerLimits
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

# Paths open without the API key: liveness probes and Prometheus scrapes (as in vLLM).
_OPEN_PATHS = ("/health", "/metrics", "/version")


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


class _BearerAuth:
    """Pure ASGI middleware: ``Authorization: Bearer <api key>`` on every path but the open ones.
    (Pure ASGI rather than ``@app.middleware``: BaseHTTPMiddleware wraps streaming responses.)"""

    def __init__(self, app: Any, api_key: str, on_reject: Callable[[int], None]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.on_reject = on_reject

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        got = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not secrets.compare_digest(got, self.expected):
            self.on_reject(401)
            body = json.dumps(error_body("invalid or missing API key (Authorization: Bearer ...)",
                                         "authentication_error", None, "invalid_api_key")).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


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


def create_app(engine: AsyncEngine, *, model_name: str, api_key: str | None = None,
               root: str | None = None, metrics: ServerMetrics | None = None,
               manage_engine: bool = True, limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as model ``model_name``.

    ``manage_engine``: start the engine thread at startup and stop it at shutdown. ``limits``:
    request body size and read timeouts (:mod:`eagle3.serve.limits`; also read by the launcher
    for uvicorn's header timeout)."""
    metrics = metrics or engine.metrics or ServerMetrics(model_name, engine.num_speculative_tokens)
    engine.metrics = metrics

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                engine.shutdown()

    app = FastAPI(title="eagle3", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.limits = limits = limits or ServerLimits()
    app.add_middleware(BodyGuard, limits=limits, on_reject=metrics.observe_error)
    if api_key:  # added last: outermost, so an unauthenticated body is never read
        app.add_middleware(_BearerAuth, api_key=api_key, on_reject=metrics.observe_error)

    # -- errors ---------------------------------------------------------------------------
    def error_response(status: int, message: str, param: str | None = None, type_: str | None = None,
                       code: str | None = None) -> JSONResponse:
        metrics.observe_error(status)
        return JSONResponse(error_body(message, type_ or error_type_for(status), param, code), status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return error_response(err.status_code, err.message, err.param, err.type, err.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(err.errors()))
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(err).__name__}: {err}", type_="server_error")

    # -- helpers --------------------------------------------------------------------------
    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` in a worker thread: tokenizing a multi-megabyte prompt (or rendering a long
        chat) takes seconds, and on the event loop it would stall every other request and
        ``/health`` for that long."""
        return await anyio.to_thread.run_sync(fn, *args)

    async def encode(text: str, add_special_tokens: bool) -> list[int]:
        return await off_loop(engine.encode, text, add_special_tokens)

    def check_model(name: str | None) -> None:
        if name is not None and name not in (model_name, root):
            raise APIError(f"The model `{name}` does not exist (this server serves `{model_name}`).", 404,
                           param="model", code="model_not_found")

    def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> Any:
        from eagle3.errors import Eagle3Error
        from eagle3.runtime.sampling import SamplingParams

        stop_ids = list(req.stop_token_ids or [])
        check_ids(stop_ids, "stop_token_ids")
        try:
            return SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k in (None, -1) else req.top_k,
                max_tokens=max_tokens, stop_token_ids=stop_ids,
                ignore_eos=req.ignore_eos, seed=req.seed)
        except Eagle3Error as err:  # the API's own checks should have caught it: name the field anyway
            field_name = str(err).removeprefix("SamplingParams.").split(" ", 1)[0]
            raise APIError(str(err), 400, param=field_name) from err

    def resolve_max_tokens(num_prompt: int, requested: int | None, what: str) -> int:
        limit = engine.context_limit
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

    def check_ids(ids: list[int], param: str) -> None:
        vocab = int(getattr(getattr(engine.llm, "target", None), "vocab_size", 0) or 0)
        if vocab and any(t >= vocab for t in ids):
            raise APIError(f"{param}: token ids must be in [0, {vocab})", 400, param=param)

    async def collect(prep: _Prepared, stops: list[str], include_stop: bool) -> _Outcome:
        """Run one prompt to the end (non-streaming) and record its metrics."""
        out = _Outcome()
        t0 = now()
        try:
            gen = engine.generate(prep.ids, prep.params, stops=stops, include_stop=include_stop)
            async with contextlib.aclosing(gen):
                async for d in gen:
                    if out.ttft is None and d.num_output_tokens > 0:
                        out.ttft = now() - t0
                    out.text += d.text
                    out.num_tokens = d.num_output_tokens
                    if d.finished:
                        out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
        finally:
            metrics.observe_request(prompt_tokens=len(prep.ids), completion_tokens=out.num_tokens,
                                    finish_reason=out.finish_reason, ttft=out.ttft, e2e=now() - t0)
        return out

    async def until_disconnect(request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def run_or_abort(request: Request, work: Awaitable[Any]) -> Any:
        """Await ``work`` unless the client goes away first; then cancel it (which aborts the
        engine requests and frees their KV blocks)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(until_disconnect(request))
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

    async def stream_events(request_id: str, object_name: str, preps: list[_Prepared], stops: list[str],
                            include_stop: bool, include_usage: bool,
                            make_choice: Callable[[int, str, str | None, bool], dict[str, Any]],
                            first: Callable[[_Prepared], dict[str, Any] | None]) -> AsyncIterator[str]:
        """SSE chunks for every prompt of a request, interleaved as the engine produces them."""
        created = int(time.time())
        queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            c: dict[str, Any] = {"id": request_id, "object": object_name, "created": created,
                                 "model": model_name, "choices": choices}
            if include_usage:
                c["usage"] = None
            return c

        async def produce(prep: _Prepared) -> None:
            t0, ttft, n, reason = now(), None, 0, None
            try:
                gen = engine.generate(prep.ids, prep.params, stops=stops, include_stop=include_stop)
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
                metrics.observe_request(prompt_tokens=len(prep.ids), completion_tokens=n, finish_reason=reason,
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
                    metrics.observe_error(err.status_code)
                    yield _sse(err.body())
                    break
                progressed = item.num_output_tokens > tokens[index]
                tokens[index] = item.num_output_tokens
                # A chunk per engine step that produced tokens, even when they add no text yet
                # (special tokens, a held-back stop-string prefix): clients time tokens, as vLLM's do.
                if item.text or item.finished or progressed:
                    yield _sse(chunk([make_choice(index, item.text, item.finish_reason if item.finished else None,
                                                  item.finished)]))
            else:
                if include_usage:
                    usage["completion_tokens"] = sum(tokens)
                    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                    yield _sse({"id": request_id, "object": object_name, "created": created, "model": model_name,
                                "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    # -- endpoints --------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return error_response(503, "the engine thread is not running", type_="service_unavailable")
        broken = getattr(engine.llm, "broken", None)  # e.g. a dead tensor-parallel worker
        if isinstance(broken, str):
            return error_response(503, broken, type_="service_unavailable")
        body: dict[str, Any] = {"status": "ok"}
        bm = getattr(engine.llm, "block_manager", None)
        if bm is not None:  # for load tests: blocks all free again once idle = nothing leaked
            body["kv_blocks_free"], body["kv_blocks_total"] = int(bm.num_free_blocks), int(bm.num_blocks)
        return JSONResponse(body)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as pkg_version

        try:
            return {"version": pkg_version("eagle3")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "eagle3",
            "root": root or model_name, "parent": None, "max_model_len": engine.context_limit,
            "tensor_parallel_size": int(getattr(engine.llm, "tensor_parallel_size", 1)),
            "kernel_backend": str(getattr(engine.llm, "kernel_backend", "torch")),
            "cuda_graphs": bool(getattr(engine.llm, "cuda_graphs", False))}]}

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        """SGLang's endpoint, which its benchmark reads the acceptance length from."""
        stats = getattr(engine.llm, "stats", None)
        accept = stats.mean_acceptance_length if stats is not None and engine.num_speculative_tokens else None
        return {"model_path": root or model_name, "num_speculative_tokens": engine.num_speculative_tokens,
                "max_model_len": engine.context_limit, "internal_states": [{"avg_spec_accept_length": accept}]}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        tok = engine.tokenizer
        if tok is None:
            raise APIError("this server has no tokenizer", 404)
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "unk_token": getattr(tok, "unk_token", None),
                "chat_template": getattr(tok, "chat_template", None), "model_max_length": engine.context_limit}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        if req.messages is not None:
            text = await render_chat([m.as_template_dict() for m in req.messages], req.add_generation_prompt,
                                     False, {})
            ids = await encode(text, False)
        else:
            ids = await encode(req.prompt or "", req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.context_limit, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        check_ids(req.tokens, "tokens")
        if engine.tokenizer is None:
            raise APIError("this server has no tokenizer", 400)
        return {"prompt": await off_loop(engine.tokenizer.decode, req.tokens)}

    async def render_chat(messages: list[dict[str, Any]], add_generation_prompt: bool, continue_final: bool,
                          kwargs: dict[str, Any]) -> str:
        tok = engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError("this model has no chat template; use /v1/completions", 400, param="messages")
        try:
            return await off_loop(lambda: tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final, **kwargs))
        except Exception as err:  # jinja TemplateError, TypeError from bad kwargs, ValueError, ...
            raise APIError(f"the chat template failed on these messages: {type(err).__name__}: {err}", 400,
                           param="messages") from err

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        check_model(req.model)
        preps: list[_Prepared] = []
        for i, p in enumerate(req.prompts()):
            if isinstance(p, str):
                ids, text = await encode(p, req.add_special_tokens), p
                if not ids:
                    raise APIError("prompt is empty after tokenization", 400, param="prompt")
            else:
                ids, text = list(p), None
                check_ids(ids, "prompt")
            max_tokens = resolve_max_tokens(len(ids), req.max_tokens, "prompt")
            preps.append(_Prepared(i, ids, text, sampling_params(req, max_tokens)))
        stops, request_id = req.stop_list(), f"cmpl-{uuid.uuid4().hex}"

        def prompt_text(p: _Prepared) -> str:
            return p.text if p.text is not None else engine.decode(p.ids)

        if req.stream:
            def choice(index: int, text: str, reason: str | None, finished: bool) -> dict[str, Any]:
                return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}

            def first(p: _Prepared) -> dict[str, Any] | None:
                return choice(p.index, prompt_text(p), None, False) if req.echo else None

            return SSEResponse(stream_events(request_id, "text_completion", preps, stops,
                                             req.include_stop_str_in_output, req.include_usage(), choice, first))

        outcomes = await run_or_abort(request, _gather_or_cancel(
            [collect(p, stops, req.include_stop_str_in_output) for p in preps]))
        if outcomes is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        choices = [{"index": p.index, "text": (prompt_text(p) if req.echo else "") + o.text, "logprobs": None,
                    "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                   for p, o in zip(preps, outcomes, strict=True)]
        completion_tokens = sum(o.num_tokens for o in outcomes)
        prompt_tokens = sum(len(p.ids) for p in preps)
        return JSONResponse({"id": request_id, "object": "text_completion", "created": int(time.time()),
                             "model": model_name, "choices": choices,
                             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                       "total_tokens": prompt_tokens + completion_tokens}})

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        check_model(req.model)
        text = await render_chat([m.as_template_dict() for m in req.messages], req.add_generation_prompt,
                                 req.continue_final_message, dict(req.chat_template_kwargs or {}))
        ids = await encode(text, False)
        if not ids:
            raise APIError("the rendered conversation is empty", 400, param="messages")
        max_tokens = resolve_max_tokens(len(ids), req.max_new_tokens(), "messages")
        prep = _Prepared(0, ids, text, sampling_params(req, max_tokens))
        stops, request_id = req.stop_list(), f"chatcmpl-{uuid.uuid4().hex}"

        if req.stream:
            def choice(index: int, content: str, reason: str | None, finished: bool) -> dict[str, Any]:
                delta = {"content": content} if content else {}
                return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}

            def first(p: _Prepared) -> dict[str, Any]:
                return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}

            return SSEResponse(stream_events(request_id, "chat.completion.chunk", [prep], stops,
                                             req.include_stop_str_in_output, req.include_usage(), choice, first))

        outcome = await run_or_abort(request, collect(prep, stops, req.include_stop_str_in_output))
        if outcome is None:
            return Response(status_code=499)
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": outcome.text},
                         "logprobs": None, "finish_reason": outcome.finish_reason,
                         "stop_reason": outcome.stop_reason}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": outcome.num_tokens,
                      "total_tokens": len(ids) + outcome.num_tokens}})

    return app
