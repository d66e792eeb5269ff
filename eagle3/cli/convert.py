"""``eagle3 convert`` and ``eagle3 quantize``: a checkpoint in, a checkpoint out."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

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
    target: Annotated[Path | None, typer.Option(help="Draft only: measure its acceptance with this target before and after quantization (held-out GSM8K 5-shot prompts) into the report.")] = None,
    eval_prompts: Annotated[int, typer.Option(help="--target: held-out prompts.")] = 24,
    eval_tokens: Annotated[int, typer.Option(help="--target: new tokens per prompt.")] = 96,
    eval_k: Annotated[int, typer.Option(help="--target: speculative tokens per step.")] = 3,
    eval_fewshot: Annotated[int, typer.Option(help="--target: GSM8K exemplars per prompt (serve --validate gsm8k sends 5).")] = 5,
    device: Annotated[str, typer.Option(help="--target: where the runtime serves the pair (cpu, cuda, ...).")] = "cpu",
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of a table.")] = False,
) -> None:
    """Quantize a checkpoint file to file into AMD Quark's export format (vLLM, SGLang, ATOM).

    Examples: eagle3 quantize ./Kimi-K2.5 ./Kimi-K2.5-W4A8 --recipe w4a8

    eagle3 quantize ./Kimi-K2.5 ./Kimi-K2.5-MXFP4 --recipe mxfp4 --scope experts --workers 4

    eagle3 quantize ./kimi-k2.5-eagle3 ./draft-int4 --recipe int4-draft --target ./Kimi-K2.5-MXFP4

    Writes OUT/quantization_report.json (+ .png): per-tensor error of the decoded output vs the source;
    with --target also the draft's held-out acceptance beside that target before and after.
    """
    from eagle3.quantize import pipeline
    from eagle3.quantize.acceptance import AcceptanceCheck

    measure = None
    if target is None:
        d = AcceptanceCheck(Path())  # its defaults are the options'
        given = [flag for flag, v, default in (("--eval-prompts", eval_prompts, d.prompts),
                                               ("--eval-tokens", eval_tokens, d.tokens), ("--eval-k", eval_k, d.k),
                                               ("--eval-fewshot", eval_fewshot, d.fewshot),
                                               ("--device", device, d.device)) if v != default]
        if given:
            from eagle3.errors import UsageError

            raise UsageError(f"{', '.join(given)} go with --target (the draft's acceptance beside it)")
    else:
        measure = AcceptanceCheck(target, eval_prompts, eval_tokens, eval_k, eval_fewshot, device=device,
                                  progress=not quiet and not json_out and sys.stderr.isatty())
        measure.check()
    _retain_freed_memory()
    result = pipeline.quantize(src, out, recipe, scope, workers=workers, engine=engine, overwrite=overwrite,
                               resume=resume, verify=verify, trust_remote_code=trust_remote_code,
                               progress=not quiet and not json_out and sys.stderr.isatty(),
                               allow_nonfinite=allow_nonfinite, any_architecture=any_architecture,
                               quark_zero_points=quark_zero_points, measure=measure)
    if json_out:
        print_json(result.to_json())
    else:
        pipeline.print_summary(result)


def _shard_bytes(text: str | None) -> int:
    from eagle3.checkpoint import DEFAULT_SHARD_BYTES

    return DEFAULT_SHARD_BYTES if text is None else parse_bytes(text, "--max-shard-size")
