"""`eagle3 make-tiny` output handling (issue 10, items 1 and 13): a full disk, a file size limit,
--overwrite of a directory eagle3 did not write; one line, exit 2, nothing left behind."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.cli import main
from tests.diskfull import fill_disk


def _error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    assert e.value.code == 2, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _nothing_left(parent: Path) -> None:
    assert list(parent.iterdir()) == [], list(parent.iterdir())


def test_disk_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    parent = tmp_path / "p"
    parent.mkdir()
    out = parent / "tiny"
    fill_disk(monkeypatch, parent / "tiny.partial")
    err = _error(capsys, ["make-tiny", str(out), "--only", "kimi-k2.5"])
    assert f"no space left on device while writing {parent / 'tiny.partial'}/kimi-k2.5/" in err
    _nothing_left(parent)


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))


def test_file_size_limit_real_kernel(tmp_path: Path) -> None:
    """The kernel refuses the write (EFBIG: RLIMIT_FSIZE, Python ignores SIGXFSZ): no simulation."""
    parent = tmp_path / "p"
    parent.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONDONTWRITEBYTECODE": "1"}
    p = subprocess.run([sys.executable, "-m", "eagle3.cli", "make-tiny", str(parent / "tiny"), "--only", "kimi-k2.5"],
                       capture_output=True, text=True, env=env, timeout=300, preexec_fn=_limit_file_size)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    assert f"file too large (file size limit) while writing {parent / 'tiny.partial'}/kimi-k2.5/" in p.stderr
    _nothing_left(parent)


def test_overwrite_only_replaces_what_eagle3_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    err = _error(capsys, ["make-tiny", str(out), "--only", "kimi-k2.5-eagle3", "--overwrite"])
    assert "not an output eagle3 wrote" in err
    assert (out / "mine.txt").read_text() == "keep" and sorted(os.listdir(tmp_path)) == ["tiny"]
    (out / "mine.txt").unlink()
    out.rmdir()
    with pytest.raises(SystemExit) as e:
        main(["make-tiny", str(out), "--only", "kimi-k2.5-eagle3"])
    assert e.value.code in (0, None)
    with pytest.raises(SystemExit) as e:
        main(["make-tiny", str(out), "--only", "speculators-eagle3", "--overwrite"])
    assert e.value.code in (0, None)
    assert sorted(os.listdir(out)) == ["manifest.json", "speculators-eagle3"]
    assert sorted(os.listdir(tmp_path)) == ["tiny"]


def test_make_tiny_into_a_missing_parent_creates_it(tmp_path: Path) -> None:
    """`make demo` writes demo-out/tiny before demo-out exists: the output lock must not need it."""
    out = tmp_path / "not-yet" / "tiny"
    with pytest.raises(SystemExit) as e:
        main(["make-tiny", str(out), "--only", "kimi-k2.5-eagle3"])
    assert e.value.code in (0, None)
    assert (out / "manifest.json").is_file() and not (tmp_path / "not-yet" / "tiny.lock").exists()
