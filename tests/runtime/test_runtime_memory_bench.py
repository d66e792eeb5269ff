"""benchmarks/runtime_memory.py's own machinery: arguments, the ratio table and goals, the
process-tree peak-RSS sampler, the cold read and the chart. No model is loaded; no timing asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.bench_module import load_benchmark

GiB = 1 << 30


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("runtime_memory")


def test_arguments(bench, tmp_path):
    a = bench.parse_args(["--json", str(tmp_path / "r.json")])
    assert a.tp == [1, 2] and a.batches == [1, 16] and a.formats == ["int4", "w4a8", "mxfp4"]
    assert a.png == tmp_path / "r.png" and a.slice is None and a.drop_cache
    a = bench.parse_args(["--tp", "1", "--formats", "mxfp4,int4", "--slice", "/x", "--no-drop-cache"])
    assert a.tp == [1] and a.formats == ["mxfp4", "int4"] and a.slice == Path("/x") and not a.drop_cache
    for bad in (["--tp", "0"], ["--tp", "one"], ["--formats", "fp8"], ["--max-tokens", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def _row(**kw):
    row = {"format": "int4", "tp": 1, "ckpt_per_rank": 10 * GiB, "resident_weights_per_rank": int(10.5 * GiB),
           "peak_rss_per_rank": 12 * GiB, "peak_rss_tree": 12 * GiB, "kv_cache_bytes": GiB // 2,
           "load_s": 30.0, "read_s": 10.0,
           "decode": {"1": {"tokens_per_s": 0.5}, "16": {"tokens_per_s": 3.25}}}
    row.update(kw)
    return row


def test_goals_and_table(bench):
    ok = _row()
    g = bench.goals(ok)
    # 10.5 <= 11 (weights); 12 <= 11 + 0.5 + 1 (peak); 30 > 2 x 10 (load)
    assert g == {"resident": True, "peak_rss": True, "load": False}
    assert bench.goals(_row(resident_weights_per_rank=12 * GiB, peak_rss_per_rank=13 * GiB))["resident"] is False
    assert bench.goals(_row(peak_rss_per_rank=13 * GiB))["peak_rss"] is False
    na = {"format": "w4a8", "tp": 2, "ckpt_per_rank": 5 * GiB, "available": False,
          "why": "TypeError: unexpected keyword argument 'tensor_parallel_size'"}
    assert bench.goals(na) == {"resident": None, "peak_rss": None, "load": None}
    table = bench.ratio_table([ok, na]).splitlines()
    assert len(table) == 4 and all(line.count("|") == table[0].count("|") for line in table)
    cells = [c.strip() for c in table[2].split("|")[1:-1]]
    assert cells[:3] == ["int4", "1", "10.00"]
    assert "1.05x ok" in cells and "1.20x" in cells and "3.00x MISS" in cells
    assert cells[-2:] == ["0.50", "3.25"]
    assert "not available: TypeError" in table[3]


def test_tree_sampler_sees_children(bench):
    # the parent spawns a child that holds ~64 MB for a moment: the tree's peak must include it
    child = "import time; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.0)"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    rc, peak, _ = bench.run_sampled([sys.executable, "-c", code], interval=0.05)
    assert rc == 0 and peak.samples > 0
    assert len(peak.per_process) >= 2
    assert peak.max_process >= 60 << 20
    assert peak.tree >= peak.max_process


def test_read_and_drop_cache(bench, tmp_path):
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    files[0].write_bytes(b"\1" * (3 << 20))
    files[1].write_bytes(b"\2" * 1000)
    assert bench.shard_files(tmp_path) == files
    bench.drop_cache(files)
    seconds, n = bench.read_seconds(files, block=1 << 20)
    assert n == (3 << 20) + 1000 and seconds >= 0


def test_chart(bench, tmp_path):
    out = tmp_path / "c.png"
    bench.plot([_row(), _row(format="mxfp4"), {"format": "w4a8", "tp": 2, "available": False}], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
