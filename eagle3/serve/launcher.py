"""Building the engine and running the HTTP server (foreground, or in a background thread for
``serve --validate`` and the tests)."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from eagle3.errors import UsageError
from eagle3.runtime.engine.config import EngineConfig

logger = logging.getLogger("eagle3.serve")
_START_TIMEOUT_S = 60.0



def build_llm(target: str | Path, draft: str | Path | None, config: EngineConfig) -> Any:
    """The runtime's :class:`~eagle3.runtime.engine.llm.LLM` for a target directory (+ draft)."""
    from eagle3.runtime.engine.llm import LLM

    target = Path(target)
    if not target.is_dir():
        raise UsageError(f"{target}: not a checkpoint directory")
    if draft is not None and not Path(draft).is_dir():
        raise UsageError(f"--draft {draft}: not a checkpoint directory")
    from eagle3.formats.check import require_valid_pair

    require_valid_pair(target, draft)  # the models against their schemas, before any weight is read
    return LLM(target, draft, config=config)


def engine_info(llm: Any) -> dict[str, Any]:
    """The kernel backend the engine runs (after ``auto`` resolved) and whether it uses CUDA graphs
    (/v1/models lists these two too), with each graphed model's context caps and forwards replayed /
    eager (the validation report's server section, the bench report)."""
    info = {"kernel_backend": str(getattr(llm, "kernel_backend", "torch")),
            "cuda_graphs": bool(getattr(llm, "cuda_graphs", False))}
    runner = getattr(llm, "runner", None)
    if info["cuda_graphs"] and hasattr(runner, "graph_stats"):  # per model: context cap, replays, eager steps
        info["graphs"] = runner.graph_stats()
    kv_info = getattr(llm, "kv_cache_info", None)
    if callable(kv_info):  # the cache's dtype and size (about twice the tokens at fp8)
        info.update(kv_info())
    policy = getattr(llm, "policy", None)
    if policy is not None:  # num_speculative_tokens="auto": what it chose so far (steps per k)
        info.update(num_speculative_tokens="auto", max_speculative_tokens=policy.max_k,
                    chosen_k_histogram=list(policy.histogram), mean_chosen_k=policy.mean_k)
    tree = getattr(llm, "tree", None)
    if tree is not None:  # draft trees (docs/trees.md)
        info.update(speculative_eagle_topk=tree[0], speculative_num_draft_tokens=tree[1])
    return info


def build_app(llm: Any, model_name: str, *, api_key: str | None = None, root: str | None = None,
              limits: Any = None) -> Any:
    """The FastAPI app over ``llm`` (the engine thread starts with the app); ``limits``: a
    :class:`eagle3.serve.limits.ServerLimits` (default: its defaults)."""
    from eagle3.serve.app import create_app
    from eagle3.serve.async_engine import AsyncEngine
    from eagle3.serve.metrics import metrics_for

    metrics = metrics_for(model_name, llm)
    engine = AsyncEngine(llm, metrics)
    return create_app(engine, model_name=model_name, api_key=api_key, root=root, metrics=metrics,
                      limits=limits)


def _uvicorn_server(app: Any, host: str, port: int, log_level: str,
                    on_started: Callable[[], None] | None = None,
                    on_stopped: Callable[[], None] | None = None) -> Any:
    import uvicorn

    class _Server(uvicorn.Server):
        got_sigint = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn re-raises a caught SIGINT through the handler that was in place before it,
            # which inside asyncio.run is the runner's: it cancels the main task, and when that task
            # is already finishing the run returns normally (exit 0, not Ctrl-C's 130). Remember it.
            self.got_sigint = self.got_sigint or sig == signal.SIGINT
            super().handle_exit(sig, frame)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started and on_started is not None:  # lifespan done, socket listening
                on_started()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises a caught SIGTERM when this context exits, with the default
            # handler back in place: the process ends right there and no ``finally`` after
            # ``run()`` ever runs (SIGINT becomes KeyboardInterrupt, which does unwind). So the
            # clean-up that must happen at any exit runs inside, before the signal is re-raised.
            with super().capture_signals():
                try:
                    yield
                finally:
                    if on_stopped is not None:
                        on_stopped()

    from eagle3.serve.limits import DEFAULT_REQUEST_TIMEOUT_S, h11_protocol

    limits = getattr(getattr(app, "state", None), "limits", None)
    header_timeout = limits.request_timeout_s if limits is not None else DEFAULT_REQUEST_TIMEOUT_S
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=5, access_log=log_level == "debug",
                            http=h11_protocol(header_timeout))
    return _Server(config)


