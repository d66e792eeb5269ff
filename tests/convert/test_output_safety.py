"""Where outputs may go and what they may replace (issue 10, items 1, 3, 4, 13, 18), at the CLI.

The rule (eagle3.checkpoint): OUT must not be, contain or lie inside any input, after resolving
symlinks; --overwrite replaces only a directory eagle3 wrote (its manifest.json); one run per OUT
(OUT.lock); side files only from inside the source; write failures are one line naming the file;
every error leaves neither OUT nor OUT.partial nor OUT.lock, and the inputs byte-identical."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.cli import main
from tests.cli_run import run_cli
from tests.diskfull import fill_disk

DRAFT = "kimi-k2.5-eagle3"
TARGET = "kimi-k2.5"


def snapshot(d: Path) -> dict[str, object]:
    """Every entry below ``d`` (and ``d`` itself): file bytes, symlink targets, directories."""
    out: dict[str, object] = {}
    for p in [d, *sorted(d.rglob("*"))]:
        rel = str(p.relative_to(d))
        out[rel] = ("link", os.readlink(p)) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return out


def error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    """Run ``eagle3 ARGS`` through the console-script entry point: exit 2 and one line."""
    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    assert e.value.code == 2, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def ok(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    assert e.value.code in (0, None), (out, err)
    return out


def nothing_left(out: Path) -> None:
    for p in (out, out.with_name(out.name + ".partial"), out.with_name(out.name + ".lock")):
        assert not os.path.lexists(p), p


@pytest.fixture
def T(tiny_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the two tiny models these tests use, the draft and the target, under
    make-tiny's manifest (so T is an eagle3 output, which --overwrite alone would replace). Not the
    other tiny models: half the bytes (a second 12 MB target among them) that every test copied and
    its snapshots read, and that no command here reads."""
    t = tmp_path / "T"
    t.mkdir()
    for model in (DRAFT, TARGET):
        shutil.copytree(tiny_dir / model, t / model, symlinks=True)
    shutil.copy2(tiny_dir / "manifest.json", t / "manifest.json")
    return t


# ---------------------------------------------------------------------------------------------
# item 1: OUT must not be, contain or lie inside an input
# ---------------------------------------------------------------------------------------------


