"""OpenAI-compatible HTTP server of the runtime (FastAPI + uvicorn).

The implementation lives in :mod:`eagle3.serve` (it grew past one file): routes in
``eagle3.serve.app``, the engine-thread bridge in ``eagle3.serve.async_engine``, Prometheus
metrics in ``eagle3.serve.metrics``, start-up in ``eagle3.serve.launcher``. This module is the
entry point the design names.
"""

from __future__ import annotations

from eagle3.serve.app import create_app
from eagle3.serve.async_engine import AsyncEngine
from eagle3.serve.launcher import EngineOptions, ServerThread, build_app, build_llm, serve_forever

__all__ = ["AsyncEngine", "EngineOptions", "ServerThread", "build_app", "build_llm", "create_app", "serve_forever"]