def base_url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port`` 0: one the OS picks, never in use).

    The CLI binds before loading the model: a taken port fails at once with one line, and from
    then on the port is this process's, so nothing can take it while the model loads (picking a
    "free" port and binding it later races with every other process on the machine)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is fine
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise UsageError(f"--port {port}: cannot listen on {host}:{port}: {err.strerror or err}") from err
    return sock


def write_ready_file(path: Path, url: str) -> None:
    """``{"url": ..., "pid": ...}`` written atomically, so a reader never sees half of it; the pid
    lets whoever started the server check that the URL is its own process's."""
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}) + "\n")
    os.replace(tmp, path)


def serve_forever(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", *,
                  sock: socket.socket | None = None, ready_file: Path | None = None,
                  on_ready: Callable[[str], None] | None = None) -> None:
    """Run the server in the foreground until Ctrl-C / SIGTERM.

    ``sock``: an already bound socket (:func:`listen_socket`; ``host`` / ``port`` are then only
    for messages). Once the engine thread runs and the socket listens, ``on_ready(url)`` is
    called with the real URL (``port`` 0 included) and ``ready_file`` is written (and removed
    again when the server stops: Ctrl-C, SIGTERM or an error)."""
    sock = sock if sock is not None else listen_socket(host, port)
    url = base_url(host, sock.getsockname()[1])
    if ready_file is not None:
        ready_file.unlink(missing_ok=True)  # never let a reader find a previous run's file

    def started() -> None:
        if ready_file is not None:
            write_ready_file(ready_file, url)
        if on_ready is not None:
            on_ready(url)

    def stopped() -> None:
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)

    server = _uvicorn_server(app, host, port, log_level, started, stopped)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
    if server.got_sigint:  # Ctrl-C ends as Ctrl-C (exit 130), whichever way asyncio unwound
        raise KeyboardInterrupt
    if not server.started:
        raise UsageError(f"the server could not start on {url}")


