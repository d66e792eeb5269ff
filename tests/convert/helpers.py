"""Shared by the convert tests: run `eagle3 convert` in-process and read a whole (tiny) output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from typer.testing import CliRunner

from eagle3.cli import app

runner = CliRunner()


def cli(*args: str) -> Any:
    res = runner.invoke(app, ["convert", *args, "--quiet"])
    if res.exit_code != 0:
        raise AssertionError(f"convert {args} failed: {res.output}\n{res.exception!r}")
    return res


def load_all(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every shard, read with the safetensors library (not eagle3's reader)."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for n in st.keys():
                out[n] = st.get_tensor(n)
    return out
