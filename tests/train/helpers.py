"""Shared by the train-draft tests: the CLI in-process."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from eagle3.cli import app, main

runner = CliRunner()
FAST = ["--batch-size", "4", "--max-len", "48", "--lr", "3e-3", "--quiet"]


def cli(*args: object, ok: bool = True) -> Any:
    res = runner.invoke(app, [str(a) for a in args])
    if ok and res.exit_code != 0:
        raise AssertionError(f"{args} failed ({res.exit_code}): {res.output}\n{res.exception!r}")
    return res


def error(capsys: pytest.CaptureFixture[str], *args: object) -> str:
    """Run ``eagle3 ARGS`` through the console-script entry point; expect exit 2 and one line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1] if err else ""
    assert last.startswith("error: "), err  # (lines before it are progress messages)
    return last
