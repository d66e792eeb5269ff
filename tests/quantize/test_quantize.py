"""`eagle3 quantize` with the native engine on the tiny Kimi targets and drafts: decoded outputs vs
the source, the loader conditions of vLLM / SGLang / ATOM, config hygiene, bad input, cross-shard
modules, FP8-block sources, resume and parallel workers."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from eagle3.checkpoint import CheckpointReader, CheckpointWriter, read_json, write_json
from eagle3.cli import main
from eagle3.formats import codecs, detect
from eagle3.quantize import pipeline, quantize
from tests.quantize import loaders
from tests.quantize.conftest import CASES, case_id
from tests.quantize.interrupt import interrupt_after_first_shard

# Relative error of a decoded weight vs its source that each scheme stays under on the tiny
# (Gaussian) weights; measured values are about 60% of these.
BOUNDS = {"w4a8": 0.15, "int4": 0.16, "mxfp4": 0.15, "fp8": 0.04}
IDS = [case_id(c) for c in CASES]


def _scheme(qc: dict) -> str:
    w = qc["global_quant_config"]["weight"]
    if isinstance(w, list):
        return "w4a8"
    return {"fp4": "mxfp4", "int4": "int4", "fp8_e4m3": "fp8"}[w["dtype"]]


def _decode(out: CheckpointReader, mod: str, scheme: str, k: int) -> torch.Tensor:
    """Decode one exported module with eagle3's codecs (independently of the pipeline's own decode)."""
    w, s = out.get(f"{mod}.weight"), out.get(f"{mod}.weight_scale")
    if scheme == "w4a8":
        return codecs.w4a8_dequantize(w, s, out.get(f"{mod}.weight_scale_2"), k)
    if scheme == "mxfp4":
        return codecs.mxfp4_dequantize(w, s)
    if scheme == "fp8":
        return codecs.fp8_dequantize(w, s, torch.float32)
    return codecs.quark_int4_per_channel_dequantize(w, s, k)


def _source_weight(src: CheckpointReader, mod: str) -> torch.Tensor:
    if f"{mod}.weight_packed" in src:  # Moonshot INT4: the fp32 product is the quantizer input
        n, k = src.get(f"{mod}.weight_shape").tolist()
        return codecs.ct_int4_dequantize(src.get(f"{mod}.weight_packed"), src.get(f"{mod}.weight_scale"), (n, k),
                                         dtype=torch.float32)
    return src.get(f"{mod}.weight").float()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_outputs_decode_within_the_schemes_error(case, tiny_dir: Path, native_runs: dict[str, Path]) -> None:
    m, r, s = case
    out_dir = native_runs[case_id(case)]
    src, out = CheckpointReader(tiny_dir / m), CheckpointReader(out_dir)
    cfg = read_json(out_dir / "config.json")
    scheme = _scheme(cfg["quantization_config"])
    quantized = sorted({n.rsplit(".", 1)[0] for n in out.names() if n.endswith(".weight_scale")})
    assert quantized
    report = {t["module"]: t for t in read_json(out_dir / "quantization_report.json")["tensors"]}
    assert set(report) == set(quantized)
    for mod in quantized:
        ref = _source_weight(src, mod)
        dec = _decode(out, mod, scheme, ref.shape[1])
        rel = ((dec - ref).norm() / ref.norm()).item()
        assert 0.002 < rel < BOUNDS[scheme], (mod, rel)
        assert report[mod]["rel_error"] == pytest.approx(rel, rel=1e-4, abs=1e-6)
        assert report[mod]["ok"]
    # Everything that is not a quantized module's tensor is carried over bit for bit.
    consumed = {f"{mod}.{p}" for mod in quantized for p in ("weight", "weight_packed", "weight_scale",
                                                            "weight_shape")}
    for name in src.names():
        if name not in consumed:
            assert torch.equal(out.get(name), src.get(name)), name
    assert (out_dir / "quantization_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# What each engine's loader makes of each recipe (tests/quantize/loaders.py): True = loads.
# w4a8: vLLM ROCm AITER W4A8 MoE and AMD's SGLang branch; ATOM cannot parse a two-stage weight.
# w4a8-int8: vLLM's W4A8 MoE requires fp8 activations in the config. int4-draft: only vLLM's
# weight-only Quark INT4 Linear (PR #48606); SGLang has no INT4 Linear scheme.
EXPECT = {
    "w4a8": {"vllm": True, "sglang": True, "atom": False},
    "w4a8-int8": {"vllm": False, "sglang": True, "atom": False},
    "mxfp4": {"vllm": True, "sglang": True, "atom": True},
    "int4-draft": {"vllm": True, "sglang": False, "atom": True},
    "fp8-draft": {"vllm": True, "sglang": True, "atom": True},
}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_loader_conditions_of_vllm_sglang_atom(case, native_runs: dict[str, Path]) -> None:
    out_dir = native_runs[case_id(case)]
    for engine, want in EXPECT[case[1]].items():
        v = loaders.check(out_dir, engine)
        assert v.loadable == want, (engine, v.problems[:3])
        if want:  # every quantized layer resolved to a scheme, every other one is excluded and bf16
            assert any(k != "excluded (bf16)" for k in v.schemes), v.schemes
    # SGLang fuses Kimi's shared experts into the routed ones: same format needed (4.2-6).
    assert loaders.sglang_shared_fusion_ok(out_dir) == (case[1] not in ("w4a8", "w4a8-int8") and case[2] != "experts")


def test_regex_excludes_are_what_vllm_needs_for_kimi_k25(native_runs: dict[str, Path], tmp_path: Path) -> None:
    """vLLM matches excludes against its own module names (language_model.layers.N...), so the
    explicit checkpoint names alone leave Kimi-K2.5's attention 'quantized' (issue vllm#54547)."""
    src = native_runs[case_id(("kimi-k2.5", "mxfp4", "experts"))]
    d = tmp_path / "no-regex"
    d.mkdir()
    for f in src.glob("*.safetensors"):
        (d / f.name).symlink_to(f)
    cfg = read_json(src / "config.json")
    cfg["quantization_config"]["exclude"] = [e for e in cfg["quantization_config"]["exclude"]
                                             if not e.startswith("re:")]
    write_json(d / "config.json", cfg)
    assert not loaders.check(d, "vllm").loadable
    assert loaders.check(d, "sglang").loadable and loaders.check(d, "atom").loadable


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_exported_config_hygiene(case, tiny_dir: Path, native_runs: dict[str, Path]) -> None:
    m, r, s = case
    out_dir = native_runs[case_id(case)]
    src_cfg, cfg = read_json(tiny_dir / m / "config.json"), read_json(out_dir / "config.json")
    qc = cfg.pop("quantization_config")
    assert "quantization_config" not in json.dumps(cfg)  # nested compressed-tensors config removed
    assert cfg.get("model_type") == src_cfg.get("model_type")
    assert cfg.get("text_config", {}).get("model_type") == src_cfg.get("text_config", {}).get("model_type")
    assert qc["quant_method"] == "quark" and qc["version"] == "0.13"
    assert qc["export"]["kv_cache_group"] == [] and qc["export"]["pack_method"] == "reorder"
    assert qc["layer_quant_config"] == {} and qc["layer_type_quant_config"] == {}
    g = qc["global_quant_config"]
    assert g["output_tensors"] is None and g["bias"] is None
    # Explicit names: exactly the Linear modules left in bf16; plus the recipe's regexes.
    _, mods = loaders.load(out_dir)
    bf16 = sorted(mod for mod, st in loaders.linear_modules(mods).items() if st == "bf16")
    names = [e for e in qc["exclude"] if not e.startswith("re:")]
    assert names == bf16
    assert any(e.startswith("re:") for e in qc["exclude"])
    # eagle3's own detector reads it as the scheme the recipe names, and finds nothing new to warn about.
    summary = detect.detect(out_dir)
    want = {"w4a8": "quark-w4a8", "w4a8-int8": "quark-w4a8", "mxfp4": "quark-mxfp4", "int4-draft": "quark-int4",
            "fp8-draft": "quark-fp8"}[r]
    assert summary.quant.scheme == want and summary.warnings == detect.detect(tiny_dir / m).warnings
    assert json.loads((out_dir / "manifest.json").read_text())["files"]


