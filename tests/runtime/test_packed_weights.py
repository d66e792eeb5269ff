"""Quantized weights stay packed in memory (issue 11, "packed weights end to end").

A loaded quantized model holds its quantized weights as the checkpoint stores them (codes +
scales): its resident weight bytes are within 10% of the checkpoint tensors it was built from, and
no module keeps a float tensor the size of a quantized weight (the torch reference decodes per
call). Runtime buffers that no checkpoint holds (RoPE frequencies) are accounted separately.
Numerics are unchanged: the numerics and losslessness tests of tests/runtime run on these models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from eagle3.formats import codecs
from eagle3.runtime.kernels import torch_ref
from eagle3.runtime.kernels.base import (
    DenseWeight,
    FP8Weight,
    Int4Weight,
    MXFP4Weight,
    dequantize,
    unpack_int4,
)
from eagle3.runtime.layers.attention import MLAAttention
from eagle3.runtime.layers.linear import Linear
from eagle3.runtime.layers.moe import MoE
from eagle3.runtime.loader import load_draft, load_target, resident_weight_bytes
from tests.runtime.model_kit import requantize_target

MAX_RATIO = 1.10


@pytest.fixture(scope="module")
def checkpoints(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Kimi target as shipped (Moonshot INT4) and as `eagle3 quantize` writes it (W4A8,
    MXFP4), a DeepSeek FP8-block target, and quantized drafts (FP8 per-channel MLA draft with a
    quantized kv_b, Quark INT4 per-group Llama draft)."""
    from eagle3.quantize import pipeline

    out = tmp_path_factory.mktemp("packed")
    runs = {"w4a8": ("kimi-k2.5", "w4a8"), "mxfp4": ("kimi-k2.5", "mxfp4"),
            "draft-fp8-mla": ("kimi-k2.6-eagle3.1-mla", "fp8-draft"), "draft-int4": ("kimi-k2.5-eagle3", "int4-draft")}
    paths = {"int4": tiny_dir / "kimi-k2.5"}
    for name, (model, recipe) in runs.items():
        pipeline.quantize(str(tiny_dir / model), out / name, recipe, None, workers=1, engine="native", verify=False,
                          progress=False)
        paths[name] = out / name
    paths["fp8-block"] = requantize_target(tiny_dir / "kimi-k2-thinking", out / "fp8-block", "fp8-block")
    return paths


