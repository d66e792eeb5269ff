"""``eagle3 quantize SRC OUT --recipe R --eval``: the output compared with its source (the two passes of
``serve --validate --reference``) before it is published: in the report, printed, covered by the
manifest, the very numbers ``serve --validate --reference SRC`` gives; misuse is one line, exit 2.

The run with ``--eval`` itself is test_quantize_calibrated.py's (``_check_fidelity``): the comparison
runs on the finished output whatever the method, and that test's calibrated W4A8 quantize already
has ``--eval`` with these numbers, so a second quantize --eval here only repeated the two model loads,
the recording and the teacher-forced pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_run import run_cli as _run


def test_eval_misuse_is_one_line_and_writes_nothing(tiny_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = str(tiny_dir / "kimi-k2.5"), str(tiny_dir / "kimi-k2.5-eagle3")
    cases = [
        ([draft, "--recipe", "int4-draft", "--eval"], "--eval: ", "is not a target"),
        ([draft, "--recipe", "int4-draft", "--eval", "--target", target], "give one", ""),
        ([target, "--recipe", "w4a8", "--eval", "--eval-k", "2"], "--eval-k goes with --target", ""),
        ([target, "--recipe", "w4a8", "--eval", "--eval-prompts", "0"], "--eval-prompts must be >= 1", ""),
        ([target, "--recipe", "w4a8", "--eval-tokens", "8"], "go with --target", "or --eval"),
    ]
    for args, a, b in cases:
        out = tmp_path / "o"
        code, _, err = _run(["quantize", args[0], str(out), *args[1:]], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and a in lines[0] and b in lines[0], (args, err)
        assert not out.exists() and not out.with_name("o.partial").exists()
