"""``eagle3 download``: a model from the Hub (or a local directory), resumably."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eagle3.cli.app import app, print_json


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
        print_json(result.to_json())
    else:
        hub.print_result(result)
