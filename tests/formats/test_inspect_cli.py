"""``eagle3 inspect`` at the user's interface: every tiny upstream-format checkpoint is identified
correctly (``eagle3 make-tiny`` then ``eagle3 inspect --json``), the human table renders, and
corrupt inputs give one ``error:`` line on stderr and exit code 2."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from eagle3.cli import app, main
from tests.formats import builders as b

runner = CliRunner()


def inspect_json(path: Path) -> dict[str, Any]:
    res = runner.invoke(app, ["inspect", str(path), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


# What each tiny checkpoint must be identified as (eagle3.testing.tiny's table of upstream formats).
EXPECTED: dict[str, dict[str, Any]] = {
    "kimi-k2.5": {"role": "target", "family": "kimi-k25", "architecture": "KimiK25ForConditionalGeneration",
                  "model_type": "kimi_k25", "text_model_type": "kimi_k2", "quant.scheme": "ct-int4",
                  "quant.config_location": "text_config", "target.text_prefix": "language_model.",
                  "target.has_vision": True},
    "kimi-k2-thinking": {"role": "target", "family": "deepseek-v3", "architecture": "DeepseekV3ForCausalLM",
                         "model_type": "kimi_k2", "quant.scheme": "ct-int4", "target.text_prefix": "",
                         "target.has_vision": False},
    "kimi-k2.5-eagle3": {"role": "draft", "family": "eagle3-llama", "architecture": "LlamaForCausalLMEagle3",
                         "quant.scheme": "bf16", "draft.eagle_version": "3", "draft.layer_prefix": "midlayer",
                         "draft.attention": "mha", "draft.d2t": False, "draft.own_embedding": True,
                         "draft.aux_layers.convention": "default", "draft.fc_norm": False},
    "kimi-k2.5-eagle3-d2t": {"role": "draft", "family": "eagle3-llama", "draft.eagle_version": "3",
                             "draft.layer_prefix": "midlayer", "draft.attention": "mha", "draft.d2t": True,
                             "draft.t2d": True, "draft.own_embedding": False,
                             "draft.aux_layers.convention": "output", "draft.vocab_map.d2t_in_range": True,
                             "draft.vocab_map.t2d_consistent": True},
    "kimi-k2.6-eagle3.1-mla": {"role": "draft", "family": "eagle3-mla", "architecture": "Eagle3DeepseekV2ForCausalLM",
                               "draft.eagle_version": "3.1", "draft.layer_prefix": "layers.0",
                               "draft.attention": "mla", "draft.fc_norm": True, "draft.fc_norm_tensors": 3,
                               "draft.norm_output": True, "draft.aux_layers.convention": "input"},
    "speculators-eagle3": {"role": "draft", "family": "speculators-eagle3", "draft.layer_prefix": "layers.0",
                           "draft.attention": "mha", "draft.d2t": True,
                           "draft.aux_layers.convention": "input", "draft.speculators.algorithm": "eagle3"},
}


def _get(j: dict[str, Any], dotted: str) -> Any:
    for k in dotted.split("."):
        j = j[k]
    return j


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``eagle3 make-tiny OUT`` through the CLI (what the must-show command line runs)."""
    out = tmp_path_factory.mktemp("cli") / "t"
    res = runner.invoke(app, ["make-tiny", str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_make_tiny_then_inspect_identifies_every_model(tiny: Path) -> None:
    found = sorted(p.name for p in tiny.iterdir() if p.is_dir())
    assert found == sorted(EXPECTED)
    results = {name: inspect_json(tiny / name) for name in EXPECTED}
    for name, want in EXPECTED.items():
        j = results[name]
        got = {k: _get(j, k) for k in want}
        assert got == want, name
        # The lightseek K2.5 draft ships no draft_vocab_size: worth a warning.
        want_warn = ["draft_vocab_size"] if name == "kimi-k2.5-eagle3" else []
        assert [w for w in want_warn if any(w in x for x in j["warnings"])] == want_warn
        assert len(j["warnings"]) == len(want_warn), (name, j["warnings"])
    # The tiny drafts were trained (conceptually) on the tiny target: their aux ids, in the input
    # convention, must be the target's default ids; and they map into the target's vocabulary.
    target = results["kimi-k2.5"]
    for name in ("kimi-k2.5-eagle3-d2t", "kimi-k2.6-eagle3.1-mla", "speculators-eagle3"):
        assert results[name]["draft"]["aux_layers"]["input_ids"] == target["target"]["default_aux_layer_ids"], name
    for name in ("kimi-k2.5-eagle3", "kimi-k2.5-eagle3-d2t", "kimi-k2.6-eagle3.1-mla", "speculators-eagle3"):
        d = results[name]["draft"]
        assert d["vocab_size"] == target["dims"]["vocab_size"]
        assert d["target_hidden_size"] == target["dims"]["hidden_size"]
    # The two targets hold the same text weights: same routed-expert count, K2.5 adds vision Linears.
    k2 = results["kimi-k2-thinking"]["quant"]["modules"]
    k25 = results["kimi-k2.5"]["quant"]["modules"]
    assert k2["ct-int4"] == k25["ct-int4"] > 0 and k25["bf16"] > k2["bf16"]


def test_inspect_human_table(tiny: Path) -> None:
    res = runner.invoke(app, ["inspect", str(tiny / "kimi-k2.6-eagle3.1-mla")])
    assert res.exit_code == 0, res.output
    for text in ("eagle3-mla draft", "eagle version", "3.1", "layers.0", "fc_norm True (3 tensors)", "input form"):
        assert text in res.stdout, text


def test_inspect_subprocess_json_and_exit_codes(tiny: Path, tmp_path: Path) -> None:
    """The installed entry point, end to end, in a fresh process (one success, one error). Inspecting
    a target reads headers and JSON only: the process never imports torch (exit 3 if it did)."""
    no_torch = ("import atexit, os, runpy, sys\n"
                "atexit.register(lambda: 'torch' in sys.modules and os._exit(3))\n"
                "runpy.run_module('eagle3.cli', run_name='__main__', alter_sys=True)\n")
    p = subprocess.run([sys.executable, "-c", no_torch, "inspect", str(tiny / "kimi-k2.5"), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["family"] == "kimi-k25"
    bad = tmp_path / "bad"
    shutil.copytree(tiny / "kimi-k2.5-eagle3", bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, "-m", "eagle3.cli", "inspect", str(bad)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and p.stderr.startswith(f"error: {bad / 'config.json'}: field 'architectures'")


# ---------------------------------------------------------------------------------------------
# Corrupt inputs: one line on stderr, exit code 2
# ---------------------------------------------------------------------------------------------


def _sharded_target(d: Path) -> Path:
    return b.write(d, b.text_config(b.CT_INT4_CONFIG), b.target_tensors("ct-int4"), max_shard_bytes=100_000)


def _run_error(capsys: pytest.CaptureFixture[str], path: Path) -> str:
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(path), "--json"])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    return err


def _corrupt_truncated(d: Path) -> str:
    f = d / "model-00002-of-00003.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    return f"{f}: truncated shard"


def _corrupt_header(d: Path) -> str:
    f = d / "model-00001-of-00003.safetensors"
    data = bytearray(f.read_bytes())
    (hlen,) = struct.unpack("<Q", data[:8])
    data[8:12] = b"{{{{"
    f.write_bytes(bytes(data))
    return f"{f}: bad safetensors header (not valid JSON"


def _corrupt_header_length(d: Path) -> str:
    f = d / "model-00003-of-00003.safetensors"
    data = bytearray(f.read_bytes())
    data[:8] = struct.pack("<Q", 10**12)
    f.write_bytes(bytes(data))
    return f"{f}: bad safetensors header (header length"


def _index_missing_tensor(d: Path) -> str:
    idx = d / "model.safetensors.index.json"
    j = json.loads(idx.read_text())
    j["weight_map"]["model.layers.9.mlp.gate.weight"] = "model-00001-of-00003.safetensors"
    idx.write_text(json.dumps(j))
    return f"{idx}: names tensor 'model.layers.9.mlp.gate.weight' in model-00001-of-00003.safetensors"


def _index_missing_shard(d: Path) -> str:
    (d / "model-00003-of-00003.safetensors").unlink()
    return f"{d / 'model.safetensors.index.json'}: names shard model-00003-of-00003.safetensors which does not exist"


def _unknown_architecture(d: Path) -> str:
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MixtralForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    return f"{d / 'config.json'}: field 'architectures' is ['MixtralForCausalLM'], not an architecture eagle3 knows"


def _bad_config_json(d: Path) -> str:
    (d / "config.json").write_text("{not json")
    return f"{d / 'config.json'}: not valid JSON"


@pytest.mark.parametrize("corrupt", [_corrupt_truncated, _corrupt_header, _corrupt_header_length,
                                     _index_missing_tensor, _index_missing_shard, _unknown_architecture,
                                     _bad_config_json], ids=lambda f: f.__name__.strip("_"))
def test_corrupt_inputs_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], corrupt: Any) -> None:
    d = _sharded_target(tmp_path / "ckpt")
    assert len(list(d.glob("*.safetensors"))) == 3  # the corruptions name shards 1..3
    want = corrupt(d)
    err = _run_error(capsys, d)
    assert err.startswith("error: " + want), err


def test_missing_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _run_error(capsys, tmp_path / "nope")
    assert "no such file or directory" in err