def _run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(args)
    return int(e.value.code or 0), capsys.readouterr().err


def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tiny_dir: Path, native_runs: dict[str, Path],
                                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad_group = tmp_path / "g128.yaml"
    bad_group.write_text("name: g128\nweight: {format: int4, qscheme: per_group, group_size: 128}\n"
                         "scope: {include: ['*self_attn.q_b_proj']}\n")
    quark_out = native_runs[case_id(("kimi-k2.5", "w4a8", None))]
    cases = {
        "unknown recipe": (["quantize", str(tiny_dir / "kimi-k2.5"), "OUT", "--recipe", "w3a7"], "w3a7"),
        "scope matches nothing": (["quantize", str(tiny_dir / "kimi-k2.5-eagle3"), "OUT", "--recipe", "w4a8"],
                                  "matches none"),
        "group size": (["quantize", str(tiny_dir / "kimi-k2-thinking"), "OUT", "--recipe", str(bad_group)],
                       "not divisible"),
        "already quark": (["quantize", str(quark_out), "OUT", "--recipe", "mxfp4"], "already Quark-quantized"),
        "unknown scope": (["quantize", str(tiny_dir / "kimi-k2.5"), "OUT", "--recipe", "mxfp4", "--scope", "attention"],
                          "unknown scope 'attention'"),
    }
    for what, (args, needle) in cases.items():
        out = tmp_path / what.replace(" ", "-")
        args = [str(out) if a == "OUT" else a for a in args]
        code, err = _run_cli(args, capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (what, err)
        assert not out.exists() and not out.with_name(out.name + ".partial").exists(), what


def _tree_digest(d: Path) -> dict[str, str]:
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.rglob("*"))
            if f.is_file()}


