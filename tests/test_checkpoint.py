"""Checkpoint I/O: reader/writer round trips (read back by the safetensors library itself), shard
caps, index, corrupt inputs, atomic output and the manifest / `eagle3 verify`."""

from __future__ import annotations

import importlib
import json
import struct
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
from typer.testing import CliRunner

from eagle3.checkpoint import (
    CheckpointReader,
    CheckpointWriter,
    atomic_output,
    copy_side_files,
    verify_manifest,
    write_manifest,
)
from eagle3.cli import app
from eagle3.errors import CheckpointError, OutputExistsError

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.uint8, torch.bool,
          torch.float8_e4m3fn, torch.int8]


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, dt in enumerate(DTYPES):
        x = torch.randn(3 + i, 5, generator=g) * 10
        out[f"t{i}.{str(dt).split('.')[-1]}"] = x.to(dt)
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.zeros(0, 4)
    return out


def _eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 and a.is_floating_point() else a, b.view(torch.uint8) if b.dtype.itemsize == 1 and b.is_floating_point() else b)


def test_round_trip_sharded_and_read_by_safetensors(tmp_path: Path) -> None:
    ts = _tensors()
    with CheckpointWriter(tmp_path, max_shard_bytes=120) as w:
        for k, v in ts.items():
            w.add(k, v)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and files[0].startswith("model-00001-of-")
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(idx["weight_map"]) == set(ts)
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ts.values())
    # The safetensors library reads what we wrote ...
    loaded = {}
    for f in files:
        loaded.update(st.load_file(tmp_path / f))
    assert all(_eq(loaded[k], v) for k, v in ts.items())
    # ... and our reader reads it, one tensor at a time, from the headers.
    r = CheckpointReader(tmp_path)
    assert set(r.names()) == set(ts)
    for k, v in ts.items():
        info = r.info(k)
        assert info.shape == tuple(v.shape) and info.torch_dtype == v.dtype
        assert _eq(r.get(k), v)


def test_single_shard_has_no_index_and_reader_reads_safetensors_files(tmp_path: Path) -> None:
    ts = _tensors(1)
    with CheckpointWriter(tmp_path) as w:
        for k, v in ts.items():
            w.add(k, v)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    other = tmp_path / "sub"
    other.mkdir()
    st.save_file({k: v for k, v in ts.items() if k != "empty"}, other / "x.safetensors")
    r = CheckpointReader(other / "x.safetensors")
    assert _eq(r.get("t0.bfloat16"), ts["t0.bfloat16"])
    assert _eq(CheckpointReader(tmp_path).get("scalar"), ts["scalar"])


def test_big_tensor_gets_its_own_shard_and_start_shard(tmp_path: Path) -> None:
    with CheckpointWriter(tmp_path, max_shard_bytes=64) as w:
        w.add("a", torch.zeros(4))
        w.add("big", torch.zeros(100))
        w.add("b", torch.zeros(2))
        w.start_shard()
        w.add("c", torch.zeros(2))
    wm = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(wm.values())) == 4 and wm["a"] != wm["big"] != wm["b"] != wm["c"]


def _write(tmp: Path, shard_bytes: int = 100) -> dict[str, torch.Tensor]:
    ts = {f"w{i}": torch.full((10,), float(i)) for i in range(6)}
    with CheckpointWriter(tmp, max_shard_bytes=shard_bytes) as w:
        for k, v in ts.items():
            w.add(k, v)
    return ts


def test_truncated_shard(tmp_path: Path) -> None:
    _write(tmp_path)
    f = tmp_path / "model-00002-of-00003.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-7])
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003.safetensors: truncated shard: tensor 'w3'"):
        CheckpointReader(tmp_path)


def test_bad_header(tmp_path: Path) -> None:
    _write(tmp_path)
    f = tmp_path / "model-00001-of-00003.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff\xfe{x"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model-00001-of-00003.safetensors: bad safetensors header"):
        CheckpointReader(tmp_path)
    f.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CheckpointError, match="bad safetensors header .header length"):
        CheckpointReader(tmp_path)
    f.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        CheckpointReader(tmp_path)


def test_index_names_missing_tensor_and_missing_shard(tmp_path: Path) -> None:
    _write(tmp_path)
    ip = tmp_path / "model.safetensors.index.json"
    idx = json.loads(ip.read_text())
    idx["weight_map"]["ghost"] = "model-00001-of-00003.safetensors"
    ip.write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"names tensor 'ghost' in model-00001-of-00003.safetensors"):
        CheckpointReader(tmp_path)
    idx["weight_map"]["ghost"] = "model-00009-of-00009.safetensors"
    ip.write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="names shard model-00009-of-00009.safetensors which does not exist"):
        CheckpointReader(tmp_path)
    ip.write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid index"):
        CheckpointReader(tmp_path)


