"""The ``eagle3`` command line (Typer).

One small function per command: parse, call the library, print. No logic lives here. torch and
the heavy libraries are imported inside the commands so that ``eagle3 --help`` is instant.
Errors meant for users (:class:`eagle3.errors.Eagle3Error`) print as one line and exit 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from eagle3.errors import Eagle3Error

app = typer.Typer(
    name="eagle3",
    help="EAGLE-3 speculative decoding for Kimi-K2.5: download, inspect, convert, quantize, serve.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_state = {"debug": False}


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks instead of one-line errors.")] = False,
) -> None:
    _state["debug"] = debug


def _print_json(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# download
# ---------------------------------------------------------------------------------------------


@app.command()
def download(
    repo: Annotated[str, typer.Argument(help="Hub repo id (owner/name) or a local directory.")],
    revision: Annotated[str | None, typer.Option(help="Branch, tag or commit.")] = None,
    local_dir: Annotated[Path | None, typer.Option(help="Download into this directory instead of the HF cache.")] = None,
    include: Annotated[list[str] | None, typer.Option(help="Glob of files to fetch (repeatable); replaces the defaults.")] = None,
    exclude: Annotated[list[str] | None, typer.Option(help="Glob of files to skip (repeatable).")] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Also fetch *.py remote-code files (never fetched otherwise, even with --include).")] = False,
    dry_run: Annotated[bool, typer.Option(help="List the files and total size; download nothing.")] = False,
    cache_dir: Annotated[Path | None, typer.Option(help="Hugging Face cache directory.")] = None,
    token: Annotated[str | None, typer.Option(help="Hub token (default: HF_TOKEN / stored login).")] = None,
    max_workers: Annotated[int, typer.Option(help="Parallel file downloads.")] = 8,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Download a model (weights, index, configs, tokenizer, chat template), resumably.

    Example: eagle3 download lightseekorg/kimi-k2.5-eagle3 --local-dir ./kimi-k2.5-eagle3

    Works offline from the cache with HF_HUB_OFFLINE=1; a local path is returned as is.
    """
    from eagle3 import hub

    result = hub.download(
        repo, revision=revision, local_dir=local_dir, include=include, exclude=exclude,
        trust_remote_code=trust_remote_code, dry_run=dry_run, cache_dir=cache_dir, token=token,
        max_workers=max_workers,
    )
    if json_out:
        _print_json(result.to_json())
    else:
        hub.print_result(result)


# ---------------------------------------------------------------------------------------------
# inspect / verify
# ---------------------------------------------------------------------------------------------


