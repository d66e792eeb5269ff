"""``eagle3 inspect`` and ``eagle3 verify``: what a checkpoint is, and whether an eagle3 output is intact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eagle3.cli.app import app, print_json


@app.command()
def inspect(
    path: Annotated[str, typer.Argument(help="Checkpoint directory, .safetensors file or Hub repo id.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the stable JSON form (keys documented in the README).")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 2 when the checkpoint disagrees with its architecture's schema.")] = False,
) -> None:
    """Identify a checkpoint: role, family, quantization, EAGLE flags, aux layers, tensors.

    Example: eagle3 inspect ./kimi-k2.5-eagle3 --json --strict
    """
    from eagle3 import hub
    from eagle3.formats import detect

    # A repo id is inspected from its configs and safetensors headers only (range requests):
    # no weights are downloaded.
    where, reader = hub.header_view(path)
    summary = detect.detect(where, reader=reader)
    if json_out:
        print_json(summary.to_json())
    else:
        detect.print_summary(summary)
    from eagle3.formats.check import report_problems

    report_problems(where, strict=strict, to_stderr=json_out, reader=reader)


@app.command()
def verify(
    path: Annotated[Path, typer.Argument(help="A directory written by eagle3 (it carries manifest.json).")],
) -> None:
    """Check an eagle3 output: the model against its architecture's schema, every file against its manifest (sha256 and size), every
    .safetensors header (as strictly as the safetensors library) and each index against its shards.

    Example: eagle3 verify ./kimi-k2.5-w4a8
    """
    from eagle3.checkpoint import verify_manifest
    from eagle3.errors import VerifyError
    from eagle3.formats.check import require_valid_tree

    if (path / "manifest.json").is_file():  # (without one, verify_manifest says so)
        require_valid_tree(path)  # the model against its schema first: one line, before any weight is hashed
    res = verify_manifest(path)
    if res.problems:
        raise VerifyError(f"{path}: {len(res.problems)} problem(s): " + "; ".join(res.problems[:5]))
    typer.echo(f"OK: {res.checked} files match {path / 'manifest.json'}; {res.headers} safetensors headers "
               "(and any index) are sound")
