"""The server a client talks to: its API root from a base URL, request headers, whether it is on
loopback (proxies are then bypassed), and the model it serves. Shared by :mod:`.bench`,
:mod:`.metrics_client` and :func:`eagle3.validate.evaluate`; imports nothing else of eagle3."""

from __future__ import annotations

import functools
from typing import Any
from urllib.parse import urlsplit


def is_loopback(url: str) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def api_root(base_url: str) -> str:
    """``http://host:port`` from a base URL given with or without ``/v1`` or an endpoint path."""
    url = base_url.rstrip("/")
    for suffix in ("/v1/completions", "/v1/chat/completions", "/v1"):
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url


@functools.cache
def tls(trust_env: bool) -> Any:
    """httpx's default certificate verification (certifi's CA bundle, or ``SSL_CERT_FILE`` /
    ``SSL_CERT_DIR`` with ``trust_env``) as one ``ssl.SSLContext`` per process. A client or one-off
    request left to build its own reads the bundle again (~50 ms of CPU), and one validation makes
    several (the model probe, a metrics scrape before and after each pass, the passes' clients)."""
    import httpx

    return httpx.create_ssl_context(trust_env=trust_env)


def client_options(url: str) -> dict[str, Any]:
    """httpx options for talking to ``url``'s server: proxies from the environment bypassed on
    loopback, the process's one verification context."""
    trust_env = not is_loopback(url)
    return {"trust_env": trust_env, "verify": tls(trust_env)}


def headers(api_key: str | None) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def served_model(base_url: str, api_key: str | None = None) -> str | None:
    """The first model id in ``GET /v1/models`` (None if the server does not say)."""
    import httpx

    try:
        r = httpx.get(api_root(base_url) + "/v1/models", headers=headers(api_key), timeout=30.0,
                      **client_options(base_url))
        data = r.json().get("data") or []
        return str(data[0]["id"]) if r.status_code == 200 and data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None