@app.command()
def inspect(
    path: Annotated[str, typer.Argument(help="Checkpoint directory, .safetensors file or Hub repo id.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the stable JSON form (keys documented in the README).")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 2 when the checkpoint disagrees with its architecture's schema.")] = False,
) -> None:
    """Identify a checkpoint: role, family, quantization, EAGLE flags, aux layers, tensors.

    Example: eagle3 inspect ./kimi-k2.5-eagle3 --json
    """
    from eagle3 import hub
    from eagle3.formats import detect

    # A repo id is inspected from its configs and safetensors headers only (range requests):
    # no weights are downloaded.
    where, reader = hub.header_view(path)
    summary = detect.detect(where, reader=reader)
    if json_out:
        _print_json(summary.to_json())
    else:
        detect.print_summary(summary)
    from eagle3.formats.check import report_problems

    report_problems(where, strict=strict, to_stderr=json_out)


@app.command()
def verify(
    path: Annotated[Path, typer.Argument(help="A directory written by eagle3 (it carries manifest.json).")],
) -> None:
    """Check an eagle3 output: every file against its manifest (sha256 and size), every
    .safetensors header (as strictly as the safetensors library) and each index against its shards.

    Example: eagle3 verify ./kimi-k2.5-w4a8
    """
    from eagle3.checkpoint import verify_manifest
    from eagle3.errors import VerifyError

    res = verify_manifest(path)
    if res.problems:
        raise VerifyError(f"{path}: {len(res.problems)} problem(s): " + "; ".join(res.problems[:5]))
    typer.echo(f"OK: {res.checked} files match {path / 'manifest.json'}; {res.headers} safetensors headers "
               "(and any index) are sound")


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------


@app.command()
def plan(
    target: Annotated[str, typer.Argument(help="Target checkpoint directory, its config.json, or a Hub repo id (weights optional).")],
    gpus: Annotated[int, typer.Option(help="Number of GPUs = tensor/expert-parallel ranks.")] = 8,
    gpu: Annotated[str | None, typer.Option(help="h100|h200|mi300x|mi325x|mi355x (memory as the driver reports it).")] = None,
    gpu_memory: Annotated[str | None, typer.Option(help="Memory per GPU, e.g. 256GiB (overrides --gpu's).")] = None,
    memory_fraction: Annotated[float, typer.Option(help="Fraction of each GPU's memory the runtime may use.")] = 0.9,
    draft: Annotated[str | None, typer.Option(help="Draft checkpoint directory, config.json or repo id (replicated).")] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help="bf16|fp8|fp16|fp32 -- KV cache element type.")] = "bf16",
    reserve: Annotated[str, typer.Option(help="Runtime reserve per GPU (context, buffers, activations).")] = "4GiB",
    embedding: Annotated[str, typer.Option(help="replicated|vocab-split -- how the embedding is placed.")] = "replicated",
    recipe: Annotated[str | None, typer.Option(help="Plan the checkpoint `eagle3 quantize --recipe` would write from TARGET.")] = None,
    scope: Annotated[str | None, typer.Option(help="With --recipe: the recipe scope.")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Sequence length the KV cache must hold at least once (default: the config's).")] = None,
    report: Annotated[Path | None, typer.Option(help="Also write the plan as JSON to this file.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Memory plan: weight bytes per rank, KV-cache capacity, and whether it fits.

    Works on a config.json alone (no weights needed); uses the safetensors headers when present
    (for a Hub repo id: its config and headers, read without downloading the weights).

    Example: eagle3 plan ./Kimi-K2.5 --gpus 8 --gpu mi325x --recipe w4a8
    """
    _print_plan(target, gpus=gpus, gpu=gpu, gpu_memory=gpu_memory, memory_fraction=memory_fraction, draft=draft,
                kv_cache_dtype=kv_cache_dtype, reserve=reserve, embedding=embedding, recipe=recipe, scope=scope,
                max_model_len=max_model_len, report=report, json_out=json_out)


def _print_plan(target: str, *, gpus: int, gpu: str | None, gpu_memory: str | None, memory_fraction: float,
                draft: str | None, kv_cache_dtype: str, reserve: str, embedding: str, recipe: str | None,
                scope: str | None, max_model_len: int | None, report: Path | None, json_out: bool) -> None:
    """`eagle3 plan` and `eagle3 serve --dry-run --plan`: one accounting (eagle3.runtime.plan)."""
    from eagle3 import hub
    from eagle3.runtime import plan as plan_mod
    from eagle3.serve.launcher import parse_bytes

    mem = parse_bytes(gpu_memory, "--gpu-memory") if gpu_memory else None
    plan_mod.check_options(gpus=gpus, gpu=gpu, gpu_memory=mem, memory_fraction=memory_fraction,
                           kv_cache_dtype=kv_cache_dtype, embedding=embedding)
    # A repo id is planned from its config and safetensors headers (range requests), like inspect.
    where, reader = hub.header_view(target)
    model = plan_mod.load_model(where, "TARGET", recipe, scope, reader=reader, name=target)
    dmodel = None
    if draft is not None:
        dwhere, dreader = hub.header_view(draft)
        dmodel = plan_mod.load_model(dwhere, "--draft", reader=dreader, name=draft)
    p = plan_mod.plan(
        model, gpus=gpus, gpu=gpu, gpu_memory=mem,
        memory_fraction=memory_fraction, draft=dmodel, kv_cache_dtype=kv_cache_dtype,
        reserve=parse_bytes(reserve, "--reserve"), embedding=embedding, max_model_len=max_model_len)
    if report is not None:
        report.write_text(json.dumps(p.to_json(), indent=2) + "\n")
    if json_out:
        _print_json(p.to_json())
    else:
        for line in plan_mod.summary_lines(p):
            typer.echo(line)


# ---------------------------------------------------------------------------------------------
# make-tiny
# ---------------------------------------------------------------------------------------------


@app.command("make-tiny")
def make_tiny(
    out: Annotated[Path, typer.Argument(help="Directory to create; one sub-directory per model.")],
    seed: Annotated[int, typer.Option(help="Random seed (the output is a pure function of it).")] = 0,
    only: Annotated[list[str] | None, typer.Option(help="Write only these models (repeatable).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUT.")] = False,
) -> None:
    """Write tiny synthetic checkpoints in the exact upstream on-disk formats.

    Example: eagle3 make-tiny /tmp/tiny && eagle3 inspect /tmp/tiny/kimi-k2.5

    Models: kimi-k2.5, kimi-k2-thinking, kimi-k2.5-eagle3, kimi-k2.5-eagle3-d2t,
    kimi-k2.6-eagle3.1-mla, speculators-eagle3; with --only only: kimi-k2.5-trained (a Kimi-architecture
    target pre-trained on GSM8K, shipped as package data).
    """
    from eagle3.testing import tiny

    paths = tiny.make_tiny(out, seed=seed, only=only, overwrite=overwrite)
    for name, p in paths.items():
        typer.echo(f"{name:28s} {p}")


@app.command("make-slice")
def make_slice(
    out: Annotated[Path, typer.Argument(help="Directory to create (the slice checkpoint).")],
    layers: Annotated[int, typer.Option(help="Decoder layers (layer 0 dense when >= 2, the rest MoE).")] = 2,
    experts: Annotated[int, typer.Option(help="Routed experts per MoE layer (Moonshot INT4).")] = 8,
    seed: Annotated[int, typer.Option(help="Random seed (the output is a pure function of it).")] = 0,
    vocab: Annotated[int, typer.Option(hidden=True, help="Vocabulary rows (tests only; the real one is 163840).")] = 163840,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUT.")] = False,
) -> None:
    """Write a Kimi-K2.5 slice at the real tensor shapes in Moonshot's format (streaming).

    Hidden 7168, 64 MLA heads, vocab 163840, expert width 2048, INT4 group-32 routed experts;
    2 layers x 32 experts is 6.8 GB.

    Example: eagle3 make-slice /tmp/k25-slice --layers 2 --experts 8 && eagle3 inspect /tmp/k25-slice
    """
    from eagle3.testing import slice as slice_mod
    from eagle3.units import human_bytes

    p = slice_mod.make_slice(out, layers=layers, experts=experts, seed=seed, vocab=vocab, overwrite=overwrite)
    typer.echo(f"kimi-k2.5 slice ({layers} layers, {experts} experts, "
               f"{human_bytes(slice_mod.slice_bytes(layers, experts, vocab))}) {p}")


# ---------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------


@app.command()
def convert(
    src: Annotated[str, typer.Argument(help="Draft or target: checkpoint directory or Hub repo id.")],
    out: Annotated[Path, typer.Argument(help="Output directory (written to OUT.partial, then renamed).")],
    engine: Annotated[str | None, typer.Option(help="vllm|sglang|atom|speculators|eagle3 (required for drafts).")] = None,
    target: Annotated[str | None, typer.Option(help="Draft: the target model (dir or Hub id) to pair-check against and take default aux ids from.")] = None,
    aux_layer_ids: Annotated[str | None, typer.Option(help="Draft: aux layer ids, e.g. 2,30,58 (overrides the source).")] = None,
    aux_convention: Annotated[str | None, typer.Option(help="Draft: input|output -- what the aux ids mean (overrides detection).")] = None,
    norm_output: Annotated[str | None, typer.Option(help="Draft: true|false -- set EAGLE-3.1 norm_output explicitly.")] = None,
    drop: Annotated[list[str] | None, typer.Option(help="Leave out tensors matching NAME (exact or glob; repeatable).")] = None,
    verifier: Annotated[str | None, typer.Option(help="Draft, speculators: verifier name_or_path (default: --target or moonshotai/Kimi-K2.5).")] = None,
    text_only: Annotated[bool, typer.Option(help="Target: Kimi-K2.5 wrapper -> DeepseekV3ForCausalLM text stack.")] = False,
    dequantize: Annotated[str | None, typer.Option(help="Target: bf16|fp32 -- INT4 / FP8-block weights become dense.")] = None,
    model_type: Annotated[str | None, typer.Option(help="Target: kimi_k2|deepseek_v3 -- model_type of the text stack.")] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Also carry *.py remote-code files over.")] = False,
    max_shard_size: Annotated[str | None, typer.Option(help="Largest output shard, e.g. 5GB (default 5GiB).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUT.")] = False,
    allow_nonfinite: Annotated[bool, typer.Option(help="Write weights that hold NaN/Inf (refused otherwise); the report lists them.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the conversion report as JSON.")] = False,
) -> None:
    """Convert a draft for an engine, or a Kimi-K2.5 target (text-only, dequantized).

    Examples: eagle3 convert ./kimi-k2.5-eagle3 ./draft-vllm --engine vllm --target ./Kimi-K2.5

    eagle3 convert ./Kimi-K2.5 ./Kimi-K2.5-text-bf16 --text-only --dequantize bf16

    Writes OUT/convert_report.json (renames, drops, aux-id choice, warnings) and a manifest.
    """
    from eagle3 import convert as conv

    report = conv.convert(
        src, out, engine=engine, target=target, aux_layer_ids=conv.parse_aux_ids(aux_layer_ids),
        aux_convention=aux_convention, norm_output=conv.parse_bool(norm_output, "--norm-output"),
        drop=drop, verifier=verifier, text_only=text_only, dequantize=dequantize, model_type=model_type,
        trust_remote_code=trust_remote_code, overwrite=overwrite, max_shard_bytes=conv.parse_size(max_shard_size),
        progress=not quiet and not json_out, allow_nonfinite=allow_nonfinite,
    )
    if json_out:
        _print_json(report.to_json())
    else:
        conv.print_summary(report)


# ---------------------------------------------------------------------------------------------
# quantize
# ---------------------------------------------------------------------------------------------


def _retain_freed_memory() -> None:
    """glibc only: keep freed memory in the process instead of handing it back to the OS at once.
    The quantizer allocates and frees multi-MB temporaries for every row chunk; by default glibc
    maps/unmaps (or trims) them each time and every reuse pays fresh page faults (~0.5 s per GB on
    this project's VMs: ~7% of a quantize run). Process-wide, so only the CLI's own short-lived
    process sets it, never the library."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: trim the heap top only past 1 GiB free
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: glibc's maximum; larger blocks are still mmapped
    except (OSError, AttributeError):  # not glibc (musl, macOS): the defaults are fine
        pass


@app.command()
def quantize(
    src: Annotated[str, typer.Argument(help="Target or draft: checkpoint directory or Hub repo id.")],
    out: Annotated[Path, typer.Argument(help="Output directory (written to OUT.partial, then renamed).")],
    recipe: Annotated[str, typer.Option(help="w4a8|w4a8-int8|mxfp4|int4-draft|fp8-draft, or a recipe YAML file.")],
    scope: Annotated[str | None, typer.Option(help="A scope of the recipe, e.g. mxfp4: experts|experts+shared+dense.")] = None,
    workers: Annotated[int, typer.Option(help="Worker threads (0 = one per CPU core, as memory allows).")] = 0,
    engine: Annotated[str, typer.Option(help="native (eagle3 codecs) | quark (AMD Quark's primitives, same bits).")] = "native",
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run from OUT.partial, skipping finished shards.")] = False,
    verify: Annotated[bool, typer.Option(help="Measure each quantized tensor's decode against the source and read it back from OUT.")] = True,
    trust_remote_code: Annotated[bool, typer.Option(help="Also carry *.py remote-code files over.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUT.")] = False,
    allow_nonfinite: Annotated[bool, typer.Option(help="Quantize weights that hold NaN/Inf (refused otherwise); the report lists them.")] = False,
    any_architecture: Annotated[bool, typer.Option(help="Quantize a model whose architecture eagle3 does not know, file to file, without its model checks.")] = False,
    quark_zero_points: Annotated[bool, typer.Option(help="Also write the all-zero INT4 zero points (weight_zero_point[_2]) that Quark's own importer needs; vLLM's DeepSeek/Kimi loader refuses them.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of a table.")] = False,
) -> None:
    """Quantize a checkpoint file to file into AMD Quark's export format (vLLM, SGLang, ATOM).

    Examples: eagle3 quantize ./Kimi-K2.5 ./Kimi-K2.5-W4A8 --recipe w4a8

    eagle3 quantize ./Kimi-K2.5 ./Kimi-K2.5-MXFP4 --recipe mxfp4 --scope experts --workers 4

    eagle3 quantize ./kimi-k2.5-eagle3 ./draft-int4 --recipe int4-draft

    Writes OUT/quantization_report.json (+ .png): per-tensor error of the decoded output vs the source.
    """
    from eagle3.quantize import pipeline

    _retain_freed_memory()
    result = pipeline.quantize(src, out, recipe, scope, workers=workers, engine=engine, overwrite=overwrite,
                               resume=resume, verify=verify, trust_remote_code=trust_remote_code,
                               progress=not quiet and not json_out and sys.stderr.isatty(),
                               allow_nonfinite=allow_nonfinite, any_architecture=any_architecture,
                               quark_zero_points=quark_zero_points)
    if json_out:
        _print_json(result.to_json())
    else:
        pipeline.print_summary(result)


# ---------------------------------------------------------------------------------------------
# serve / validate / bench
# ---------------------------------------------------------------------------------------------


_KERNEL_BACKEND_HELP = ("Kernel backend of the bundled runtime: auto (triton on a GPU where triton imports, aiter "
                        "on ROCm where aiter imports, torch otherwise), torch, triton, aiter.")
_ENFORCE_EAGER_HELP = "No CUDA/HIP graphs: run every decode / verify / draft step eagerly (graphs are GPU only)."


def _check_kernel_backend(name: str) -> str:
    """``--kernel-backend`` checked before anything loads (one line, exit 2, on a bad value)."""
    from eagle3.errors import UsageError

    choices = ("auto", "torch", "triton", "aiter")
    if name not in choices:
        raise UsageError(f"--kernel-backend {name!r}: expected one of {', '.join(choices)}")
    return name


def _exit_on_report(report: dict, lines: list[str]) -> None:
    for line in lines:
        typer.echo(line)
    if not report["passed"]:
        raise typer.Exit(1)


@app.command()
def serve(
    target: Annotated[Path, typer.Argument(help="Target checkpoint directory.")],
    draft: Annotated[Path | None, typer.Option(help="EAGLE-3 draft checkpoint directory.")] = None,
    num_speculative_tokens: Annotated[int, typer.Option(help="Draft tokens per step (k).")] = 3,
    host: Annotated[str, typer.Option(help="Address to bind (loopback unless you mean otherwise).")] = "127.0.0.1",
    port: Annotated[int | None, typer.Option(help="Port (default 8000; 0 or --validate: a free one the OS picks).")] = None,
    ready_file: Annotated[Path | None, typer.Option(help="Write {\"url\", \"pid\"} JSON here once the server answers (removed at exit); with --port 0 it tells the port.")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="EAGLE3_API_KEY", help="Require 'Authorization: Bearer KEY'.")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Model id in the API (default: the target directory name).")] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow code shipped with the model (e.g. its tokenizer) to run.")] = False,
    dtype: Annotated[str, typer.Option(help="Activation / dense weight dtype: bfloat16|float16|float32.")] = "bfloat16",
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:1, ...")] = "cpu",
    max_model_len: Annotated[int | None, typer.Option(help="Context length (default: the model's).")] = None,
    kv_cache_memory: Annotated[str | None, typer.Option(help="KV cache size, e.g. 4GiB (default: 256MiB on CPU, 80% of free GPU memory).")] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences in one batch.")] = 64,
    seed: Annotated[int, typer.Option(help="Engine seed (requests without their own seed).")] = 0,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    max_request_bytes: Annotated[str, typer.Option(help="Largest request body accepted, e.g. 8MiB (413 above it, refused before it is read).")] = "8MiB",
    request_timeout: Annotated[float, typer.Option(help="Seconds a client may take to send its headers, and between reads of its body (408 / disconnect after).")] = 30.0,
    validate: Annotated[str | None, typer.Option(help="Run a validation through the HTTP API, then stop: gsm8k.")] = None,
    limit: Annotated[int | None, typer.Option(help="--validate: first N test questions.")] = None,
    num_fewshot: Annotated[int, typer.Option(help="--validate: few-shot exemplars.")] = 5,
    concurrency: Annotated[int, typer.Option(help="--validate: requests in flight.")] = 1,
    dataset: Annotated[Path | None, typer.Option(help="--validate: directory with train.jsonl + test.jsonl (default: Hub openai/gsm8k).")] = None,
    max_tokens: Annotated[int, typer.Option(help="--validate: new tokens per answer (lm-eval: 256).")] = 256,
    report: Annotated[Path | None, typer.Option(help="--validate: write the JSON report here (+ .png figure).")] = None,
    figure: Annotated[Path | None, typer.Option(help="--validate: the figure's path (default: REPORT with .png).")] = None,
    overwrite: Annotated[bool, typer.Option(help="--validate: replace an existing report / figure.")] = False,
    min_accuracy: Annotated[float | None, typer.Option(help="--validate: fail (exit 1) below this exact match.")] = None,
    accuracy_filter: Annotated[str, typer.Option(help="--validate: strict-match|flexible-extract for --min-accuracy.")] = "strict-match",
    min_acceptance: Annotated[float | None, typer.Option(help="--validate: fail (exit 1) below this acceptance rate.")] = None,
    baseline: Annotated[bool, typer.Option(help="--validate with a draft: also run without speculation (lossless check, speedup).")] = True,
    engine: Annotated[str | None, typer.Option(help="Hand off to vllm|sglang|atom: print and run its launch command.")] = None,
    dry_run: Annotated[bool, typer.Option(help="--engine: print the command only.")] = False,
    tensor_parallel_size: Annotated[int, typer.Option(help="Tensor parallel size: worker processes of the bundled runtime (gloo on CPU, nccl on GPUs), or passed to --engine.")] = 1,
    kernel_backend: Annotated[str, typer.Option(help=_KERNEL_BACKEND_HELP)] = "auto",
    enforce_eager: Annotated[bool, typer.Option(help=_ENFORCE_EAGER_HELP)] = False,
    kv_cache_dtype: Annotated[str, typer.Option(help="--engine: auto|bf16|fp8|fp8_e4m3|fp8_e5m2.")] = "auto",
    quantization: Annotated[str | None, typer.Option(help="--engine: quantization method (default: from config.json).")] = None,
    plan: Annotated[bool, typer.Option("--plan", help="Print the memory plan (as `eagle3 plan`) for --tensor-parallel-size GPUs; with --dry-run only that. Config-only: no weights needed.")] = False,
    gpu: Annotated[str | None, typer.Option(help="--plan: h100|h200|mi300x|mi325x|mi355x.")] = None,
    gpu_memory: Annotated[str | None, typer.Option(help="--plan: memory per GPU, e.g. 256GiB (overrides --gpu's).")] = None,
    memory_fraction: Annotated[float, typer.Option(help="--plan: fraction of each GPU's memory the runtime may use.")] = 0.9,
) -> None:
    """Serve TARGET (+ EAGLE-3 draft) over an OpenAI-compatible API, validate it, or hand off.

    Examples: eagle3 serve ./Kimi-K2.5 --draft ./kimi-k2.5-eagle3 --port 8000

    eagle3 serve ./Kimi-K2.5 --draft ./kimi-k2.5-eagle3 --device cuda --kernel-backend triton --enforce-eager

    eagle3 serve ./tiny/kimi-k2.5 --draft ./tiny/kimi-k2.5-eagle3 --validate gsm8k --limit 8 --report r.json

    eagle3 serve ./Kimi-K2.5-W4A8 --draft ./draft-vllm --engine vllm --tensor-parallel-size 8 --dry-run

    eagle3 serve ./Kimi-K2.5 --dry-run --plan --tensor-parallel-size 8 --gpu mi325x

    Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics (Prometheus),
    /tokenize, /detokenize, /tokenizer_info. Exit code 1 when a --validate threshold is missed.
    """
    from eagle3.errors import UsageError

    if plan:
        # The same projection as `eagle3 plan`, for the serve command's own target, draft, GPU count
        # and context length; printed first (stdout for --dry-run, else stderr before the load).
        kv = {"auto": "bf16", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}.get(kv_cache_dtype, kv_cache_dtype)
        with contextlib.redirect_stdout(sys.stdout if dry_run else sys.stderr):
            _print_plan(str(target), gpus=tensor_parallel_size, gpu=gpu, gpu_memory=gpu_memory,
                        memory_fraction=memory_fraction, draft=None if draft is None else str(draft),
                        kv_cache_dtype=kv, reserve="4GiB", embedding="replicated", recipe=None, scope=None,
                        max_model_len=max_model_len, report=None, json_out=False)
        if dry_run and engine is None:
            return
    elif gpu is not None or gpu_memory is not None:
        raise UsageError("--gpu / --gpu-memory go with --plan")
    if engine is not None:
        from eagle3.serve import engines

        cmd = engines.build_command(
            engine, target, draft, num_speculative_tokens=num_speculative_tokens, host=host,
            port=8000 if port is None else port, tensor_parallel_size=tensor_parallel_size,
            kv_cache_dtype=kv_cache_dtype, quantization=quantization, trust_remote_code=trust_remote_code,
            served_model_name=served_model_name, max_model_len=max_model_len)
        for note in cmd.notes:
            typer.echo(f"# note: {note}", err=True)
        typer.echo(cmd.shell())
        if not dry_run:
            raise typer.Exit(engines.run(cmd))
        return
    if dry_run:
        raise UsageError("--dry-run goes with --engine vllm|sglang|atom or --plan")
    from eagle3.serve import launcher

    eopts = launcher.EngineOptions(
        num_speculative_tokens=num_speculative_tokens, dtype=dtype, device=device, max_model_len=max_model_len,
        kv_cache_memory=None if kv_cache_memory is None else launcher.parse_bytes(kv_cache_memory),
        max_num_seqs=max_num_seqs, seed=seed, trust_remote_code=trust_remote_code,
        tensor_parallel_size=tensor_parallel_size, backend=_check_kernel_backend(kernel_backend),
        enforce_eager=enforce_eager)
    name = served_model_name or target.resolve().name
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        typer.echo(f"warning: serving on {host} without --api-key: anyone who can reach it can use it", err=True)
    if validate is not None:
        from eagle3.validate import ValidateOptions
        from eagle3.validate.report import summary_lines

        vopts = ValidateOptions(task=validate, limit=limit, num_fewshot=num_fewshot, concurrency=concurrency,
                                dataset=dataset, max_tokens=max_tokens, model=name, report=report, figure=figure,
                                overwrite=overwrite, min_accuracy=min_accuracy, min_acceptance=min_acceptance,
                                accuracy_filter=accuracy_filter, inputs=(target, draft))
        result = launcher.serve_and_validate(target, draft, eopts, vopts, model_name=name, api_key=api_key,
                                             host=host, port=0 if port is None else port, baseline=baseline,
                                             echo=lambda s: typer.echo(s, err=True))
        _exit_on_report(result, summary_lines(result) + ([f"report: {report}"] if report else []))
        return
    from eagle3.serve.limits import ServerLimits

    if not request_timeout > 0:
        raise UsageError(f"--request-timeout must be > 0 seconds, got {request_timeout}")
    limits = ServerLimits(launcher.parse_bytes(max_request_bytes, "--max-request-bytes"), request_timeout)
    sock = launcher.listen_socket(host, 8000 if port is None else port)  # before the (long) load
    llm = launcher.build_llm(target, draft, eopts)
    api = launcher.build_app(llm, name, api_key=api_key, root=str(target), limits=limits)
    launcher.serve_forever(api, host, 8000 if port is None else port, log_level, sock=sock, ready_file=ready_file,
                           on_ready=lambda url: typer.echo(f"eagle3: serving {name} on {url}/v1", err=True))


@app.command("validate")
def validate_cmd(
    base_url: Annotated[str, typer.Option(help="The server, e.g. http://127.0.0.1:8000 (any OpenAI-compatible server).")],
    task: Annotated[str, typer.Option(help="Validation task.")] = "gsm8k",
    model: Annotated[str | None, typer.Option(help="Model id to request (default: the first of /v1/models).")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="EAGLE3_API_KEY", help="Bearer token for the server.")] = None,
    baseline_url: Annotated[str | None, typer.Option(help="The same target without speculation: lossless check and speedup.")] = None,
    limit: Annotated[int | None, typer.Option(help="First N test questions.")] = None,
    num_fewshot: Annotated[int, typer.Option(help="Few-shot exemplars.")] = 5,
    concurrency: Annotated[int, typer.Option(help="Requests in flight.")] = 1,
    dataset: Annotated[Path | None, typer.Option(help="Directory with train.jsonl + test.jsonl (default: Hub openai/gsm8k).")] = None,
    max_tokens: Annotated[int, typer.Option(help="New tokens per answer (lm-eval: 256).")] = 256,
    report: Annotated[Path | None, typer.Option(help="Write the JSON report here (+ .png figure).")] = None,
    figure: Annotated[Path | None, typer.Option(help="The figure's path (default: REPORT with .png).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing report / figure.")] = False,
    min_accuracy: Annotated[float | None, typer.Option(help="Fail (exit 1) below this exact match.")] = None,
    accuracy_filter: Annotated[str, typer.Option(help="strict-match|flexible-extract for --min-accuracy.")] = "strict-match",
    min_acceptance: Annotated[float | None, typer.Option(help="Fail (exit 1) below this acceptance rate.")] = None,
) -> None:
    """Validate a running OpenAI-compatible server (vLLM, SGLang, ATOM, eagle3) on GSM8K.

    Example: eagle3 validate --base-url http://127.0.0.1:8000 --limit 200 --concurrency 16 --report r.json

    Prompts, stop strings, greedy decoding and scoring are lm-eval's gsm8k task; speculative
    acceptance is read from the server's /metrics when it has them. Exit code 1 on a missed threshold.
    """
    from eagle3 import validate as val
    from eagle3.validate.report import summary_lines

    vopts = val.ValidateOptions(task=task, limit=limit, num_fewshot=num_fewshot, concurrency=concurrency,
                                dataset=dataset, max_tokens=max_tokens, model=model, api_key=api_key, report=report,
                                figure=figure, overwrite=overwrite, min_accuracy=min_accuracy,
                                min_acceptance=min_acceptance, accuracy_filter=accuracy_filter)
    prep = val.prepare(vopts)
    run = val.evaluate(base_url, prep, vopts)
    base = val.evaluate(baseline_url, prep, vopts, "baseline") if baseline_url else None
    result = val.finish(run, base, prep, vopts, {"engine": "external"})
    _exit_on_report(result, summary_lines(result) + ([f"report: {report}"] if report else []))


@app.command()
def bench(
    target: Annotated[Path | None, typer.Argument(help="Serve this target in-process and benchmark it (or use --base-url).")] = None,
    draft: Annotated[Path | None, typer.Option(help="With TARGET: EAGLE-3 draft directory.")] = None,
    num_speculative_tokens: Annotated[int, typer.Option(help="With TARGET: draft tokens per step.")] = 3,
    base_url: Annotated[str | None, typer.Option(help="A running OpenAI-compatible server.")] = None,
    model: Annotated[str | None, typer.Option(help="Model id to request (default: the first of /v1/models).")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="EAGLE3_API_KEY", help="Bearer token for the server.")] = None,
    dataset: Annotated[str, typer.Option(help="random|gsm8k prompts.")] = "random",
    dataset_path: Annotated[Path | None, typer.Option(help="gsm8k: directory with train.jsonl + test.jsonl.")] = None,
    tokenizer: Annotated[Path | None, typer.Option(help="random: tokenizer directory (default: TARGET).")] = None,
    input_len: Annotated[int, typer.Option(help="random: prompt tokens.")] = 256,
    output_len: Annotated[int, typer.Option(help="New tokens per request (random: exactly, with ignore_eos).")] = 128,
    num_prompts: Annotated[int, typer.Option(help="Requests per concurrency level.")] = 32,
    concurrency: Annotated[str, typer.Option(help="Concurrency levels, e.g. 1,4,16.")] = "1",
    seed: Annotated[int, typer.Option(help="Random prompts seed.")] = 0,
    report: Annotated[Path | None, typer.Option(help="Write the results as JSON.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing report.")] = False,
    device: Annotated[str, typer.Option(help="With TARGET: cpu, cuda, ...")] = "cpu",
    dtype: Annotated[str, typer.Option(help="With TARGET: bfloat16|float16|float32.")] = "bfloat16",
    trust_remote_code: Annotated[bool, typer.Option(help="Allow code shipped with the model to run.")] = False,
    tensor_parallel_size: Annotated[int, typer.Option(help="With TARGET: tensor parallel size (worker processes).")] = 1,
    kernel_backend: Annotated[str, typer.Option(help="With TARGET: " + _KERNEL_BACKEND_HELP)] = "auto",
    enforce_eager: Annotated[bool, typer.Option(help="With TARGET: " + _ENFORCE_EAGER_HELP)] = False,
) -> None:
    """Serving benchmark: TTFT / TPOT / ITL / E2EL / throughput as `vllm bench serve` defines them.

    Examples: eagle3 bench --base-url http://127.0.0.1:8000 --tokenizer ./Kimi-K2.5 --concurrency 1,8,32

    eagle3 bench ./tiny/kimi-k2.5 --draft ./tiny/kimi-k2.5-eagle3 --input-len 64 --output-len 32
    """
    from eagle3.errors import UsageError
    from eagle3.validate import bench as b
    from eagle3.validate.report import write_json_atomic

    if (target is None) == (base_url is None):
        raise UsageError("give either TARGET (served in-process) or --base-url")
    if report is not None:
        from eagle3.checkpoint import check_output_path

        check_output_path(report, [target, draft, dataset_path, tokenizer], what="report")
        if report.is_dir():
            raise UsageError(f"{report}: --report names a directory; give a file path")
        if report.exists() and not overwrite:
            raise UsageError(f"{report} exists; pass --overwrite to replace it")
    opts = b.BenchOptions(dataset=dataset, dataset_path=dataset_path, input_len=input_len, output_len=output_len,
                          num_prompts=num_prompts, concurrency=b.parse_levels(concurrency), seed=seed, model=model,
                          api_key=api_key)
    opts.check()
    tok = None
    if tokenizer is not None or target is not None:
        from eagle3.runtime.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer or target, trust_remote_code)
    if target is not None:
        from eagle3.serve import launcher

        eopts = launcher.EngineOptions(num_speculative_tokens=num_speculative_tokens, dtype=dtype, device=device,
                                       trust_remote_code=trust_remote_code, tensor_parallel_size=tensor_parallel_size,
                                       backend=_check_kernel_backend(kernel_backend), enforce_eager=enforce_eager)
        llm = launcher.build_llm(target, draft, eopts)
        try:
            api = launcher.build_app(llm, target.resolve().name, root=str(target))
            with launcher.ServerThread(api) as url:
                result = b.run_bench(url, opts, tok)
                result["tensor_parallel_size"] = tensor_parallel_size
                result.update(launcher.engine_info(llm))
        finally:
            launcher.close_llm(llm)
    else:
        result = b.run_bench(base_url, opts, tok)
    for line in b.bench_lines(result):
        typer.echo(line)
    if report is not None:
        write_json_atomic(report, result)
        typer.echo(f"report: {report}")


