"""``eagle3 convert`` and ``eagle3 quantize``: a checkpoint in, a checkpoint out."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from eagle3.cli.app import app, print_json
from eagle3.cli.options import parse_bytes


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
        trust_remote_code=trust_remote_code, overwrite=overwrite, max_shard_bytes=_shard_bytes(max_shard_size),
        progress=not quiet and not json_out, allow_nonfinite=allow_nonfinite,
    )
    if json_out:
        print_json(report.to_json())
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


def _map_large_blocks() -> None:
    """glibc only, for a calibrated run: every block of 1 MiB or more gets its own mapping, handed
    back to the OS when freed. The calibration pass allocates and frees MB-sized tensors of many
    sizes around long-lived ones (a layer's packed results until its file is written); in the heap,
    the holes they leave keep their pages while later blocks extend it, so the resident peak moved
    with the layers run before. Its solver time dwarfs the page faults this costs."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (fixed: glibc no longer raises it after a free)
    except (OSError, AttributeError):  # not glibc: nothing to set
        pass


@app.command()
def quantize(
    src: Annotated[str, typer.Argument(help="Target or draft: checkpoint directory or Hub repo id.")],
    out: Annotated[Path, typer.Argument(help="Output directory (written to OUT.partial, then renamed).")],
    recipe: Annotated[str, typer.Option(help="w4a8|w4a8-int8|mxfp4|int4-draft|fp8-draft, or a recipe YAML file.")],
    scope: Annotated[str | None, typer.Option(help="A scope of the recipe, e.g. mxfp4: experts|experts+shared+dense.")] = None,
    workers: Annotated[int, typer.Option(help="Worker threads (0 = one per CPU core, as memory allows).")] = 0,
    engine: Annotated[str, typer.Option(help="native (eagle3 codecs) | quark (AMD Quark's primitives: Quark's round to nearest, the bits of --method rtn).")] = "native",
    method: Annotated[str | None, typer.Option(help="How the numbers are chosen within the recipe's format: rtn (Quark's round to nearest, max-based scales) | mse (data-free scale search against the source, and error feedback for the modelled mean input of routed experts' down_proj; w4a8's default) | calibrated, with --calibrate (w4a8 / mxfp4 MLP weights): gptq | gptaq | smooth | smooth+gptq | smooth+gptaq. Default: the recipe's.")] = None,
    calibrate: Annotated[str | None, typer.Option(help="A calibrated --method's prompts, run through the source layer by layer: gsm8k (the packaged training split, 5-shot problems with their answers) or FILE.jsonl (one JSON object per line: 'text', 'prompt' (+ 'completion') or 'question' + 'answer').")] = None,
    calibrate_samples: Annotated[int | None, typer.Option(help="--calibrate: sequences (default 16).")] = None,
    calibrate_tokens: Annotated[int | None, typer.Option(help="--calibrate: tokens per sequence at most (default 2048).")] = None,
    calibrate_min_tokens: Annotated[float | None, typer.Option(help="--calibrate: an MLP is calibrated when at least this many tokens per input channel reach it (default 1.0: fewer leave its inputs' Hessian rank-deficient, and error feedback then moves rounding error into directions calibration never saw); the others keep their data-free values and the report counts them.")] = None,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run from OUT.partial, skipping finished shards.")] = False,
    verify: Annotated[bool, typer.Option(help="Measure each quantized tensor's decode against the source and read it back from OUT.")] = True,
    trust_remote_code: Annotated[bool, typer.Option(help="Also carry *.py remote-code files over.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUT.")] = False,
    allow_nonfinite: Annotated[bool, typer.Option(help="Quantize weights that hold NaN/Inf (refused otherwise); the report lists them.")] = False,
    any_architecture: Annotated[bool, typer.Option(help="Quantize a model whose architecture eagle3 does not know, file to file, without its model checks.")] = False,
    quark_zero_points: Annotated[bool, typer.Option(help="Also write the all-zero INT4 zero points (weight_zero_point[_2]) that Quark's own importer needs; vLLM's DeepSeek/Kimi loader refuses them.")] = False,
    target: Annotated[Path | None, typer.Option(help="Draft only: measure its acceptance with this target before and after quantization (held-out GSM8K 5-shot prompts) into the report.")] = None,
    eval_: Annotated[bool, typer.Option("--eval", help="Target only: compare OUT with SRC before publishing it (the two passes of serve --validate gsm8k --reference, held-out GSM8K prompts, one model loaded at a time): mean / p99 KLD, top-1 agreement and first divergence into the report.")] = False,
    eval_prompts: Annotated[int | None, typer.Option(help="--target / --eval: held-out prompts (default 24 with --target, 8 with --eval).")] = None,
    eval_tokens: Annotated[int | None, typer.Option(help="--target / --eval: new tokens per prompt (default 96 with --target, 64 with --eval).")] = None,
    eval_k: Annotated[int | None, typer.Option(help="--target: speculative tokens per step (default 3).")] = None,
    eval_fewshot: Annotated[int | None, typer.Option(help="--target / --eval: GSM8K exemplars per prompt (default 5, as serve --validate gsm8k).")] = None,
    device: Annotated[str | None, typer.Option(help="--target / --eval: where the runtime serves the models (cpu, cuda, ...; default cpu).")] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of a table.")] = False,
) -> None:
    """Quantize a checkpoint file to file into AMD Quark's export format (vLLM, SGLang, ATOM).

    Examples: eagle3 quantize ./Kimi-K2.5 ./Kimi-K2.5-W4A8 --recipe w4a8

    eagle3 quantize ./Kimi-K2.5 ./Kimi-K2.5-W4A8-rtn --recipe w4a8 --method rtn

    eagle3 quantize ./Kimi-K2.5 ./Kimi-K2.5-MXFP4 --recipe mxfp4 --scope experts --workers 4

    eagle3 quantize ./kimi-k2.5-eagle3 ./draft-int4 --recipe int4-draft --target ./Kimi-K2.5-MXFP4

    eagle3 quantize ./Kimi-K2.5 ./Kimi-K2.5-W4A8 --recipe w4a8 --eval --eval-prompts 24 --eval-tokens 96

    eagle3 quantize ./Kimi-K2.5 ./Kimi-K2.5-MXFP4-gptq --recipe mxfp4 --calibrate gsm8k --method smooth+gptq

    Writes OUT/quantization_report.json (+ .png): per-tensor error of the decoded output vs the source;
    with --target also the draft's held-out acceptance beside that target before and after; with --eval
    the output's KLD, top-1 agreement and first divergence against the source; with --calibrate the
    calibration pass per layer (MLPs calibrated / kept data-free, tokens, output error, time, peak RSS).
    """
    from eagle3.quantize import pipeline, report

    progress = not quiet and not json_out and sys.stderr.isatty()
    calibration = _calibration(calibrate, calibrate_samples, calibrate_tokens, calibrate_min_tokens)
    measure = _measurement(target, eval_, eval_prompts, eval_tokens, eval_k, eval_fewshot, device, progress)
    if calibration is None:  # a calibrated run's time is the solver's; its peak memory should not wander
        _retain_freed_memory()  # with what the heap keeps (up to the 1 GiB trim threshold)
    else:
        _map_large_blocks()
    result = pipeline.quantize(src, out, recipe, scope, workers=workers, engine=engine, overwrite=overwrite,
                               resume=resume, verify=verify, trust_remote_code=trust_remote_code,
                               progress=not quiet and not json_out and sys.stderr.isatty(),
                               allow_nonfinite=allow_nonfinite, any_architecture=any_architecture,
                               quark_zero_points=quark_zero_points, measure=measure, method=method,
                               calibration=calibration, echo=None if quiet else _echo_err)
    if json_out:
        print_json(result.to_json())
    else:
        report.print_summary(result)


def _echo_err(line: str) -> None:
    typer.echo(line, err=True)


def _calibration(source: str | None, samples: int | None, tokens: int | None, min_tokens: float | None) -> Any:
    """``--calibrate`` and its options (None without it; then its options are refused)."""
    from eagle3.errors import UsageError
    from eagle3.quantize.calibrated import Calibration

    if source is None:
        given = [f for f, v in (("--calibrate-samples", samples), ("--calibrate-tokens", tokens),
                                ("--calibrate-min-tokens", min_tokens)) if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} go with --calibrate gsm8k|FILE.jsonl")
        return None
    if samples is not None and samples < 1:
        raise UsageError(f"--calibrate-samples {samples}: must be >= 1")
    if tokens is not None and tokens < 2:
        raise UsageError(f"--calibrate-tokens {tokens}: must be >= 2")
    if min_tokens is not None and not min_tokens >= 0:
        raise UsageError(f"--calibrate-min-tokens {min_tokens}: must be >= 0")
    return Calibration(source, samples, tokens, min_tokens)


def _measurement(target: Path | None, eval_: bool, prompts: int | None, tokens: int | None, k: int | None,
                 fewshot: int | None, device: str | None, progress: bool) -> Any:
    """``--target`` (a draft's acceptance beside it) or ``--eval`` (a target against its source), checked
    before anything is quantized; None without either (and then none of their options may be given)."""
    from eagle3.errors import UsageError

    options = (("--eval-prompts", prompts), ("--eval-tokens", tokens), ("--eval-k", k), ("--eval-fewshot", fewshot),
               ("--device", device))
    if target is not None and eval_:
        raise UsageError("--target (a draft's acceptance beside a target) and --eval (a target against its source) "
                         "measure different sources: give one")
    if target is None and not eval_:
        given = [flag for flag, v in options if v is not None]
        if given:
            raise UsageError(f"{', '.join(given)} go with --target (a draft's acceptance) or --eval (a target "
                             f"against its source)")
        return None
    if eval_:
        if k is not None:
            raise UsageError("--eval-k goes with --target (the speculative tokens of a draft's acceptance run)")
        from eagle3.serve.fidelity import DEFAULT_PROMPTS, DEFAULT_TOKENS, FidelityCheck

        echo = (lambda line: typer.echo(line, err=True)) if progress else None
        m: Any = FidelityCheck(DEFAULT_PROMPTS if prompts is None else prompts,
                               DEFAULT_TOKENS if tokens is None else tokens, 5 if fewshot is None else fewshot,
                               device=device or "cpu", echo=echo)
    else:
        from eagle3.quantize.acceptance import AcceptanceCheck

        assert target is not None
        d = AcceptanceCheck(target)
        m = AcceptanceCheck(target, d.prompts if prompts is None else prompts, d.tokens if tokens is None else tokens,
                            d.k if k is None else k, d.fewshot if fewshot is None else fewshot,
                            device=device or d.device, progress=progress)
    m.check()
    return m


def _shard_bytes(text: str | None) -> int:
    from eagle3.checkpoint import DEFAULT_SHARD_BYTES

    return DEFAULT_SHARD_BYTES if text is None else parse_bytes(text, "--max-shard-size")
