"""`eagle3 download` / `hub.resolve` against a loopback Hub (eagle3.testing.fakehub) with the real
huggingface_hub client: cache and --local-dir downloads, patterns, remote-code gating, dry run,
revisions, resume, offline mode, free-disk refusal and one-line errors.

The CLI runs in a subprocess where the test is about HF_ENDPOINT / HF_HOME / HF_HUB_OFFLINE, which
huggingface_hub reads once, at import; the others run in-process (the free-disk test has to patch
``shutil.disk_usage``)."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import socket
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3 import hub as hubmod
from eagle3.cli import app
from eagle3.errors import DownloadError, UsageError
from eagle3.testing.fakehub import FakeHub
from tests.cli_run import run_cli

KIMI = "moonshotai/Kimi-K2.5"
DRAFT = "lightseekorg/kimi-k2.5-eagle3"
GATED = "lightseekorg/kimi-k2.6-eagle3.1-mla"
BIG = "org/big-shard"
TOKEN = "hf_fake_valid_token"
CHUNK = 10 * 1024 * 1024  # huggingface_hub's DOWNLOAD_CHUNK_SIZE: the granularity of in-run resume

# What a Kimi repo carries besides the tiny checkpoint: remote code, docs and images we must skip.
EXTRAS = {
    "modeling_deepseek.py": b"# remote code\n",
    "configuration_deepseek.py": b"# remote code\n",
    "README.md": b"# Kimi\n",
    "LICENSE": b"modified MIT\n",
    "docs/deploy_guidance.md": b"guide\n",
    "figures/benchmark.png": b"\x89PNG fake",
    ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
}
DEFAULT_SKIPPED = {"modeling_deepseek.py", "configuration_deepseek.py", "docs/deploy_guidance.md",
                   "figures/benchmark.png", ".gitattributes"}


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and ".cache" not in p.relative_to(d).parts}


@pytest.fixture(scope="module")
def fixtures(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hubsrc")
    kimi = root / "kimi"
    shutil.copytree(tiny_dir / "kimi-k2.5", kimi)
    for name, data in EXTRAS.items():
        (kimi / name).parent.mkdir(parents=True, exist_ok=True)
        (kimi / name).write_bytes(data)
    v0 = root / "kimi-v0"
    v0.mkdir()
    (v0 / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "revision_marker": "v0"}))
    (v0 / "tokenizer_config.json").write_text("{}")
    big = root / "big"
    big.mkdir()
    (big / "config.json").write_text("{}")
    (big / "model.safetensors").write_bytes(random.Random(0).randbytes(CHUNK + CHUNK // 5))
    return {"kimi": kimi, "v0": v0, "draft": tiny_dir / "kimi-k2.5-eagle3",
            "gated": tiny_dir / "kimi-k2.6-eagle3.1-mla", "big": big}


@pytest.fixture(scope="module")
def hub(fixtures: dict[str, Path]):
    # page_size=4: the tree listing of every repo spans several pages (cursor + Link header).
    with FakeHub(page_size=4, tokens=(TOKEN,)) as h:
        h.add_repo(KIMI, fixtures["kimi"])
        h.add_repo(KIMI, fixtures["v0"], revision="v0")
        h.add_repo(DRAFT, fixtures["draft"])
        h.add_repo(GATED, fixtures["gated"], gated=True)
        h.add_repo(BIG, fixtures["big"])
        yield h


def run(hub: FakeHub, home: Path, *args: str, endpoint: str | None = None,
        **env: str) -> subprocess.CompletedProcess[str]:
    e = hub.env(home, HF_HUB_DISABLE_PROGRESS_BARS="1", **env)
    if endpoint is not None:
        e["HF_ENDPOINT"] = endpoint
    return subprocess.run([sys.executable, "-m", "eagle3.cli", *args], env=e, capture_output=True,
                          text=True, timeout=60)


def one_error(p: subprocess.CompletedProcess[str]) -> str:
    """The CLI's contract for user errors: exit 2, exactly one `error:` line, no traceback."""
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    errs = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errs) == 1 and "Traceback" not in p.stderr, p.stderr
    return errs[0]


