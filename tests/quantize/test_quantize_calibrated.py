"""``eagle3 quantize SRC OUT --recipe R --calibrate gsm8k|FILE.jsonl --method gptq|gptaq|smooth...``:
the streaming calibration pass inside a quantize run, on the trained tiny target (few short prompts).

Checked at the CLI: the output has the tensors (names, dtypes, shapes) and ``quantization_config`` of
the data-free methods; the calibrated MLPs' numbers are the calibration pass's (the Python API run
separately), the MLPs it kept data-free are byte for byte ``--method mse``'s, and the calibrated ones
lower the output error the pass reports; the report's calibration section adds up; ``--eval`` and
``eagle3 verify`` work on it, and ``--eval``'s numbers are ``serve --validate --reference SRC``'s
(the ``--eval`` run of test_quantize_eval.py's docstring); misuse is one line, exit 2, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.cli_run import run_cli as _run

CALIB = ["--calibrate", "gsm8k", "--calibrate-samples", "2", "--calibrate-tokens", "300"]
EVAL = ["--eval-prompts", "2", "--eval-tokens", "6", "--eval-fewshot", "0"]


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open has no iteration
                out[k] = h.get_tensor(k)
    return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def target(trained_pair: Path) -> Path:
    return trained_pair / "kimi-k2.5-trained"


def test_calibrated_w4a8_has_rtn_layout_and_the_pass_numbers(target: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from eagle3.quantize.calibrate import CalibConfig, Calibrator, TensorStore, load_calibration
    from eagle3.quantize.recipes import load_recipe
    from eagle3.runtime.tokenizer import load_tokenizer

    out, mse = tmp_path / "gptq", tmp_path / "mse"
    code, printed, err = _run(["quantize", str(target), str(out), "--recipe", "w4a8", "--method", "gptq", *CALIB,
                               "--eval", *EVAL], capsys)
    assert code == 0, err
    assert "layer 1/4:" in err and "layer 4/4:" in err and " s (attention " in err  # progress + time per layer
    flat = " ".join(printed.split())  # (the console wraps a line at its width: the path may start a new one)
    assert "calibration: gptq on " in flat and f"fidelity vs {target} " in flat
    assert "KLD mean" in flat and "top-1 agreement" in flat
    assert _run(["quantize", str(target), str(mse), "--recipe", "w4a8", "--method", "mse", "--quiet"], capsys)[0] == 0

    rep = json.loads((out / "quantization_report.json").read_text())
    cal = rep["calibration"]
    _check_fidelity(rep["fidelity"], out, target, tmp_path, capsys)
    assert cal["method"] == "gptq" and cal["sequences"] == 2 and cal["tokens"] == 600
    assert len(cal["layers"]) == 4 and cal["peak_rss_mb"] > 0 and cal["seconds"] > 0
    assert cal["calibrated"] + cal["kept_data_free"] == 24  # 3 MoE layers x 8 routed experts (w4a8's scope)
    assert cal["calibrated"] == sum(x["calibrated"] for x in cal["layers"]) > 0
    assert cal["kept_data_free"] == sum(x["kept_data_free"] for x in cal["layers"]) > 0  # few tokens: some are
    for x in cal["layers"]:
        if x["calibrated"]:
            assert x["rel_output_error"] < x["rel_output_error_data_free"]
    assert rep["method"] == "gptq"

    # The data-free methods' layout (rtn's and mse's are one: tests/quantize/test_methods.py).
    got, want_mse = _tensors(out), _tensors(mse)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in got.items()} == {
        k: (v.dtype, tuple(v.shape)) for k, v in want_mse.items()}
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg == json.loads((mse / "config.json").read_text())["quantization_config"]

    # The pass run on its own through the Python API: the output holds its tensors for the MLPs it
    # calibrated, and --method mse's bytes for every other quantized weight.
    rec = load_recipe("w4a8")
    calib = load_calibration("gsm8k", load_tokenizer(target), samples=2, max_tokens=300)
    store = TensorStore(tmp_path / "store")
    Calibrator(target, rec, rec.scope(None), CalibConfig("gptq"), calib, store, echo=lambda s: None).run()
    solved = set(store.modules())
    assert solved and all(".mlp.experts." in m for m in solved)
    for k, v in got.items():
        module = k.rsplit(".", 1)[0]
        want = store.get(module)[k.rsplit(".", 1)[1]] if module in solved else want_mse[k]
        assert _same_bytes(v, want), k
    assert not all(_same_bytes(got[k], want_mse[k]) for k in got if k.rsplit(".", 1)[0] in solved)
    assert _run(["verify", str(out)], capsys)[0] == 0


def _check_fidelity(f: dict, out: Path, src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--eval``'s comparison with the source (``fidelity``), written before publishing: its fields,
    and the very numbers ``serve OUT --validate --reference SRC`` gives on the same prompts. (The
    comparison runs after the quantization whatever the method, so this run of the calibrated
    pipeline is also ``--eval``'s test: a second quantize --eval of its own paid two model loads,
    a recording and a teacher-forced pass more.)"""
    assert (f["prompts"], f["tokens"], f["fewshot"], f["logprobs"]) == (2, 6, 0, 20)
    assert f["divergence"]["sequences"] == 2 and 0 < f["kld"]["tokens"] <= 12
    assert f["kld"]["mean"] > 0 and f["kld"]["p99"] >= f["kld"]["median"] and 0 <= f["top1_agreement"] <= 1
    report = tmp_path / "r.json"
    code, _, err = _run(["serve", str(out), "--validate", "gsm8k", "--limit", "2", "--num-fewshot", "0",
                         "--max-tokens", "6", "--reference", str(src), "--report", str(report)], capsys)
    assert code in (0, 1), err  # 1: a threshold of the tiny model's comparison may fail
    ref = json.loads(report.read_text())["reference"]
    assert ref["kld"] == f["kld"] and ref["top1_agreement"] == f["top1_agreement"]
    assert ref["divergence"] == f["divergence"]


