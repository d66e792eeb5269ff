"""--report / --figure of serve --validate, validate and bench must not lie inside an input
(--target, --draft, --dataset, --dataset-path, --tokenizer): refused with one line before a
server is contacted or a model loaded (issue 10, item 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.cli import main

DEAD = "http://127.0.0.1:9"  # nothing listens: a test that got past the check would fail differently


def _error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    assert e.value.code == 2, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def data(tmp_path: Path) -> Path:
    d = tmp_path / "gsm8k"
    d.mkdir()
    (d / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    (d / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    return d


def _unchanged(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_validate_report_inside_dataset(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _unchanged(data)
    err = _error(capsys, ["validate", "--base-url", DEAD, "--dataset", str(data), "--report",
                          str(data / "r.json")])
    assert "report lies inside the input" in err and str(data) in err
    err = _error(capsys, ["validate", "--base-url", DEAD, "--dataset", str(data), "--report",
                          str(data / "train.jsonl"), "--overwrite"])
    assert "report lies inside the input" in err
    err = _error(capsys, ["validate", "--base-url", DEAD, "--dataset", str(data), "--report",
                          str(data.parent / "r.json"), "--figure", str(data / "f.png")])
    assert "figure lies inside the input" in err
    assert _unchanged(data) == before


def test_serve_validate_report_inside_target_or_draft(tiny_dir: Path, data: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.5-eagle3"
    for where in (target, draft):
        err = _error(capsys, ["serve", str(target), "--draft", str(draft), "--validate", "gsm8k", "--dataset",
                              str(data), "--report", str(where / "r.json")])
        assert "report lies inside the input" in err and str(where) in err
    err = _error(capsys, ["serve", str(target), "--validate", "gsm8k", "--dataset", str(data), "--report",
                          str(data.parent / "r.json"), "--figure", str(target / "config.json"), "--overwrite"])
    assert "figure lies inside the input" in err
    assert not (target / "r.json").exists() and not (draft / "r.json").exists()


def test_bench_report_inside_an_input(tiny_dir: Path, data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, ["bench", "--base-url", DEAD, "--dataset", "gsm8k", "--dataset-path", str(data),
                          "--report", str(data / "b.json")])
    assert "report lies inside the input" in err
    err = _error(capsys, ["bench", "--base-url", DEAD, "--tokenizer", str(tiny_dir / "kimi-k2.5"), "--report",
                          str(tiny_dir / "kimi-k2.5" / "b.json")])
    assert "report lies inside the input" in err
    err = _error(capsys, ["bench", "--base-url", DEAD, "--report", str(data)])
    assert "names a directory" in err


def test_report_and_reference_writes_are_strict_json_and_leave_nothing_on_failure(tmp_path: Path) -> None:
    """Written aside and renamed; NaN (lm-eval's stderr of one sample) is null, as strict parsers
    need; an unwritable path or a full disk is one line naming the file, with no '.partial' left."""
    import errno
    import json

    from eagle3.checkpoint.rawio import write_aside
    from eagle3.errors import OutputError
    from eagle3.validate import reference as refmod
    from eagle3.validate.report import write_json_atomic

    report = tmp_path / "r.json"
    write_json_atomic(report, {"stderr": float("nan"), "x": [float("inf"), 1.0]})
    assert json.loads(report.read_text(), parse_constant=lambda c: pytest.fail(c)) == {"stderr": None,
                                                                                          "x": [None, 1.0]}
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    ref = refmod.Reference({"format": refmod.FORMAT, "version": refmod.VERSION, "logprobs": 2})
    for write in (lambda p: write_json_atomic(p, {}), lambda p: refmod.write(p, ref)):
        with pytest.raises(OutputError, match=f"while writing {blocker / 'out'}$"):
            write(blocker / "out")

    def full_disk(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputError, match="no space left on device while writing"):
        write_aside(tmp_path / "full.json", full_disk)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "r.json"]