def _split_module_across_shards(src: Path, dst: Path, module: str) -> None:
    """Copy a sharded checkpoint, moving `module.weight_scale` into another shard (index updated)."""
    shutil.copytree(src, dst)
    r = CheckpointReader(src)
    idx = read_json(src / "model.safetensors.index.json")
    scale = f"{module}.weight_scale"
    home = idx["weight_map"][scale]
    other = next(f for f in dict.fromkeys(idx["weight_map"].values()) if f != home)
    for fname in (home, other):
        names = [n for n in r.names() if idx["weight_map"][n] == fname and n != scale]
        if fname == other:
            names.append(scale)
        tmp = dst / f".w-{fname}"
        with CheckpointWriter(tmp, max_shard_bytes=1 << 40) as w:
            for n in names:
                w.add(n, r.get(n))
        (tmp / "model.safetensors").replace(dst / fname)
        shutil.rmtree(tmp)
    idx["weight_map"][scale] = other
    write_json(dst / "model.safetensors.index.json", idx)


def test_module_split_across_shards_quantizes_like_the_original(tiny_dir: Path, native_runs: dict[str, Path],
                                                               tmp_path: Path) -> None:
    mod = "model.layers.2.mlp.experts.3.down_proj"
    src = tmp_path / "split"
    _split_module_across_shards(tiny_dir / "kimi-k2-thinking", src, mod)
    r = CheckpointReader(src)
    assert r.info(f"{mod}.weight_scale").file.name != r.info(f"{mod}.weight_packed").file.name
    before = _tree_digest(src)
    quantize(src, tmp_path / "out", "mxfp4", workers=1)
    assert _tree_digest(src) == before  # the source is never modified
    ref = CheckpointReader(native_runs[case_id(("kimi-k2-thinking", "mxfp4", None))])
    got = CheckpointReader(tmp_path / "out")
    assert sorted(got.names()) == sorted(ref.names())
    for n in ref.names():
        assert torch.equal(got.get(n).reshape(-1).view(torch.uint8), ref.get(n).reshape(-1).view(torch.uint8)), n
    # The module's outputs land in the shard of its packed weight.
    assert got.info(f"{mod}.weight_scale").file.name == r.info(f"{mod}.weight_packed").file.name


