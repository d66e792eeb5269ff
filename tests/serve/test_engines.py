"""Engine hand-off: the launch commands for vLLM, SGLang and ATOM (printed with --dry-run)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3.cli import app, main
from eagle3.runtime.engine.config import EngineConfig
from eagle3.serve import engines

runner = CliRunner()


def _dry(*args: str) -> list[str]:
    r = runner.invoke(app, ["serve", *args, "--dry-run"])
    assert r.exit_code == 0, r.output
    return shlex.split(r.stdout.strip().splitlines()[-1])


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The console-script entry point (one-line errors, exit 2)."""
    with pytest.raises(SystemExit) as e:
        main(args)
    return int(e.value.code or 0), capsys.readouterr().err


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm(tiny_dir: Path) -> None:
    t, d = tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.5-eagle3"
    argv = _dry(str(t), "--draft", str(d), "--engine", "vllm", "--num-speculative-tokens", "4",
                "--tensor-parallel-size", "8", "--kv-cache-dtype", "fp8", "--port", "9000")
    assert argv[:3] == ["vllm", "serve", str(t)]
    assert json.loads(_flag(argv, "--speculative-config")) == {"method": "eagle3", "model": str(d),
                                                               "num_speculative_tokens": 4}
    assert _flag(argv, "--tensor-parallel-size") == "8" and _flag(argv, "--kv-cache-dtype") == "fp8"
    assert _flag(argv, "--port") == "9000" and _flag(argv, "--host") == "127.0.0.1"
    # the tiny K2.5 target is compressed-tensors INT4: said explicitly
    assert _flag(argv, "--quantization") == "compressed-tensors"
    assert "--trust-remote-code" not in argv


def test_sglang(tiny_dir: Path) -> None:
    t, d = tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.5-eagle3"
    argv = _dry(str(t), "--draft", str(d), "--engine", "sglang", "--tensor-parallel-size", "8",
                "--kv-cache-dtype", "fp8", "--trust-remote-code")
    assert argv[1:3] == ["-m", "sglang.launch_server"] and _flag(argv, "--model-path") == str(t)
    assert _flag(argv, "--speculative-algorithm") == "EAGLE3"
    assert _flag(argv, "--speculative-draft-model-path") == str(d)
    assert _flag(argv, "--speculative-num-steps") == "3" and _flag(argv, "--speculative-eagle-topk") == "1"
    assert _flag(argv, "--speculative-num-draft-tokens") == "4"
    assert _flag(argv, "--tp") == "8" and _flag(argv, "--kv-cache-dtype") == "fp8_e4m3"
    assert "--trust-remote-code" in argv


def test_atom(tiny_dir: Path) -> None:
    t, d = tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.6-eagle3.1-mla"
    argv = _dry(str(t), "--draft", str(d), "--engine", "atom", "--tensor-parallel-size", "8",
                "--kv-cache-dtype", "fp8", "--port", "8123")
    assert argv[1:3] == ["-m", "atom.entrypoints.openai_server"] and _flag(argv, "--model") == str(t)
    assert _flag(argv, "--method") == "eagle3" and _flag(argv, "--draft-model") == str(d)
    assert _flag(argv, "--num-speculative-tokens") == "3" and _flag(argv, "-tp") == "8"
    assert _flag(argv, "--kv_cache_dtype") == "fp8" and _flag(argv, "--server-port") == "8123"
    assert "--quantization" not in argv


def test_without_draft_no_speculation_flags(tiny_dir: Path) -> None:
    argv = _dry(str(tiny_dir / "kimi-k2.5"), "--engine", "vllm")
    assert "--speculative-config" not in argv and "--kv-cache-dtype" not in argv


