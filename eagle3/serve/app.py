"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health,
Prometheus metrics, and vLLM's tokenizer endpoints (``/tokenizer_info``, ``/tokenize``,
``/detokenize``) so that lm-eval's ``local-completions`` can use the server's own tokenizer.

Every error is answered in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``)
with a 4xx status for client mistakes; a bad request never reaches the engine, and a failing
request never stops the engine thread.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagle3.serve.async_engine import AsyncEngine
from eagle3.serve.handlers import OpenAIHandlers
from eagle3.serve.limits import BodyGuard, ServerLimits
from eagle3.serve.metrics import ServerMetrics, metrics_for
from eagle3.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)

# Paths open without the API key: liveness probes and Prometheus scrapes (as in vLLM).
_OPEN_PATHS = ("/health", "/metrics", "/version")


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


def create_app(engine: AsyncEngine, *, model_name: str, api_key: str | None = None,
               root: str | None = None, metrics: ServerMetrics | None = None,
               manage_engine: bool = True, limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as model ``model_name``.

    ``manage_engine``: start the engine thread at startup and stop it at shutdown. ``limits``:
    request body size and read timeouts (:mod:`eagle3.serve.limits`; also read by the launcher
    for uvicorn's header timeout)."""
    metrics = metrics or engine.metrics or metrics_for(model_name, engine.llm)
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
    app.state.handlers = h = OpenAIHandlers(engine, metrics, model_name, root)
    for exc, handler in ((APIError, h.api_error), (RequestValidationError, h.invalid),
                         (StarletteHTTPException, h.http_error), (Exception, h.unexpected)):
        app.add_exception_handler(exc, handler)
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=[method])
    return app


# The endpoints are module-level functions that find the app's handlers on the request, not the
# handlers' bound methods: FastAPI keeps every endpoint callable it has classified in process-wide
# caches (fastapi.dependencies.models, up to 4,096 each), and a bound method there kept its
# handlers, engine and LLM (a model's weights) alive after the server stopped, so that
# serve --validate loaded its baseline beside the speculative run's model.

def _h(request: Request) -> OpenAIHandlers:
    return request.app.state.handlers


async def health(request: Request) -> Response:
    return await _h(request).health()


async def version(request: Request) -> dict[str, str]:
    return await _h(request).version()


async def prometheus(request: Request) -> Response:
    return await _h(request).prometheus()


async def models(request: Request) -> dict[str, Any]:
    return await _h(request).models()


async def server_info(request: Request) -> dict[str, Any]:
    return await _h(request).server_info()


async def tokenizer_info(request: Request) -> dict[str, Any]:
    return await _h(request).tokenizer_info()


async def tokenize(req: TokenizeRequest, request: Request) -> dict[str, Any]:
    return await _h(request).tokenize(req)


async def detokenize(req: DetokenizeRequest, request: Request) -> dict[str, Any]:
    return await _h(request).detokenize(req)


async def completions(req: CompletionRequest, request: Request) -> Response:
    return await _h(request).completions(req, request)


async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    return await _h(request).chat_completions(req, request)


ROUTES: list[tuple[str, str, Callable[..., Any]]] = [  # every endpoint: (method, path, handler)
    ("GET", "/health", health),
    ("GET", "/version", version),
    ("GET", "/metrics", prometheus),
    ("GET", "/v1/models", models),
    ("GET", "/get_server_info", server_info),
    ("GET", "/tokenizer_info", tokenizer_info),
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/chat/completions", chat_completions),
]