def _floats(obj: Any, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """Every float tensor wider than a byte (FP8 codes are packed codes) an op / weight object holds
    (through lists, dicts, dataclasses and eagle3 objects)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.element_size() > 1:
            yield obj
    elif isinstance(obj, list | tuple):
        for x in obj:
            yield from _floats(x, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _floats(x, seen)
    elif dataclasses.is_dataclass(obj) or type(obj).__module__.startswith("eagle3."):
        yield from _floats(vars(obj), seen)


def _assert_no_dense_copy(model: nn.Module) -> int:
    """No quantized weight has a float copy: every float tensor its op holds is far smaller than the
    dense weight (scales are at most 1/32 of it here). Returns the number of quantized weights seen."""
    checked = 0
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.kind not in ("DenseWeight", "unloaded"):
            shapes = [(m.out_features, m.in_features)]
            numel = m.out_features * m.in_features
            ops: Any = m.op
        elif isinstance(m, MoE) and m.experts is not None and not m.kind.startswith("DenseWeight"):
            shapes = [(m.inter, m.hidden), (2 * m.inter, m.hidden), (m.hidden, m.inter)]
            numel = 3 * m.inter * m.hidden * m.num_experts  # all experts, as they would be dense
            ops = m.experts
        elif isinstance(m, MLAAttention) and m.kv_b_packed is not None:
            assert m.w_uk is None and m.w_uv_t is None, name
            shapes = [tuple(m.kv_b_packed.shape)]
            numel = shapes[0][0] * shapes[0][1]
            ops = m.kv_b_packed
        else:
            continue
        checked += 1
        dense = {s for d in shapes for s in (d, d[::-1])}
        for t in _floats(ops):
            assert tuple(t.shape[-2:]) not in dense and t.numel() < numel // 4, (
                f"{name} keeps a float tensor {list(t.shape)} for quantized weights {shapes}")
    return checked


@pytest.mark.parametrize("fmt", ["int4", "w4a8", "mxfp4", "fp8-block"])
def test_quantized_target_resident_bytes(checkpoints: dict[str, Path], fmt: str) -> None:
    model = load_target(checkpoints[fmt], dtype=torch.bfloat16)
    rb = resident_weight_bytes(model)
    t = rb.totals
    assert rb.checkpoint_bytes == model.checkpoint_bytes > 0
    assert t["packed"] > 0 and t["scales"] > 0 and t["dense"] > 0
    assert rb.weights <= MAX_RATIO * rb.checkpoint_bytes, (fmt, t, rb.checkpoint_bytes)
    assert rb.buffers > 0  # RoPE frequencies: no checkpoint holds them, accounted apart from weights
    # per module: the routed experts of layer 1 hold packed codes, never dense floats
    experts = rb.per_module["layers.1.mlp"]
    assert experts["packed"] > 0 and experts.get("dense", 0) < experts["packed"]
    assert _assert_no_dense_copy(model) >= model.num_layers - 1  # every MoE layer's experts at least


@pytest.mark.parametrize("name", ["draft-fp8-mla", "draft-int4"])
def test_quantized_draft_resident_bytes(checkpoints: dict[str, Path], name: str) -> None:
    target = load_target(checkpoints["int4"], dtype=torch.bfloat16)
    draft = load_draft(checkpoints[name], target)
    rb = resident_weight_bytes(draft, exclude=target)  # the shared embedding is the target's
    assert rb.totals["packed"] > 0
    assert rb.weights <= MAX_RATIO * rb.checkpoint_bytes, (name, rb.totals, rb.checkpoint_bytes)
    assert _assert_no_dense_copy(draft) >= 3
    if name == "draft-fp8-mla":  # kv_b_proj is FP8 too: absorbed per call, kept packed
        assert draft.self_attn.kv_b_packed is not None


def test_dense_checkpoint_is_held_once(tiny_dir: Path) -> None:
    """A bf16 model in bf16 holds its weights once, in bf16 (the CPU widens them per call)."""
    draft_dir = tiny_dir / "kimi-k2.5-eagle3"
    target = load_target(tiny_dir / "kimi-k2.5", dtype=torch.bfloat16)
    draft = load_draft(draft_dir, target)
    rb = resident_weight_bytes(draft, exclude=target)
    assert rb.totals["packed"] == 0 and rb.weights <= rb.checkpoint_bytes


def test_row_tiles_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Linear larger than the scratch bound decodes and multiplies a tile of rows at a time; the
    output is bit-identical to the one-tile product (and so to the load-time decode it replaced)."""
    g = torch.Generator().manual_seed(0)
    n, k = 384, 256
    w = torch.randn(n, k, generator=g)
    packed, scale = codecs.ct_int4_quantize(w.bfloat16(), 32)
    q8, s8 = codecs.fp8_block_quantize(w)
    weights = {"int4": Int4Weight(packed, scale, 32, packing="ct", in_features=k),
               "fp8-block": FP8Weight(q8, s8, block=(128, 128))}
    x = torch.randn(5, k, generator=g)
    for kind, wt in weights.items():
        whole = torch_ref.TorchLinear()
        whole.prepare(wt, None, torch.float32, torch.device("cpu"))
        with monkeypatch.context() as mp:
            mp.setattr(torch_ref.packed, "LINEAR_SCRATCH_BYTES", 128 * k * 4)  # 128 rows of fp32
            tiled = torch_ref.TorchLinear()
            tiled.prepare(wt, None, torch.float32, torch.device("cpu"))
        assert len(tiled.tiles) == 3 and len(whole.tiles) == 1, kind
        assert torch.equal(tiled(x), whole(x)), kind
        assert not any(t.is_floating_point() and t.element_size() > 1 and t.numel() >= n * k // 4
                       for _, t in tiled.resident()), kind


def test_moe_chunks_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gathered MoE path decodes the active experts in bounded chunks: one expert per chunk gives
    the same bits as all of them at once."""
    g = torch.Generator().manual_seed(1)
    e, inter, hidden = 6, 32, 64

    def expert(rows: int, cols: int) -> Int4Weight:
        packed, scale = codecs.ct_int4_quantize(torch.randn(rows, cols, generator=g).bfloat16(), 32)
        return Int4Weight(packed, scale, 32, packing="ct", in_features=cols)

    gate = [expert(inter, hidden) for _ in range(e)]
    up = [expert(inter, hidden) for _ in range(e)]
    down = [expert(hidden, inter) for _ in range(e)]
    x = torch.randn(9, hidden, generator=g)
    ids = torch.randint(0, e - 1, (9, 2), generator=g)  # the last expert is never active
    wts = torch.rand(9, 2, generator=g)
    outs = []
    for scratch in (1 << 30, 1):
        with monkeypatch.context() as mp:
            mp.setattr(torch_ref.moe, "_MOE_ALL_BYTES", 0)
            mp.setattr(torch_ref.packed, "MOE_SCRATCH_BYTES", scratch)
            op = torch_ref.TorchMoE()
            op.prepare(gate, up, down, None, torch.float32, torch.device("cpu"))
        assert op.path == "gather" and (op.chunk == 1 if scratch == 1 else op.chunk >= e)
        outs.append(op(x, ids, wts))
    assert torch.equal(outs[0], outs[1])


def test_moe_decodes_only_routed_experts_with_the_same_bits() -> None:
    """The all-experts path of a small MoE decodes only the experts a call routes to when few are;
    a token's output is the same bits as in a batch that routes to every expert."""
    g = torch.Generator().manual_seed(2)
    e, inter, hidden = 8, 32, 64

    def expert(rows: int, cols: int) -> Int4Weight:
        packed, scale = codecs.ct_int4_quantize(torch.randn(rows, cols, generator=g).bfloat16(), 32)
        return Int4Weight(packed, scale, 32, packing="ct", in_features=cols)

    op = torch_ref.TorchMoE()
    op.prepare([expert(inter, hidden) for _ in range(e)], [expert(inter, hidden) for _ in range(e)],
               [expert(hidden, inter) for _ in range(e)], None, torch.float32, torch.device("cpu"))
    assert op.path == "all"
    x = torch.randn(5, hidden, generator=g)
    ids = torch.tensor([[0, 3], [1, 2], [3, 4], [5, 6], [7, 0]])
    wts = torch.rand(5, 2, generator=g)
    alone = op(x[:1], ids[:1], wts[:1])  # 2 of 8 experts decoded
    assert torch.equal(alone, op(x, ids, wts)[:1])


def _weights(n: int, k: int, seed: int) -> dict[str, Any]:
    """One weight of every canonical kind, [n, k], from the same random floats."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    packed, scale = codecs.ct_int4_quantize(w.bfloat16(), 32)
    fp4, e8 = codecs.mxfp4_quantize(w)
    q8, s8 = codecs.fp8_block_quantize(w)
    codes = torch.randint(-8, 8, (n, k), generator=g)
    return {"bf16": DenseWeight(w.bfloat16()),
            "int4-ct": Int4Weight(packed, scale, 32, packing="ct", in_features=k),
            "mxfp4": MXFP4Weight(fp4, e8),
            "int4-quark-g32": Int4Weight(codecs.quark_int4_pack(codes), scale, 32, packing="quark", in_features=k),
            "fp8-block": FP8Weight(q8, s8, block=(128, 128))}


KINDS = ["bf16", "int4-ct", "mxfp4", "int4-quark-g32", "fp8-block"]


@pytest.mark.parametrize("kind", KINDS)
def test_scratch_decode_gives_the_bits_of_the_dequantized_weight(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the packed weight is decoded into a reused scratch, a row tile at a time: a bf16 Linear's
    output is bit-identical to the per-call decode it replaced and to the GEMM over the load-time
    dequantized weight, call after call (the scratch holds nothing over)."""
    n, k = 384, 256
    wt = _weights(n, k, 3)[kind]
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(4)).bfloat16()  # 2 row tiles
    cpu = torch.device("cpu")
    whole = torch_ref.TorchLinear()
    whole.prepare(wt, None, torch.bfloat16, cpu)
    ref = torch_ref.mm_rows(x, dequantize(wt, torch.bfloat16).float().t())
    assert torch.equal(whole(x), ref) and torch.equal(whole(x[:1]), ref[:1])
    with monkeypatch.context() as mp:
        mp.setattr(torch_ref.packed, "LINEAR_SCRATCH_BYTES", 128 * k * 4)  # 128 rows of fp32
        tiled = torch_ref.TorchLinear()
        tiled.prepare(wt, None, torch.bfloat16, cpu)
    assert len(tiled.tiles) == 3
    new = [tiled(x), tiled(x[3:4]), whole(x)]
    monkeypatch.setattr(torch_ref.packed, "_scratch_ok", lambda t: False)  # the per-call tensors
    assert torch.equal(new[0], tiled(x)) and torch.equal(new[0], ref)
    assert torch.equal(new[1], ref[3:4]) and torch.equal(new[2], ref)


