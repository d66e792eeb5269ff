"""``eagle3 serve TARGET --draft DRAFT --validate gsm8k`` end to end on the tiny Kimi models, for
the bf16 target and for its W4A8 quantization (made with ``eagle3 convert`` / ``eagle3 quantize``).

Prompts are lm-eval's gsm8k ones, 3-shot for bf16 (~920 tokens each with the tiny tokenizer): two of
them prefill at once through the per-sequence attention schedule (two already take the batched path
of several long sequences in one forward; each further one adds ~2 s of CPU to the speculative and
the baseline run alike). lm-eval's default 5 shots (~1,600 tokens each) cost twice the CPU (~10
against ~4.6 CPU-s for the bf16 run, measured side by side: a prompt's attention grows with its
square) for one more thing: the two prompts outgrew one step's token budget (2048), so the second
prefill was chunked. Chunked prefill's lossless greedy output is the engine's own tests'
(tests/runtime: test_llm_tiny, test_engine_toy, test_long_prompt); the default of 5 shots is
checked in ``serve --help``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.cli import app, main
from tests.validate import lmeval


def _cli(args: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        main(args)
    return int(e.value.code or 0)


def _has_command(name: str) -> bool:
    return any((c.name or c.callback.__name__) == name for c in app.registered_commands)


@pytest.fixture(scope="module")
def targets(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not _has_command("convert") or not _has_command("quantize"):
        pytest.skip("eagle3 convert / quantize are not available yet")
    root = tmp_path_factory.mktemp("serve-validate")
    bf16, w4a8 = root / "kimi-k2.5-bf16", root / "kimi-k2.5-w4a8"
    assert _cli(["convert", str(tiny_dir / "kimi-k2.5"), str(bf16), "--text-only", "--dequantize", "bf16",
                 "--quiet"]) == 0
    # rtn, unverified: the W4A8 layout serve loads (mse's is the same, tests/quantize/test_methods.py) for
    # about a third of the default quantize's CPU; both runs here serve this one target, so its
    # numbers need not be the best, and quantize's verification is tests/quantize's
    assert _cli(["quantize", str(bf16), str(w4a8), "--recipe", "w4a8", "--method", "rtn", "--no-verify",
                 "--quiet"]) == 0
    return {"bf16": bf16, "w4a8": w4a8}


@pytest.mark.parametrize("which", ["bf16", "w4a8"])
def test_serve_validate_gsm8k(which: str, targets: dict[str, Path], tiny_dir: Path, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "report.json"
    # bf16: 3-shot prompts (the long prefills, both in one step); W4A8's claim is its experts through
    # the same path, which 1-shot prompts (under half the tokens) make as well
    shots = ["--num-fewshot", "3" if which == "bf16" else "1"]
    code = _cli(["serve", str(targets[which]), "--draft", str(tiny_dir / "kimi-k2.5-eagle3"),
                 "--validate", "gsm8k", "--limit", "2", "--max-tokens", "16", *shots,
                 "--concurrency", "2", "--dataset", str(lmeval.gsm8k_dir()), "--report", str(report)])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    r = json.loads(report.read_text())
    assert r["passed"] and r["n_samples"] == 2 and r["num_fewshot"] == (3 if which == "bf16" else 1)
    assert r["lossless"]["passed"] and r["lossless"]["num_compared"] == 2
    assert r["server"]["engine"] == "eagle3" and r["server"]["num_speculative_tokens"] == 3
    spec = r["speculative"]
    assert spec["source"] == "eagle3" and spec["num_drafts"] > 0
    assert sum(spec["accepted_histogram"]) == spec["num_drafts"]
    assert r["throughput"]["failed"] == 0 and r["baseline"]["throughput"]["completed"] == 2
    assert r["speedup"]["tpot"] is not None
    assert Path(r["figure"]).read_bytes()[:4] == b"\x89PNG"
    assert "result: PASS" in out.out and "lossless" in out.out


def test_serve_validate_gsm8k_defaults_to_lm_evals_five_shots(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --num-fewshot, serve --validate gsm8k sends lm-eval's default 5-shot prompts."""
    assert _cli(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # (help lines wrap with the terminal's width)
    assert "--num-fewshot <int> --validate gsm8k: few-shot exemplars. [default: 5]" in text


@pytest.mark.slow
def test_serve_validate_mtbench_and_concurrency(tiny_dir: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A chat workload through the tiny target's own chat template, per category, and a second
    concurrency level, with the bundled runtime on both sides (speculative, then the target alone)."""
    report = tmp_path / "report.json"
    code = _cli(["serve", str(tiny_dir / "kimi-k2.5"), "--draft", str(tiny_dir / "kimi-k2.5-eagle3"),
                 "--validate", "mtbench", "--limit", "1", "--max-tokens", "3", "--concurrency", "1,4",
                 "--report", str(report)])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    r = json.loads(report.read_text())
    mt = r["workloads"]["mtbench"]
    assert r["passed"] and mt["lossless"]["num_compared"] == 16 and len(mt["categories"]) == 8
    assert all(c["speculative"]["num_drafts"] > 0 and c["lossless"]["passed"] for c in mt["categories"].values())
    assert [lv["concurrency"] for lv in r["concurrency"]] == [1, 4]
    assert all(lv["speedup"]["tpot"] is not None for lv in r["concurrency"])
    assert "mtbench / humanities" in out.err and "all workloads at concurrency 4" in out.err
