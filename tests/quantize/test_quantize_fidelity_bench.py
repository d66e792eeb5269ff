"""benchmarks/quantize_fidelity.py's own machinery: the commands it runs are the CLI a user types,
the numbers it reads from ``serve --validate --reference`` reports, its table, ``--dry-run``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_module import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():  # type: ignore[no-untyped-def]
    return load_benchmark("quantize_fidelity")


def test_commands_are_the_cli_a_user_types(bench, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ref, rep = tmp_path / "ref.gz", tmp_path / "r.json"
    assert bench.shown(bench.quantize_cmd(Path("src"), Path("q"), "w4a8", "mse")) == \
        "eagle3 quantize src q --recipe w4a8 --method mse --overwrite --quiet --json"
    assert bench.shown(bench.quantize_cmd(Path("src"), Path("q"), "mxfp4", "smooth+gptq", (4, 512))) == (
        "eagle3 quantize src q --recipe mxfp4 --method smooth+gptq --calibrate gsm8k --calibrate-samples 4 "
        "--calibrate-tokens 512 --overwrite --quiet --json")
    assert bench.plan(["w4a8", "mxfp4"], ["rtn", "w4a8:mse", "w4a8:gptq", "mxfp4:smooth+gptq"]) == [
        ("w4a8", "rtn"), ("mxfp4", "rtn"), ("w4a8", "mse"), ("w4a8", "gptq"), ("mxfp4", "smooth+gptq")]
    assert bench.shown(bench.serve_cmd(Path("q"), None, 24, 96, rep, ref, weight_only=True)) == (
        f"eagle3 serve q --activation-quant none --validate gsm8k --limit 24 --max-tokens 96 --report {rep} "
        f"--overwrite --reference {ref} --no-baseline")
    assert bench.shown(bench.record_cmd(Path("src"), Path("d"), ref, 24, 96)) == (
        f"eagle3 serve src --draft d --validate gsm8k --limit 24 --max-tokens 96 --record-reference {ref} --overwrite")


def test_table_from_reports(bench) -> None:  # type: ignore[no-untyped-def]
    report = {"reference": {"kld": {"mean": 0.002, "p99": 0.02}, "top1_agreement": 0.98,
                            "divergence": {"identical": 5, "sequences": 24, "mean_first_divergence": 20.5}},
              "workloads": {"gsm8k": {"speculative": {"mean_acceptance_length": 3.2}}}}
    c = bench.comparison(report)
    assert c == {"kld_mean": 0.002, "kld_p99": 0.02, "top1": 0.98, "identical": 5, "sequences": 24,
                 "mean_first_divergence": 20.5, "accept_length": 3.2}
    row = {"recipe": "w4a8", "method": "mse", "full": c, "weight_only": c, "accept_mla": 3.3,
           "quantize": {"wall_s": 4.0, "peak_rss_bytes": 300 * 2**20},
           "full_width": {"wall_s": 20.0, "peak_rss_bytes": 2**30}}
    lines = bench.table([row], {"accept_eagle3": 3.21, "accept_mla": 3.4})
    assert "| w4a8 | mse | 0.00200 | 0.0200 | 98.0 % | 5/24 | 20.5 | 0.00200 | 98.0 % | 3.20 | 3.30 | 4.0 | 300 | " \
           "20.0 | 1.00 |" in lines
    assert "3.21" in lines[0] and "3.40" in lines[0]


def test_dry_run_prints_every_command(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quantize_fidelity.py"), "--workdir", str(tmp_path),
                        "--recipes", "mxfp4", "--methods", "rtn", "--dry-run"],
                       capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    cmds = [line for line in r.stdout.splitlines() if line.startswith("$ eagle3 ")]
    assert len(cmds) == 6 and not list(tmp_path.iterdir())  # record, MLA on the source, quantize, 3 serves
