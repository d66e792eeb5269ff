"""``eagle3 serve``: the bundled OpenAI-compatible server, ``--validate`` through it, ``--engine`` hand-off,
and ``--dry-run --plan``."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from eagle3.cli.app import app
from eagle3.cli.engine_flags import EngineFlags, engine_options
from eagle3.cli.options import (
    CODE_HELP,
    CONCURRENCY_HELP,
    LIMIT_HELP,
    LOGPROBS_HELP,
    MAX_FLIPS_HELP,
    MAX_KLD_HELP,
    MAX_TOKENS_HELP,
    MIN_TOP1_HELP,
    TASK_HELP,
    exit_on_report,
    parse_bytes,
)
from eagle3.cli.plan import print_plan


@app.command()
@engine_options()
def serve(
    target: Annotated[Path, typer.Argument(help="Target checkpoint directory.")],
    draft: Annotated[Path | None, typer.Option(help="EAGLE-3 draft checkpoint directory.")] = None,
    host: Annotated[str, typer.Option(help="Address to bind (loopback unless you mean otherwise).")] = "127.0.0.1",
    port: Annotated[int | None, typer.Option(help="Port (default 8000; 0 or --validate: a free one the OS picks).")] = None,
    ready_file: Annotated[Path | None, typer.Option(help="Write {\"url\", \"pid\"} JSON here once the server answers (removed at exit); with --port 0 it tells the port.")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="EAGLE3_API_KEY", help="Require 'Authorization: Bearer KEY'.")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Model id in the API (default: the target directory name).")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    max_request_bytes: Annotated[str, typer.Option(help="Largest request body accepted, e.g. 8MiB (413 above it, refused before it is read).")] = "8MiB",
    request_timeout: Annotated[float, typer.Option(help="Seconds a client may take to send its headers, and between reads of its body (408 / disconnect after).")] = 30.0,
    validate: Annotated[str | None, typer.Option(help="Run a validation through the HTTP API, then stop. " + TASK_HELP)] = None,
    limit: Annotated[int | None, typer.Option(help="--validate: " + LIMIT_HELP)] = None,
    num_fewshot: Annotated[int, typer.Option(help="--validate gsm8k: few-shot exemplars.")] = 5,
    concurrency: Annotated[str, typer.Option(help="--validate: " + CONCURRENCY_HELP)] = "1",
    dataset: Annotated[Path | None, typer.Option(help="--validate gsm8k: directory with train.jsonl + test.jsonl (default: the copy eagle3 ships; hub: the Hub dataset openai/gsm8k).")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="--validate: " + MAX_TOKENS_HELP)] = None,
    allow_code_execution: Annotated[bool, typer.Option(help="--validate " + CODE_HELP)] = False,
    report: Annotated[Path | None, typer.Option(help="--validate: write the JSON report here (+ .png figure).")] = None,
    figure: Annotated[Path | None, typer.Option(help="--validate: the figure's path (default: REPORT with .png).")] = None,
    overwrite: Annotated[bool, typer.Option(help="--validate: replace an existing report / figure.")] = False,
    min_accuracy: Annotated[float | None, typer.Option(help="--validate: fail (exit 1) when a workload's accuracy (gsm8k exact match, humaneval pass@1) is below this.")] = None,
    accuracy_filter: Annotated[str, typer.Option(help="--validate gsm8k: strict-match|flexible-extract for --min-accuracy.")] = "strict-match",
    min_acceptance: Annotated[float | None, typer.Option(help="--validate: fail (exit 1) when a workload's acceptance rate is below this.")] = None,
    baseline: Annotated[bool, typer.Option(help="--validate with a draft: also run without speculation (lossless check, speedup).")] = True,
    reference: Annotated[Path | None, typer.Option(help="--validate: compare TARGET with its source: SRC_DIR (served first, one model loaded at a time: the two passes) or a file --record-reference wrote.")] = None,
    record_reference: Annotated[Path | None, typer.Option(help="--validate: keep the source's recording here (with --reference SRC_DIR), or record TARGET as a source and stop.")] = None,
    logprobs: Annotated[int | None, typer.Option(help="--validate: " + LOGPROBS_HELP)] = None,
    max_kld: Annotated[float | None, typer.Option(help=MAX_KLD_HELP)] = None,
    min_top1: Annotated[float | None, typer.Option(help=MIN_TOP1_HELP)] = None,
    max_flips: Annotated[float | None, typer.Option(help=MAX_FLIPS_HELP)] = None,
    engine: Annotated[str | None, typer.Option(help="Hand off to vllm|sglang|atom: print and run its launch command.")] = None,
    dry_run: Annotated[bool, typer.Option(help="--engine: print the command only.")] = False,
    quantization: Annotated[str | None, typer.Option(help="--engine: quantization method (default: from config.json).")] = None,
    attention_backend: Annotated[str | None, typer.Option(help="--engine sglang: its --attention-backend (draft trees over MLA: triton (default) or fa3, at --page-size 1).")] = None,
    plan: Annotated[bool, typer.Option("--plan", help="Print the memory plan (as `eagle3 plan`) for --tensor-parallel-size GPUs; with --dry-run only that. Config-only: no weights needed.")] = False,
    gpu: Annotated[str | None, typer.Option(help="--plan: h100, h100-pcie, h100-nvl, h200, mi300x, mi325x or mi355x.")] = None,
    gpu_memory: Annotated[str | None, typer.Option(help="--plan: memory per GPU, e.g. 256GiB (overrides --gpu's).")] = None,
    memory_fraction: Annotated[float, typer.Option(help="--plan: fraction of each GPU's memory the runtime may use.")] = 0.9,
    *,
    engine_flags: EngineFlags,
) -> None:
    """Serve TARGET (+ EAGLE-3 draft) over an OpenAI-compatible API, validate it, or hand off.

    Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics (Prometheus),
    /tokenize, /detokenize, /tokenizer_info. Exit code 1 when a --validate threshold is missed.
    The engine options are EngineConfig's (docs/architecture.md): the bundled runtime runs with
    them, --validate validates it, --engine passes them to vLLM / SGLang / ATOM.

    Examples:

    \b
    eagle3 serve ./Kimi-K2.5 --draft ./kimi-k2.5-eagle3 --port 8000
    eagle3 serve ./Kimi-K2.5 --draft ./kimi-k2.5-eagle3 --device cuda --kernel-backend triton --enforce-eager
    eagle3 serve ./Kimi-K2.5 --draft ./kimi-k2.5-eagle3 --device cuda --kv-cache-dtype fp8
    eagle3 serve ./tiny/kimi-k2.5 --draft ./tiny/kimi-k2.5-eagle3 --validate gsm8k --limit 8 --report r.json
    eagle3 serve ./Kimi-K2.5 --draft ./kimi-k2.5-eagle3 --validate gsm8k,humaneval,mtbench --limit 20 --concurrency 1,8,32
    eagle3 serve ./Kimi-K2.5-W4A8 --draft ./kimi-k2.5-eagle3 --validate gsm8k,mtbench --limit 50 --reference ./Kimi-K2.5
    eagle3 serve ./Kimi-K2.5-W4A8 --draft ./draft-vllm --engine vllm --tensor-parallel-size 8 --dry-run
    eagle3 serve ./Kimi-K2.5 --draft ./kimi-k2.5-eagle3 --engine sglang --speculative-eagle-topk 4 --dry-run
    eagle3 serve ./Kimi-K2.5 --dry-run --plan --tensor-parallel-size 8 --gpu mi325x

    Two nodes (run on each, R = 0 on the one that serves):

    \b
    eagle3 serve ./Kimi-K2.5 --draft ./kimi-k2.5-eagle3 --device cuda --tensor-parallel-size 16 --nnodes 2 --node-rank R --dist-init-addr NODE0:29500
    """
    from eagle3.errors import UsageError

    if plan:
        _print_serve_plan(target, draft, engine_flags.config(draft, serving=False), gpu, gpu_memory,
                          memory_fraction, to_stdout=dry_run)
        if dry_run and engine is None:
            return
    elif gpu is not None or gpu_memory is not None:
        raise UsageError("--gpu / --gpu-memory go with --plan")
    if engine is not None:  # the other engine's launch, from the same EngineConfig (serve/engines.py)
        config = engine_flags.config(draft, serving=False)  # its address: checked per engine (node_commands)
        kw = dict(host=host, port=8000 if port is None else port, quantization=quantization,
                  served_model_name=served_model_name, attention_backend=attention_backend)
        if config.nnodes > 1:
            _hand_off_nodes(engine, target, draft, config, **kw)
        else:
            _hand_off(engine, target, draft, config, dry_run=dry_run, **kw)
        return
    if attention_backend is not None:
        raise UsageError("--attention-backend goes with --engine sglang")
    if dry_run:
        raise UsageError("--dry-run goes with --engine vllm|sglang|atom or --plan")
    from eagle3.serve import launcher

    eopts = engine_flags.config(draft)
    if engine_flags.torchrun_rank is not None or eopts.node_rank != 0:  # this node's ranks only: node 0 serves
        raise typer.Exit(launcher.run_headless(target, eopts, engine_flags.torchrun_rank))
    name = served_model_name or target.resolve().name
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        typer.echo(f"warning: serving on {host} without --api-key: anyone who can reach it can use it", err=True)
    if validate is not None:
        from eagle3.validate import ValidateOptions

        vopts = ValidateOptions(task=validate, limit=limit, num_fewshot=num_fewshot, concurrency=concurrency,
                                dataset=dataset, max_tokens=max_tokens, model=name, report=report, figure=figure,
                                overwrite=overwrite, min_accuracy=min_accuracy, min_acceptance=min_acceptance,
                                accuracy_filter=accuracy_filter, allow_code_execution=allow_code_execution,
                                record_reference=record_reference, logprobs=logprobs, max_kld=max_kld,
                                min_top1=min_top1, max_flips=max_flips,
                                inputs=(target, draft, reference), echo=lambda s: typer.echo(s, err=True))
        _serve_and_validate(target, draft, eopts, vopts, name, api_key=api_key, host=host,
                            port=0 if port is None else port, baseline=baseline, reference=reference)
        return
    given = [f for f, v in (("--reference", reference), ("--record-reference", record_reference),
                            ("--logprobs", logprobs), ("--max-kld", max_kld), ("--min-top1", min_top1),
                            ("--max-flips", max_flips)) if v is not None]
    if given:
        raise UsageError(f"{', '.join(given)} go with --validate")
    _serve_http(target, draft, eopts, name, api_key=api_key, host=host, port=8000 if port is None else port,
                log_level=log_level, ready_file=ready_file, max_request_bytes=max_request_bytes,
                request_timeout=request_timeout)


def _print_serve_plan(target: Path, draft: Path | None, config: Any, gpu: str | None, gpu_memory: str | None,
                      memory_fraction: float, to_stdout: bool) -> None:
    """``--plan``: the same projection as `eagle3 plan`, for the serve command's own target, draft, GPU
    count, nodes, KV cache dtype and context length (its EngineConfig); printed first (stdout for
    --dry-run, else stderr before the load)."""
    kv = {"auto": "bf16", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}.get(config.kv_cache_dtype, config.kv_cache_dtype)
    gpus = config.tensor_parallel_size
    with contextlib.redirect_stdout(sys.stdout if to_stdout else sys.stderr):
        print_plan(str(target), gpus=gpus, gpus_per_node=max(1, gpus // config.nnodes), gpu=gpu, gpu_memory=gpu_memory,
                   memory_fraction=memory_fraction, draft=None if draft is None else str(draft),
                   kv_cache_dtype=kv, reserve="4GiB", embedding="replicated", recipe=None, scope=None,
                   max_model_len=config.max_model_len, report=None, json_out=False)


def _hand_off(engine: str, target: Path, draft: Path | None, config: Any, *, dry_run: bool, **kwargs: Any) -> None:
    """``--engine``: print the other engine's launch command, and run it unless ``--dry-run``."""
    from eagle3.formats.check import require_valid_pair
    from eagle3.serve import engines

    require_valid_pair(target, draft)  # a model the engine would refuse after a long start, refused now
    cmd = engines.build_command(engine, target, draft, config, **kwargs)
    for note in cmd.notes:
        typer.echo(f"# note: {note}", err=True)
    typer.echo(cmd.shell())
    if not dry_run:
        raise typer.Exit(engines.run(cmd))


