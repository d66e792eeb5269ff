"""eagle3 quantize against AMD Quark 0.13 itself: the Quark engine (Quark's per-tensor primitives),
Quark's config classes, Quark's own file-to-file quantizer and Quark's importer.

Quark's import costs 20-40 s, so everything that needs it lives in this one module, behind one
module-scoped fixture."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from eagle3.checkpoint import CheckpointReader, read_json
from eagle3.quantize import compat, quantize
from eagle3.quantize.recipes import builtin_names, load_recipe, parse_recipe
from tests.quantize.conftest import CASES, case_id
from tests.quantize.test_quantize import _split_module_across_shards, _tree_digest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quark():  # type: ignore[no-untyped-def]
    pytest.importorskip("quark")
    os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")
    from eagle3.quantize import quark as q

    q.quark_api()
    return q


def _same_files(a: Path, b: Path) -> None:
    da, db = _tree_digest(a), _tree_digest(b)
    da.pop("quantization_report.png", None), db.pop("quantization_report.png", None)
    da.pop("manifest.json", None), db.pop("manifest.json", None)
    assert da == db


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_native_and_quark_engines_write_identical_checkpoints(case, quark, tiny_dir: Path,
                                                              native_runs: dict[str, Path], tmp_path: Path) -> None:
    m, r, s = case
    # Two worker threads here (the native runs use one): Quark's primitives run concurrently,
    # and the planned layout makes the output independent of the order modules finish in.
    quantize(tiny_dir / m, tmp_path / "q", r, s, workers=2, engine="quark")
    _same_files(tmp_path / "q", native_runs[case_id(case)])  # tensors, config (Quark's classes), report


USER_SPECS = {
    "int4-g32": "{format: int4, qscheme: per_group, group_size: 32}",
    "int4-g128": "{format: int4, qscheme: per_group, group_size: 128}",
    "fp8-tensor": "{format: fp8, qscheme: per_tensor}",
}


@pytest.mark.parametrize("name", sorted(USER_SPECS))
def test_schemes_outside_the_shipped_recipes_match_quark(name: str, quark, tiny_dir: Path, tmp_path: Path) -> None:
    f = tmp_path / f"{name}.yaml"
    f.write_text(f"name: {name}\nweight: {USER_SPECS[name]}\n"
                 "scope: {include: ['*self_attn.*_proj', '*mlp.*_proj'], exclude_regex: ['re:.*lm_head$']}\n")
    for engine in ("native", "quark"):
        quantize(tiny_dir / "kimi-k2.5-eagle3", tmp_path / engine, str(f), workers=1, engine=engine)
    _same_files(tmp_path / "native", tmp_path / "quark")


def test_row_chunked_native_engine_gives_quarks_bits(quark, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny models' weights fit in one row chunk; here every scheme runs over many chunks
    (ragged last one included) and must still equal Quark's whole-tensor result."""
    from eagle3.quantize import native
    from eagle3.quantize.recipes import WeightSpec
    from eagle3.quantize.sources import DenseRows

    monkeypatch.setattr(native, "CHUNK_ELEMENTS", 8 * 1024)
    specs = [WeightSpec("fp8_int4", "per_channel"), WeightSpec("int4", "per_channel"),
             WeightSpec("int4", "per_group", 32), WeightSpec("mxfp4", "per_group", 32),
             WeightSpec("fp8", "per_channel"), WeightSpec("fp8", "per_tensor")]
    g = torch.Generator().manual_seed(0)
    engine = quark.QuarkEngine()
    for dtype in (torch.bfloat16, torch.float32):
        w = (torch.randn(200, 256, generator=g) * 0.02).to(dtype)
        w[3, 5], w[150] = 0.3, 0.0  # an outlier and an all-zero row
        for spec in specs:
            zp = spec.format == "int4"
            ours = native.NativeEngine().quantize(DenseRows(w), spec, zp)
            theirs = engine.quantize(DenseRows(w), spec, zp)
            assert ours.keys() == theirs.keys()
            for k in ours:
                a, b = ours[k].reshape(-1), theirs[k].reshape(-1)
                assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (spec, dtype, k)


def test_config_from_quark_classes_equals_eagle3_schema(quark) -> None:
    recipes = [load_recipe(n) for n in builtin_names()]
    recipes += [parse_recipe(f"name: u\nweight: {w}\nscope: {{include: ['*']}}\n", "user") for w in USER_SPECS.values()]
    recipes.append(parse_recipe("name: u\nweight: {format: fp8}\nactivation: {format: fp8, qscheme: per_tensor}\n"
                                "scope: {include: ['*']}\n", "user"))
    exclude = ["lm_head", "model.layers.0.self_attn.q_proj", "re:.*lm_head$"]
    for rec in recipes:
        ours = compat.quantization_config(rec, exclude)
        theirs = quark.quantization_config(rec, exclude)
        assert json.dumps(ours) == json.dumps(theirs), rec.name  # same keys, values and order


