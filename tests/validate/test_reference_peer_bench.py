"""benchmarks/reference_peer.py's own machinery: the commands of both passes, vLLM's start-failure
reason, the comparison of two engines' references, the table and figure from reports, --help and
--dry-run. vLLM is never imported or started (the benchmark drives it in its own environment)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.validate import reference as refmod
from tests.bench_module import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("reference_peer")


def test_commands_are_the_cli_a_user_types(bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref, rep = tmp_path / "ref.jsonl.gz", tmp_path / "r.json"
    p1 = bench.pass1_external("http://127.0.0.1:9", "gsm8k", 8, 64, ref)
    assert bench.shown(p1) == (f"eagle3 validate --base-url http://127.0.0.1:9 --task gsm8k --limit 8 --max-tokens 64 "
                               f"--record-reference {ref}")
    p2 = bench.pass2_eagle3(Path("w4a8"), Path("d"), "gsm8k", 8, 64, ref, rep)
    assert bench.shown(p2) == (f"eagle3 serve w4a8 --draft d --validate gsm8k --limit 8 --max-tokens 64 --reference {ref} "
                               f"--no-baseline --report {rep} --overwrite")
    assert "--draft" not in bench.pass1_eagle3(Path("src"), None, "gsm8k", 8, 64, ref)
    v = bench.vllm_server_argv("/venv/bin/python", Path("/m"), "src", 1234, 4096)
    assert v[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert v[v.index("--port") + 1] == "1234" and "--enforce-eager" in v
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    env = bench.vllm_env(2)
    assert env["PYTHONPATH"] == "" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_failure_reason_is_the_root_error(bench) -> None:
    log = "\n".join([
        "(APIServer pid=1) WARNING Found ulimit of 20000 and failed to automatically increase with error current",
        "(Worker pid=2) ERROR [multiproc_executor.py:953]     return QuarkW4A8Fp8MoEMethod(module.moe_config)",
        "(Worker pid=2) ERROR [multiproc_executor.py:953] AssertionError: W4A8 FP8 MoE requires ROCm AITER fused MoE support.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"])
    assert bench.failure_reason(log) == "AssertionError: W4A8 FP8 MoE requires ROCm AITER fused MoE support."
    assert bench.failure_reason("all good\n") is None


def _item(i: int, tokens: list[int], top: list[dict], prompt: list[int] | None = None) -> refmod.RefItem:
    return refmod.RefItem("gsm8k", f"gsm8k/{i}", 0, None, "x", prompt or [1, 2], tokens, top, "")


def test_compare_recordings(bench) -> None:
    lp = -0.1
    a = refmod.Reference({}, [_item(0, [5, 6], [{5: lp}, {6: lp}]), _item(1, [7, 8], [{7: lp}, {8: lp}])])
    b = refmod.Reference({}, [_item(0, [5, 6], [{5: lp}, {6: lp}]), _item(1, [7, 9], [{7: -0.2}, {9: lp}], [1, 3])])
    c = bench.compare_recordings(a, b)
    assert c["identical_prompt_ids"] == 1 and c["identical_continuations"] == 1
    assert c["common_prefix_tokens"] == [2, 1]
    k = c["kld_on_common_prefix"]
    assert k["tokens"] == 3 and k["max"] > 0 and k["median"] == 0.0


def _report(kld: float, top1: float, identical: int, first: float | None, passed: bool = True) -> dict:
    return {"reference": {"kld": {"tokens": 64, "mean": kld, "p99": 2 * kld, "max": 3 * kld}, "top1_agreement": top1,
                          "divergence": {"sequences": 2, "identical": identical, "mean_first_divergence": first},
                          "flips": {"flips": 0}, "passed": passed, "failures": [] if passed else ["mean KLD"]},
            "workloads": {"gsm8k": {"speculative": {"mean_acceptance_length": 3.1}}}}


def test_rows_table_and_figure(bench, tmp_path: Path) -> None:
    rows = [bench.row("vllm (source)", "eagle3", "bf16", _report(1e-4, 0.996, 1, 23.0)),
            bench.row("eagle3 (source)", "eagle3", "bf16", _report(0.0, 1.0, 2, None)),
            bench.row("eagle3 (source)", "eagle3", "mxfp4", _report(0.05, 0.85, 0, 7.5, passed=False))]
    assert rows[0]["served_accept_length"] == 3.1 and rows[2]["failures"] == ["mean KLD"]
    lines = bench.table_lines(rows)
    assert "mean KLD" in lines[0] and len(lines) == 5
    assert "0.0001" in lines[2] and "1/2" in lines[2] and "23.0" in lines[2]
    assert lines[3].split()[-1] == "PASS" and lines[4].split()[-1] == "FAIL" and " - " in lines[3]
    pytest.importorskip("matplotlib")
    assert bench.figure(tmp_path / "f.png", rows, "x")
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_help_and_dry_run(tmp_path: Path) -> None:
    script = str(ROOT / "benchmarks" / "reference_peer.py")
    p = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--vllm-python" in p.stdout and "reference_peer.py ./tiny/kimi-k2.5-trained" in p.stdout
    p = subprocess.run([sys.executable, script, "src", "--vllm-python", "/nowhere/python", "--dry-run", "--work",
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    cmds = p.stdout.splitlines()
    assert len(cmds) == 11 and cmds[0].startswith("eagle3 serve src --validate gsm8k")
    assert sum("--reference" in c and c.startswith("eagle3 serve") for c in cmds) == 6
    scratch = tmp_path / "tmp"  # its temporary directory: a refused run leaves no work directory there
    scratch.mkdir()
    p = subprocess.run([sys.executable, script, "src", "--vllm-python", str(tmp_path / "none")], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, TMPDIR=str(scratch)))
    assert p.returncode != 0 and "--vllm-python" in p.stderr and "no such file" in p.stderr
    assert list(scratch.iterdir()) == []