class ServerThread:
    """The server in a background thread of this process, for ``serve --validate`` and tests.

    >>> with ServerThread(app) as url:   # port 0: an ephemeral loopback port
    ...     httpx.get(url + "/health")
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.app = app
        self.host = host
        self.server = _uvicorn_server(app, host, port, log_level)
        self.thread = threading.Thread(target=self.server.run, name="eagle3-http", daemon=True)
        self.url = ""

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise UsageError(f"the HTTP server did not start on {self.host} (port in use?)")
            time.sleep(0.01)
        self.url = base_url(self.host, self.server.servers[0].sockets[0].getsockname()[1])
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30.0)


def _served(path: Path, draft: Path | None, eopts: EngineConfig, work: Callable[[str], Any], *, model_name: str,
            api_key: str | None, host: str, port: int, echo: Callable[[str], None],
            meta: dict[str, Any] | None = None, rejoin: bool = False) -> Any:
    """Load ``path`` (+ ``draft``), serve it in a background thread, run ``work(url)``, and unload it
    again (one model in memory at a time: a source and its quantized copy never share a node)."""
    echo(f"loading {path}" + (f" + draft {draft}" if draft is not None else " (no speculation)"))
    llm = build_llm(path, draft, eopts)
    if meta is not None:
        meta.update(engine_info(llm))  # what "auto" resolved to, whether graphs are on
    app = build_app(llm, model_name, api_key=api_key, root=str(path))
    try:
        with ServerThread(app, host, port) as url:
            out = work(url)
        if meta is not None:
            meta.update(engine_info(llm))  # auto: the k it chose over the run
    finally:
        # its tensor-parallel workers, before the next run forms its own group (rejoin: the ranks, of
        # this node and the others, wait to join that one)
        close_llm(llm, rejoin=rejoin)
        del app, llm
        gc.collect()
        _empty_device_cache(eopts.device)
    return out


def record_reference(source: Path, draft: Path | None, eopts: EngineConfig, vopts: Any, path: Path, *,
                     model_name: str, api_key: str | None = None, host: str = "127.0.0.1", port: int = 0,
                     echo: Callable[[str], None] = print, prep: Any = None) -> Any:
    """Pass 1 with the bundled runtime: serve ``source`` (+ ``draft``: the acceptance on the source)
    and record its reference to ``path`` (:func:`eagle3.validate.twopass.record`)."""
    from eagle3 import validate
    from eagle3.formats.check import require_valid_pair
    from eagle3.validate import twopass

    require_valid_pair(source, draft)
    prep = prep if prep is not None else validate.prepare(vopts)
    vopts.api_key = api_key
    info = {"engine": "eagle3", "checkpoint": str(source), "draft": None if draft is None else str(draft),
            "dtype": eopts.dtype, "kernel_backend": eopts.backend}

    def work(url: str) -> Any:
        echo(f"reference: recording {prep.describe()} item(s) from the source at {url}")
        return twopass.record(url, prep, vopts, path, info, model_name)

    return _served(source, draft, eopts, work, model_name=model_name, api_key=api_key, host=host, port=port,
                   echo=echo, rejoin=eopts.nnodes > 1)


def teacher_force_reference(target: Path, eopts: EngineConfig, vopts: Any, loaded: Any, prep: Any, *,
                            model_name: str, echo: Callable[[str], None] = print) -> Any:
    """Pass 2's teacher forcing alone with the bundled runtime: serve ``target`` (no draft), send every
    turn of the reference ``loaded`` back through it (:func:`eagle3.validate.twopass.teacher_force`),
    unload it. No validation run: ``quantize --eval`` compares, it does not score."""
    from eagle3.formats.check import require_valid_pair
    from eagle3.validate import twopass

    require_valid_pair(target, None)

    def work(url: str) -> Any:
        echo(f"reference: teacher-forcing {prep.describe()} item(s) through {target} at {url}")
        return twopass.teacher_force(url, loaded, prep, vopts, model_name)

    return _served(target, None, eopts, work, model_name=model_name, api_key=None, host="127.0.0.1", port=0,
                   echo=echo)


def serve_and_validate(target: Path, draft: Path | None, eopts: EngineConfig, vopts: Any, *,
                       model_name: str, api_key: str | None = None, host: str = "127.0.0.1", port: int = 0,
                       baseline: bool = True, echo: Callable[[str], None] = print,
                       source: Path | None = None) -> dict[str, Any]:
    """Serve, validate over HTTP, stop; with a draft, serve the target alone and run the same
    items again (every concurrency level) for the lossless check and the speedup. Returns the report.

    ``source`` (``--reference SRC_DIR``): first serve the source (+ draft) and record its reference
    (to ``vopts.record_reference`` when given, else a temporary file), then compare the target with it;
    ``vopts.reference`` alone: compare with a reference recorded before."""
    import tempfile

    from eagle3 import validate
    from eagle3.formats.check import require_valid_pair
    from eagle3.validate import twopass

    require_valid_pair(target, draft)  # before the data set is read and anything is printed
    if source is not None:
        require_valid_pair(source, draft)
    vopts.source = source
    prep = validate.prepare(vopts)  # --record-reference (where the source's recording is kept) checked too
    keep = vopts.record_reference
    vopts.record_reference = None  # serve records only as part of --reference SRC_DIR here
    vopts.api_key = api_key
    meta = {"target": str(target), "draft": None if draft is None else str(draft),
            "num_speculative_tokens": eopts.num_speculative_tokens if draft is not None else 0,
            "max_speculative_tokens": eopts.max_k if draft is not None and eopts.adaptive else None,
            "engine": "eagle3", "device": eopts.device, "dtype": eopts.dtype,
            "tensor_parallel_size": eopts.tensor_parallel_size, "kernel_backend": eopts.backend,
            "enforce_eager": eopts.enforce_eager, "activation_quant": eopts.activation_quant}
    common = dict(model_name=model_name, api_key=api_key, host=host, port=port, echo=echo)
    with tempfile.TemporaryDirectory(prefix="eagle3-reference-") as tmp:
        if source is not None:
            ref_path = keep if keep is not None else Path(tmp) / "reference.jsonl.gz"
            # the source under its own name: the reference says which model it is
            record_reference(source, draft, eopts, vopts, ref_path, prep=prep,  # type: ignore[arg-type]
                             **dict(common, model_name=source.resolve().name))
            meta["source"] = str(source)
            vopts.reference = ref_path
        loaded = twopass.load(vopts.reference, prep, vopts) if vopts.reference is not None else None
        forced: list[Any] = []

        def work(label: str) -> Callable[[str], Any]:
            def run_on(url: str) -> Any:
                echo(f"{label}: {prep.describe()} item(s) to {url} at concurrency "
                     f"{','.join(str(c) for c in vopts.levels)}")
                run = validate.evaluate(url, prep, vopts, label)
                if loaded is not None and not forced:  # the served model's side of the comparison
                    forced.append(twopass.teacher_force(url, loaded, prep, vopts, model_name))
                return run
            return run_on

        with_draft = draft is not None
        run = _served(target, draft if with_draft else None, eopts, work("speculative" if with_draft else "run"),
                      meta=meta, rejoin=with_draft and baseline, **common)  # type: ignore[arg-type]
        base = (_served(target, None, eopts, work("baseline"), **common)  # type: ignore[arg-type]
                if with_draft and baseline else None)
        sections = []
        if loaded is not None:
            adapt = None
            if draft is not None:
                import shlex

                from eagle3.train.adapt import adapt_command

                out = Path(draft).with_name(Path(draft).name + "-adapted")
                adapt = shlex.join(adapt_command(target, out, draft))
            sections.append(twopass.section(loaded, forced[0], prep, run, vopts, adapt))
        return validate.finish(run, base, prep, vopts, meta, sections=sections)


def close_llm(llm: Any, rejoin: bool = False) -> None:
    close = getattr(llm, "close", None)
    if callable(close):
        close(rejoin=True) if rejoin else close()


def run_headless(target: Path, config: EngineConfig, torchrun_rank: int | None) -> int:
    """A node other than node 0 (or a torchrun rank other than 0): run this node's tensor-parallel
    ranks without a server until node 0 ends them. Returns the exit status."""
    import torch

    from eagle3.runtime.engine.worker import Layout, run_node, run_torchrun_rank
    from eagle3.runtime.kernels import resolve_backend_name
    from eagle3.runtime.parallel import parse_addr

    if not Path(target).is_dir():
        raise UsageError(f"{target}: not a checkpoint directory")
    config.check_address()
    device = torch.device(config.device)
    load_kw = {"dtype": config.torch_dtype(), "backend": resolve_backend_name(config.backend, device),
               "kv_cache_dtype": config.kv_cache_dtype, "act_override": config.act_override}
    layout = Layout(config.tensor_parallel_size, config.nnodes, parse_addr(str(config.dist_init_addr)))
    if torchrun_rank is not None:  # this process is the rank (torchrun started it)
        return run_torchrun_rank(torchrun_rank, layout, str(target), dict(load_kw, device=str(device)))
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    return run_node(layout, config.node_rank, str(target), load_kw, device)


def _empty_device_cache(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
