"""The ``eagle3`` command line (Typer).

One small function per command: parse, call the library, print. No logic lives here. torch and
the heavy libraries are imported inside the commands so that ``eagle3 --help`` is instant.
Errors meant for users (:class:`eagle3.errors.Eagle3Error`) print as one line and exit 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

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


@app.command()
def verify(
    path: Annotated[Path, typer.Argument(help="A directory written by eagle3 (it carries manifest.json).")],
) -> None:
    """Check every file of an eagle3 output against its manifest (sha256 and size).

    Example: eagle3 verify ./kimi-k2.5-w4a8
    """
    from eagle3.checkpoint import verify_manifest
    from eagle3.errors import VerifyError

    res = verify_manifest(path)
    if res.problems:
        raise VerifyError(f"{path}: {len(res.problems)} problem(s): " + "; ".join(res.problems[:5]))
    typer.echo(f"OK: {res.checked} files match {path / 'manifest.json'}")


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
    kimi-k2.6-eagle3.1-mla, speculators-eagle3.
    """
    from eagle3.testing import tiny

    paths = tiny.make_tiny(out, seed=seed, only=only, overwrite=overwrite)
    for name, p in paths.items():
        typer.echo(f"{name:28s} {p}")


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
        progress=not quiet and not json_out,
    )
    if json_out:
        _print_json(report.to_json())
    else:
        conv.print_summary(report)


# ---------------------------------------------------------------------------------------------
# quantize
# ---------------------------------------------------------------------------------------------


@app.command()
def quantize(
    src: Annotated[str, typer.Argument(help="Target or draft: checkpoint directory or Hub repo id.")],
    out: Annotated[Path, typer.Argument(help="Output directory (written to OUT.partial, then renamed).")],
    recipe: Annotated[str, typer.Option(help="w4a8|w4a8-int8|mxfp4|int4-draft|fp8-draft, or a recipe YAML file.")],
    scope: Annotated[str | None, typer.Option(help="A scope of the recipe, e.g. mxfp4: experts|experts+shared+dense.")] = None,
    workers: Annotated[int, typer.Option(help="Parallel shard processes (0 = one per CPU core).")] = 0,
    engine: Annotated[str, typer.Option(help="native (eagle3 codecs) | quark (AMD Quark's primitives, same bits).")] = "native",
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run from OUT.partial, skipping finished shards.")] = False,
    verify: Annotated[bool, typer.Option(help="Read every quantized tensor back and compare with the source.")] = True,
    trust_remote_code: Annotated[bool, typer.Option(help="Also carry *.py remote-code files over.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUT.")] = False,
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

    result = pipeline.quantize(src, out, recipe, scope, workers=workers, engine=engine, overwrite=overwrite,
                               resume=resume, verify=verify, trust_remote_code=trust_remote_code,
                               progress=not quiet and not json_out and sys.stderr.isatty())
    if json_out:
        _print_json(result.to_json())
    else:
        pipeline.print_summary(result)


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


if __name__ == "__main__":
    main()
