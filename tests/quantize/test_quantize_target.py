"""``eagle3 quantize DRAFT OUT --recipe int4-draft|fp8-draft --target T``: the draft's acceptance with
T before and after quantization (the runtime, held-out GSM8K prompts) is in the report, printed, and
covered by the manifest; --target with a target source or a missing directory is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.cli import main
from eagle3.train import target_fingerprint

EVAL = ["--eval-prompts", "2", "--eval-tokens", "6", "--eval-fewshot", "0"]  # 0-shot: short prompts


@pytest.mark.parametrize("draft, recipe", [("kimi-k2.5-eagle3", "int4-draft"), ("kimi-k2.6-eagle3.1-mla", "fp8-draft")])
def test_quantize_draft_with_target(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], draft: str,
                                    recipe: str) -> None:
    target, out = tiny_dir / "kimi-k2.5", tmp_path / "q"
    with pytest.raises(SystemExit) as e:
        main(["quantize", str(tiny_dir / draft), str(out), "--recipe", recipe, "--target", str(target), *EVAL])
    assert e.value.code == 0
    printed = capsys.readouterr().out
    assert "mean accept length" in printed and "lossless PASS" in printed
    acc = json.loads((out / "quantization_report.json").read_text())["acceptance"]
    assert acc["target"] == target_fingerprint(target)
    assert acc["before"]["num_prompts"] == acc["after"]["num_prompts"] == 2
    assert acc["before"]["lossless"] and acc["after"]["lossless"]
    assert acc["ratio"] == pytest.approx(acc["after"]["mean_acceptance_length"] / acc["before"]["mean_acceptance_length"])
    with pytest.raises(SystemExit) as e:  # the report with the acceptance is what the manifest hashed
        main(["verify", str(out)])
    assert e.value.code == 0


def test_target_errors(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [(["quantize", str(tiny_dir / "kimi-k2.5"), str(tmp_path / "a"), "--recipe", "mxfp4", "--scope", "experts",
               "--target", str(tiny_dir / "kimi-k2.5")], "not an EAGLE draft"),
             (["quantize", str(tiny_dir / "kimi-k2.5-eagle3"), str(tmp_path / "b"), "--recipe", "int4-draft",
               "--target", str(tmp_path / "missing")], "not a checkpoint directory"),
             (["quantize", str(tiny_dir / "kimi-k2.5-eagle3"), str(tmp_path / "c"), "--recipe", "int4-draft", *EVAL],
              "--eval-prompts, --eval-tokens, --eval-fewshot go with --target")]
    for args, want in cases:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and want in err[0], err
        assert not Path(args[2]).exists() and not Path(args[2] + ".partial").exists()