@pytest.mark.parametrize("engine", engines.ENGINES)
def test_refuses_when_not_installed(tiny_dir: Path, engine: str, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(engines, "installed", lambda name: False)
    code, err = _main(["serve", str(tiny_dir / "kimi-k2.5"), "--engine", engine], capsys)
    assert code == 2
    assert err.startswith("error: ") and f"{engine} is not installed" in err and "--dry-run" in err


def test_bad_engine_and_dry_run_alone(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _main(["serve", str(tiny_dir / "kimi-k2.5"), "--engine", "tgi", "--dry-run"], capsys)
    assert code == 2 and "vllm, sglang, atom" in err
    code, err = _main(["serve", str(tiny_dir / "kimi-k2.5"), "--dry-run"], capsys)
    assert code == 2 and "--engine" in err


def test_executes_with_this_python(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setattr(engines, "installed", lambda name: True)
    calls: list[list[str]] = []
    monkeypatch.setattr(engines.subprocess, "call", lambda argv: calls.append(argv) or 0)
    r = runner.invoke(app, ["serve", str(tiny_dir / "kimi-k2.5"), "--draft", str(tiny_dir / "kimi-k2.5-eagle3"),
                            "--engine", "sglang"])
    assert r.exit_code == 0, r.output
    assert calls[0][:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert shlex.split(r.stdout.strip().splitlines()[-1])[0] == "python3"


def test_two_node_commands(tiny_dir: Path) -> None:
    """`--engine sglang|vllm --nnodes 2`: each engine's launch on each of the two nodes, printed."""
    t, d = tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.5-eagle3"
    common = [str(t), "--draft", str(d), "--tensor-parallel-size", "16", "--nnodes", "2", "--dist-init-addr",
              "10.0.0.1:29500", "--dry-run"]
    r = runner.invoke(app, ["serve", *common, "--engine", "sglang"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "# node 0:" and lines[2] == "# node 1:"
    for node, line in ((0, lines[1]), (1, lines[3])):
        argv = shlex.split(line)
        assert _flag(argv, "--tp") == "16" and _flag(argv, "--nnodes") == "2"
        assert _flag(argv, "--node-rank") == str(node) and _flag(argv, "--dist-init-addr") == "10.0.0.1:29500"
        assert _flag(argv, "--speculative-draft-model-path") == str(d)
    r = runner.invoke(app, ["serve", *common, "--engine", "vllm"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    assert lines[:4] == ["# node 0:", "ray start --head --port 29500", "# node 1:",
                         "ray start --address 10.0.0.1:29500 --block"]
    assert lines[4] == "# node 0:"
    argv = shlex.split(lines[5])
    assert argv[:3] == ["vllm", "serve", str(t)] and _flag(argv, "--tensor-parallel-size") == "16"
    assert _flag(argv, "--distributed-executor-backend") == "ray"


def test_two_node_commands_need_the_address(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _main(["serve", str(tiny_dir / "kimi-k2.5"), "--engine", "sglang", "--tensor-parallel-size", "16",
                       "--nnodes", "2", "--dry-run"], capsys)
    assert code == 2 and "--dist-init-addr" in err
    code, err = _main(["serve", str(tiny_dir / "kimi-k2.5"), "--engine", "atom", "--tensor-parallel-size", "16",
                       "--nnodes", "2", "--dist-init-addr", "h:1", "--dry-run"], capsys)
    assert code == 2 and "sglang and vllm only" in err


# --- draft trees (--speculative-eagle-topk > 1) over the MLA target --------------------------------


def _refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one-line refusal (exit 2) of a --dry-run."""
    code, err = _main(["serve", *args, "--dry-run"], capsys)
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    return err


def test_sglang_tree_over_mla(tiny_dir: Path) -> None:
    t, d = tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.5-eagle3"
    argv = _dry(str(t), "--draft", str(d), "--engine", "sglang", "--speculative-eagle-topk", "4",
                "--num-speculative-tokens", "5", "--speculative-num-draft-tokens", "16")
    assert _flag(argv, "--speculative-eagle-topk") == "4" and _flag(argv, "--speculative-num-steps") == "5"
    assert _flag(argv, "--speculative-num-draft-tokens") == "16"
    # MLA + topk > 1: a tree-capable backend (Triton by default) at page size 1
    assert _flag(argv, "--attention-backend") == "triton" and _flag(argv, "--page-size") == "1"
    fa3 = _dry(str(t), "--draft", str(d), "--engine", "sglang", "--speculative-eagle-topk", "2",
               "--attention-backend", "fa3")
    assert _flag(fa3, "--attention-backend") == "fa3" and _flag(fa3, "--page-size") == "1"
    # the default tree size is the bundled runtime's: min(K * steps + 1, 64)
    assert _flag(fa3, "--speculative-num-draft-tokens") == "7"


def test_sglang_chain_unchanged(tiny_dir: Path) -> None:
    argv = _dry(str(tiny_dir / "kimi-k2.5"), "--draft", str(tiny_dir / "kimi-k2.5-eagle3"), "--engine", "sglang")
    assert _flag(argv, "--speculative-eagle-topk") == "1" and "--attention-backend" not in argv
    assert "--page-size" not in argv


@pytest.mark.parametrize(("extra", "message"), [
    (["--engine", "vllm"], "no MLA tree backend"),
    (["--engine", "atom"], "not supported by ATOM as far as documented"),
    (["--engine", "sglang", "--attention-backend", "flashinfer"], "flashinfer attention backend refuses topk > 1"),
    (["--engine", "sglang", "--attention-backend", "flashmla"], "flashmla attention backend refuses topk > 1"),
    (["--engine", "sglang", "--attention-backend", "cutlass_mla"], "refuses topk > 1"),
    (["--engine", "sglang", "--kv-cache-dtype", "fp8"], "no FP8 KV cache"),
    (["--engine", "sglang", "--speculative-num-draft-tokens", "8", "--num-speculative-tokens", "3",
      "--speculative-eagle-topk", "2"], "must be in 2..7"),
])
def test_tree_refusals(tiny_dir: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    topk = [] if "--speculative-eagle-topk" in extra else ["--speculative-eagle-topk", "2"]
    err = _refused([str(tiny_dir / "kimi-k2.5"), "--draft", str(tiny_dir / "kimi-k2.5-eagle3"), *topk, *extra], capsys)
    assert message in err


def test_tree_flag_misuse(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t, d = str(tiny_dir / "kimi-k2.5"), str(tiny_dir / "kimi-k2.5-eagle3")
    assert "needs --draft" in _refused([t, "--engine", "sglang", "--speculative-eagle-topk", "2"], capsys)
    assert "goes with --speculative-eagle-topk > 1" in _refused(
        [t, "--draft", d, "--engine", "sglang", "--speculative-num-draft-tokens", "8"], capsys)
    assert "goes with --engine sglang" in _refused(
        [t, "--draft", d, "--engine", "vllm", "--attention-backend", "triton"], capsys)


def test_weight_only_emulation_is_the_bundled_runtimes(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--activation-quant none`` measures a checkpoint's weights alone; an engine would quantize the
    activations anyway, so the hand-off refuses it (one line, exit 2) rather than noting it."""
    t = str(tiny_dir / "kimi-k2.5")
    for engine in ("vllm", "sglang"):
        assert "--activation-quant none (weight-only emulation) is the bundled runtime's" in _refused(
            [t, "--engine", engine, "--activation-quant", "none"], capsys)
    assert "--activation-quant 'int8': expected one of auto, none" in _refused(
        [t, "--engine", "vllm", "--activation-quant", "int8"], capsys)


def test_vllm_tree_refused_for_mha_target_too(tmp_path: Path) -> None:
    """A multi-head-attention target: vLLM's trees are static (speculative_token_tree), not topk trees."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(engines.UsageError, match="static speculative_token_tree"):
        engines.build_command("vllm", tmp_path, tmp_path / "draft", EngineConfig(speculative_eagle_topk=2))
    argv = engines.build_command("sglang", tmp_path, tmp_path / "draft", EngineConfig(speculative_eagle_topk=2)).argv
    assert "--page-size" not in argv  # the MLA-only constraint is not applied to MHA


# --- the hand-off maps the one EngineConfig (no defaults of its own) --------------------------------


def test_engine_settings_map_from_the_same_config(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t, d = str(tiny_dir / "kimi-k2.5"), str(tiny_dir / "kimi-k2.5-eagle3")
    plain = _dry(t, "--draft", d, "--engine", "vllm")
    assert not {"--seed", "--max-num-seqs", "--enforce-eager", "--dtype", "--max-logprobs"} & set(plain)
    set_ = ["--max-num-seqs", "128", "--seed", "7", "--enforce-eager", "--dtype", "fp16", "--max-logprobs", "5"]
    vllm = _dry(t, "--draft", d, "--engine", "vllm", *set_)
    assert _flag(vllm, "--max-num-seqs") == "128" and _flag(vllm, "--seed") == "7" and "--enforce-eager" in vllm
    assert _flag(vllm, "--dtype") == "float16" and _flag(vllm, "--max-logprobs") == "5"
    with pytest.raises(SystemExit) as e:
        main(["serve", t, "--draft", d, "--engine", "sglang", *set_, "--device", "cuda", "--max-seq-len-to-capture",
              "4096", "--dry-run"])
    out = capsys.readouterr()
    assert not e.value.code, out.err
    argv, err = shlex.split(out.out.strip().splitlines()[-1]), out.err
    assert _flag(argv, "--max-running-requests") == "128" and _flag(argv, "--random-seed") == "7"
    assert "--disable-cuda-graph" in argv and "--max-logprobs" not in argv and "--device" not in argv
    # what SGLang has no flag for, and what is the bundled runtime's alone: said, not dropped silently
    assert "--max-logprobs 5: sglang has no flag for it" in err
    assert "--device cuda: the bundled runtime's setting, not passed" in err
    assert "--max-seq-len-to-capture 4096: the bundled runtime's setting, not passed" in err