def test_out_parent_of_src_with_overwrite_deletes_nothing(T: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's repro: OUT is the parent of SRC (and an eagle3 output, so --overwrite alone
    would have allowed replacing it)."""
    before = snapshot(T.parent)
    err = error(capsys, ["convert", str(T / DRAFT), str(T), "--engine", "vllm", "--overwrite", "--quiet"])
    assert str(T) in err and "contain the input" in err and str(T / DRAFT) in err
    assert snapshot(T.parent) == before


def test_out_equal_to_src_refused(T: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(T.parent)
    src = T / DRAFT
    err = error(capsys, ["convert", str(src), str(src), "--engine", "vllm", "--overwrite", "--quiet"])
    assert "is the input" in err
    assert snapshot(T.parent) == before


def test_out_equal_to_src_through_a_symlink_refused(T: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    link = tmp_path / "link"
    link.symlink_to(T / DRAFT)
    before = snapshot(tmp_path)
    # SRC through the link, OUT the real directory; and the other way round.
    error(capsys, ["convert", str(link), str(T / DRAFT), "--engine", "vllm", "--overwrite", "--quiet"])
    error(capsys, ["convert", str(T / DRAFT), str(link), "--engine", "vllm", "--overwrite", "--quiet"])
    # OUT's parent through a link to SRC's parent: OUT resolves to SRC.
    plink = tmp_path / "plink"
    plink.symlink_to(T)
    err = error(capsys, ["convert", str(T / DRAFT), str(plink / DRAFT), "--engine", "vllm", "--overwrite",
                         "--quiet"])
    assert "is the input" in err
    plink.unlink()
    assert snapshot(tmp_path) == before


def test_out_inside_src_refused(T: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(T.parent)
    out = T / DRAFT / "converted"
    err = error(capsys, ["convert", str(T / DRAFT), str(out), "--engine", "vllm", "--quiet"])
    assert "lies inside the input" in err
    assert snapshot(T.parent) == before


def test_out_equal_to_target_with_overwrite_refused(T: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # An eagle3-written target (so only the path rule can refuse it).
    tgt = tmp_path / "target-vllm"
    ok(capsys, ["convert", str(T / TARGET), str(tgt), "--quiet"])
    before = snapshot(tmp_path)
    err = error(capsys, ["convert", str(T / DRAFT), str(tgt), "--engine", "vllm", "--target", str(tgt),
                         "--overwrite", "--quiet"])
    assert "is the input" in err and str(tgt) in err
    # ... and OUT containing the target.
    error(capsys, ["convert", str(T / DRAFT), str(tmp_path), "--engine", "vllm", "--target", str(tgt),
                   "--overwrite", "--quiet"])
    assert snapshot(tmp_path) == before


def test_src_named_like_outs_partial_is_not_removed(T: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """OUT.partial is removed by a run: it must not be an input either."""
    src = tmp_path / "o.partial"
    shutil.copytree(T / DRAFT, src)
    before = snapshot(src)
    err = error(capsys, ["convert", str(src), str(tmp_path / "o"), "--engine", "vllm", "--quiet"])
    assert "o.partial" in err
    assert snapshot(src) == before


def test_overwrite_refuses_a_directory_eagle3_did_not_write(T: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    (out / "manifest.json").write_text(json.dumps({"files": {}}))  # not eagle3's manifest
    before = snapshot(tmp_path)
    err = error(capsys, ["convert", str(T / DRAFT), str(out), "--engine", "vllm", "--overwrite", "--quiet"])
    assert "not an output eagle3 wrote" in err
    f = tmp_path / "file"
    f.write_text("x")
    before = snapshot(tmp_path)
    error(capsys, ["convert", str(T / DRAFT), str(f), "--engine", "vllm", "--overwrite", "--quiet"])
    assert snapshot(tmp_path) == before


def test_overwrite_replaces_an_eagle3_output(T: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    ok(capsys, ["convert", str(T / DRAFT), str(out), "--engine", "vllm", "--quiet"])
    ok(capsys, ["convert", str(T / DRAFT), str(out), "--engine", "sglang", "--overwrite", "--quiet"])
    assert json.loads((out / "convert_report.json").read_text())["engine"] == "sglang"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["T", "o"]  # no .old, .partial or .lock left


def test_a_foreign_partial_directory_is_not_removed(T: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    part = tmp_path / "o.partial"
    part.mkdir()
    (part / "data.bin").write_bytes(b"someone else's")
    err = error(capsys, ["convert", str(T / DRAFT), str(out), "--engine", "vllm", "--quiet"])
    assert "o.partial" in err and "not started by eagle3" in err
    assert (part / "data.bin").read_bytes() == b"someone else's"


def test_quantize_out_parent_of_src_refused(T: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(T.parent)
    err = error(capsys, ["quantize", str(T / DRAFT), str(T), "--recipe", "int4-draft", "--overwrite", "--quiet"])
    assert "contain the input" in err
    assert snapshot(T.parent) == before


def test_quantize_out_equal_to_recipe_dir_refused(T: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from eagle3.quantize.recipes import load_recipe

    rdir = tmp_path / "recipes"
    rdir.mkdir()
    rec = rdir / "r.yaml"
    rec.write_text(json.dumps(load_recipe("int4-draft").raw))  # JSON is YAML
    before = snapshot(tmp_path)
    err = error(capsys, ["quantize", str(T / DRAFT), str(rdir), "--recipe", str(rec), "--quiet"])
    assert "contain the input" in err and str(rec) in err
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# item 3: one run per OUT
# ---------------------------------------------------------------------------------------------

HOLDER = """
import sys, time
from eagle3.checkpoint import lock_output
lock_output(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def test_second_run_into_the_same_out_names_the_first(T: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Another process (eagle3's own lock code, so the test needs no timing) holds OUT's lock: the
    run gets one line naming it; once that process is killed (-9, its lock file stays behind), the
    stale file does not block."""
    out = tmp_path / "o"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), "convert-holder"], stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        err = error(capsys, ["convert", str(T / DRAFT), str(out), "--engine", "vllm", "--quiet"])
        assert f"pid {holder.pid}" in err and "another eagle3 run" in err and "convert-holder" in err
        assert not out.exists() and not out.with_name("o.partial").exists()
        assert out.with_name("o.lock").exists()  # the holder's: untouched
        # quantize and make-tiny obey the same lock.
        err = error(capsys, ["quantize", str(T / DRAFT), str(out), "--recipe", "int4-draft", "--quiet"])
        assert f"pid {holder.pid}" in err
        err = error(capsys, ["make-tiny", str(out), "--only", DRAFT])
        assert f"pid {holder.pid}" in err
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert out.with_name("o.lock").exists()  # stale, from the killed run
    ok(capsys, ["convert", str(T / DRAFT), str(out), "--engine", "vllm", "--quiet"])
    assert (out / "manifest.json").is_file() and not out.with_name("o.lock").exists()


def test_two_concurrent_cli_runs(T: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two real `eagle3 convert` processes into one OUT: whatever the interleaving, each either
    succeeds or says the other run holds the lock (or that OUT already exists); never a traceback,
    and the output is complete."""
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "eagle3.cli", "convert", str(T / DRAFT), str(out), "--engine", "vllm", "--quiet"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    res = [(p.wait(timeout=300), p.stderr.read() if p.stderr else "") for p in procs]
    assert sum(rc == 0 for rc, _ in res) >= 1, res
    for rc, err in res:
        assert "Traceback" not in err, err
        if rc != 0:
            assert rc == 2 and ("another eagle3 run" in err or "already exists" in err), err
    # the output checked in-process (a third Python process would only add its imports)
    assert run_cli(["verify", str(out)], capsys)[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["T", "o"]


def test_a_foreign_lock_named_file_is_left_alone(T: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "o.lock").write_text("my notes")
    err = error(capsys, ["convert", str(T / DRAFT), str(tmp_path / "o"), "--engine", "vllm", "--quiet"])
    assert "o.lock" in err and "not an eagle3 lock file" in err
    assert (tmp_path / "o.lock").read_text() == "my notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["T", "o.lock"]


# ---------------------------------------------------------------------------------------------
# item 4: side files
# ---------------------------------------------------------------------------------------------


def test_symlinked_side_file_outside_the_source_refused(T: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not a template")
    src = T / TARGET
    (src / "chat_template.jinja").unlink()
    (src / "chat_template.jinja").symlink_to(secret)
    out = tmp_path / "o"
    err = error(capsys, ["convert", str(src), str(out), "--quiet"])
    assert "chat_template.jinja" in err and "outside" in err
    nothing_left(out)
    err = error(capsys, ["quantize", str(src), str(out), "--recipe", "w4a8", "--quiet"])
    assert "chat_template.jinja" in err
    nothing_left(out)


def test_side_file_that_is_not_a_regular_file_refused(T: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    src = T / TARGET
    (src / "tokenizer_config.json").unlink()
    os.mkfifo(src / "tokenizer_config.json")
    out = tmp_path / "o"
    err = error(capsys, ["convert", str(src), str(out), "--quiet"])
    assert "tokenizer_config.json" in err and "not a regular file" in err
    nothing_left(out)


def test_symlinked_side_file_inside_the_source_is_copied(T: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    src = T / TARGET
    (src / "templates").mkdir()
    (src / "chat_template.jinja").rename(src / "templates" / "kimi.jinja")
    (src / "chat_template.jinja").symlink_to(Path("templates") / "kimi.jinja")
    out = tmp_path / "o"
    ok(capsys, ["convert", str(src), str(out), "--quiet"])
    got = out / "chat_template.jinja"
    assert not got.is_symlink() and got.read_bytes() == (src / "templates" / "kimi.jinja").read_bytes()


def test_hf_cache_snapshot_side_files_are_copied(tiny_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`eagle3 download` without --local-dir gives a cache snapshot whose files are symlinks into
    ../../blobs: converting from it must keep working."""
    from eagle3.testing.fakehub import FakeHub

    home = tmp_path / "hf"
    with FakeHub() as hub:
        hub.add_repo("moonshotai/Kimi-K2.5", tiny_dir / TARGET)
        p = subprocess.run([sys.executable, "-m", "eagle3.cli", "download", "moonshotai/Kimi-K2.5", "--json"],
                           env=hub.env(home, HF_HUB_DISABLE_PROGRESS_BARS="1"), capture_output=True, text=True,
                           timeout=120)
    assert p.returncode == 0, p.stderr
    snap = Path(json.loads(p.stdout)["path"])
    assert (snap / "chat_template.jinja").is_symlink() and "blobs" in os.readlink(snap / "chat_template.jinja")
    out = tmp_path / "o"
    ok(capsys, ["convert", str(snap), str(out), "--quiet"])
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert not (out / name).is_symlink()
        assert (out / name).read_bytes() == (tiny_dir / TARGET / name).read_bytes()


# ---------------------------------------------------------------------------------------------
# item 18: speculators verifier path
# ---------------------------------------------------------------------------------------------


def test_speculators_verifier_local_dir_written_absolute(T: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(T)
    ok(capsys, ["convert", DRAFT, str(tmp_path / "s"), "--engine", "speculators", "--target", TARGET, "--quiet"])
    ver = json.loads((tmp_path / "s" / "config.json").read_text())["speculators_config"]["verifier"]
    assert ver["name_or_path"] == str(T / TARGET) and Path(ver["name_or_path"]).is_absolute()
    ok(capsys, ["convert", DRAFT, str(tmp_path / "v"), "--engine", "speculators", "--verifier", TARGET, "--quiet"])
    ver = json.loads((tmp_path / "v" / "config.json").read_text())["speculators_config"]["verifier"]
    assert ver["name_or_path"] == str(T / TARGET)
    # A Hub id stays a Hub id.
    ok(capsys, ["convert", DRAFT, str(tmp_path / "h"), "--engine", "speculators", "--verifier", "moonshotai/Kimi-K2.5",
                "--quiet"])
    ver = json.loads((tmp_path / "h" / "config.json").read_text())["speculators_config"]["verifier"]
    assert ver["name_or_path"] == "moonshotai/Kimi-K2.5"


# ---------------------------------------------------------------------------------------------
# item 13 (output side): disk full, read-only parent
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model,extra", [(TARGET, []), (TARGET, ["--text-only", "--dequantize", "bf16"]),
                                         (DRAFT, ["--engine", "vllm"])])
def test_disk_full_during_convert(T: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str], model: str, extra: list[str]) -> None:
    out = tmp_path / "o"
    before = snapshot(T)
    fill_disk(monkeypatch, tmp_path / "o.partial")
    err = error(capsys, ["convert", str(T / model), str(out), *extra, "--quiet"])
    assert f"no space left on device while writing {tmp_path / 'o.partial'}/" in err, err
    assert str(T) not in err  # the source is not blamed
    nothing_left(out)
    monkeypatch.undo()
    assert snapshot(T) == before


def test_disk_full_while_replacing_keeps_the_old_output(T: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    ok(capsys, ["convert", str(T / DRAFT), str(out), "--engine", "vllm", "--quiet"])
    before = snapshot(out)
    fill_disk(monkeypatch, tmp_path / "o.partial")
    error(capsys, ["convert", str(T / DRAFT), str(out), "--engine", "sglang", "--overwrite", "--quiet"])
    monkeypatch.undo()
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["T", "o"]


def test_failed_final_rename_keeps_the_old_output(T: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The old OUT is moved aside before the new one takes its name; if that rename fails, the old
    one is moved back."""
    out = tmp_path / "o"
    ok(capsys, ["convert", str(T / DRAFT), str(out), "--engine", "vllm", "--quiet"])
    before = snapshot(out)
    real_rename = Path.rename

    def rename(self: Path, target: object) -> Path:
        if self.name == "o.partial":
            raise OSError(5, "Input/output error")
        return real_rename(self, target)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "rename", rename)
    err = error(capsys, ["convert", str(T / DRAFT), str(out), "--engine", "sglang", "--overwrite", "--quiet"])
    monkeypatch.undo()
    assert str(out) in err
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["T", "o"]


def _without_dac_override() -> list[str] | None:
    """A command prefix that makes permission bits apply (root ignores them otherwise)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner"]


# Both commands in one process without the override (a Python start and torch's import each, ~1.5
# CPU-s, is most of what a command costs here); each command's exit status and stderr apart.
_TWO_COMMANDS = """
import contextlib, io, json, sys
from eagle3.cli import main
got = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    got.append([code, err.getvalue()])
print(json.dumps(got))
"""


def test_read_only_output_parent(T: Path, tmp_path: Path) -> None:
    prefix = _without_dac_override()
    if prefix is None:
        pytest.skip("running as root without setpriv: permission bits cannot be made to apply")
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    commands = [["convert", str(T / DRAFT), str(parent / "o"), "--engine", "vllm", "--quiet"],
                ["make-tiny", str(parent / "o"), "--only", DRAFT]]
    try:
        p = subprocess.run([*prefix, sys.executable, "-c", _TWO_COMMANDS, json.dumps(commands)], capture_output=True,
                           text=True, env=env, timeout=300)
        assert p.returncode == 0, (p.stdout, p.stderr)
        results = json.loads(p.stdout.splitlines()[-1])
        assert len(results) == len(commands), results
        for code, stderr in results:
            assert code == 2, (code, stderr)
            assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
            assert "permission denied" in stderr and str(parent / "o") in stderr
            assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o755)
