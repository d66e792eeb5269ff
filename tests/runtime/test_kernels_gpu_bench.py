"""benchmarks/kernels_gpu.py's own machinery on a CPU: arguments and --help, the HBM peak table, the
"not built" lookup of the Triton kernels, the byte counts, the goal lines, the chart, and the clear
exit without a GPU. Nothing is timed here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.bench_module import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("kernels_gpu")


def test_help_has_an_example() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels_gpu.py"), "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "Example: python benchmarks/kernels_gpu.py" in r.stdout


def test_arguments(bench, tmp_path: Path) -> None:
    a = bench.parse_args(["--out", str(tmp_path / "k.json")])
    assert a.batches == [1, 4, 16, 64] and a.backends == ["torch", "triton"] and a.png == tmp_path / "k.png"
    a = bench.parse_args(["--kernels", "moe_w4a16,mla_decode", "--batches", "1,16", "--backends", "triton"])
    assert a.kernels == ["moe_w4a16", "mla_decode"] and a.batches == [1, 16] and a.backends == ["triton"]
    for bad in (["--kernels", "gemm"], ["--batches", "0"], ["--backends", "aiter"], ["--experts", "4"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_hbm_peaks(bench) -> None:
    names = {"NVIDIA H100 80GB HBM3": 3.35, "NVIDIA H100 PCIe": 2.0, "NVIDIA H100 NVL": 3.9,
             "NVIDIA H200": 4.8, "AMD Instinct MI300X": 5.3, "AMD Instinct MI325X": 6.0,
             "AMD Instinct MI355X": 8.0, "Tesla T4": None}
    assert {n: bench.hbm_peak_tbps(n) for n in names} == names
    # one table: the memory plan's cards, each found by its own name at its own peak
    from eagle3.plan import GPUS

    assert all(bench.hbm_peak_tbps(g.name) == g.hbm_tbps for g in GPUS.values())
    assert not hasattr(bench, "HBM_PEAK_TBPS")


def test_triton_kernels_are_looked_up_by_name(bench) -> None:
    pytest.importorskip("triton")
    for kernel, (module, attr) in bench.TRITON_KERNEL.items():
        present = importlib.util.find_spec(module) is not None
        status = bench.triton_kernel_status(kernel)
        if not present:
            assert status.startswith("not built (triton/") and status.endswith(".py missing)")
        elif attr:
            assert (status is None) == hasattr(importlib.import_module(module), attr)
    assert bench.triton_kernel_status("mla_decode") is None and bench.triton_kernel_status("rmsnorm") is None
    # every row has its kernel in this tree (the fused MoE and the GEMM included)
    assert [k for k in bench.TRITON_KERNEL if bench.triton_kernel_status(k) is not None] == []


def test_bytes_and_goals(bench) -> None:
    # one sequence of 4096 keys: the latent rows (576 bf16 each) dominate
    assert bench.mla_bytes(1, 1, 4096) == 4096 * 576 * 2 + 64 * (576 + 512) * 2
    per_expert = (4096 * 7168 // 2 + 4096 * 224 * 2) + (7168 * 2048 // 2 + 7168 * 64 * 2)
    assert bench.moe_bytes(8, 1) == 8 * per_expert + 7168 * 4
    bw, frac = bench.fraction(3_350_000_000, 0.002, 3.35)
    assert bw == pytest.approx(1.675e12) and frac == pytest.approx(0.5)
    rows = [{"kernel": "mla_decode", "backend": "triton", "batch": 1, "hbm_fraction": 0.7},
            {"kernel": "mla_decode", "backend": "triton", "batch": 16, "hbm_fraction": 0.5},
            {"kernel": "mla_decode", "backend": "triton", "batch": 64, "hbm_fraction": 0.1}]
    lines = bench.goal_lines(rows, "H100")
    assert "mla_decode" in lines[1] and "worst 50%" in lines[1] and "missed" in lines[1]
    assert "moe_w4a16" in lines[0] and "not measured" in lines[0]


def test_chart(bench, tmp_path: Path) -> None:
    report = {"device": "fake", "hbm_peak_tbps": 3.35,
              "kernels": [{"kernel": "mla_decode", "backend": b, "batch": n, "status": "ok", "bytes_per_s": 1e12,
                           "hbm_fraction": 0.3} for b in ("torch", "triton") for n in (1, 16)]
              + [{"kernel": "moe_w4a16", "backend": "triton", "batch": 1, "status": "not built"}],
              "e2e": [{"backend": "triton", "graphs": True, "batch": 1, "status": "ok", "decode_tokens_per_s": 12.0}]}
    bench.plot(report, tmp_path / "k.png")
    assert (tmp_path / "k.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_without_a_gpu_it_says_so(bench, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--out", str(tmp_path / "k.json")]) == 2
    assert "no CUDA / ROCm GPU on this machine" in capsys.readouterr().err
    assert not (tmp_path / "k.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_a_small_run_on_the_gpu(bench, tmp_path: Path) -> None:
    import json

    out = tmp_path / "k.json"
    assert bench.main(["--out", str(out), "--kernels", "rmsnorm,act_quant_int8,mla_decode", "--batches", "1,4",
                       "--context", "256", "--iters", "2", "--skip-e2e"]) == 0
    rep = json.loads(out.read_text())
    assert rep["device"] and len(rep["kernels"]) == 3 * 2 * 2
    assert all(r["status"] == "ok" for r in rep["kernels"]), rep["kernels"]
    assert (tmp_path / "k.png").is_file()


def test_speculative_arguments_and_lines(bench) -> None:
    a = bench.parse_args(["--spec-shapes", "1,3,4 2,5,16 auto", "--make-draft", "eagle3.1-mla"])
    assert a.spec_shapes == [(1, 3, 4), (2, 5, 16), "auto"] and a.spec_backends == ["triton"] and a.draft is None
    for bad in (["--spec-shapes", "1,3,5"], ["--spec-shapes", "2,5"], ["--make-draft", "medusa"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    # 31 decode steps each; the chain drafted in 30 of them, the tree in 26 (none in its last S = 5)
    spec = {"plain": (31 * 5.0, 0), "1,3,4": (30 * 8.0 + 5.0, 30), "2,5,16": (26 * 10.0 + 5 * 5.0, 26),
            "auto": (31 * 5.0, 1)}
    rows = [{"backend": "triton", "graphs": g, "batch": 1, "status": "ok", "spec": name, "tpot_ms": ms / 31,
             "seconds": ms / 1000, "decode_steps": 31, "drafting_steps": n}
            for g in (False, True) for name, (ms, n) in spec.items()]
    lines = bench.spec_lines(rows)  # per drafting step: 10 ms against 8 ms, not the TPOTs' 9.2 / 7.9
    assert len(lines) == 2 and "tree 2,5,16 vs chain 1,3,4" in lines[0] and "= 1.25x" in lines[0], lines
    assert bench.drafting_step_ms(rows[2], rows[0]) == pytest.approx(10.0)


def test_speculative_rows_run_on_the_cpu(bench, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The end-to-end rows' code path with the tiny pair on the CPU (a dry run: nothing is timed
    against anything): plain, a chain, a tree and auto, each row with its TPOT and tokens per forward."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    a = bench.parse_args(["--backends", "torch", "--spec-backends", "torch", "--e2e-batches", "1,2",
                          "--e2e-tokens", "4", "--spec-shapes", "1,2,3 2,2,4 auto", "--e2e-kv-gib", "0.01",
                          "--e2e-kv-dtypes", "auto"])
    rows = bench.e2e_rows(a, tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.5-eagle3")
    assert [(r["spec"], r["graphs"], r["batch"]) for r in rows] == [
        (spec, g, b) for spec in ("plain", "1,2,3", "2,2,4", "auto") for g in (False, True) for b in (1, 2)]
    assert all(r["status"] == "ok" and r["tpot_ms"] > 0 for r in rows), rows
    spec = [r for r in rows if r["spec"] in ("1,2,3", "2,2,4")]
    assert all(r["tokens_per_forward"] >= 1 and 0 < r["drafting_steps"] <= r["decode_steps"] == 3 for r in spec), spec
    assert not any(r["graphs_captured"] for r in rows)  # no graphs on the CPU
    assert bench.spec_lines(rows)  # the tree against the chain, per drafting step


def test_fp8_kv_rows_dry_run_on_the_cpu(bench, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp8 KV rows beside bf16 without a GPU: the MLA case over an fp8 latent (1 byte per cached
    value, the kernel's output that of the dequantized cache), the side-by-side lines, and plain
    end-to-end rows per --e2e-kv-dtypes on the tiny target. Nothing is timed against anything."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    a = bench.parse_args(["--context", "64", "--backends", "torch", "--e2e-batches", "1", "--e2e-tokens", "3",
                          "--e2e-kv-dtypes", "auto,fp8", "--e2e-kv-gib", "0.01"])
    assert a.e2e_kv_dtypes == ["auto", "fp8"] and "mla_decode_fp8" in a.kernels
    with pytest.raises(SystemExit):
        bench.parse_args(["--e2e-kv-dtypes", "fp4"])
    k = bench.Kernels(a, None)
    fn, nbytes, extra = k.case("mla_decode_fp8", "torch", 2)
    assert extra["kv_cache"] == "float8_e4m3fn" and nbytes == bench.mla_bytes(2, 1, 64, kv_elem=1)
    assert bench.mla_bytes(2, 1, 64) - nbytes == 2 * 64 * 576  # the latent rows at one byte instead of two
    assert fn().shape == (2, 1, 64, 512)
    rows = [{"kernel": kern, "backend": "triton", "batch": 1, "status": "ok", "seconds": s, "bytes_per_s": bw}
            for kern, s, bw in (("mla_decode", 2e-4, 1.2e12), ("mla_decode_fp8", 1.25e-4, 1.0e12))]
    assert bench.kv_lines(rows) == ["mla_decode_fp8 vs bf16 (triton, b=1): 125.0 / 200.0 us = 1.60x faster; "
                                    "1000 / 1200 GB/s"]
    e2e = bench.e2e_rows(a, tiny_dir / "kimi-k2.5")
    assert [(r["kv_cache_dtype"], r["graphs"]) for r in e2e] == [("auto", False), ("auto", True), ("fp8", False),
                                                                  ("fp8", True)]
    assert all(r["status"] == "ok" for r in e2e), e2e
    auto, fp8 = e2e[0]["kv_tokens_total"], e2e[2]["kv_tokens_total"]
    assert fp8 > auto  # the same memory holds more fp8 tokens (CPU: 4x, its bf16 cache is kept in fp32)


def test_a_row_whose_requests_failed_is_an_error(bench, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that fails inside the engine ends early: the row says so instead of timing less work
    (on a first GPU run, tree rows whose every request failed printed a 0.77 ms TPOT)."""
    from eagle3.runtime.engine.llm import LLM

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    real = LLM.generate

    def failing(self, prompts, sp=None):  # noqa: ANN001, ANN202
        outs = real(self, prompts, sp)
        outs[-1].token_ids, outs[-1].finish_reason, outs[-1].error = outs[-1].token_ids[:1], "error", "boom"
        return outs

    monkeypatch.setattr(LLM, "generate", failing)
    a = bench.parse_args(["--backends", "torch", "--e2e-batches", "2", "--e2e-tokens", "3",
                          "--e2e-kv-gib", "0.01", "--e2e-kv-dtypes", "auto"])
    rows = bench.e2e_rows(a, tiny_dir / "kimi-k2.5")
    # the graphs-off row fails in its warm-up (3 tokens); the graphs-on row shares that engine on a CPU
    # and skips the warm-up, so it fails in its first timed generation, the prefill's one token
    assert [r["status"] for r in rows] == [f"error: RuntimeError: 1 of 2 requests did not generate {n} tokens "
                                           "(error: boom)" for n in (3, 1)]


