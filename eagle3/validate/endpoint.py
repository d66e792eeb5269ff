"""The server a client talks to: its API root from a base URL, request headers, whether it is on
loopback (proxies are then bypassed), and the model it serves. Shared by :mod:`.bench`,
:mod:`.metrics_client` and :func:`eagle3.validate.evaluate`; imports nothing else of eagle3."""

from __future__ import annotations

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
                      trust_env=not is_loopback(base_url))
        data = r.json().get("data") or []
        return str(data[0]["id"]) if r.status_code == 200 and data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None
