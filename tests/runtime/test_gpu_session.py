"""benchmarks/gpu_session.py on a CPU: the plan it prints, its one-line exit without a GPU, a stage
killed at its time box, and how it reads the stages' outputs back (junit XML or the verbose log, the
benchmark JSON, the validation report) into issue 39's targets. Nothing is timed here."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.bench_module import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gs():
    return load_benchmark("gpu_session")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_session.py"), *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_dry_run_prints_the_plan_under_eight_minutes() -> None:
    r = _run("--dry-run")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("gpu_session plan: 4 stages, 460 s of boxes")
    stages = [ln.split("]")[0].split("[")[1].split()[0] for ln in lines[1:]]
    assert stages == ["tests", "kernels", "e2e", "serve", "serve"]  # the tiny pair is made inside serve's box
    text = r.stdout
    assert "-m pytest -n 8" in text and "tests/runtime/test_device_placement.py" in text
    assert "--batches 1,16,64" in text and "--e2e-graphs on" in text and "'1,3,4 auto 2,5,16'" in text
    assert "--kernel-backend triton --validate gsm8k" in text and "--concurrency 1" in text
    r = _run("--dry-run", "--only", "serve", "--timeout", "serve=120")
    assert r.stdout.startswith("gpu_session plan: 1 stages, 120 s") and "[serve <= 120 s]" in r.stdout
    assert _run("--only", "bench").returncode == 2 and _run("--timeout", "serve=x").returncode == 2
    assert "Example: PYTHONPATH=$PWD python3 benchmarks/gpu_session.py" in _run("--help").stdout


def test_stage_arguments_parse(gs, tmp_path: Path) -> None:
    """The benchmark stages' arguments are ones kernels_gpu.py accepts."""
    bench = load_benchmark("kernels_gpu")
    for s in gs.stages(tmp_path)[1:3]:
        a = bench.parse_args(s.cmd[2:])
    assert a.skip_kernels and a.e2e_graphs == "on" and a.spec_shapes == [(1, 3, 4), "auto", (2, 5, 16)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_without_a_gpu_it_exits_2_in_one_line(gs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gs.main(["--results", str(tmp_path / "r"), "--work", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no CUDA / ROCm GPU" in err
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the scratch folder


def test_a_stage_past_its_box_is_killed(gs, tmp_path: Path) -> None:
    # the child starts a grandchild in the same group: both go at the deadline
    sleeper = [sys.executable, "-c", "import subprocess, sys, time; "
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('up', flush=True); "
               "time.sleep(60)"]
    stage = gs.Stage("kernels", sleeper, 3.0, [[sys.executable, "-c", "print('setup')"]])
    t0 = time.monotonic()
    res = gs.run_stage(stage, tmp_path / "k.log", {})
    assert time.monotonic() - t0 < 30
    assert res["status"] == "timeout" and res["rc"] is None and res["timeout_s"] == 3.0
    log = (tmp_path / "k.log").read_text()
    assert "setup" in log and "up" in log and "killed at its 3 s box" in log
    bad = gs.run_stage(gs.Stage("serve", [sys.executable, "-c", "raise SystemExit(3)"], 30, []), tmp_path / "s.log", {})
    assert bad["status"] == "failed" and bad["rc"] == 3


def test_outputs_read_back_into_the_targets(gs, tmp_path: Path) -> None:
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
                   '<testcase classname="tests.a" name="t1"/><testcase classname="tests.a" name="t2"><failure/></testcase>'
                   '<testcase classname="tests.b" name="t3"><skipped/></testcase><testcase classname="tests.b" name="t4"/>'
                   '</testsuite></testsuites>')
    t = gs.read_tests(xml)
    assert t["counts"] == {"tests": 4, "failures": 1, "errors": 0, "skipped": 1, "passed": 2}
    assert t["failed"] == ["tests.a::t2"]
    log = tmp_path / "tests.log"  # a run the box cut short: no XML, the verbose lines that finished
    log.write_text("[gw0] [ 10%] PASSED tests/runtime/x.py::test_a \n[gw1] [ 20%] FAILED tests/runtime/x.py::test_b \n"
                   "tests/runtime/y.py::test_c SKIPPED (no gpu)\n")
    t = gs.read_tests(tmp_path / "missing.xml", log)
    assert t["source"] == "log" and t["counts"]["passed"] == 1 and t["failed"] == ["tests/runtime/x.py::test_b"]
    (tmp_path / "v.json").write_text(json.dumps({
        "lossless": {"checked": True, "passed": True, "num_compared": 16, "num_mismatches": 0},
        "speedup": {"tpot": 1.7, "output_throughput": 1.6}, "speculative": {"acceptance_rate": 0.7},
        "latency": {"tpot_ms": {"mean": 2.0}}, "baseline": {"latency": {"tpot_ms": {"mean": 3.4}}}}))
    v = gs.read_validate(tmp_path / "v.json")
    assert v["lossless"] == "PASS" and v["tpot_speedup"] == 1.7 and v["baseline_tpot_ms"] == 3.4
    assert gs.read_validate(tmp_path / "none.json") == {"report": None}

    def row(kernel: str, batch: int, frac: float) -> dict:
        return {"kernel": kernel, "backend": "triton", "batch": batch, "status": "ok", "hbm_fraction": frac,
                "seconds": 1e-4, "floor_s": 1e-4 * frac, "x_floor": 1 / frac}

    report = {"card": "NVIDIA H200", "date": "2026-12-01", "stages": ["tests", "kernels", "e2e", "serve"],
              "tests": {"status": "ok", "seconds": 90, "timeout_s": 140, **gs.read_tests(xml)},
              "kernels": {"status": "ok", "seconds": 60, "timeout_s": 100,
                          "rows": [row("moe_w4a16", 16, 0.45), row("moe_w4a16", 64, 0.35), row("moe_w4a16", 1, 0.25),
                                   row("linear_bf16", 1, 0.6), row("linear_bf16", 16, 0.7)]},
              "e2e": {"status": "timeout", "seconds": 150, "timeout_s": 150, "floor_lines": ["floor e2e ..."],
                      "rows": [{"status": "ok", "graphs": True, "batch": 1, "spec": "plain", "tpot_ms": 1.5,
                                "x_floor": 1.9},
                               {"status": "ok", "graphs": True, "batch": 1, "spec": "1,3,4", "tpot_ms": 3.0}]},
              "serve": {"status": "ok", "seconds": 50, "timeout_s": 70, **v}}
    got = {t["target"]: t["met"] for t in gs.targets(report)}
    assert got["moe_w4a16 >= 40% of HBM at b = 16, 64"] is False  # b = 64 at 35 %
    assert got["moe_w4a16 >= 20% of HBM at b = 1"] is True
    assert got["mla_decode >= 40% of HBM at b = 16, 64"] is None  # not measured
    assert got["linear_bf16 >= 50% of HBM at b = 1, 16"] is True
    assert got["slice plain decode step with graphs within 2x its byte floor at b = 1"] is True
    assert got["slice chain k = 3 step <= 1.6x the plain step at b = 1"] is False  # 2.0x
    assert got["serve --validate gsm8k, trained tiny pair: lossless PASS"] is True
    assert got["serve --validate gsm8k: TPOT speedup >= 1.5x at concurrency 1"] is True
    assert got["GPU tests pass"] is False
    report["targets"] = gs.targets(report)
    lines = gs.summary_lines(report)
    assert lines[0].startswith("gpu_session on NVIDIA H200 (2026-12-01): tests ok 90/140 s, kernels ok 60/100 s")
    assert any("[MISSED] moe_w4a16 >= 40%" in ln for ln in lines) and any("[not measured]" in ln for ln in lines)
    assert gs.slug("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