def _quark_file_to_file(quark, src: Path, dst: Path, recipe: str) -> None:
    from quark.torch import ModelQuantizer

    C = quark.quark_api().C
    rec = load_recipe(recipe)
    cfg = C.QConfig(global_quant_config=C.QLayerConfig(weight=quark.weight_qspec(rec.weight),
                                                       input_tensors=quark.input_qspec(rec.activation)),
                    exclude=list(rec.scope().exclude))
    ModelQuantizer(cfg).direct_quantize_checkpoint(pretrained_model_path=str(src), save_path=str(dst), device="cpu")


@pytest.mark.parametrize("recipe", ["mxfp4", "w4a8"])
def test_tensors_equal_quarks_own_file_to_file(recipe: str, quark, tiny_dir: Path, native_runs: dict[str, Path],
                                               tmp_path: Path) -> None:
    """Where Quark 0.13's file-to-file output is right (MXFP4, progressive W4A8 with reorder
    packing), eagle3 writes the same tensors from the same Moonshot INT4 source."""
    src = tiny_dir / "kimi-k2-thinking"
    _quark_file_to_file(quark, src, tmp_path / "f2f", recipe)
    ours = native_runs[case_id(("kimi-k2-thinking", "mxfp4", None))] if recipe == "mxfp4" else tmp_path / "e3"
    if recipe != "mxfp4":
        quantize(src, ours, recipe, workers=1, method="rtn")
    a, b = CheckpointReader(ours), CheckpointReader(tmp_path / "f2f")
    assert sorted(a.names()) == sorted(b.names())
    for n in a.names():
        x, y = a.get(n), b.get(n)
        assert x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), n


def test_quark_file_to_file_fails_where_eagle3_does_not(quark, tiny_dir: Path, tmp_path: Path) -> None:
    """The index allows a module's tensors in different shards; Quark 0.13 then raises KeyError."""
    src = tmp_path / "split"
    _split_module_across_shards(tiny_dir / "kimi-k2-thinking", src, "model.layers.2.mlp.experts.3.down_proj")
    with pytest.raises(KeyError, match="weight_packed"):
        _quark_file_to_file(quark, src, tmp_path / "f2f", "mxfp4")
    quantize(src, tmp_path / "e3", "mxfp4", workers=1)


def test_quark_importer_reloads_int4_llama_with_eagle3_logits(quark, tmp_path: Path) -> None:
    """A tiny Llama quantized with int4-draft: Quark's importer gives the logits of the model whose
    weights are eagle3's decode of the exported tensors."""
    from quark.torch import import_model_from_safetensors
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3.quantize.native import decode

    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "llama")
    res = quantize(tmp_path / "llama", tmp_path / "q", "int4-draft", workers=1, any_architecture=True)
    assert res.quantized == 14 and res.source_kind == "bf16"
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))

    # Both skeletons come from from_pretrained: `.to(bfloat16)` on a fresh model would also round the
    # rotary inv_freq buffer to bf16, a difference that has nothing to do with quantization.
    skeleton = LlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.bfloat16).eval()
    imported = import_model_from_safetensors(skeleton, str(tmp_path / "q"))
    ref = LlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.bfloat16).eval()
    out = CheckpointReader(tmp_path / "q")
    spec = load_recipe("int4-draft").weight
    mods = dict(ref.named_modules())
    for name in {n.rsplit(".", 1)[0] for n in out.names() if n.endswith(".weight_scale")}:
        w = mods[name].weight
        t = {p: out.get(f"{name}.{p}") for p in ("weight", "weight_scale")}
        w.data = decode(t, spec, tuple(w.shape)).to(w.dtype)
    with torch.no_grad():
        a = imported(ids).logits.float()
        b = ref(ids).logits.float()
        full = LlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.bfloat16).eval()(ids).logits.float()
    assert torch.equal(a, b)  # Quark dequantizes to fp32 and casts to bf16, exactly as eagle3's decode
    assert ((full - b).norm() / b.norm()).item() > 1e-2  # and quantization did change the model
    assert read_json(tmp_path / "q" / "config.json")["quantization_config"]["export"]["pack_method"] == "reorder"
