"""``eagle3 train-draft`` at the command line on the tiny Kimi-K2.5 target: a few steps lower the
loss; the output is an eagle3-format draft that the runtime serves (greedy speculative == plain)
and that converts to every engine profile that supports its kind; ``--resume`` continues an
interrupted run from its checkpoint to the same weights as an uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from eagle3.cli import app, main
from eagle3.testing.tiny import corpus_text

runner = CliRunner()
FAST = ["--batch-size", "4", "--max-len", "48", "--lr", "3e-3", "--quiet"]


def _cli(*args: str, ok: bool = True):
    res = runner.invoke(app, [str(a) for a in args])
    if ok and res.exit_code != 0:
        raise AssertionError(f"{args} failed ({res.exit_code}): {res.output}\n{res.exception!r}")
    return res


def _error(capsys: pytest.CaptureFixture[str], *args: object) -> str:
    """Run ``eagle3 ARGS`` through the console-script entry point; expect exit 2 and one line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1] if err else ""
    assert last.startswith("error: "), err  # (lines before it are progress messages)
    return last


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Prose and arithmetic lines of the tiny tokenizer's own corpus, as {"text": ...} rows."""
    lines = [ln for ln in corpus_text().split("\n") if len(ln) > 40][:24]
    p = tmp_path_factory.mktemp("train-data") / "data.jsonl"
    p.write_text("".join(json.dumps({"text": ln}) + "\n" for ln in lines), encoding="utf-8")
    return p


def _check_serves(target: Path, draft: Path) -> None:
    from eagle3.runtime.engine.llm import LLM
    from eagle3.runtime.sampling import SamplingParams

    prompts = ["Anna has 3 apples and buys 4 more.", [5, 17, 200, 33, 9, 41]]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    spec = LLM(target, draft=draft, num_speculative_tokens=3, num_blocks=32).generate(prompts, params)
    plain = LLM(target, num_blocks=32).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.spec_stats is not None and o.spec_stats.num_drafts > 0 for o in spec)


def _converts(draft: Path, target: Path, tmp: Path, engines: list[str]) -> None:
    for engine in engines:
        _cli("convert", draft, tmp / f"conv-{engine}", "--engine", engine, "--target", target, "--quiet")
        cfg = json.loads((tmp / f"conv-{engine}" / "config.json").read_text())
        assert cfg["architectures"], engine


@pytest.mark.parametrize("variant", ["llama", "mla-eagle31-reduced-vocab"])
def test_train_draft_cli(tiny_dir: Path, tmp_path: Path, data_file: Path, variant: str,
                         capsys: pytest.CaptureFixture[str]) -> None:
    target = tiny_dir / "kimi-k2.5"
    out = tmp_path / "draft"
    extra = ["--arch", "llama"] if variant == "llama" else ["--arch", "mla", "--eagle31", "--draft-vocab-size", "300"]
    res = _cli("train-draft", target, out, "--data", data_file, "--steps", "12", "--eval-prompts", "2",
               "--eval-tokens", "8", *extra, *FAST)
    assert "held-out acceptance (k=3)" in res.output and "lossless PASS" in res.output
    assert not (tmp_path / "draft.partial").exists()
    report = json.loads((out / "train_report.json").read_text())
    loss = report["training"]["loss"]
    assert len(loss) == 12
    assert sum(loss[-3:]) < sum(loss[:3])  # training lowers the TTT loss
    assert report["heldout"]["lossless"] is True and report["heldout"]["num_drafts"] > 0
    assert (out / "train_loss.png").stat().st_size > 0
    assert not (out / "init").exists() and not (out / "checkpoint").exists()
    _cli("verify", out)

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle3_canonical"]["layer_prefix"] == "layers.0"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # default (2, N//2, N-3) of 7 layers
    names = set(_tensors(out))
    if variant == "llama":
        assert cfg["architectures"] == ["Eagle3LlamaForCausalLM"] and cfg["draft_vocab_size"] == 1024
        assert "layers.0.self_attn.q_proj.weight" in names and "d2t" not in names
    else:
        assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
        assert cfg["fc_norm"] is True and cfg["norm_output"] is True and cfg["draft_vocab_size"] == 300
        assert {"fc_norm.0.weight", "layers.0.self_attn.kv_a_proj_with_mqa.weight", "d2t"} <= names
        assert "t2d" not in names  # the eagle3 profile drops the training-only mask

    _check_serves(target, out)
    if variant == "llama":
        _converts(out, target, tmp_path, ["vllm", "sglang", "atom", "speculators"])
    else:
        _converts(out, target, tmp_path, ["vllm", "sglang"])
        # the engines that cannot hold this draft kind say so in one line
        assert "reduced-vocabulary" in _error(capsys, "convert", out, tmp_path / "atom", "--engine", "atom")
        assert "MLA" in _error(capsys, "convert", out, tmp_path / "spec", "--engine", "speculators")


def test_resume_continues_from_checkpoint(tiny_dir: Path, tmp_path: Path, data_file: Path,
                                          monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    target = tiny_dir / "kimi-k2.5"
    common = ["--data", data_file, "--steps", "6", "--checkpoint-every", "3", "--eval-prompts", "0",
              "--seed", "7", *FAST]
    _cli("train-draft", target, tmp_path / "whole", *common)

    import eagle3.train.trainer as trainer

    real = trainer.ttt_loss
    calls = {"n": 0}

    def crash_after_four(*a, **kw):
        calls["n"] += 1
        if calls["n"] > 4:
            raise RuntimeError("simulated crash")
        return real(*a, **kw)

    out = tmp_path / "resumed"
    monkeypatch.setattr(trainer, "ttt_loss", crash_after_four)
    crashed = _cli("train-draft", target, out, *common, ok=False)
    assert crashed.exit_code != 0 and not out.exists()
    assert (tmp_path / "resumed.partial" / "checkpoint" / "state.pt").is_file()  # kept for --resume
    monkeypatch.setattr(trainer, "ttt_loss", real)

    refused = _error(capsys, "train-draft", target, out, *common, "--seed", "8", "--resume")
    assert "different options" in refused

    _cli("train-draft", target, out, *common, "--resume")
    whole, resumed = _tensors(tmp_path / "whole"), _tensors(out)
    assert whole.keys() == resumed.keys()
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k
    a = json.loads((tmp_path / "whole" / "train_report.json").read_text())["training"]["loss"]
    b = json.loads((out / "train_report.json").read_text())["training"]["loss"]
    assert a == b and len(b) == 6


def test_errors_are_one_line(tiny_dir: Path, tmp_path: Path, data_file: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    target = tiny_dir / "kimi-k2.5"
    assert "no checkpoint" in _error(capsys, "train-draft", target, tmp_path / "x", "--data", data_file, "--resume")
    assert "missing.jsonl" in _error(capsys, "train-draft", target, tmp_path / "x", "--data",
                                     tmp_path / "missing.jsonl", "--quiet")
    assert "--arch mla" in _error(capsys, "train-draft", target, tmp_path / "y", "--data", data_file, "--init-from",
                                  tiny_dir / "kimi-k2.5-eagle3", "--arch", "mla", "--steps", "1", "--quiet")
    assert not (tmp_path / "y").exists()
