"""``eagle3 make-tiny`` and ``eagle3 make-slice``: small checkpoints in the exact upstream formats."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eagle3.cli.app import app


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
    layers: Annotated[int, typer.Option(help="Decoder layers (layer 0 dense when >= 2, the rest MoE); "
                                             "with --draft, the target slice's layers.")] = 2,
    experts: Annotated[int, typer.Option(help="Routed experts per MoE layer (Moonshot INT4).")] = 8,
    draft: Annotated[str | None, typer.Option(help="Write a full-width EAGLE-3 draft for such a slice instead "
                                                   "(random weights): eagle3 or eagle3.1-mla.")] = None,
    seed: Annotated[int, typer.Option(help="Random seed (the output is a pure function of it).")] = 0,
    vocab: Annotated[int, typer.Option(hidden=True, help="Vocabulary rows (tests only; the real one is 163840).")] = 163840,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUT.")] = False,
) -> None:
    """Write a Kimi-K2.5 slice at the real tensor shapes in Moonshot's format (streaming).

    Hidden 7168, 64 MLA heads, vocab 163840, expert width 2048, INT4 group-32 routed experts;
    2 layers x 32 experts is 6.8 GB. With --draft, an EAGLE-3 draft at the real widths whose aux
    layers exist in a slice of --layers layers: its drafts are random, so speculative decoding
    with it measures step costs (GPU benchmarks), not gains.

    Example: eagle3 make-slice /tmp/k25-slice --layers 2 --experts 8 && eagle3 inspect /tmp/k25-slice
    Example: eagle3 make-slice /tmp/k25-draft --layers 2 --draft eagle3.1-mla
    """
    from eagle3.testing import slice as slice_mod
    from eagle3.units import human_bytes

    if draft is not None:
        p = slice_mod.make_draft_slice(out, draft, target_layers=layers, seed=seed, vocab=vocab, overwrite=overwrite)
        typer.echo(f"{draft} draft for a {layers}-layer slice "
                   f"({human_bytes(slice_mod.draft_slice_bytes(draft, layers, vocab))}) {p}")
        return
    p = slice_mod.make_slice(out, layers=layers, experts=experts, seed=seed, vocab=vocab, overwrite=overwrite)
    typer.echo(f"kimi-k2.5 slice ({layers} layers, {experts} experts, "
               f"{human_bytes(slice_mod.slice_bytes(layers, experts, vocab))}) {p}")