def test_calibrated_mxfp4_smoothing_from_a_jsonl_file(target: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "calib.jsonl"
    f.write_text("".join(json.dumps({"text": f"Question {i}: what is {i} + {i}? Answer: {2 * i}. " * 6}) + "\n"
                         for i in range(3)))
    out = tmp_path / "q"
    code, _, err = _run(["quantize", str(target), str(out), "--recipe", "mxfp4", "--method", "smooth+gptaq",
                         "--calibrate", str(f), "--json"], capsys)
    assert code == 0, err
    cal = json.loads((out / "quantization_report.json").read_text())["calibration"]
    assert cal["method"] == "smooth+gptaq" and cal["sequences"] == 3 and cal["source"] == str(f)
    assert cal["calibrated"] + cal["kept_data_free"] == sum(x["mlps"] for x in cal["layers"]) > 24  # + dense, shared
    assert _run(["verify", str(out)], capsys)[0] == 0


def test_calibration_misuse_is_one_line_and_writes_nothing(target: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no text"}\n')
    notjson = tmp_path / "broken.jsonl"
    notjson.write_text('{"text": "fine"}\n\n{"text": \n')
    cases = [
        (["--recipe", "w4a8", "--method", "gptq"], "--method gptq is calibrated: give --calibrate"),
        (["--recipe", "w4a8", "--method", "rtn", "--calibrate", "gsm8k"], "--calibrate goes with a calibrated"),
        (["--recipe", "w4a8", "--calibrate", "gsm8k"], "--method mse is data-free"),
        (["--recipe", "w4a8", "--method", "gptq", "--calibrate", str(bad)], "bad.jsonl:2: expected a JSON object"),
        (["--recipe", "w4a8", "--method", "gptq", "--calibrate", str(notjson)], "broken.jsonl:3: not JSON"),
        (["--recipe", "w4a8", "--method", "gptq", "--calibrate", str(tmp_path / "none.jsonl")], "no such file"),
        (["--recipe", "w4a8", "--method", "gptq", "--calibrate", "wiki"], "--calibrate wiki: give gsm8k or"),
        (["--recipe", "w4a8", "--calibrate-samples", "4"], "--calibrate-samples go with --calibrate"),
        (["--recipe", "w4a8", "--method", "gptq", "--calibrate", "gsm8k", "--calibrate-tokens", "1"], "must be >= 2"),
        (["--recipe", "w4a8", "--method", "gptq", "--calibrate", "gsm8k", "--calibrate-min-tokens", "-1"],
         "--calibrate-min-tokens -1.0: must be >= 0"),
        (["--recipe", "w4a8", "--method", "gptq", "--calibrate", "gsm8k", "--engine", "quark"], "--engine quark"),
        (["--recipe", "fp8-draft", "--method", "gptq", "--calibrate", "gsm8k"], "--method gptq: recipe"),
    ]
    for args, want in cases:
        out = tmp_path / "o"
        code, _, err = _run(["quantize", str(target), str(out), *args], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and want in lines[0], (args, err)
        assert not out.exists() and not out.with_name("o.partial").exists()


def test_a_pass_that_calibrates_few_mlps_says_so() -> None:
    """At Kimi-K2.5's width the default calibration tokens reach no routed expert often enough: the
    summary line and the report then say how many kept their data-free values and what to raise."""
    from eagle3.quantize.calibrated import coverage_warning, summary_line

    assert coverage_warning(28, 0) is None and coverage_warning(20, 8) is None
    warning = coverage_warning(1, 27)
    assert warning is not None and warning.startswith("27 of 28 MLPs") and "--calibrate-samples" in warning
    section = {"method": "gptq", "tokens": 300, "sequences": 2, "source": "gsm8k", "calibrated": 1,
               "kept_data_free": 27, "seconds": 1.0, "peak_rss_mb": 300.0, "layers": [], "warning": warning}
    assert summary_line(section).splitlines()[1] == f"warning: {warning}"
