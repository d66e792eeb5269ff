"""The loader reads every weight format straight from the files: each decoded expert weight is
bit-identical to the weight its writer meant (compressed-tensors INT4 against the codec, Quark
W4A8 / INT4 / MXFP4 and DeepSeek FP8 block against the dense weights the test wrote next to
them), weight-only formats give the same logits as the dense model, the Kimi wrapper's vision
tower is never read, and user mistakes are one-line errors naming the file and tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from eagle3.checkpoint import CheckpointReader, CheckpointWriter
from eagle3.errors import CheckpointError, Eagle3Error, FormatError, ShapeError, UsageError
from eagle3.formats import codecs
from eagle3.runtime.kernels.base import DenseWeight, FP8Weight, Int4Weight, MXFP4Weight, dequantize
from eagle3.runtime.loader import WeightReader, load_draft, load_target, target_spec
from tests.runtime.model_kit import PagedKV, requantize_target, single_thread

_threads = pytest.fixture(scope="module", autouse=True)(single_thread)

EXPERT = "model.layers.3.mlp.experts.5"


@pytest.fixture(scope="module")
def schemes(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("schemes")
    out = {}
    for s in ("w4a8", "int4", "mxfp4", "fp8-block"):
        out[s] = (requantize_target(tiny_dir / "kimi-k2-thinking", root / s, s, root / f"{s}-ref"), root / f"{s}-ref")
    return out


@pytest.mark.parametrize("scheme,kind,act", [("w4a8", Int4Weight, "fp8"), ("int4", Int4Weight, None),
                                             ("mxfp4", MXFP4Weight, "mxfp4"), ("fp8-block", FP8Weight, None)])
def test_decoded_expert_weights_are_exact(schemes, scheme: str, kind: type, act) -> None:
    qdir, refdir = schemes[scheme]
    spec = target_spec(qdir)
    wr = WeightReader(qdir, spec.quant, torch.float32, torch.device("cpu"))
    ref = CheckpointReader(refdir)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        w, a = wr.linear(f"{EXPERT}.{proj}")
        assert isinstance(w, kind) and a == act
        assert torch.equal(dequantize(w, torch.float32), ref.get(f"{EXPERT}.{proj}.weight"))
    # non-expert Linears stay dense and unquantized
    w, a = wr.linear("model.layers.3.self_attn.q_b_proj")
    assert isinstance(w, DenseWeight) and a is None


def test_compressed_tensors_int4_decodes_like_the_codec(tiny_dir) -> None:
    d = tiny_dir / "kimi-k2.5"
    spec = target_spec(d)
    assert spec.prefix == "language_model." and spec.quant.method == "compressed-tensors" and spec.quant.act is None
    wr = WeightReader(d, spec.quant, torch.bfloat16, torch.device("cpu"))
    r = CheckpointReader(d)
    m = "language_model." + EXPERT + ".down_proj"
    w, act = wr.linear(m)
    assert isinstance(w, Int4Weight) and w.group_size == 32 and act is None
    want = codecs.ct_int4_dequantize(r.get(m + ".weight_packed"), r.get(m + ".weight_scale"), r.get(m + ".weight_shape"))
    assert want.dtype == torch.bfloat16 and torch.equal(dequantize(w, torch.bfloat16), want)


@pytest.mark.parametrize("scheme", ["int4", "fp8-block"])
def test_weight_only_formats_give_the_dense_models_logits(schemes, scheme: str) -> None:
    qdir, refdir = schemes[scheme]
    ids = torch.randint(0, 768, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = []
    for d in (qdir, refdir):
        m = load_target(d, dtype=torch.float32)
        kv = PagedKV(m)
        x, meta = kv.step({0: ids})
        with torch.no_grad():
            h, _ = m(x, meta, kv.caches)
        logits.append(m.compute_logits(h))
    assert torch.equal(logits[0], logits[1])


def test_kimi_wrapper_is_read_without_the_vision_tower(tiny_dir, monkeypatch) -> None:
    read: list[str] = []
    orig = CheckpointReader.get

    def spy(self, name):
        read.append(name)
        return orig(self, name)

    monkeypatch.setattr(CheckpointReader, "get", spy)
    load_target(tiny_dir / "kimi-k2.5", dtype=torch.bfloat16)
    names = CheckpointReader(tiny_dir / "kimi-k2.5").names()
    vision = [n for n in names if n.startswith(("vision_tower.", "mm_projector."))]
    assert vision and not any(n.startswith(("vision_tower.", "mm_projector.")) for n in read)
    assert len(read) == len(set(read))  # every tensor read once
    text = {n for n in names if n.startswith("language_model.")}
    assert set(read) == text  # and every text tensor is used


def test_user_errors_are_one_line_and_name_the_culprit(tiny_dir, tmp_path) -> None:
    with pytest.raises(FormatError, match="draft checkpoint"):
        load_target(tiny_dir / "kimi-k2.5-eagle3")
    with pytest.raises(UsageError, match="act_override"):
        load_target(tiny_dir / "kimi-k2.5", act_override="mxfp4")
    with pytest.raises(UsageError, match="kernel backend"):
        load_target(tiny_dir / "kimi-k2.5", backend="nope")

    # a checkpoint that lacks one tensor
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(tiny_dir / "kimi-k2-thinking" / "config.json", broken / "config.json")
    victim = "model.layers.2.self_attn.kv_b_proj.weight"
    src = CheckpointReader(tiny_dir / "kimi-k2-thinking")
    assert victim in src
    with CheckpointWriter(broken) as w:
        for n in src.names():
            if n != victim:
                w.add(n, src.get(n))
    with pytest.raises(CheckpointError) as e:
        load_target(broken)
    assert victim in str(e.value) and "\n" not in str(e.value)

    # a draft for another target: vocabulary mismatch
    tgt = load_target(tiny_dir / "kimi-k2.5", dtype=torch.float32)
    other = tmp_path / "other-vocab"
    shutil.copytree(tiny_dir / "kimi-k2.5-eagle3", other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] = 2048
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ShapeError, match="2048"):
        load_draft(other, tgt)
    # aux ids that do not fit the target
    with pytest.raises(FormatError, match="aux layer ids"):
        load_draft(tiny_dir / "kimi-k2.5-eagle3", tgt, aux_layer_ids=(2, 3, 9))
    for err in (FormatError, ShapeError, UsageError, CheckpointError):
        assert issubclass(err, Eagle3Error)


def _ptpc_fp8_draft(src, dst, ref_dst):
    """An AMD ``ptpc_fp8``-style draft (Quark FP8 per-channel weights, dynamic per-token FP8
    activations; fc and lm_head excluded) plus the same draft with the dequantized weights."""
    dst.mkdir()
    ref_dst.mkdir()
    r = CheckpointReader(src)
    with CheckpointWriter(dst) as wq, CheckpointWriter(ref_dst) as wr:
        for n in r.names():
            t = r.get(n)
            if n.startswith("midlayer.") and n.endswith("_proj.weight"):
                s = t.float().abs().amax(-1) / codecs.FP8_E4M3_MAX
                q = codecs.fp8_quantize(t.float(), s[:, None])
                wq.add(n, q)
                wq.add(n[: -len("weight")] + "weight_scale", s)
                wr.add(n, q.float() * s[:, None])
            else:
                wq.add(n, t)
                wr.add(n, t)
    cfg = json.loads((src / "config.json").read_text())
    (ref_dst / "config.json").write_text(json.dumps(cfg))
    spec = {"dtype": "fp8_e4m3", "qscheme": "per_channel", "ch_axis": 0, "is_dynamic": False, "symmetric": True,
            "round_method": "half_even", "scale_type": "float32"}
    cfg["quantization_config"] = {
        "quant_method": "quark", "layer_quant_config": {}, "layer_type_quant_config": {},
        "global_quant_config": {"weight": spec, "input_tensors": {**spec, "is_dynamic": True, "ch_axis": 1},
                                "output_tensors": None, "bias": None},
        "exclude": ["fc", "lm_head"], "export": {"kv_cache_group": [], "pack_method": "reorder",
                                                 "weight_format": "real_quantized"}}
    (dst / "config.json").write_text(json.dumps(cfg))


def test_fp8_per_channel_draft(tiny_dir, tmp_path) -> None:
    qdir, rdir = tmp_path / "fp8", tmp_path / "fp8-ref"
    _ptpc_fp8_draft(tiny_dir / "kimi-k2.5-eagle3", qdir, rdir)
    tgt = load_target(tiny_dir / "kimi-k2.5", dtype=torch.float32)
    d, r = load_draft(qdir, tgt), load_draft(rdir, tgt)
    assert d.mlp.down.kind == "FP8Weight" and d.mlp.down.act == "fp8"
    assert d.self_attn.qkv_proj.act == "fp8" and d.fc.kind == "DenseWeight" and d.fc.act is None
    gen = torch.Generator().manual_seed(3)
    ids, hid = torch.randint(0, 768, (8,), generator=gen).tolist(), torch.randn(8, 128, generator=gen)
    outs = []
    for m in (d, r):
        kv = PagedKV(m, num_layers=1)
        x, meta = kv.step({0: ids})
        with torch.no_grad():
            outs.append(m(x, hid, meta, kv.caches[0])[1])
    rel = (outs[0] - outs[1]).norm() / outs[1].norm()
    assert 0 < rel < 0.05  # only the dynamic FP8 activations differ