def test_byte_floors_beside_the_times(bench, tmp_path: Path) -> None:
    """Each kernel row's floor is its bytes at the HBM peak; each plain end-to-end row gets the slice's
    decode-step floor from the memory plan (``eagle3.plan.decode_floor``) and its TPOT over it."""
    import json

    from eagle3 import plan
    from eagle3.testing import slice as slice_mod

    assert bench.floor_fields(4.8e9, 2e-3, 4.8) == {"floor_s": pytest.approx(1e-3), "x_floor": pytest.approx(2.0)}
    assert bench.floor_fields(1, 1.0, None) == {"floor_s": None, "x_floor": None}
    row = {"kernel": "moe_w4a16", "backend": "triton", "batch": 16, "status": "ok", "seconds": 2e-3,
           "bytes_per_s": 2.4e12, "hbm_fraction": 0.5, **bench.floor_fields(4.8e9, 2e-3, 4.8)}
    assert bench.kernel_line(row).endswith("50.0% of HBM  floor  1000.0 us (2.0x)")
    (tmp_path / "config.json").write_text(json.dumps(slice_mod.slice_config(2, 8)))
    rows = [{"backend": "triton", "graphs": True, "kv_cache_dtype": kv, "spec": spec, "batch": 1, "status": "ok",
             "tpot_ms": 5.8} for kv, spec in (("auto", "plain"), ("fp8", "plain"), ("auto", "1,3,4"))]
    lines = bench.e2e_floors(rows, tmp_path, 4.8, tokens=32)
    want = plan.decode_floor(plan.load_model(tmp_path), gpus=1, batch=1, context=48, hbm_tbps=4.8)
    assert len(lines) == 2 and rows[0]["floor_ms"] == pytest.approx(1e3 * want.floor_seconds)
    assert rows[0]["x_floor"] == pytest.approx(5.8 / rows[0]["floor_ms"]) and "x_floor" not in rows[2]
    assert rows[1]["floor_bytes"] < rows[0]["floor_bytes"]  # the fp8 cache reads half the KV bytes
    assert "TPOT 5.80 ms = 7.3x floor" in lines[0], lines
