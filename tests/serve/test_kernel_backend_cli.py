"""``--kernel-backend`` and ``--enforce-eager`` at the user's interface: the default ``auto`` (torch
on the CPU), what the engine runs recorded in /v1/models, the validation report's server section and
the bench report, and bad values refused in one line with exit code 2 before anything loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from eagle3.cli import main
from eagle3.runtime.engine.llm import LLM
from eagle3.serve import launcher

REPO = Path(__file__).resolve().parents[2]


def _cli(args: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        main(args)
    return int(e.value.code or 0)


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "EAGLE3_KERNEL_BACKEND")}
    e.update(PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-m", "eagle3.cli", *args], capture_output=True, text=True, env=e,
                          timeout=300)


BAD = "--kernel-backend 'cudnn': expected one of auto, torch, triton, aiter"


def test_a_bad_kernel_backend_is_one_line_and_exit_2(tiny_dir: Path) -> None:
    r = _run(["serve", str(tiny_dir / "kimi-k2.5"), "--kernel-backend", "cudnn"])
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and BAD in lines[0]


@pytest.mark.parametrize("cmd", [["serve", "--validate", "gsm8k"], ["bench"]])
def test_a_bad_kernel_backend_is_refused_everywhere(cmd: list[str], tiny_dir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli([*cmd[:1], str(tiny_dir / "kimi-k2.5"), *cmd[1:], "--kernel-backend", "cudnn"]) == 2
    assert BAD in capsys.readouterr().err


def test_triton_on_a_cpu_without_the_interpreter_is_one_line(tiny_dir: Path) -> None:
    pytest.importorskip("triton")
    # (serve, not bench: the engine refuses it as it loads the target, the same launcher.build_llm
    # for both; bench loads its prompts' tokenizer first, transformers' import and all, ~2 CPU-s more)
    r = _run(["serve", str(tiny_dir / "kimi-k2.5"), "--port", "0", "--kernel-backend", "triton"])
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "TRITON_INTERPRET=1" in lines[0] and "Traceback" not in r.stderr


def test_aiter_without_rocm_is_one_line(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "aiter", None)  # as without ROCm: import aiter fails
    assert _cli(["bench", str(tiny_dir / "kimi-k2.5"), "--kernel-backend", "aiter", "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kernel backend 'aiter' needs ROCm's aiter package" in err[0]


def test_models_endpoint_records_backend_and_graphs(tiny_dir: Path) -> None:
    llm = LLM(tiny_dir / "kimi-k2.5", None, tokenizer=None, dtype="float32", num_blocks=16)
    assert llm.kernel_backend == "torch" and not llm.cuda_graphs  # auto on the CPU
    app = launcher.build_app(llm, "tiny")
    with launcher.ServerThread(app) as url:
        m = httpx.get(url + "/v1/models").json()["data"][0]
    assert m["kernel_backend"] == "torch" and m["cuda_graphs"] is False and m["tensor_parallel_size"] == 1


def test_serve_validate_and_bench_record_the_backend(tiny_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "gsm8k"  # two GSM8K-shaped questions are enough here
    data.mkdir()
    rows = [{"question": f"What is {a} plus {a}?", "answer": f"{a} + {a} = {2 * a}\n#### {2 * a}"} for a in (2, 3)]
    for name in ("train.jsonl", "test.jsonl"):
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = tmp_path / "report.json"
    code = _cli(["serve", str(tiny_dir / "kimi-k2.5"), "--kernel-backend", "torch", "--enforce-eager",
                 "--dtype", "float32", "--validate", "gsm8k", "--limit", "2", "--num-fewshot", "0",
                 "--max-tokens", "4", "--dataset", str(data), "--report", str(report)])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    server = json.loads(report.read_text())["server"]
    assert server["kernel_backend"] == "torch" and server["enforce_eager"] is True
    assert server["cuda_graphs"] is False

    bench = tmp_path / "bench.json"
    code = _cli(["bench", str(tiny_dir / "kimi-k2.5"), "--dtype", "float32", "--input-len", "8", "--output-len", "2",
                 "--num-prompts", "1", "--report", str(bench)])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    rep = json.loads(bench.read_text())
    assert rep["kernel_backend"] == "torch" and rep["cuda_graphs"] is False  # the default: auto -> torch here


def test_help_names_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("serve", "bench"):
        assert _cli([cmd, "--help"]) == 0
        out = capsys.readouterr().out
        assert "--kernel-backend" in out and "--enforce-eager" in out
