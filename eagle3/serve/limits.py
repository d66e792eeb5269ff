"""Limits that keep one client from holding the server: the request body size, and how long a
client may take to send its headers and its body.

- Body size (``--max-request-bytes``): a request whose ``Content-Length`` is over the limit is
  answered 413 before a byte of its body is read; a chunked body is counted while it arrives and
  refused as soon as it passes the limit. Either way the connection is closed after the answer
  (the rest of the body is never read).
- Body time (``--request-timeout``): each read of the body must bring data within the timeout
  (nginx's ``client_body_timeout`` rule), or the request is answered 408 and the connection
  closed. A client that sends headers announcing a body and then nothing is let go after the
  timeout instead of holding its connection (and a worker) indefinitely.
- Header time: uvicorn does not bound how long a client may take to complete its headers (its
  keep-alive timer is cancelled by any byte received); the h11 protocol below closes a
  connection whose next request's headers are not complete within the timeout.

The body is read by :class:`BodyGuard` before the app sees the request and replayed to it as
one message. Reading it first is what lets a refusal be an ordinary OpenAI-shaped answer: an
error raised from inside the app's ``receive()`` would surface as a 500 from whatever handler
happened to be reading. The body is bounded by the limit, so buffering it costs at most that.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from eagle3.serve.protocol import error_body

DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # 8 MiB: a full-context prompt as text or token-id JSON fits easily
DEFAULT_REQUEST_TIMEOUT_S = 30.0


@dataclass
class ServerLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S  # headers, and each read of the body


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers") or []:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses these before the app is called
    return None


def _has_body(scope: dict[str, Any]) -> bool:
    return any(name in (b"content-length", b"transfer-encoding") for name, _ in scope.get("headers") or [])


class BodyGuard:
    """Pure ASGI middleware enforcing :class:`ServerLimits` on request bodies (see the module
    docstring). ``on_reject(status)`` counts refusals in the metrics."""

    def __init__(self, app: Any, limits: ServerLimits, on_reject: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.limits = limits
        self.on_reject = on_reject

    async def _refuse(self, send: Any, status: int, message: str, code: str) -> None:
        if self.on_reject is not None:
            self.on_reject(status)
        body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_request_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(send, 413, f"request body is {declared} bytes; this server accepts at most {limit} "
                                          f"(--max-request-bytes)", "request_too_large")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            with anyio.move_on_after(self.limits.request_timeout_s) as scope_timer:
                message = await receive()
            if scope_timer.cancelled_caught:
                await self._refuse(send, 408, f"the request body did not arrive within "
                                              f"{self.limits.request_timeout_s:g} s (--request-timeout)",
                                   "request_timeout")
                return
            if message["type"] == "http.disconnect":
                return  # the client went away while sending: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(send, 413, f"request body is over {limit} bytes, the most this server accepts "
                                              f"(--max-request-bytes)", "request_too_large")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: http.disconnect when the client goes away

        await self.app(scope, replay, send)


def h11_protocol(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol with a header timeout: from the moment a connection is made, and
    again after each response, the next request's headers must be complete within
    ``header_timeout_s`` or the connection is closed. (uvicorn's own keep-alive timer is
    cancelled by any byte received, so a client trickling a partial header line is never let go.)"""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class _H11HeaderTimeout(H11Protocol):  # type: ignore[misc]
        _header_timer: Any = None

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request's headers arrived in time: the app (and BodyGuard) has it
            if not self.transport.is_closing():
                try:
                    self.conn.send(h11.ConnectionClosed())
                except h11.LocalProtocolError:
                    pass
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return _H11HeaderTimeout