def _hand_off_nodes(engine: str, target: Path, draft: Path | None, config: Any, **kwargs: Any) -> None:
    """``--engine X --nnodes N``: print the engine's launch on every node (to run there; nothing is run
    here: each command belongs on its own machine)."""
    from eagle3.formats.check import require_valid_pair
    from eagle3.serve import engines

    commands = engines.node_commands(engine, target, draft, config, **kwargs)  # flags checked first
    require_valid_pair(target, draft)
    for node, cmd in commands:
        for note in cmd.notes:
            typer.echo(f"# note: {note}", err=True)
        typer.echo(f"# node {node}:")
        typer.echo(cmd.shell())


def _serve_and_validate(target: Path, draft: Path | None, eopts: Any, vopts: Any, name: str, *,
                        api_key: str | None, host: str, port: int, baseline: bool, reference: Path | None) -> None:
    """``--validate``: serve on a free port, run the validation through the HTTP API, stop; with
    ``--record-reference`` alone, record TARGET as a source and stop. ``--reference``: a source
    checkpoint directory (recorded first) or a reference file."""
    from eagle3.serve import launcher
    from eagle3.validate.report import summary_lines

    source = reference if reference is not None and reference.is_dir() else None
    if reference is not None and source is None:
        vopts.reference = reference

    echo = lambda s: typer.echo(s, err=True)  # noqa: E731
    if vopts.record_reference is not None and source is None:
        from eagle3.validate import twopass

        ref = launcher.record_reference(target, draft, eopts, vopts, vopts.record_reference, model_name=name,
                                        api_key=api_key, host=host, port=port, echo=echo)
        for line in twopass.record_summary(ref, vopts.record_reference):
            typer.echo(line)
        return
    result = launcher.serve_and_validate(target, draft, eopts, vopts, model_name=name, api_key=api_key,
                                         host=host, port=port, baseline=baseline, echo=echo, source=source)
    report = vopts.report
    exit_on_report(result, summary_lines(result) + ([f"report: {report}"] if report else []))


def _serve_http(target: Path, draft: Path | None, eopts: Any, name: str, *, api_key: str | None, host: str,
                port: int, log_level: str, ready_file: Path | None, max_request_bytes: str,
                request_timeout: float) -> None:
    """The server itself: limits checked and the socket bound before the (long) load, then serve."""
    from eagle3.errors import UsageError
    from eagle3.serve import launcher
    from eagle3.serve.limits import ServerLimits

    if not request_timeout > 0:
        raise UsageError(f"--request-timeout must be > 0 seconds, got {request_timeout}")
    limits = ServerLimits(parse_bytes(max_request_bytes, "--max-request-bytes"), request_timeout)
    sock = launcher.listen_socket(host, port)  # before the (long) load
    llm = launcher.build_llm(target, draft, eopts)
    api = launcher.build_app(llm, name, api_key=api_key, root=str(target), limits=limits)
    launcher.serve_forever(api, host, port, log_level, sock=sock, ready_file=ready_file,
                           on_ready=lambda url: typer.echo(f"eagle3: serving {name} on {url}/v1", err=True))