# ---------------------------------------------------------------------------------------------
# train-draft
# ---------------------------------------------------------------------------------------------


@app.command("train-draft")
def train_draft(
    target: Annotated[Path, typer.Argument(help="Target checkpoint directory (any format the runtime loads).")],
    out: Annotated[Path, typer.Argument(help="Output draft directory (eagle3 format; written to OUT.partial, then renamed).")],
    arch: Annotated[str | None, typer.Option(help="llama|mla draft layer (default llama; with --init-from: its own).")] = None,
    eagle31: Annotated[bool | None, typer.Option("--eagle31/--no-eagle31", help="EAGLE-3.1: fc_norm + norm_output (post-norm hidden fed back).")] = None,
    data: Annotated[str, typer.Option(help="gsm8k, or a FILE.jsonl with \"text\" or \"prompt\"/\"completion\" rows.")] = "gsm8k",
    dataset: Annotated[Path | None, typer.Option(help="gsm8k: directory with train.jsonl + test.jsonl (default: Hub openai/gsm8k).")] = None,
    regenerate: Annotated[bool, typer.Option(help="Train on the target's own greedy continuations of the prompts.")] = False,
    regen_tokens: Annotated[int, typer.Option(help="--regenerate: new tokens per prompt.")] = 128,
    draft_vocab_size: Annotated[int | None, typer.Option(help="Reduced draft vocabulary (d2t/t2d from token frequencies).")] = None,
    aux_layer_ids: Annotated[str | None, typer.Option(help="Target layers feeding the draft, input-to-layer convention, e.g. 2,30,58 (default 2,N//2,N-3).")] = None,
    ttt_steps: Annotated[int, typer.Option(help="Training-time-test steps unrolled per position.")] = 3,
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 1000,
    batch_size: Annotated[int, typer.Option(help="Sequences per step.")] = 8,
    lr: Annotated[float, typer.Option(help="Peak AdamW learning rate (linear warm-up, cosine decay).")] = 1e-3,
    max_len: Annotated[int, typer.Option(help="Tokens per training sequence (longer ones are cut).")] = 512,
    num_train: Annotated[int | None, typer.Option(help="Use the first N training examples.")] = None,
    fewshot: Annotated[int, typer.Option(help="gsm8k: solved train problems before each training problem (serve --validate prompts 5-shot).")] = 0,
    eval_prompts: Annotated[int, typer.Option(help="Held-out prompts for the acceptance measurement.")] = 8,
    eval_tokens: Annotated[int, typer.Option(help="New tokens per held-out prompt.")] = 64,
    eval_fewshot: Annotated[int, typer.Option(help="gsm8k: few-shot exemplars in the held-out prompts.")] = 5,
    init_from: Annotated[Path | None, typer.Option(help="Start from this draft (any format eagle3 reads).")] = None,
    checkpoint_every: Annotated[int, typer.Option(help="Checkpoint into OUT.partial every N steps.")] = 100,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run from its OUT.partial checkpoint.")] = False,
    seed: Annotated[int, typer.Option(help="Seed (initial weights, batch order).")] = 0,
    dtype: Annotated[str, typer.Option(help="Target compute dtype: bfloat16|float16|float32.")] = "bfloat16",
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:1, ...")] = "cpu",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUT.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the training report as JSON.")] = False,
) -> None:
    """Train an EAGLE-3 / 3.1 draft against TARGET with the runtime's own target model as teacher.

    Example: eagle3 train-draft ./tiny/kimi-k2.5 ./draft --data gsm8k --dataset ./gsm8k --regenerate --steps 300

    eagle3 train-draft ./Kimi-K2.5 ./draft-mla --arch mla --eagle31 --aux-layer-ids 2,30,58 --draft-vocab-size 32000

    Writes OUT (convertible with eagle3 convert --engine vllm|sglang|atom|speculators), OUT/train_report.json
    (loss curve, held-out acceptance measured by the runtime, lossless check) and OUT/train_loss.png.
    """
    from eagle3.convert import parse_aux_ids
    from eagle3.train import TrainOptions, print_summary
    from eagle3.train import train_draft as run

    opts = TrainOptions(
        target=target, out=out, arch=arch, eagle31=eagle31, data=data, dataset=dataset, regenerate=regenerate,
        regen_tokens=regen_tokens, draft_vocab_size=draft_vocab_size, aux_layer_ids=parse_aux_ids(aux_layer_ids),
        ttt_steps=ttt_steps, steps=steps, batch_size=batch_size, lr=lr, max_len=max_len, num_train=num_train,
        fewshot=fewshot, eval_prompts=eval_prompts, eval_tokens=eval_tokens, eval_fewshot=eval_fewshot, init_from=init_from,
        checkpoint_every=checkpoint_every, resume=resume, seed=seed, dtype=dtype, device=device,
        overwrite=overwrite, progress=not quiet and not json_out and sys.stderr.isatty())
    report = run(opts)
    if json_out:
        _print_json(report)
    else:
        print_summary(report)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: one-line errors and exit code 2 for user errors.

    Typer/click (standalone mode) already print usage errors such as unknown flags with exit 2."""
    try:
        app(args=argv)
    except Eagle3Error as e:
        if _state["debug"]:
            raise
        typer.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    finally:
        # An output lock a command took and did not get to release (an error before its write
        # began) goes now, not at interpreter exit. Only if loaded: importing it imports torch.
        cp = sys.modules.get("eagle3.checkpoint")
        if cp is not None:
            cp.release_output_locks()


if __name__ == "__main__":
    main()