def test_unknown_tensor_and_missing_path(tmp_path: Path) -> None:
    _write(tmp_path)
    with pytest.raises(CheckpointError, match="no tensor named 'nope'"):
        CheckpointReader(tmp_path).get("nope")
    with pytest.raises(CheckpointError, match="no such file or directory"):
        CheckpointReader(tmp_path / "missing")


def test_atomic_output_refuses_overwrites_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with atomic_output(out) as d:
        assert d.name == "out.partial"
        (d / "a.txt").write_text("1")
    assert (out / "a.txt").read_text() == "1" and (out / "manifest.json").is_file()
    assert not (tmp_path / "out.partial").exists()
    with pytest.raises(OutputExistsError, match="already exists .pass --overwrite"):
        with atomic_output(out):
            pass
    with pytest.raises(RuntimeError):
        with atomic_output(out, overwrite=True) as d:
            (d / "b.txt").write_text("2")
            raise RuntimeError("boom")
    # the failed run left nothing behind and the old output is intact
    assert not (tmp_path / "out.partial").exists() and (out / "a.txt").is_file()
    with atomic_output(out, overwrite=True) as d:
        (d / "b.txt").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt", "manifest.json"]


def test_atomic_output_resume_keeps_partial(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with atomic_output(out, resume=True) as d:
            (d / "done-shard").write_text("x")
            raise KeyboardInterrupt
    assert (tmp_path / "out.partial" / "done-shard").is_file()
    with atomic_output(out, resume=True) as d:
        assert (d / "done-shard").is_file()
    assert (out / "done-shard").is_file()


def test_copy_side_files_gates_remote_code(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    for n in ["config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json", "modeling_kimi.py", "model.safetensors", "tiktoken.model"]:
        (src / n).write_text("x")
    assert copy_side_files(src, dst) == ["chat_template.jinja", "generation_config.json", "tiktoken.model",
                                         "tokenizer.json", "tokenizer_config.json"]
    assert "modeling_kimi.py" in copy_side_files(src, dst, trust_remote_code=True)


def test_verify_cli(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    _write(d)
    write_manifest(d)
    runner = CliRunner()
    res = runner.invoke(app, ["verify", str(d)])
    assert res.exit_code == 0 and "OK: 4 files" in res.output
    f = d / "model-00002-of-00003.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    (d / "extra.txt").write_text("?")
    r = verify_manifest(d)
    assert r.problems == ["model-00002-of-00003.safetensors: sha256 mismatch", "extra.txt: not in the manifest"]
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "eagle3.cli", "verify", str(d)], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and "sha256 mismatch" in p.stderr


@pytest.mark.parametrize("n_small", [3, 30000])
def test_large_shard_single_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n_small: int) -> None:
    """Past _ShardBuilder.DIRECT_WRITE_BYTES a shard is written in place behind a reserved,
    space-padded header; with more entries than the reservation holds (n_small=30000) it falls
    back to the copy. Both read back exactly with the safetensors library."""
    from eagle3.checkpoint import _ShardBuilder

    monkeypatch.setattr(_ShardBuilder, "DIRECT_WRITE_BYTES", 4096)
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(600, generator=g), "b": torch.randn(2000, generator=g).to(torch.bfloat16)}
    for i in range(n_small):
        tensors[f"model.layers.{i}.mlp.experts.{i}.gate_proj.weight_scale"] = torch.tensor([float(i)])
    tensors["z"] = torch.arange(5000, dtype=torch.int64)
    d = tmp_path / "ckpt"
    with CheckpointWriter(d, max_shard_bytes=1_000_000) as w:  # the header estimate assumes ~2 KB per tensor
        for n, t in tensors.items():
            w.add(n, t)
    files = sorted(d.glob("*.safetensors"))
    assert [p.name for p in d.iterdir()] == ["model.safetensors"]  # one shard, no leftover .data file
    got = {}
    for f in files:
        got.update(st.load_file(f))
    assert set(got) == set(tensors) and all(torch.equal(got[n], t) for n, t in tensors.items())
    hlen = max(struct.unpack("<Q", f.read_bytes()[:8])[0] for f in files)
    if n_small == 3:
        assert hlen >= 1 << 20  # written in place: the reservation (spaces) is the header
    else:
        assert 1 << 20 < hlen < 1 << 22  # header of the right size, data moved behind it


