"""The ``eagle3`` command line (Typer).

One small function per command: parse, call the library, print. No logic lives here. torch and
the heavy libraries are imported inside the commands so that ``eagle3 --help`` is instant.
Errors meant for users (:class:`eagle3.errors.Eagle3Error`) print as one line and exit 2;
``--debug`` shows the traceback instead.

Commands, one module per group (registered on :data:`eagle3.cli.app.app` in this order, which is the
order of ``eagle3 --help``): :mod:`.download`, :mod:`.inspect` (inspect, verify), :mod:`.plan`,
:mod:`.fixtures` (make-tiny, make-slice), :mod:`.convert` (convert, quantize), :mod:`.serve`,
:mod:`.validate` (validate, bench), :mod:`.train` (train-draft). Shared flags live in :mod:`.options`.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import typer

# The commands register on `app` when their module is imported; this order is `eagle3 --help`'s.
# isort: off
from eagle3.cli import download, inspect, plan, fixtures, convert, serve, validate, train  # noqa: F401
# isort: on
from eagle3.cli.app import _state, app, use_help_layout
from eagle3.errors import Eagle3Error

use_help_layout(app)  # every command's help: whole option names at any width (cli/app.py)

__all__ = ["app", "main"]


@functools.cache
def _command() -> Any:
    """The click command tree, built once per process. ``app(...)`` rebuilds it from every command's
    signature and annotations on each call (~0.1 CPU-s, most of an in-process ``inspect``'s time);
    callers that run the CLI more than once in a process (the Python API's users, the test suite)
    paid that per run. Unexpected exceptions keep Python's own traceback (``app(...)`` would have
    installed Typer's rich one)."""
    return typer.main.get_command(app)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: one-line errors and exit code 2 for user errors.

    Typer/click (standalone mode) already print usage errors such as unknown flags with exit 2."""
    try:
        _command()(args=argv)
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
        # began) goes now, not at interpreter exit. Only if loaded (no lock was taken otherwise):
        # importing it imports torch.
        out = sys.modules.get("eagle3.checkpoint.output")
        if out is not None:
            out.release_output_locks()
