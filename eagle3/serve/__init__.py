"""The OpenAI-compatible server of the bundled runtime, validation glue, and launch commands for
the external engines (vLLM, SGLang, ATOM).

Modules: ``protocol`` (request bodies, error shape), ``metrics`` (Prometheus), ``async_engine``
(asyncio <-> engine-thread bridge, stop strings), ``app`` (FastAPI routes), ``launcher`` (engine
construction, uvicorn in the foreground or a thread, ``serve --validate``), ``engines`` (vLLM /
SGLang / ATOM command lines).
"""
