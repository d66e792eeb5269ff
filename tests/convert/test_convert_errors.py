"""Bad input to ``eagle3 convert``: one line on stderr, exit code 2, nothing left behind."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3.cli import main
from tests.formats import builders as b


def run_error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    """Run ``eagle3 convert ARGS`` through the console-script entry point; expect exit 2."""
    with pytest.raises(SystemExit) as e:
        main(["convert", *args, "--quiet"])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    return err


def _draft(d: Path, **kw: object) -> Path:
    cfg = b.llama_draft_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True})
    t = b.draft_tensors(**kw)  # type: ignore[arg-type]
    return b.write(d, cfg, t)


def _no_output(out: Path) -> None:
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def test_unknown_draft_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _draft(tmp_path / "d")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["MedusaForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    err = run_error(capsys, [str(src), str(tmp_path / "o"), "--engine", "vllm"])
    assert "MedusaForCausalLM" in err and "architectures" in err
    _no_output(tmp_path / "o")


def test_missing_fc(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = b.draft_tensors()
    del t["fc.weight"]
    src = b.write(tmp_path / "d", b.llama_draft_config(), t)
    err = run_error(capsys, [str(src), str(tmp_path / "o"), "--engine", "sglang"])
    assert "fc.weight" in err
    _no_output(tmp_path / "o")


def test_wrong_fc_width(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = b.draft_tensors()
    t["fc.weight"] = torch.zeros(b.DH, 3 * b.H + 8, dtype=torch.bfloat16)
    src = b.write(tmp_path / "d", b.llama_draft_config(), t)
    err = run_error(capsys, [str(src), str(tmp_path / "o"), "--engine", "vllm"])
    assert "fc.weight" in err and str(3 * b.H + 8) in err
    _no_output(tmp_path / "o")


def test_d2t_longer_than_draft_vocab(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d2t, t2d = b.vocab_map(129)
    src = _draft(tmp_path / "d", draft_vocab=128, d2t=d2t, t2d=t2d)
    err = run_error(capsys, [str(src), str(tmp_path / "o"), "--engine", "vllm"])
    assert "'d2t' has 129 entries" in err and "128" in err
    _no_output(tmp_path / "o")


def test_tensor_not_in_any_draft_format(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        tiny_dir: Path) -> None:
    t = b.draft_tensors()
    t["mtp_head.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    src = b.write(tmp_path / "d", b.llama_draft_config(), t)
    err = run_error(capsys, [str(src), str(tmp_path / "o"), "--engine", "vllm"])
    assert "mtp_head.weight" in err and "--drop" in err
    _no_output(tmp_path / "o")
    # ... converts once the user drops it explicitly, and the report says so
    with pytest.raises(SystemExit) as e:
        main(["convert", str(src), str(tmp_path / "o"), "--engine", "vllm", "--drop", "mtp_head.weight", "--quiet"])
    assert e.value.code == 0
    rep = json.loads((tmp_path / "o" / "convert_report.json").read_text())
    assert {"name": "mtp_head.weight", "reason": "--drop"} in rep["drops"]


def test_input_norm_refused_by_atom(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = b.write(tmp_path / "d", b.llama_draft_config(norm_before_fc=True), b.draft_tensors(input_norm=True))
    err = run_error(capsys, [str(src), str(tmp_path / "o"), "--engine", "atom"])
    assert "input_norm.weight" in err and "atom" in err
    _no_output(tmp_path / "o")


@pytest.mark.parametrize("which,args,expect", [
    ("draft", ["--engine", "vllm", "--text-only"], "--text-only applies to target"),
    ("draft", ["--engine", "vllm", "--dequantize", "bf16"], "--dequantize applies to target"),
    ("draft", [], "--engine is required"),
    ("draft", ["--engine", "tensorrt"], "--engine tensorrt"),
    ("draft", ["--engine", "vllm", "--aux-layer-ids", "2,x"], "--aux-layer-ids"),
    ("draft", ["--engine", "vllm", "--norm-output", "maybe"], "--norm-output"),
    ("draft", ["--engine", "vllm", "--drop", "nothing.like.this"], "--drop nothing.like.this"),
    ("draft-noids", ["--engine", "vllm", "--aux-convention", "output"], "--aux-convention"),
    ("draft", ["--engine", "sglang", "--verifier", "org/model"], "--verifier applies to --engine speculators"),
    ("target", ["--aux-layer-ids", "2,3,4"], "--aux-layer-ids applies to EAGLE drafts"),
    ("target", ["--engine", "speculators"], "speculators is a draft format"),
    ("target", ["--dequantize", "int8"], "--dequantize int8"),
    ("target-bf16", ["--dequantize", "bf16"], "not quantized"),
    ("draft-as-target", ["--engine", "vllm", "--target", "DRAFT"], "not a target"),
])
def test_conflicting_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_dir: Path, which: str,
                           args: list[str], expect: str) -> None:
    src = {"draft": tiny_dir / "kimi-k2.5-eagle3-d2t", "draft-noids": tiny_dir / "kimi-k2.5-eagle3",
           "target": tiny_dir / "kimi-k2.5", "draft-as-target": tiny_dir / "kimi-k2.5-eagle3-d2t"}.get(which)
    if which == "target-bf16":
        src = b.write(tmp_path / "t", b.text_config(), b.target_tensors())
    args = [str(tiny_dir / "kimi-k2.5-eagle3") if a == "DRAFT" else a for a in args]
    err = run_error(capsys, [str(src), str(tmp_path / "o"), *args])
    assert expect in err
    _no_output(tmp_path / "o")


def test_existing_output_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_dir: Path) -> None:
    (tmp_path / "o").mkdir()
    err = run_error(capsys, [str(tiny_dir / "kimi-k2.5-eagle3"), str(tmp_path / "o"), "--engine", "vllm"])
    assert "--overwrite" in err
    assert list((tmp_path / "o").iterdir()) == []


def test_failure_midway_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_dir: Path) -> None:
    """A shard truncated after planning-time header checks would pass: truncation is caught by the
    reader before writing starts, and the partial directory is removed."""
    src = tmp_path / "d"
    shutil.copytree(tiny_dir / "kimi-k2.5-eagle3", src)
    f = src / "model-00002-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    err = run_error(capsys, [str(src), str(tmp_path / "o"), "--engine", "vllm"])
    assert "truncated" in err
    _no_output(tmp_path / "o")


def test_subprocess_exit_code(tmp_path: Path, tiny_dir: Path) -> None:
    """The installed entry point (a fresh interpreter): exit 2 and one line."""
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "convert", str(tiny_dir / "kimi-k2.5-eagle3"),
                        str(tmp_path / "o"), "--engine", "vllm", "--text-only"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    _no_output(tmp_path / "o")