@pytest.mark.parametrize("kind", ["bf16", "int4-ct", "mxfp4", "int4-quark-g32"])
def test_looped_moe_scratch_gives_the_same_bits(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts too big to gather (the full-width case) run one at a time, their gate/up rows in row
    tiles through the scratch: the same bits as decoding each whole expert per call."""
    e, inter, hidden = 4, 128, 256
    gate = [_weights(inter, hidden, 10 + i)[kind] for i in range(e)]
    up = [_weights(inter, hidden, 20 + i)[kind] for i in range(e)]
    down = [_weights(hidden, inter, 30 + i)[kind] for i in range(e)]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, hidden, generator=g).bfloat16()
    ids = torch.randint(0, e, (7, 2), generator=g)
    wts = torch.rand(7, 2, generator=g)
    monkeypatch.setattr(torch_ref.moe, "_MOE_ALL_BYTES", 0)
    monkeypatch.setattr(torch_ref.moe, "_MOE_GATHER_BYTES", 0)
    monkeypatch.setattr(torch_ref.packed, "LINEAR_SCRATCH_BYTES", 128 * hidden * 4)
    op = torch_ref.TorchMoE()
    op.prepare(gate, up, down, None, torch.bfloat16, torch.device("cpu"))
    assert op.path == "loop" and len(op.tiles13) == 2
    new = op(x, ids, wts)
    monkeypatch.setattr(torch_ref.packed, "_scratch_ok", lambda t: False)
    assert torch.equal(new, op(x, ids, wts))


@pytest.mark.parametrize("packing", ["ct", "quark", "quark_order"])
def test_int4_codes_unpacked_into_the_scratch(packing: str) -> None:
    """The table unpack of INT4 words gives the codec's codes for every packing and nibble."""
    g = torch.Generator().manual_seed(6)
    codes = torch.randint(-8, 8, (2, 40, 64), generator=g, dtype=torch.int8)
    words = (codecs.quark_int4_pack(codes, reorder=packing == "quark") if packing != "ct"
             else torch.stack([codecs.ct_int4_quantize(torch.randn(40, 64, generator=g).bfloat16(), 32)[0]
                               for _ in range(2)]))
    ws = [[Int4Weight(words[i], torch.ones(40), None, packing=packing, in_features=64)] for i in range(2)]
    bank = torch_ref._Bank(ws, torch.bfloat16, torch.device("cpu"))
    for e in range(2):
        got = bank.int_codes(e, (8, 40), "test")
        assert got.dtype == torch.int8 and torch.equal(got, unpack_int4(words[e, 8:40], packing, 64))


@pytest.mark.parametrize("act", ["int8", "fp8"])
def test_w4a8_experts_exact_path_gives_the_same_bits(act: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """W4A8 experts (Quark per-channel INT4, int8 or FP8 activations): the codes unpacked into the
    scratch and, for FP8 activations, the exact int8-digit GEMMs give the bits of the float64 sums."""
    e, inter, hidden = 3, 64, 128
    g = torch.Generator().manual_seed(7)

    def expert(rows: int, cols: int) -> Int4Weight:
        codes = torch.randint(-8, 8, (rows, cols), generator=g, dtype=torch.int8)
        return Int4Weight(codecs.quark_int4_pack(codes), torch.rand(rows, generator=g) / 64 + 1e-3, None,
                          packing="quark", in_features=cols)

    gate, up, down = ([expert(inter, hidden) for _ in range(e)], [expert(inter, hidden) for _ in range(e)],
                      [expert(hidden, inter) for _ in range(e)])
    x = (torch.randn(6, hidden, generator=g) * 3).bfloat16()
    ids = torch.randint(0, e, (6, 2), generator=g)
    wts = torch.rand(6, 2, generator=g)
    op = torch_ref.TorchMoE()
    op.prepare(gate, up, down, act, torch.bfloat16, torch.device("cpu"))
    lin = torch_ref.TorchLinear()
    lin.prepare(gate[0], act, torch.bfloat16, torch.device("cpu"))
    new = op(x, ids, wts), lin(x), lin(x[:1])
    monkeypatch.setattr(torch_ref.packed, "_scratch_ok", lambda t: False)
    assert torch.equal(new[0], op(x, ids, wts))
    assert torch.equal(new[1], lin(x)) and torch.equal(new[2], lin(x[:1]))
    if act == "fp8":  # and the float64 reference itself
        w64 = gate[0].unpack().to(torch.float64)
        ref = torch_ref.fp8_linear(x, w64, torch_ref.int4_channel_scale(gate[0])).to(torch.bfloat16)
        assert torch.equal(new[1], ref)