def _fp8_block_draft(src: Path, dst: Path) -> None:
    """The tiny Llama draft as a DeepSeek-style FP8-block checkpoint (128x128 weight_scale_inv on
    every Linear; ``lm_head`` stays dense, as in DeepSeek-V3's own FP8 release and as the engines'
    FP8 configs load it)."""
    dst.mkdir()
    r = CheckpointReader(src)
    with CheckpointWriter(dst) as w:
        for n in r.names():
            t = r.get(n)
            if n.endswith(".weight") and t.dim() == 2 and "embed" not in n and not n.startswith("lm_head"):
                q, s = codecs.fp8_block_quantize(t.float())
                w.add(n, q)
                w.add(n + "_scale_inv", s)
            else:
                w.add(n, t)
    cfg = read_json(src / "config.json")
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    write_json(dst / "config.json", cfg)


def test_fp8_block_source_is_dequantized_in_fp32(tiny_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle3.quantize import native
    from eagle3.quantize.native import NativeEngine

    monkeypatch.setattr(native, "CHUNK_ELEMENTS", 1)  # chunks of 128 rows, one per FP8 block row
    from eagle3.quantize.recipes import load_recipe
    from eagle3.quantize.sources import DenseRows

    src = tmp_path / "fp8src"
    _fp8_block_draft(tiny_dir / "kimi-k2.5-eagle3", src)
    res = quantize(src, tmp_path / "out", "int4-draft", workers=1)
    assert res.source_kind == "fp8-block" and res.quantized == 7 and not res.failed
    s, o = CheckpointReader(src), CheckpointReader(tmp_path / "out")
    spec = load_recipe("int4-draft").weight
    mod = "midlayer.self_attn.q_proj"
    w32 = codecs.fp8_block_dequantize(s.get(f"{mod}.weight"), s.get(f"{mod}.weight_scale_inv"), dtype=torch.float32)
    want = NativeEngine().quantize(DenseRows(w32), spec, zero_point=True)
    for k, t in want.items():
        assert torch.equal(o.get(f"{mod}.{k}"), t), k
    # An excluded FP8 module (fc) becomes dense bf16: the config no longer describes FP8 blocks.
    fc = o.get("fc.weight")
    assert fc.dtype == torch.bfloat16 and "fc.weight_scale_inv" not in o
    assert torch.equal(fc, codecs.fp8_block_dequantize(s.get("fc.weight"), s.get("fc.weight_scale_inv")))


@pytest.mark.parametrize("workers", [1, 2])
def test_resume_skips_finished_shards(tiny_dir: Path, native_runs: dict[str, Path], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    out = tmp_path / "out"
    real = pipeline.finish_shard
    calls = [interrupt_after_first_shard(tiny_dir / "kimi-k2.5", out, monkeypatch, workers)]
    partial = out.with_name("out.partial")
    assert not out.exists() and (partial / calls[0]).is_file()

    def counting(shard):  # type: ignore[no-untyped-def]
        calls.append(shard.job.file)
        return real(shard)

    monkeypatch.setattr(pipeline, "finish_shard", counting)
    res = quantize(tiny_dir / "kimi-k2.5", out, "w4a8", workers=workers, resume=True, method="rtn")
    assert res.shards_resumed == 1 and len(calls) == 3 and calls[0] not in calls[1:]
    assert not partial.exists()
    assert _tree_digest(out) == _tree_digest(native_runs[case_id(("kimi-k2.5", "w4a8", None))])


def test_parallel_workers_write_the_same_checkpoint(tiny_dir: Path, native_runs: dict[str, Path],
                                                    tmp_path: Path) -> None:
    quantize(tiny_dir / "kimi-k2.5", tmp_path / "out", "mxfp4", "experts", workers=2)
    assert _tree_digest(tmp_path / "out") == _tree_digest(native_runs[case_id(("kimi-k2.5", "mxfp4", "experts"))])


def test_cli_prints_the_summary_table(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main_args = ["quantize", str(tiny_dir / "speculators-eagle3"), str(tmp_path / "o"), "--recipe", "fp8-draft",
                 "--workers", "1"]
    with pytest.raises(SystemExit) as e:
        main(main_args)
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    assert "mean rel err" in out and "quantized 7 modules" in out and "quantization_report.json" in out
    code, err = _run_cli(main_args, capsys)
    assert code == 2 and "already exists" in err


def test_moonshot_int4_source_needs_no_compressed_tensors(tiny_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Quark 0.13's file-to-file path fails with NameError without compressed-tensors installed;
    eagle3 reads the Moonshot INT4 layout with its own codecs."""
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # `import compressed_tensors` now fails
    res = quantize(tiny_dir / "kimi-k2-thinking", tmp_path / "o", "w4a8", workers=1)
    assert res.source_kind == "ct-int4" and res.quantized == 144 and not res.failed


def test_int4_modules_outside_the_scope_are_written_dense_bf16(tiny_dir: Path, tmp_path: Path) -> None:
    f = tmp_path / "e0.yaml"
    f.write_text("name: e0\nweight: {format: mxfp4}\nactivation: {format: mxfp4}\n"
                 "scope: {include: ['*.experts.0.*']}\n")
    res = quantize(tiny_dir / "kimi-k2-thinking", tmp_path / "o", str(f), workers=1)
    assert res.quantized == 6 * 3  # expert 0 of the six MoE layers
    src, out = CheckpointReader(tiny_dir / "kimi-k2-thinking"), CheckpointReader(tmp_path / "o")
    mod = "model.layers.1.mlp.experts.1.up_proj"
    n, k = src.get(f"{mod}.weight_shape").tolist()
    want = codecs.ct_int4_dequantize(src.get(f"{mod}.weight_packed"), src.get(f"{mod}.weight_scale"), (n, k))
    assert torch.equal(out.get(f"{mod}.weight"), want) and want.dtype == torch.bfloat16
    assert f"{mod}.weight_packed" not in out and f"{mod}.weight_shape" not in out
    assert mod in read_json(tmp_path / "o" / "config.json")["quantization_config"]["exclude"]
    assert detect.detect(tmp_path / "o").quant.modules["quark-mxfp4"] == 18


def test_verification_reads_back_what_was_written(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A tensor that lands on disk different from what was quantized and measured (here: one bit
    flipped by a faulty write) fails the run with one line naming the file and tensor."""
    from eagle3.checkpoint import ShardFile

    real = ShardFile.write

    def faulty(self, name, tensor):  # type: ignore[no-untyped-def]
        real(self, name, tensor)
        if name == "midlayer.self_attn.k_proj.weight":
            slot = self.layout.tensors[name]
            b = os.pread(self._fd, 1, slot.offset + 5)
            os.pwrite(self._fd, bytes([b[0] ^ 0x10]), slot.offset + 5)

    monkeypatch.setattr(ShardFile, "write", faulty)
    out = tmp_path / "o"
    code, err = _run_cli(["quantize", str(tiny_dir / "kimi-k2.5-eagle3"), str(out), "--recipe", "int4-draft"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "midlayer.self_attn.k_proj.weight reads back different" in lines[0] and ".part" in lines[0]
    assert not out.exists() and not out.with_name("o.partial").exists()
    # Without verification the same fault goes unnoticed: the check is what catches it.
    assert quantize(tiny_dir / "kimi-k2.5-eagle3", tmp_path / "nv", "int4-draft", verify=False).quantized == 7
