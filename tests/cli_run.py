"""``eagle3 ARGS`` in-process, as the tests at the CLI call it: (exit code, stdout, stderr)."""

from __future__ import annotations

import pytest

from eagle3.cli import main


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out, out.err
