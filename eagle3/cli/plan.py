"""``eagle3 plan``: the memory plan (weights per rank, KV capacity); also ``serve --dry-run --plan``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from eagle3.cli.app import app, print_json


@app.command()
def plan(
    target: Annotated[str, typer.Argument(help="Target checkpoint directory, its config.json, or a Hub repo id (weights optional).")],
    gpus: Annotated[int, typer.Option(help="Number of GPUs = tensor/expert-parallel ranks.")] = 8,
    gpu: Annotated[str | None, typer.Option(help="h100, h100-pcie, h100-nvl, h200, mi300x, mi325x or mi355x (memory as the driver reports it).")] = None,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per machine: more --gpus than that span several nodes (serve --nnodes).")] = 8,
    gpu_memory: Annotated[str | None, typer.Option(help="Memory per GPU, e.g. 256GiB (overrides --gpu's).")] = None,
    memory_fraction: Annotated[float, typer.Option(help="Fraction of each GPU's memory the runtime may use.")] = 0.9,
    draft: Annotated[str | None, typer.Option(help="Draft checkpoint directory, config.json or repo id (replicated).")] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help="bf16|fp8|fp8_e4m3|fp8_e5m2|fp16|fp32 -- KV cache element type (fp8: one byte per value).")] = "bf16",
    reserve: Annotated[str, typer.Option(help="Runtime reserve per GPU (context, buffers, activations).")] = "4GiB",
    embedding: Annotated[str, typer.Option(help="replicated|vocab-split -- how the embedding is placed.")] = "replicated",
    recipe: Annotated[str | None, typer.Option(help="Plan the checkpoint `eagle3 quantize --recipe` would write from TARGET.")] = None,
    scope: Annotated[str | None, typer.Option(help="With --recipe: the recipe scope.")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Sequence length the KV cache must hold at least once (default: the config's).")] = None,
    decode_floor: Annotated[str | None, typer.Option(help="Batches, e.g. 1,16,64: the bytes a plain decode step reads per rank and the floor time at --gpu's HBM peak (docs/kernels.md).")] = None,
    context: Annotated[int, typer.Option(help="With --decode-floor: tokens per sequence in the KV cache.")] = 4096,
    report: Annotated[Path | None, typer.Option(help="Also write the plan as JSON to this file.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Memory plan: weight bytes per rank, KV-cache capacity, and whether it fits.

    Works on a config.json alone (no weights needed); uses the safetensors headers when present
    (for a Hub repo id: its config and headers, read without downloading the weights).

    Example: eagle3 plan ./Kimi-K2.5 --gpus 8 --gpu mi325x --recipe w4a8

    Two nodes: eagle3 plan ./Kimi-K2.5 --gpus 16 --gpu h100

    Decode floor: eagle3 plan ./Kimi-K2.5 --gpus 8 --gpu h200 --decode-floor 1,16,64 --context 4096
    """
    print_plan(target, gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, gpu_memory=gpu_memory, memory_fraction=memory_fraction, draft=draft,
                kv_cache_dtype=kv_cache_dtype, reserve=reserve, embedding=embedding, recipe=recipe, scope=scope,
                max_model_len=max_model_len, report=report, json_out=json_out, decode_floor=decode_floor,
                context=context)


def _batches(text: str) -> list[int]:
    from eagle3.errors import UsageError

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise UsageError(f"--decode-floor {text!r}: expected comma-separated batches >= 1, e.g. 1,16,64")
    return vals


def print_plan(target: str, *, gpus: int, gpu: str | None, gpus_per_node: int = 8, gpu_memory: str | None, memory_fraction: float,
                draft: str | None, kv_cache_dtype: str, reserve: str, embedding: str, recipe: str | None,
                scope: str | None, max_model_len: int | None, report: Path | None, json_out: bool,
                decode_floor: str | None = None, context: int = 4096) -> None:
    """`eagle3 plan` and `eagle3 serve --dry-run --plan`: one accounting (eagle3.plan)."""
    from eagle3 import hub
    from eagle3 import plan as plan_mod
    from eagle3.cli.options import parse_bytes

    mem = parse_bytes(gpu_memory, "--gpu-memory") if gpu_memory else None
    batches = _batches(decode_floor) if decode_floor is not None else []
    if context < 0:
        from eagle3.errors import UsageError

        raise UsageError(f"--context {context}: must be >= 0")
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
        reserve=parse_bytes(reserve, "--reserve"), embedding=embedding, max_model_len=max_model_len,
        gpus_per_node=gpus_per_node)
    floors = [plan_mod.decode_floor(model, gpus=gpus, batch=b, context=context, kv_cache_dtype=kv_cache_dtype,
                                    embedding=embedding, hbm_tbps=plan_mod.gpu_hbm_tbps(gpu)) for b in batches]
    out = p.to_json()
    if floors:
        out["decode_floor"] = [f.to_json() for f in floors]
    if report is not None:
        tmp = report.with_name(report.name + ".partial")
        tmp.write_text(json.dumps(out, indent=2) + "\n")
        tmp.replace(report)
    if json_out:
        print_json(out)
    else:
        for line in plan_mod.summary_lines(p) + plan_mod.floor_lines(floors):
            typer.echo(line)
