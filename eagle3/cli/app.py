"""The Typer application every command module registers on, and the global ``--debug`` flag."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

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


def print_json(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