@pytest.fixture
def cli(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """In-process `eagle3 ...` (CliRunner) against the fake hub with a private cache dir. hub.py reads
    HF_ENDPOINT at call time, so this works although huggingface_hub is already imported; the
    user-facing env-var contract itself is covered by the subprocess tests."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    cache = tmp_path / "cache"

    def invoke(*args: str):
        return CliRunner().invoke(app, [*args, "--cache-dir", str(cache)])

    invoke.cache = cache  # type: ignore[attr-defined]
    return invoke


def download_error(res) -> str:  # type: ignore[no-untyped-def]
    assert isinstance(res.exception, DownloadError), (res.exception, res.output)
    msg = str(res.exception)
    assert "\n" not in msg
    return msg


@pytest.fixture(scope="module")
def cached(hub: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`eagle3 download KIMI --json` once (subprocess, real env vars, progress bars on) into a fresh
    HF_HOME; later tests reuse that cache."""
    home = tmp_path_factory.mktemp("hf-cached")
    hub.clear_log()
    p = subprocess.run([sys.executable, "-m", "eagle3.cli", "download", KIMI, "--json"],
                       env=hub.env(home), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    shard = "model-00001-of-00003.safetensors"
    return {"home": home, "result": json.loads(p.stdout),
            "shard_hosts": [r.host.split(":")[0] for r in hub.content_gets(KIMI, shard)],
            "skipped_fetched": [s for s in DEFAULT_SKIPPED if hub.content_gets(KIMI, s)]}


def _snapshot(home: Path, hub: FakeHub) -> Path:
    return home / "hub" / "models--moonshotai--Kimi-K2.5" / "snapshots" / hub.repos[KIMI].refs["main"]


def test_download_to_cache_default_patterns(hub: FakeHub, fixtures: dict[str, Path], cached: dict) -> None:
    home, res = cached["home"], cached["result"]
    commit = hub.repos[KIMI].refs["main"]
    snap = _snapshot(home, hub)
    assert Path(res["path"]) == snap and res["commit"] == commit and not res["local"]
    src = _files(fixtures["kimi"])
    want = {k: v for k, v in src.items() if k not in DEFAULT_SKIPPED}
    assert _files(snap) == want  # weights, index, configs, tokenizer, chat template, README, LICENSE
    assert {f["name"] for f in res["files"]} == set(want)
    assert res["total_bytes"] == res["download_bytes"] == sum(len(v) for v in want.values())
    assert (home / "hub" / "models--moonshotai--Kimi-K2.5" / "refs" / "main").read_text() == commit
    # The LFS shard came through the CDN redirect; remote code, docs and images were never fetched.
    assert cached["shard_hosts"] == ["localhost"]
    assert cached["skipped_fetched"] == []

    # A second run finds everything in place: prints the path only, fetches no bytes.
    hub.clear_log()
    p2 = run(hub, home, "download", KIMI)
    assert p2.returncode == 0, p2.stderr
    assert p2.stdout == f"{snap}\n"
    assert not [r for r in hub.requests("GET") if "/resolve/" in r.path or r.path.startswith("/cdn/")]


def test_offline_resolves_from_cache_or_fails_clearly(hub: FakeHub, cached: dict,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    home = cached["home"]
    snap = _snapshot(home, hub)
    hub.clear_log()
    p = run(hub, home, "download", KIMI, "--json", HF_HUB_OFFLINE="1")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert Path(res["path"]) == snap and res["offline"] and res["commit"] == hub.repos[KIMI].refs["main"]
    assert {f["name"] for f in res["files"]} == {f["name"] for f in cached["result"]["files"]}
    err = one_error(run(hub, home, "download", DRAFT, HF_HUB_OFFLINE="1"))
    assert DRAFT in err and "HF_HUB_OFFLINE=1" in err and str(home / "hub") in err
    assert hub.requests() == []  # offline means offline

    # resolve() -- what `inspect REPO` uses -- gives the same directory. In-process, so the frozen
    # offline constant is patched the way HF_HUB_OFFLINE=1 would have set it at import.
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hubmod.resolve(KIMI, cache_dir=home / "hub") == snap
    with pytest.raises(DownloadError, match="--dry-run asks the Hub"):
        hubmod.download(KIMI, dry_run=True, cache_dir=home / "hub")
    assert hub.requests() == []


def test_hub_unreachable(hub: FakeHub, cached: dict, cli, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    dead = _closed_port_url()
    p = run(hub, cached["home"], "download", KIMI, endpoint=dead)  # cached: served from the cache
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(_snapshot(cached["home"], hub))
    assert f"warning: the Hub at {dead} could not be used" in p.stderr
    monkeypatch.setenv("HF_ENDPOINT", dead)
    msg = download_error(cli("download", KIMI))
    assert "cannot reach the Hub" in msg and dead in msg and KIMI in msg


def test_missing_repo_exits_2_with_one_line(hub: FakeHub, cli, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    # In-process through the console-script entry point (the `cli` fixture's endpoint and cache):
    # the error path reads no import-time setting, so a Python process of its own would add only imports.
    code, _, err = run_cli(["download", "nobody/no-such-model", "--cache-dir", str(cli.cache)], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: nobody/no-such-model: repository not found on " + hub.url)


def test_gated_repo_needs_token(hub: FakeHub, fixtures: dict[str, Path], cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    msg = download_error(cli("download", GATED))
    assert GATED in msg and "gated" in msg
    out = tmp_path / "mla"
    res = cli("download", GATED, "--local-dir", str(out), "--token", TOKEN)
    assert res.exit_code == 0, res.output
    assert _files(out) == _files(fixtures["gated"])
    res = cli("download", "not a repo!")
    assert isinstance(res.exception, UsageError) and "neither an existing path nor a Hub repo id" in str(res.exception)


def test_local_dir_include_exclude(fixtures: dict[str, Path], cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "kimi-json"
    res = cli("download", KIMI, "--local-dir", str(out), "--include", "*.json", "--exclude", "generation_config.json")
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == str(out.resolve())
    src = _files(fixtures["kimi"])
    assert _files(out) == {k: v for k, v in src.items() if k.endswith(".json") and k != "generation_config.json"}
    assert not (cli.cache / "models--moonshotai--Kimi-K2.5" / "blobs").exists()  # nothing went to the cache


def test_remote_code_needs_trust_remote_code(fixtures: dict[str, Path], cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    plain = tmp_path / "plain"
    msg = download_error(cli("download", KIMI, "--local-dir", str(plain), "--include", "*.py"))
    assert "only downloaded with --trust-remote-code" in msg  # an explicit --include does not bypass the gate
    assert _files(plain) == {}
    msg = download_error(cli("download", KIMI, "--include", "*.gguf"))
    assert "no file in the repo matches --include *.gguf" in msg

    trusted = tmp_path / "trusted"
    res = cli("download", KIMI, "--local-dir", str(trusted), "--trust-remote-code")
    assert res.exit_code == 0, res.output
    got = _files(trusted)
    assert got["modeling_deepseek.py"] == EXTRAS["modeling_deepseek.py"]
    assert "configuration_deepseek.py" in got and "figures/benchmark.png" not in got


def test_dry_run_lists_sizes_and_downloads_nothing(hub: FakeHub, fixtures: dict[str, Path], cli,  # type: ignore[no-untyped-def]
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    hub.clear_log()
    res = cli("download", DRAFT, "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    src = {k: len(v) for k, v in _files(fixtures["draft"]).items()}
    assert {f["name"]: f["size"] for f in out["files"]} == src
    assert all(f["will_download"] for f in out["files"]) and out["dry_run"]
    assert out["total_bytes"] == out["download_bytes"] == sum(src.values())
    assert not list(cli.cache.rglob("*.safetensors"))
    assert not [r for r in hub.requests("GET") if "/resolve/" in r.path or r.path.startswith("/cdn/")]
    # Sizes come from the file metadata: a HEAD per file (X-Linked-Size for the LFS shards).
    assert {r.path.rsplit("/", 1)[-1] for r in hub.requests("HEAD")} >= set(src)

    hubmod.print_result(hubmod.download(DRAFT, dry_run=True, cache_dir=cli.cache))
    text = capsys.readouterr().out
    assert f"{len(src)} files" in text and f"({sum(src.values())} bytes)" in text
    assert "model-00001-of-00002.safetensors" in text


def test_dry_run_marks_cached_files(hub: FakeHub, cached: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    res = hubmod.download(KIMI, dry_run=True, cache_dir=cached["home"] / "hub")
    assert res.files and not any(f.will_download for f in res.files) and res.download_bytes == 0
    assert res.path == _snapshot(cached["home"], hub)


def test_revision_branch_commit_and_missing(hub: FakeHub, fixtures: dict[str, Path], cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    res = cli("download", KIMI, "--revision", "v0", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["commit"] == hub.repos[KIMI].refs["v0"] and out["revision"] == "v0"
    assert json.loads((Path(out["path"]) / "config.json").read_text())["revision_marker"] == "v0"
    assert (cli.cache / "models--moonshotai--Kimi-K2.5" / "refs" / "v0").read_text() == out["commit"]

    by_commit = tmp_path / "by-commit"
    res = cli("download", KIMI, "--revision", hub.repos[KIMI].refs["main"], "--local-dir", str(by_commit),
              "--include", "config.json")
    assert res.exit_code == 0, res.output
    assert (by_commit / "config.json").read_bytes() == (fixtures["kimi"] / "config.json").read_bytes()

    msg = download_error(cli("download", KIMI, "--revision", "no-such-branch"))
    assert "revision 'no-such-branch' not found" in msg and KIMI in msg


def test_dropped_connection_resumes_with_range(hub: FakeHub, fixtures: dict[str, Path], cli) -> None:  # type: ignore[no-untyped-def]
    hub.clear_log()
    drop_at = CHUNK + 4096  # past the first 10 MiB chunk, so that chunk is kept on disk
    hub.add_fault(BIG, "model.safetensors", drop_after=drop_at)
    res = cli("download", BIG, "--json")
    assert res.exit_code == 0, res.output
    gets = hub.content_gets(BIG, "model.safetensors")
    assert len(gets) == 2 and "range" not in gets[0].headers
    assert gets[1].headers["range"] == f"bytes={CHUNK}-"  # resumed, not restarted
    got = (Path(json.loads(res.stdout)["path"]) / "model.safetensors").read_bytes()
    want = (fixtures["big"] / "model.safetensors").read_bytes()
    assert hashlib.sha256(got).digest() == hashlib.sha256(want).digest()


def test_failed_run_then_rerun_fetches_only_the_missing_file(hub: FakeHub, fixtures: dict[str, Path], cli,  # type: ignore[no-untyped-def]
                                                             tmp_path: Path) -> None:
    out = tmp_path / "draft"
    broken = "model-00002-of-00002.safetensors"
    hub.add_fault(DRAFT, broken, status=500)
    msg = download_error(cli("download", DRAFT, "--local-dir", str(out), "--max-workers", "1"))
    assert DRAFT in msg and "500" in msg
    assert not (out / broken).exists() and (out / "model-00001-of-00002.safetensors").exists()

    hub.clear_log()
    res = cli("download", DRAFT, "--local-dir", str(out))
    assert res.exit_code == 0, res.output
    fetched = {name for name in _files(fixtures["draft"]) if hub.content_gets(DRAFT, name)}
    assert fetched == {broken}
    assert _files(out) == _files(fixtures["draft"])


def _closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def test_free_disk_preflight_refuses(hub: FakeHub, cli, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    hub.clear_log()
    msg = download_error(cli("download", DRAFT))
    repo = hub.repos[DRAFT]
    need = sum(f.size for f in repo.commits[repo.refs["main"]].values())
    assert f"({need} bytes)" in msg and "(1000 bytes) are free" in msg and str(cli.cache.parent) in msg
    assert not hub.content_gets(DRAFT, "model-00001-of-00002.safetensors")
    assert not (cli.cache / "models--lightseekorg--kimi-k2.5-eagle3" / "blobs").exists()


def test_local_path_is_reported_not_downloaded(fixtures: dict[str, Path], tmp_path: Path) -> None:
    src = fixtures["draft"]
    res = CliRunner().invoke(app, ["download", str(src), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["local"] and out["path"] == str(src) and out["download_bytes"] == 0
    assert out["total_bytes"] == sum(len(v) for v in _files(src).values())
    assert hubmod.resolve(str(src)) == src
    assert hubmod.resolve(src / "config.json") == src / "config.json"
    with pytest.raises(UsageError, match="no such file or directory"):
        hubmod.resolve(str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="local path"):
        hubmod.download(str(src), local_dir=tmp_path / "x")


def test_inspect_accepts_a_repo_id(hub: FakeHub, fixtures: dict[str, Path], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    res = CliRunner().invoke(app, ["inspect", DRAFT, "--json"])
    assert res.exit_code == 0, (res.exception, res.output)
    out = json.loads(res.stdout)
    assert out["role"] == "draft"
    snaps = list((tmp_path / "cache" / "models--lightseekorg--kimi-k2.5-eagle3" / "snapshots").iterdir())
    assert snaps
    # Only configs/index/tokenizer were downloaded: the shards were read through range requests.
    assert not list(snaps[0].glob("*.safetensors"))
    local = json.loads(CliRunner().invoke(app, ["inspect", str(fixtures["draft"]), "--json"]).stdout)
    for key in ("role", "family", "quant", "dims"):
        assert out[key] == local[key]
    assert out["tensors"]["count"] == local["tensors"]["count"]
    assert out["tensors"]["total_bytes"] == local["tensors"]["total_bytes"]
