"""``eagle3 quantize SRC OUT --recipe R --eval``: the output compared with its source (the two passes of
``serve --validate --reference``) before it is published: in the report, printed, covered by the
manifest, the very numbers ``serve --validate --reference SRC`` gives; misuse is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_run import run_cli as _run

EVAL = ["--eval-prompts", "2", "--eval-tokens", "6", "--eval-fewshot", "0"]  # 0-shot: short prompts


def test_eval_writes_the_comparison_with_the_source_before_publishing(tiny_dir: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    src, out = tiny_dir / "kimi-k2.5", tmp_path / "q"
    code, printed, err = _run(["quantize", str(src), str(out), "--recipe", "w4a8", "--eval", *EVAL], capsys)
    assert code == 0, err
    assert f"fidelity vs {src}" in printed and "KLD mean" in printed and "top-1 agreement" in printed
    f = json.loads((out / "quantization_report.json").read_text())["fidelity"]
    assert (f["prompts"], f["tokens"], f["fewshot"], f["logprobs"]) == (2, 6, 0, 20)
    assert f["divergence"]["sequences"] == 2 and 0 < f["kld"]["tokens"] <= 12
    assert f["kld"]["mean"] > 0 and f["kld"]["p99"] >= f["kld"]["median"] and 0 <= f["top1_agreement"] <= 1
    assert _run(["verify", str(out)], capsys)[0] == 0  # the report with the comparison is what the manifest hashed

    # The same comparison as serve --validate --reference SRC on the same prompts: the same numbers.
    report = tmp_path / "r.json"
    code, _, err = _run(["serve", str(out), "--validate", "gsm8k", "--limit", "2", "--num-fewshot", "0",
                         "--max-tokens", "6", "--reference", str(src), "--report", str(report)], capsys)
    assert code in (0, 1), err  # 1: a threshold of the tiny random model's comparison may fail
    ref = json.loads(report.read_text())["reference"]
    assert ref["kld"] == f["kld"] and ref["top1_agreement"] == f["top1_agreement"]
    assert ref["divergence"] == f["divergence"]


def test_eval_misuse_is_one_line_and_writes_nothing(tiny_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = str(tiny_dir / "kimi-k2.5"), str(tiny_dir / "kimi-k2.5-eagle3")
    cases = [
        ([draft, "--recipe", "int4-draft", "--eval"], "--eval: ", "is not a target"),
        ([draft, "--recipe", "int4-draft", "--eval", "--target", target], "give one", ""),
        ([target, "--recipe", "w4a8", "--eval", "--eval-k", "2"], "--eval-k goes with --target", ""),
        ([target, "--recipe", "w4a8", "--eval", "--eval-prompts", "0"], "--eval-prompts must be >= 1", ""),
        ([target, "--recipe", "w4a8", "--eval-tokens", "8"], "go with --target", "or --eval"),
    ]
    for args, a, b in cases:
        out = tmp_path / "o"
        code, _, err = _run(["quantize", args[0], str(out), *args[1:]], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and a in lines[0] and b in lines[0], (args, err)
        assert not out.exists() and not out.with_name("o.partial").exists()