def test_add_raw_copies_file_to_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """add_raw: tensors renamed without passing through memory, mixed with add(), across shards and
    across the switch to in-place writing; read back by the safetensors library."""
    from eagle3.checkpoint import _ShardBuilder

    monkeypatch.setattr(_ShardBuilder, "DIRECT_WRITE_BYTES", 2048)
    src = tmp_path / "src"
    with CheckpointWriter(src, max_shard_bytes=5000) as w:
        for i, dt in enumerate((torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.int64)):
            w.add(f"t{i}", torch.randn(1000).mul(10).to(dt))
    reader = CheckpointReader(src)
    extra = torch.arange(300, dtype=torch.int64)
    out = tmp_path / "out"
    with CheckpointWriter(out, max_shard_bytes=10_000) as w:
        for i, info in enumerate(reader.infos()):
            w.add_raw("renamed." + info.name, info)
            if i == 1:
                w.add("extra", extra)
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(st.load_file(f))
    assert torch.equal(got.pop("extra"), extra)
    assert set(got) == {"renamed." + n for n in reader.names()}
    for n in reader.names():
        a, c = got["renamed." + n], reader.get(n)
        assert a.dtype == c.dtype and torch.equal(a.view(torch.uint8), c.view(torch.uint8))
    assert len(list(out.glob("*.safetensors"))) > 1


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_planned_shard_written_out_of_order_from_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         kernel_copy: bool) -> None:
    """ShardLayout/ShardFile: the header is final up front, tensors (and raw copies) land at their
    planned offsets in any order from several threads; the file is byte-identical to what
    CheckpointWriter writes for the same tensors in the same order, and safetensors reads it."""
    from concurrent.futures import ThreadPoolExecutor

    from eagle3.checkpoint import ShardFile, ShardLayout, tag_from_dtype

    if not kernel_copy:  # a platform or filesystem pair without copy_file_range: the pread/pwrite path
        def no_copy(*_a: object, **_k: object) -> int:
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr("os.copy_file_range", no_copy)
    src = tmp_path / "src"
    with CheckpointWriter(src) as w:
        w.add("raw.a", torch.randn(64, 33))
        w.add("raw.b", torch.arange(1000, dtype=torch.int64))
    reader = CheckpointReader(src)
    tensors = _tensors(1)
    order = [("raw.a", None), *[(n, t) for n, t in tensors.items()], ("raw.b", None)]
    entries = [(n, reader.info(n).dtype, reader.info(n).shape) if t is None else (n, tag_from_dtype(t.dtype),
                                                                                   tuple(t.shape)) for n, t in order]
    layout = ShardLayout(entries)
    f = ShardFile(tmp_path / "planned.safetensors", layout)

    def put(item: tuple[str, torch.Tensor | None]) -> None:
        name, t = item
        f.copy_raw(name, reader.info(name)) if t is None else f.write(name, t)

    with ThreadPoolExecutor(2) as ex:
        list(ex.map(put, reversed(order)))
    with pytest.raises(CheckpointError, match=r"planned.safetensors: tensor 'raw.b' is I32\[1000\], planned as I64"):
        f.write("raw.b", torch.zeros(1000, dtype=torch.int32))
    with pytest.raises(CheckpointError, match="'nope' is not in the planned layout"):
        f.write("nope", torch.zeros(1))
    assert torch.equal(f.read("raw.b"), reader.get("raw.b"))
    f.close()
    ref = tmp_path / "ref"
    with CheckpointWriter(ref) as w:
        for name, t in order:
            w.add(name, reader.get(name) if t is None else t)
    assert (tmp_path / "planned.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    got = st.load_file(tmp_path / "planned.safetensors")
    assert torch.equal(got["raw.a"], reader.get("raw.a")) and got["t0.bfloat16"].dtype == torch.bfloat16


def test_package_exports_resolve_lazily_to_their_modules() -> None:
    """``eagle3.checkpoint`` resolves its names on first use (so that ``eagle3 download`` never imports
    torch): its ``__all__`` and its name -> module map list the same names, and each resolves."""
    import eagle3.checkpoint as cp

    assert sorted(cp.__all__) == sorted(cp._MODULE_OF)
    for name in cp.__all__:
        assert getattr(cp, name) is getattr(importlib.import_module(f"eagle3.checkpoint.{cp._MODULE_OF[name]}"), name)
