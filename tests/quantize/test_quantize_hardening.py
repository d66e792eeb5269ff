"""Issue 10 for `eagle3 quantize` (and convert's NaN check): resume re-checks finished shards (2),
one line and exit 2 for a file given as SRC and a full disk, OUT.partial kept only where --resume
is worth it (13), the model validation convert runs (15), NaN/Inf weights (16) and the opt-in
zero points of Quark's importer (19). Each test fails on the code before the issue."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3 import checkpoint
from eagle3.checkpoint import CheckpointReader, read_json
from eagle3.cli import main
from eagle3.formats import keys
from eagle3.quantize import pipeline, quantize
from tests.quantize.conftest import case_id
from tests.quantize.interrupt import interrupt_after_first_shard
from tests.quantize.test_quantize import _tree_digest

W4A8 = case_id(("kimi-k2.5", "w4a8", None))


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(args)
    cap = capsys.readouterr()
    return int(e.value.code or 0), cap.out, cap.err


def _one_line_exit_2(code: int, err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _nothing_left(out: Path) -> None:
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def _strict_json(path: Path) -> object:
    """json.loads refusing Infinity/NaN (Python's json accepts them by default; JSON does not)."""
    def refuse(c: str) -> None:
        raise ValueError(f"{path}: non-JSON constant {c}")

    return json.loads(path.read_text(), parse_constant=refuse)


def _edit_tensor(d: Path, name: str, fn) -> None:  # type: ignore[no-untyped-def]
    """Rewrite the shard of ``d`` holding ``name`` with ``fn(tensor)`` in its place."""
    f = CheckpointReader(d).info(name).file
    t = load_file(f)
    t[name] = fn(t[name])
    save_file(t, f, metadata={"format": "pt"})


def _edit_config(d: Path, fn) -> None:  # type: ignore[no-untyped-def]
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


# ---------------------------------------------------------------------------------------------
# 2: --resume checks finished shards
# ---------------------------------------------------------------------------------------------


def test_resume_redoes_a_finished_shard_damaged_since(tiny_dir: Path, native_runs: dict[str, Path], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    done = interrupt_after_first_shard(tiny_dir / "kimi-k2.5", out, monkeypatch)
    shard = out.with_name("out.partial") / done
    size = shard.stat().st_size
    assert size > 8192
    with open(shard, "r+b") as f:  # the last 4 KB: the header and the size stay as they were
        f.seek(size - 4096)
        f.write(os.urandom(4096))
    capsys.readouterr()
    code, _, err = _cli(["quantize", str(tiny_dir / "kimi-k2.5"), str(out), "--recipe", "w4a8", "--workers", "1",
                         "--resume", "--quiet", "--method", "rtn"], capsys)
    assert code == 0, err
    notes = [line for line in err.splitlines() if "redoing" in line]
    assert len(notes) == 1 and done in notes[0] and "sha256" in notes[0], err
    code, stdout, err = _cli(["verify", str(out)], capsys)
    assert code == 0 and "OK" in stdout, err
    assert _tree_digest(out) == _tree_digest(native_runs[W4A8])


def test_resume_redoes_a_truncated_or_missing_finished_shard(tiny_dir: Path, native_runs: dict[str, Path],
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    done = interrupt_after_first_shard(tiny_dir / "kimi-k2.5", out, monkeypatch)
    shard = out.with_name("out.partial") / done
    os.truncate(shard, shard.stat().st_size - 100)
    res = quantize(tiny_dir / "kimi-k2.5", out, "w4a8", workers=1, resume=True, method="rtn")
    assert res.shards_resumed == 0 and "planned" in capsys.readouterr().err
    assert _tree_digest(out) == _tree_digest(native_runs[W4A8])


# ---------------------------------------------------------------------------------------------
# 13: a file as SRC, a full disk, what is left behind
# ---------------------------------------------------------------------------------------------


def test_a_safetensors_file_as_src_is_one_line(tiny_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    src = tiny_dir / "kimi-k2.5-eagle3-d2t" / "model.safetensors"
    out = tmp_path / "o"
    code, _, err = _cli(["quantize", str(src), str(out), "--recipe", "fp8-draft"], capsys)
    _one_line_exit_2(code, err, str(src), "not a checkpoint directory")
    _nothing_left(out)


def _enospc_after(monkeypatch: pytest.MonkeyPatch, shards_ok: int) -> list[str]:
    """Positional writes into the .part files of the first ``shards_ok`` shards written succeed;
    any other shard's fail as on a full disk. Returns the shard names in the order first written."""
    real = checkpoint._pwrite_all
    seen: list[str] = []

    def full(fd: int, data, offset: int) -> None:  # type: ignore[no-untyped-def]
        name = Path(os.readlink(f"/proc/self/fd/{fd}")).name
        if name.endswith(".part") and name not in seen:
            seen.append(name)
        if name.endswith(".part") and seen.index(name) >= shards_ok:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data, offset)

    monkeypatch.setattr(checkpoint.layout, "_pwrite_all", full)  # where ShardFile looks it up
    return seen


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_disk_full_after_a_finished_shard_keeps_it_for_resume(tiny_dir: Path, native_runs: dict[str, Path],
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    seen = _enospc_after(monkeypatch, 1)
    code, _, err = _cli(["quantize", str(tiny_dir / "kimi-k2.5"), str(out), "--recipe", "w4a8", "--workers", "1",
                         "--quiet", "--method", "rtn"], capsys)
    line = _one_line_exit_2(code, err, seen[1], "no space left on device", "--resume", "o.partial")
    assert "1 of 3 shards" in line
    assert not out.exists() and (out.with_name("o.partial") / seen[0].removesuffix(".part")).is_file()
    monkeypatch.undo()
    res = quantize(tiny_dir / "kimi-k2.5", out, "w4a8", workers=1, resume=True, method="rtn")
    assert res.shards_resumed == 1
    assert _tree_digest(out) == _tree_digest(native_runs[W4A8])


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_disk_full_before_any_finished_shard_leaves_nothing(tiny_dir: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    seen = _enospc_after(monkeypatch, 0)
    code, _, err = _cli(["quantize", str(tiny_dir / "kimi-k2.5"), str(out), "--recipe", "w4a8", "--workers", "2",
                         "--quiet"], capsys)
    line = _one_line_exit_2(code, err, seen[0], "no space left on device")
    assert "--resume" not in line
    _nothing_left(out)


def test_file_size_limit_in_a_real_process_is_one_line(tiny_dir: Path, tmp_path: Path) -> None:
    """The kernel's own refusal (RLIMIT_FSIZE: EFBIG, as a quota or a full disk would refuse). Also
    the quantize console script's own exit code: a real process, ended by a user error, exits 2 with
    one line (the in-process tests see the same through ``main``'s SystemExit)."""
    out = tmp_path / "o"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    p = subprocess.run([sys.executable, "-m", "eagle3.cli", "quantize", str(tiny_dir / "kimi-k2.5"), str(out),
                        "--recipe", "w4a8", "--workers", "1", "--quiet"], capture_output=True, text=True,
                       preexec_fn=limit)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert str(out.with_name("o.partial")) in lines[0] and "while writing" in lines[0] and "file too large" in lines[0]
    _nothing_left(out)


def test_a_failure_that_resume_cannot_fix_removes_the_partial_output(tiny_dir: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A shard was finished, then an input-side error (here: a verification failure): nothing kept."""
    real = pipeline.finish_shard
    seen: list[str] = []

    def fail_second(shard):  # type: ignore[no-untyped-def]
        if seen:
            raise pipeline.Eagle3Error(f"{shard.work}: header entry of tensor 'x' does not match where it was written")
        seen.append(shard.job.file)
        return real(shard)

    monkeypatch.setattr(pipeline, "finish_shard", fail_second)
    out = tmp_path / "o"
    code, _, err = _cli(["quantize", str(tiny_dir / "kimi-k2.5"), str(out), "--recipe", "w4a8", "--workers", "1",
                         "--quiet"], capsys)
    _one_line_exit_2(code, err, "does not match")
    _nothing_left(out)


# ---------------------------------------------------------------------------------------------
# 15: the model validation of convert and serve
# ---------------------------------------------------------------------------------------------


def _d2t(fn):  # type: ignore[no-untyped-def]
    return lambda d: _edit_tensor(d, keys.D2T, lambda t: fn(t).contiguous())


BAD_MODELS = {
    "unknown architecture": ("kimi-k2.5-eagle3", "int4-draft",
                             lambda d: _edit_config(d, lambda c: c.update(architectures=["FooForCausalLM"])),
                             "'architectures'"),
    "draft hidden size": ("kimi-k2.5-eagle3", "int4-draft",
                          lambda d: _edit_config(d, lambda c: c.update(hidden_size=256)), "hidden_size is 256"),
    "draft vocab size": ("kimi-k2.5-eagle3", "int4-draft",
                         lambda d: _edit_config(d, lambda c: c.update(vocab_size=2048)), "target vocabulary is 2048"),
    "d2t out of range": ("kimi-k2.5-eagle3-d2t", "fp8-draft", _d2t(lambda t: t + 100000), "'d2t'"),
    "d2t negative": ("kimi-k2.5-eagle3-d2t", "fp8-draft", _d2t(lambda t: t - 100000), "'d2t'"),
    "d2t wrong length": ("kimi-k2.5-eagle3-d2t", "fp8-draft", _d2t(lambda t: t[:-3]), "'d2t' has 253 entries"),
    "target hidden size": ("kimi-k2.5", "w4a8",
                           lambda d: _edit_config(d, lambda c: c["text_config"].update(hidden_size=256)),
                           "hidden_size 256"),
    "target vocab size": ("kimi-k2.5", "w4a8",
                          lambda d: _edit_config(d, lambda c: c["text_config"].update(vocab_size=4096)),
                          "vocab_size 4096"),
}


@pytest.mark.parametrize("what", list(BAD_MODELS))
def test_quantize_runs_the_model_validation_first(what: str, tiny_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    model, recipe, spoil, needle = BAD_MODELS[what]
    src = tmp_path / "src"
    shutil.copytree(tiny_dir / model, src)
    spoil(src)
    out = tmp_path / "o"
    code, _, err = _cli(["quantize", str(src), str(out), "--recipe", recipe, "--quiet"], capsys)
    _one_line_exit_2(code, err, needle)
    _nothing_left(out)


def test_any_architecture_still_quantizes_file_to_file(tiny_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_dir / "kimi-k2.5-eagle3", src)
    _edit_config(src, lambda c: c.update(architectures=["LlamaForCausalLM"]))
    assert quantize(src, tmp_path / "o", "int4-draft", workers=1, any_architecture=True).quantized == 7


# ---------------------------------------------------------------------------------------------
# 16: NaN / Inf weights
# ---------------------------------------------------------------------------------------------

QUANTIZED = "midlayer.self_attn.q_proj.weight"  # quantized by int4-draft
COPIED = "midlayer.input_layernorm.weight"  # copied byte for byte by both convert and quantize


def _poisoned(tiny_dir: Path, tmp_path: Path, name: str, value: float) -> Path:
    src = tmp_path / "src"
    shutil.copytree(tiny_dir / "kimi-k2.5-eagle3", src)

    def poison(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[3] = value
        return t

    _edit_tensor(src, name, poison)
    return src


@pytest.mark.parametrize(("name", "value", "verify"), [(QUANTIZED, float("nan"), "--verify"),
                                                     (QUANTIZED, float("-inf"), "--no-verify"),
                                                     (COPIED, float("inf"), "--verify")])
def test_quantize_refuses_nonfinite_weights(name: str, value: float, verify: str, tiny_dir: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    src = _poisoned(tiny_dir, tmp_path, name, value)
    out = tmp_path / "o"
    code, _, err = _cli(["quantize", str(src), str(out), "--recipe", "int4-draft", verify, "--quiet"], capsys)
    _one_line_exit_2(code, err, name, "--allow-nonfinite", str(CheckpointReader(src).info(name).file))
    _nothing_left(out)


def test_quantize_allow_nonfinite_writes_a_strict_json_report(tiny_dir: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    src = _poisoned(tiny_dir, tmp_path, QUANTIZED, float("inf"))
    out = tmp_path / "o"
    code, stdout, err = _cli(["quantize", str(src), str(out), "--recipe", "int4-draft", "--allow-nonfinite",
                              "--json"], capsys)
    assert code == 0, err
    printed = json.loads(stdout, parse_constant=lambda c: pytest.fail(f"--json printed {c}"))
    assert QUANTIZED.rsplit(".", 1)[0] in printed["failed"]
    rep = _strict_json(out / "quantization_report.json")
    assert isinstance(rep, dict)
    row = next(r for r in rep["tensors"] if r["module"] == QUANTIZED.rsplit(".", 1)[0])
    assert row["ok"] is False and row["rel_error"] is None
    assert rep["summary"]["all"]["nonfinite"] >= 1
    for f in out.rglob("*.json"):
        _strict_json(f)


def test_convert_refuses_nonfinite_weights_unless_allowed(tiny_dir: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    src = _poisoned(tiny_dir, tmp_path, COPIED, float("nan"))
    out = tmp_path / "c"
    code, _, err = _cli(["convert", str(src), str(out), "--engine", "vllm", "--quiet"], capsys)
    _one_line_exit_2(code, err, COPIED, "--allow-nonfinite", str(CheckpointReader(src).info(COPIED).file))
    _nothing_left(out)
    code, _, err = _cli(["convert", str(src), str(out), "--engine", "vllm", "--quiet", "--allow-nonfinite"], capsys)
    assert code == 0, err
    rep = _strict_json(out / "convert_report.json")
    assert isinstance(rep, dict) and any(COPIED in w for w in rep["warnings"])


def test_convert_checks_the_tensors_it_computes(tiny_dir: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A dequantized target tensor (computed, not copied) holding Inf is refused by name."""
    src = tmp_path / "src"
    shutil.copytree(tiny_dir / "kimi-k2.5", src)
    scale = next(n for n in CheckpointReader(src).names() if n.endswith(".weight_scale") and ".experts." in n)

    def poison(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = float("inf")
        return t

    _edit_tensor(src, scale, poison)
    out = tmp_path / "c"
    code, _, err = _cli(["convert", str(src), str(out), "--text-only", "--dequantize", "bf16", "--quiet"], capsys)
    _one_line_exit_2(code, err, scale.rsplit(".", 1)[0].removeprefix("language_model."), "NaN or Inf")
    _nothing_left(out)


# ---------------------------------------------------------------------------------------------
# 19: zero points for Quark's importer, opt-in
# ---------------------------------------------------------------------------------------------


def test_w4a8_has_no_zero_points_by_default(native_runs: dict[str, Path]) -> None:
    names = CheckpointReader(native_runs[W4A8]).names()
    assert not [n for n in names if "zero_point" in n]


def test_quark_zero_points_flag_writes_zero_point_2_for_w4a8(tiny_dir: Path, native_runs: dict[str, Path],
                                                             tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    code, _, err = _cli(["quantize", str(tiny_dir / "kimi-k2.5"), str(out), "--recipe", "w4a8", "--workers", "1",
                         "--quark-zero-points", "--quiet", "--method", "rtn"], capsys)
    assert code == 0, err
    r, base = CheckpointReader(out), CheckpointReader(native_runs[W4A8])
    scales2 = [n for n in r.names() if n.endswith(f".{keys.SCALE_2}")]
    assert scales2
    for s2 in scales2:
        mod = s2.rsplit(".", 1)[0]
        zp = r.get(f"{mod}.{keys.ZERO_POINT_2}")
        assert zp.dtype == torch.int32 and zp.shape == ((r.info(s2).shape[0] + 7) // 8,) and not zp.any()
        assert f"{mod}.{keys.ZERO_POINT}" not in r  # the FP8 stage has none (Quark's importer wants none)
    # Everything else is the default export, bit for bit.
    for n in base.names():
        assert torch.equal(r.get(n).reshape(-1).view(torch.uint8), base.get(n).reshape(-1).view(torch.uint8)), n
    assert set(r.names()) - set(base.names()) == {f"{s.rsplit('.', 1)[0]}.{keys.ZERO_POINT_2}" for s in scales2}
    code, _, err = _cli(["quantize", str(tiny_dir / "kimi-k2.5"), str(tmp_path / "m"), "--recipe", "mxfp4",
                         "--quark-zero-points"], capsys)
    _one_line_exit_2(code, err, "--quark-zero-points", "mxfp4")


@pytest.mark.slow
def test_quark_importer_loads_w4a8_only_with_the_zero_points(tmp_path: Path) -> None:
    """Quark 0.13's import_model_from_safetensors on a tiny Llama quantized W4A8 (every Linear):
    the default export misses `weight_quantizer.1.zero_point`; with --quark-zero-points it loads,
    and the imported model computes with eagle3's decode of the exported weights."""
    pytest.importorskip("quark")
    os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")
    from quark.torch import import_model_from_safetensors
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3.quantize.native import decode
    from eagle3.quantize.recipes import load_recipe

    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "llama")
    recipe = tmp_path / "w4a8-all.yaml"
    recipe.write_text("name: w4a8-all\nweight: {format: fp8_int4, qscheme: per_channel}\n"
                      "activation: {format: fp8, qscheme: per_tensor}\n"
                      "scope: {include: ['re:.*(self_attn|mlp)\\..*_proj$'], exclude: ['*lm_head']}\n")
    quantize(tmp_path / "llama", tmp_path / "plain", str(recipe), workers=1, any_architecture=True)
    quantize(tmp_path / "llama", tmp_path / "zp", str(recipe), workers=1, any_architecture=True,
             quark_zero_points=True)
    # Quark's own primitives (--engine quark) write the same zero points, bit for bit.
    quantize(tmp_path / "llama", tmp_path / "zp-quark", str(recipe), workers=1, any_architecture=True,
             quark_zero_points=True, engine="quark")
    a, b = CheckpointReader(tmp_path / "zp"), CheckpointReader(tmp_path / "zp-quark")
    assert sorted(a.names()) == sorted(b.names()) and any(n.endswith(keys.ZERO_POINT_2) for n in a.names())
    for n in a.names():
        assert torch.equal(a.get(n).reshape(-1).view(torch.uint8), b.get(n).reshape(-1).view(torch.uint8)), n

    def skeleton() -> torch.nn.Module:
        return LlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.bfloat16).eval()

    with pytest.raises(ValueError, match=r"weight_quantizer\.1\.zero_point"):
        import_model_from_safetensors(skeleton(), str(tmp_path / "plain"), device="cpu")
    # The scale search's numbers (--method mse) load the same way: only the numbers differ.
    quantize(tmp_path / "llama", tmp_path / "zp-mse", str(recipe), workers=1, any_architecture=True,
             quark_zero_points=True, method="mse")
    spec = load_recipe(str(recipe)).weight
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    errs = {}
    for run in ("zp", "zp-mse"):
        imported = import_model_from_safetensors(skeleton(), str(tmp_path / run), device="cpu")
        ref = skeleton()
        out = CheckpointReader(tmp_path / run)
        mods = dict(ref.named_modules())
        for name in {n.rsplit(".", 1)[0] for n in out.names() if n.endswith(".weight_scale_2")}:
            w = mods[name].weight
            t = {p: out.get(f"{name}.{p}") for p in ("weight", "weight_scale", "weight_scale_2")}
            w.data = decode(t, spec, tuple(w.shape)).to(w.dtype)
        with torch.no_grad():
            a = imported(ids).logits.float()
            b = ref(ids).logits.float()
        # Quark's W4A8 runs with fake-quantized FP8 activations, eagle3's reference does not: close, not equal.
        assert ((a - b).norm() / b.norm()).item() < 0.1, run
        errs[run] = read_json(tmp_path / run / "quantization_report.json")["summary"]["all"]["mean_rel_error"]
    assert errs["zp-mse"] < 0.9 * errs["zp"]  # the searched scales: closer to the source weights
    assert read_json(tmp_path / "zp" / "config.json")["quantization_config"]["export"]["pack_method"] == "reorder"
