"""eagle3.formats.codecs: round trips (hypothesis), independent references, and bit-exact parity with
the compressed-tensors library and AMD Quark 0.13's own primitives.

The library tests skip only when the library is not installed. Quark is imported once for the whole
module (module-scoped fixture); its import takes 20-40 s, so QUARK_DISABLE_COMPILE must be set first
(it only turns off torch.compile of fake-quant ops, whose results are identical).
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from eagle3.errors import ShapeError  # noqa: E402
from eagle3.formats import codecs as C  # noqa: E402

HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
HYP_SLOW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _codes(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (FP8 tensors compare through their byte view)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


# The INT4 tie pattern: with amax 7.5 * 2**-5 the scale is exactly 2**-5, so w / scale hits .5 ties.
_INT4_TIES = torch.tensor([0.5, -1.5, 2.5, -3.5, 4.5, -5.5, 6.5, 7.5]) * 2.0**-5
# The MXFP4 tie pattern: amax 6 gives scale 1, so every element but -6 is an E2M1 midpoint.
_FP4_TIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0])


def _weight(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A random weight with what breaks sloppy quantizers: outliers, an all-zero row, an all-zero
    32-block, a row of exact INT4 ties and a row of exact E2M1 ties."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[1, 3] = 0.7
    w[n - 1, k // 2] = -1.3
    w[0] = 0
    w[2, 32:64] = 0
    w[3] = _INT4_TIES.repeat(k // 8)
    w[4] = _FP4_TIES.repeat(k // 8)
    return w.to(dtype)


# ---------------------------------------------------------------------------------------------
# Bit layouts and round trips (no external library)
# ---------------------------------------------------------------------------------------------


def test_ct_int4_known_word():
    # compressed-tensors pack-quantized: codes [-8,-7,-1,0,1,2,6,7] -> 0xFEA98710 (as an int32 bit pattern).
    q = torch.tensor([[-8, -7, -1, 0, 1, 2, 6, 7]], dtype=torch.int8)
    assert C.ct_int4_pack(q).item() == 0xFEA98710 - 2**32


def test_quark_reorder_byte_layout():
    # Quark's reorder packing: byte0=(v2<<4|v0), byte1=(v6<<4|v4), byte2=(v3<<4|v1), byte3=(v7<<4|v5).
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, -8]], dtype=torch.int8)
    v = [int(x) & 0xF for x in q[0]]
    want = [v[2] << 4 | v[0], v[6] << 4 | v[4], v[3] << 4 | v[1], v[7] << 4 | v[5]]
    got = C.quark_int4_pack(q, reorder=True).view(torch.uint8).tolist()[0]
    assert got == want
    natural = C.quark_int4_pack(q, reorder=False).view(torch.uint8).tolist()[0]
    assert natural == [v[1] << 4 | v[0], v[3] << 4 | v[2], v[5] << 4 | v[4], v[7] << 4 | v[6]]


@HYP
@given(n=st.integers(1, 5), k=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_int4_pack_round_trips(n, k, seed):
    q = _codes(n, k, seed)
    packed = C.ct_int4_pack(q)
    assert packed.dtype == torch.int32 and packed.shape == (n, (k + 7) // 8)
    assert torch.equal(C.ct_int4_unpack(packed, k), q)
    for reorder in (True, False):
        packed = C.quark_int4_pack(q, reorder)
        assert packed.shape == (n, (k + 7) // 8)
        assert torch.equal(C.quark_int4_unpack(packed, reorder, k), q)
    # The two formats differ only by the +8 offset (= flipping bit 3 of every nibble) in natural order.
    if k % 8 == 0:
        flipped = C.quark_int4_pack(q, reorder=False) ^ torch.tensor(0x88888888 - 2**32, dtype=torch.int32)
        assert torch.equal(flipped, C.ct_int4_pack(q))


@HYP
@given(n=st.integers(1, 4), k=st.integers(1, 40).map(lambda x: 2 * x), seed=st.integers(0, 2**16))
def test_fp4_pack_round_trip(n, k, seed):
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = C.fp4_pack(codes)
    assert packed.shape == (n, k // 2)
    assert torch.equal(packed & 0xF, codes[:, 0::2])  # even element in the low nibble
    assert torch.equal(C.fp4_unpack(packed), codes)


def _fp4_reference(x: float) -> int:
    """Nearest E2M1 value by exhaustive search; ties -> even mantissa (even grid index); saturating;
    a result of zero is +0."""
    a = min(abs(x), 6.0)
    dists = [abs(a - v) for v in C.E2M1_VALUES]
    best = min(dists)
    idx = min(i for i, d in enumerate(dists) if d == best and (i % 2 == 0 or dists.count(best) == 1))
    return idx | (8 if x < 0 and idx else 0)


_SPECIAL_FP4 = [0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e9, 1e-40, -0.25, -5.0, -100.0]


@HYP
@given(xs=st.lists(st.one_of(st.floats(-8, 8, width=32), st.sampled_from(_SPECIAL_FP4)), min_size=1, max_size=64))
def test_fp4_encode_matches_exhaustive_reference(xs):
    x = torch.tensor(xs, dtype=torch.float32)
    assert C.fp4_encode(x).tolist() == [_fp4_reference(v) for v in x.tolist()]


def test_fp4_encode_decode_is_identity_on_the_grid():
    codes = torch.arange(16, dtype=torch.uint8)
    back = C.fp4_encode(C.fp4_decode(codes))
    assert torch.equal(back[codes != 8], codes[codes != 8])
    assert back[8] == 0  # -0 encodes as +0


def test_e8m0_round_trip():
    e = torch.arange(0, 255, dtype=torch.uint8)
    f = C.e8m0_to_float(e)
    assert torch.equal(f[1:], torch.exp2(torch.arange(-126, 128, dtype=torch.float64)).float())
    assert torch.equal(C.float_to_e8m0(f)[1:], e[1:])  # byte 0 (2**-127) reads back as 1, like Quark
    assert torch.isnan(C.e8m0_to_float(torch.tensor([255], dtype=torch.uint8))).all()


@HYP
@given(n=st.integers(1, 4), groups=st.integers(1, 4), seed=st.integers(0, 2**16), log_mag=st.integers(-20, 20))
def test_mxfp4_round_trip(n, groups, seed, log_mag):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, 32 * groups, generator=g) * 2.0**log_mag
    packed, scale = C.mxfp4_quantize(w)
    assert packed.dtype == torch.uint8 and packed.shape == (n, 16 * groups)
    assert scale.dtype == torch.uint8 and scale.shape == (n, groups)
    deq = C.mxfp4_dequantize(packed, scale)
    # "even" scales keep |x| / scale < 7: clipping to 6 and half the top grid step (2) both cost at
    # most 1 * scale.
    s = C.e8m0_to_float(scale).repeat_interleave(32, dim=1)
    assert ((deq - w).abs() <= s).all()
    # Dequantized values are on the grid: quantizing them again is the identity.
    assert torch.equal(C.mxfp4_quantize(deq)[0], packed)


@HYP
@given(n=st.integers(1, 6), k=st.integers(1, 8).map(lambda x: 32 * x), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), group=st.sampled_from([None, 32]))
def test_quark_int4_round_trip_error_is_half_a_step(n, k, seed, dtype, group):
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)
    if group is None:
        packed, scale = C.quark_int4_per_channel_quantize(w, scale_dtype=torch.float32)
        deq = C.quark_int4_per_channel_dequantize(packed, scale, k)
        step = scale[:, None].expand(n, k)
    else:
        packed, scale = C.quark_int4_per_group_quantize(w, group, scale_dtype=torch.float32)
        assert packed.shape == (k, (n + 7) // 8) and scale.shape == (k // group, n)
        deq = C.quark_int4_per_group_dequantize(packed, scale)
        step = scale.t().repeat_interleave(group, dim=1)
    # Half a step, plus the clipping of |w / s| <= 7.5 * (1 + 2**-8) (bf16-rounded scale) to 7.
    assert ((deq - w.float()).abs() <= 0.53 * step).all()


def test_w4a8_round_trip_and_layout():
    w = _weight(24, 256, torch.float32)
    packed, s1, s2 = C.w4a8_quantize(w)
    assert packed.shape == (24, 32) and packed.dtype == torch.int32
    assert s1.shape == () and s1.dtype == torch.float32 and s2.shape == (24,) and s2.dtype == torch.float32
    assert s1.item() == pytest.approx(6.0 / 448)  # the E2M1 tie row holds the largest magnitude
    deq = C.w4a8_dequantize(packed, s1, s2, 256)
    assert ((deq - w).abs() <= (0.51 * s2 * s1)[:, None] + 0.07 * w.abs()).all()  # INT4 step + FP8 rel. error


def test_fp8_per_channel_and_per_tensor_round_trip():
    w = _weight(16, 128, torch.float32)
    for quantize in (C.fp8_per_channel_quantize, C.fp8_per_tensor_quantize):
        q, s = quantize(w)
        assert q.dtype == torch.float8_e4m3fn
        deq = C.fp8_dequantize(q, s, torch.float32)
        s_rows = s.reshape(-1, 1) if s.dim() else s
        assert ((deq - w).abs() <= w.abs() / 16 + s_rows * 2.0**-9).all()  # 3 mantissa bits + subnormals


def test_ct_int4_dequantize_dtype_semantics():
    q = _codes(4, 64, 1)
    scale = (torch.rand(4, 2, generator=torch.Generator().manual_seed(1)) + 0.1).to(torch.bfloat16)
    packed = C.ct_int4_pack(q)
    exact = q.float() * scale.float().repeat_interleave(32, dim=1)
    assert torch.equal(C.ct_int4_dequantize(packed, scale, (4, 64), torch.float32), exact)
    assert torch.equal(C.ct_int4_dequantize(packed, scale, (4, 64)), exact.to(torch.bfloat16))
    assert torch.equal(C.ct_int4_dequantize(packed, scale.float(), torch.tensor([4, 64]), torch.bfloat16),
                       exact.to(torch.bfloat16))
    # A ragged K (not a multiple of 8: the last word is padded) through the table-lookup fp32 path.
    q, scale = _codes(3, 60, 2), torch.rand(3, 2, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = C.ct_int4_dequantize(C.ct_int4_pack(q), scale, (3, 60), torch.float32)
    assert got.is_contiguous() and torch.equal(got, q.float() * scale.float().repeat_interleave(30, dim=1))


def _fp8_block_dequant_loop(w: torch.Tensor, s: torch.Tensor, bn: int = 128, bk: int = 128) -> torch.Tensor:
    """Independent reference: one block at a time."""
    out = torch.empty(w.shape, dtype=torch.float32)
    for i in range(0, w.shape[0], bn):
        for j in range(0, w.shape[1], bk):
            out[i:i + bn, j:j + bk] = w[i:i + bn, j:j + bk].float() * s[i // bn, j // bk].float()
    return out


@pytest.mark.parametrize("shape", [(128, 128), (300, 200), (7, 130), (256, 512)])
def test_fp8_block_dequantize_matches_loop_reference(shape):
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=g)
    q, s = C.fp8_block_quantize(w)
    assert s.shape == ((shape[0] + 127) // 128, (shape[1] + 127) // 128)
    ref = _fp8_block_dequant_loop(q, s)
    assert torch.equal(C.fp8_block_dequantize(q, s, dtype=torch.float32), ref)
    assert torch.equal(C.fp8_block_dequantize(q, s), ref.to(torch.bfloat16))
    assert ((ref - w).abs() <= w.abs() / 16 + 2.0**-9).all()


def test_shape_errors_name_the_tensor():
    with pytest.raises(ShapeError, match="weight_scale_inv"):
        C.fp8_block_dequantize(torch.zeros(256, 128).to(torch.float8_e4m3fn), torch.ones(1, 1))
    with pytest.raises(ShapeError, match="weight_packed"):
        C.ct_int4_dequantize(torch.zeros(4, 3, dtype=torch.int32), torch.ones(4, 1), (4, 32))
    with pytest.raises(ShapeError, match="weight_scale"):
        C.ct_int4_dequantize(torch.zeros(4, 4, dtype=torch.int32), torch.ones(4, 3), (4, 32))
    with pytest.raises(ShapeError, match="group size"):
        C.quark_int4_per_group_quantize(torch.zeros(8, 96), 128)
    with pytest.raises(ShapeError, match="MXFP4"):
        C.mxfp4_dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ShapeError, match="weight_scale"):
        C.fp8_dequantize(torch.zeros(4, 8).to(torch.float8_e4m3fn), torch.ones(3))


# ---------------------------------------------------------------------------------------------
# compressed-tensors
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ct():
    return pytest.importorskip("compressed_tensors")


@HYP
@given(n=st.integers(1, 5), k=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_ct_pack_unpack_match_library(ct, n, k, seed):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    q = _codes(n, k, seed)
    packed = pack_to_int32(q, 4)
    assert torch.equal(C.ct_int4_pack(q), packed)
    assert torch.equal(C.ct_int4_unpack(packed, k), unpack_from_int32(packed, 4, torch.Size([n, k])))


def _ct_group_args():
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)


@pytest.mark.parametrize("shape", [(8, 64), (33, 224)])
def test_ct_dequantize_matches_library(ct, shape):
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    n, k = shape
    q = _codes(n, k, n)
    scale = (torch.rand(n, k // 32, generator=torch.Generator().manual_seed(k)) * 0.01).to(torch.bfloat16)
    packed = C.ct_int4_pack(q)
    ref = dequantize(x_q=q, scale=scale, args=_ct_group_args())
    assert _bits_equal(C.ct_int4_dequantize(packed, scale, shape), ref)
    # Quark's file-to-file reader upcasts the scale first: that is our dtype=float32.
    ref32 = dequantize(x_q=q, scale=scale.float(), args=_ct_group_args())
    assert _bits_equal(C.ct_int4_dequantize(packed, scale, shape, torch.float32), ref32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ct_quantize_matches_library(ct, dtype):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    w = _weight(24, 128, dtype)
    wg = w.reshape(24, 4, 32)
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), _ct_group_args())
    q = quantize(w, scale, zp, _ct_group_args(), dtype=torch.int8)
    packed, our_scale = C.ct_int4_quantize(w, 32)
    assert _bits_equal(our_scale, scale)
    assert torch.equal(packed, pack_to_int32(q, 4))


_KIMI_CT_CONFIG = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}


def test_ct_dequantizer_on_kimi_tensors(ct, tmp_path):
    """The library's own Kimi-config dequantizer agrees bit for bit."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": _KIMI_CT_CONFIG}))
    g = torch.Generator().manual_seed(7)
    tensors, ours = {}, {}
    for name, (n, k) in {"model.layers.1.mlp.experts.0.gate_proj": (16, 64),
                         "model.layers.1.mlp.experts.0.down_proj": (64, 96)}.items():
        q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
        scale = (torch.rand(n, k // 32, generator=g) * 0.01).to(torch.bfloat16)
        tensors[f"{name}.weight_packed"] = C.ct_int4_pack(q)
        tensors[f"{name}.weight_scale"] = scale
        tensors[f"{name}.weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
        ours[f"{name}.weight"] = C.ct_int4_dequantize(tensors[f"{name}.weight_packed"], scale, (n, k))
    attn = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    tensors["model.layers.1.self_attn.q_a_proj.weight"] = attn
    out = CompressedTensorsDequantizer(tmp_path).process(dict(tensors))
    assert set(out) == set(ours) | {"model.layers.1.self_attn.q_a_proj.weight"}
    for name, w in ours.items():
        assert _bits_equal(out[name], w), name
    assert torch.equal(out["model.layers.1.self_attn.q_a_proj.weight"], attn)


@pytest.mark.parametrize("shape", [(300, 200), (128, 256)])
def test_fp8_block_dequantize_matches_ct_fp8_dequantizer(ct, shape):
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    w = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    q, s = C.fp8_block_quantize(w)
    out = FP8BlockDequantizer(targets=["re:.*"]).process({"m.weight": q, "m.weight_scale_inv": s})
    assert _bits_equal(out["m.weight"], C.fp8_block_dequantize(q, s))


# ---------------------------------------------------------------------------------------------
# AMD Quark 0.13
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quark():
    """Import Quark once per module; skip only if it is not installed."""
    pytest.importorskip("quark")
    import quark.torch  # noqa: F401  (slow: scans transformers and JIT-loads a C++ extension)
    import quark.torch.kernel
    from quark.torch.quantization.config import config as cfg
    from quark.torch.quantization.config.template import INT4_FP8Scheme, PTPCFP8Scheme
    from quark.torch.quantization.tensor_quantize import FakeQuantizeBase
    from quark.torch.utils.numerics import to_e8m0_uint8
    from quark.torch.utils.pack import create_pack_method

    return {"kernel": quark.torch.kernel, "cfg": cfg, "FakeQuantizeBase": FakeQuantizeBase,
            "to_e8m0_uint8": to_e8m0_uint8, "create_pack_method": create_pack_method,
            "int4_fp8": INT4_FP8Scheme().config.weight, "ptpc_fp8": PTPCFP8Scheme().config.weight}


def _quark_quantize(Q, w: torch.Tensor, spec):
    """Quark's per-tensor primitives, the sequence file2file runs per weight: observer -> scale,
    scaled_real_quantize -> codes. Returns (unpacked quantized tensor, scale as observed)."""
    fq = Q["FakeQuantizeBase"].get_fake_quantize(spec)
    fq.enable_observer()
    fq.disable_fake_quant()
    fq(w)
    q = Q["kernel"].scaled_real_quantize(spec.dtype.value, w, fq.scale, fq.zero_point, spec.ch_axis, spec.group_size,
                                         fq.quant_min, fq.quant_max, spec.round_method.value, spec.qscheme.value)
    return q, fq.scale


@HYP_SLOW
@given(n=st.integers(1, 9), k=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_quark_int4_pack_matches_quark(quark, n, k, seed):
    q = _codes(n, k, seed)
    for reorder in (True, False):
        pc = quark["create_pack_method"](qscheme="per_channel", dtype="int4")
        packed = pc.pack(q.to(torch.int32), reorder)
        assert torch.equal(C.quark_int4_pack(q, reorder), packed)
        # (Quark's origin_packed_axis_size trims dim 0, so trim the columns by hand)
        assert torch.equal(C.quark_int4_unpack(packed, reorder, k), pc.unpack(packed, reorder)[:, :k])
        # per_group packing transposes first: [K, ceil(N/8)]
        pg = quark["create_pack_method"](qscheme="per_group", dtype="int4")
        assert torch.equal(C.quark_int4_pack(q.t(), reorder), pg.pack(q.to(torch.int32), reorder))


@HYP
@given(xs=st.lists(st.one_of(st.floats(-7, 7, width=32), st.sampled_from(_SPECIAL_FP4)), min_size=2, max_size=64)
       .filter(lambda v: len(v) % 2 == 0))
def test_fp4_encode_and_pack_match_quark(quark, xs):
    x = torch.tensor(xs, dtype=torch.float32)
    rounded = torch.ops.quark.fake_quantize_to_low_precision_fp(x.contiguous(), 2, 1, 6.0, 0)
    ours = C.fp4_encode(x)
    assert torch.equal(C.fp4_decode(ours), rounded)
    assert torch.equal(C.fp4_pack(ours), quark["create_pack_method"](qscheme="per_group", dtype="fp4").pack(rounded, True))


def test_e8m0_matches_quark(quark):
    g = torch.Generator().manual_seed(0)
    scales = torch.cat([torch.exp2(torch.arange(-149, 128, dtype=torch.float32)), torch.zeros(1),
                        torch.rand(2000, generator=g) * torch.exp2(torch.randint(-130, 120, (2000,), generator=g).float())])
    assert torch.equal(C.float_to_e8m0(scales), quark["to_e8m0_uint8"](scales))


_SHAPES = [(64, 256), (36, 384), (8, 128)]
_DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("shape", _SHAPES, ids=str)
def test_int4_per_channel_matches_quark(quark, shape, dtype):
    cfg, w = quark["cfg"], _weight(*shape, dtype)
    for scale_type, scale_dtype in (("float", None), ("float32", torch.float32)):
        spec = cfg.Int4PerChannelSpec(ch_axis=0, symmetric=True, is_dynamic=False, scale_type=scale_type,
                                      round_method="half_even").to_quantization_spec()
        q, scale = _quark_quantize(quark, w, spec)
        pack = quark["create_pack_method"](qscheme="per_channel", dtype="int4")
        for reorder in (True, False):
            packed, our_scale = C.quark_int4_per_channel_quantize(w, reorder, scale_dtype)
            assert torch.equal(packed, pack.pack(q, reorder)), (scale_type, reorder)
            assert _bits_equal(our_scale, scale), scale_type
        deq = quark["kernel"].dequantize("int4", q, scale, torch.zeros_like(scale, dtype=torch.int32), 0, None,
                                         "per_channel")
        assert _bits_equal(C.quark_int4_per_channel_dequantize(packed, our_scale, shape[1], False, deq.dtype), deq)


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("shape", _SHAPES, ids=str)
@pytest.mark.parametrize("group", [32, 128])
def test_int4_per_group_matches_quark(quark, shape, dtype, group):
    cfg, w = quark["cfg"], _weight(*shape, dtype)
    spec = cfg.Int4PerGroupSpec(ch_axis=-1, group_size=group, symmetric=True, is_dynamic=False,
                                round_method="half_even").to_quantization_spec()
    q, scale = _quark_quantize(quark, w, spec)  # scale [N, K/g] as observed; the export transposes it
    packed, our_scale = C.quark_int4_per_group_quantize(w, group)
    assert torch.equal(packed, quark["create_pack_method"](qscheme="per_group", dtype="int4").pack(q, True))
    assert _bits_equal(our_scale, scale.t().contiguous())
    deq = quark["kernel"].dequantize("int4", q, scale, torch.zeros_like(scale, dtype=torch.int32), -1, group,
                                     "per_group")
    assert _bits_equal(C.quark_int4_per_group_dequantize(packed, our_scale, True, deq.dtype), deq)


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("shape", _SHAPES, ids=str)
def test_mxfp4_matches_quark(quark, shape, dtype):
    w = _weight(*shape, dtype)
    spec = quark["cfg"].OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec()
    q, scale = _quark_quantize(quark, w, spec)
    packed, e8m0 = C.mxfp4_quantize(w)
    assert torch.equal(packed, quark["create_pack_method"](qscheme="per_group", dtype="fp4").pack(q, True))
    assert torch.equal(e8m0, quark["to_e8m0_uint8"](scale))
    assert e8m0[0, 0] == 1  # all-zero block: Quark's 2**-127 scale is stored as byte 1


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("shape", _SHAPES, ids=str)
def test_fp8_per_tensor_and_per_channel_match_quark(quark, shape, dtype):
    cfg, w = quark["cfg"], _weight(*shape, dtype)
    ptpc = quark["ptpc_fp8"]  # the fp8-draft recipe's weight spec (FP8 per-channel, static, scale_type float)
    cases = [
        (cfg.FP8E4M3PerTensorSpec(observer_method="min_max", is_dynamic=False, scale_type="float32")
         .to_quantization_spec(), C.fp8_per_tensor_quantize, torch.float32),
        (cfg.FP8E4M3PerTensorSpec(observer_method="min_max", is_dynamic=False, scale_type="float")
         .to_quantization_spec(), C.fp8_per_tensor_quantize, None),
        (ptpc, C.fp8_per_channel_quantize, None),
        (cfg.FP8E4M3PerChannelSpec(ch_axis=0, is_dynamic=False, scale_type="float32").to_quantization_spec(),
         C.fp8_per_channel_quantize, torch.float32),
    ]
    for spec, quantize, scale_dtype in cases:
        q, scale = _quark_quantize(quark, w, spec)
        ours, our_scale = quantize(w, scale_dtype)
        assert _bits_equal(ours, q), (spec.qscheme, scale_dtype)
        assert _bits_equal(our_scale, scale), (spec.qscheme, scale_dtype)
        axis = 0 if spec.qscheme.value == "per_channel" else None
        deq = quark["kernel"].dequantize("fp8_e4m3", q, scale, None, axis, None, spec.qscheme.value)
        assert _bits_equal(C.fp8_dequantize(ours, our_scale, deq.dtype), deq)


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("shape", _SHAPES, ids=str)
def test_w4a8_matches_quark_progressive(quark, shape, dtype):
    """The int4_fp8 scheme (= the Kimi-K2.5-W4A8 ProgressiveSpec) through Quark's file-to-file
    per-weight function and through the in-memory SequentialQuantize + export real-quantizer."""
    from quark.torch.export.nn.modules.realquantizer import get_real_quantizer
    from quark.torch.quantization.file2file_quantization import _progressive_quantize_weight

    w, spec = _weight(*shape, dtype), quark["int4_fp8"]
    out: dict[str, torch.Tensor] = {}
    _progressive_quantize_weight(w, "m.weight", "m", spec, out, "model.safetensors", "cpu")
    packed, s1, s2 = C.w4a8_quantize(w)
    assert torch.equal(packed, out["m.weight"])
    assert _bits_equal(s1, out["m.weight_scale"])
    assert _bits_equal(s2, out["m.weight_scale_2"])

    seq = quark["FakeQuantizeBase"].get_fake_quantize(spec)
    seq.enable_observer()
    seq.disable_fake_quant()
    seq(w)
    real = get_real_quantizer(qspec=spec, quantizer=seq, reorder=True, real_quantized=True, float_dtype=w.dtype,
                              device="cpu")
    packed, s1, s2 = C.w4a8_quantize(w, stage2_dtype=None)
    assert torch.equal(packed, real.to_real_quantize_params(w))
    assert _bits_equal(s1, seq[0].scale)
    assert _bits_equal(s2, seq[1].scale.float())


def test_single_stage_file2file_layout(quark):
    """Quark 0.13 file-to-file INT4: natural nibble order, fp32 scales, per-group scale NOT transposed
    - i.e. our export-layout functions with reorder=False / scale.T."""
    from quark.torch.quantization.file2file_quantization import _single_stage_quantize_weight

    cfg, w = quark["cfg"], _weight(64, 256, torch.bfloat16)
    pc = cfg.Int4PerChannelSpec(ch_axis=0, symmetric=True, is_dynamic=False).to_quantization_spec()
    out: dict[str, torch.Tensor] = {}
    _single_stage_quantize_weight(w, "m.weight", "m", pc, out, "model.safetensors")
    packed, scale = C.quark_int4_per_channel_quantize(w, reorder=False, scale_dtype=torch.float32)
    assert torch.equal(out["m.weight"], packed) and _bits_equal(out["m.weight_scale"], scale)
    pg = cfg.Int4PerGroupSpec(ch_axis=-1, group_size=32, symmetric=True, is_dynamic=False).to_quantization_spec()
    out = {}
    _single_stage_quantize_weight(w, "m.weight", "m", pg, out, "model.safetensors")
    packed, scale = C.quark_int4_per_group_quantize(w, 32, reorder=False, scale_dtype=torch.float32)
    assert torch.equal(out["m.weight"], packed) and _bits_equal(out["m.weight_scale"], scale.t())


# ---------------------------------------------------------------------------------------------
# GPU: the runtime decodes on the accelerator, so decoding must give the CPU bits there too
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_decoders_on_gpu_match_cpu():
    dev = torch.device("cuda")
    w = _weight(72, 256, torch.bfloat16)
    cases = [
        (C.quark_int4_per_channel_dequantize, C.quark_int4_per_channel_quantize(w)),
        (C.quark_int4_per_group_dequantize, C.quark_int4_per_group_quantize(w, 32)),
        (C.w4a8_dequantize, C.w4a8_quantize(w.float())),
        (C.mxfp4_dequantize, C.mxfp4_quantize(w)),
        (C.fp8_dequantize, C.fp8_per_channel_quantize(w)),
        (C.fp8_block_dequantize, C.fp8_block_quantize(w.float())),
    ]
    for decode, args in cases:
        assert _bits_equal(decode(*(a.to(dev) for a in args)).cpu(), decode(*args)), decode.__name__
    packed, scale = C.ct_int4_quantize(w)
    assert _bits_equal(C.ct_int4_dequantize(packed.to(dev), scale.to(dev), (72, 256)).cpu(),
                       C.ct_int4_dequantize(packed, scale, (72, 256)))
    q = _codes(9, 40, 0)
    for reorder in (True, False):
        assert torch.equal(C.quark_int4_pack(q.to(dev), reorder).cpu(), C.quark_int4_pack(q, reorder))
    assert torch.equal(C.ct_int4_pack(q.to(dev)).cpu(), C.ct_int4_pack(q))


@pytest.mark.parametrize("shape", [(8, 1), (1, 8), (16, 3), (2, 3, 8)])
def test_quark_int4_fast_paths_accept_any_strides(shape: tuple[int, ...]) -> None:
    """Regression: a transposed [8, 1] is "contiguous" with stride 1 on its size-1 dim, which the
    int64 bit-move paths must not .view() directly (it raised in a CI run)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    for codes in (q.transpose(0, 1), q):
        for reorder in (True, False):
            if codes.shape[-1] % 8:
                continue
            packed = C.quark_int4_pack(codes, reorder)
            ref = C._pack_nibbles(codes.to(torch.int32) & 0xF, C._SHIFTS_REORDER if reorder else C._SHIFTS_NATURAL)
            assert torch.equal(packed, ref)
            assert torch.equal(C.quark_int4_unpack(packed.t().contiguous().t() if packed.dim() == 2 else packed,
                                                   reorder), codes)


# ---------------------------------------------------------------------------------------------
# Fast quantizer paths == the plain element-wise formulations, bit for bit, on edge cases
# ---------------------------------------------------------------------------------------------


def _edge_weight(k: int = 256) -> torch.Tensor:
    """Rows that stress the table-lookup paths: E2M1 midpoints and grid values at block scales
    2**-127 .. 2**125 (amax 6 * 2**p), the same nudged by one ulp either way, INT4 ties, +-0 and
    all-zero blocks, fp32 subnormals (1e-42, 1e-40, 1e-45), values near fp32 max (e = 127, whose
    reciprocal 2**-127 is subnormal), and plain normals from 1e-3 to 1e3."""
    g = torch.Generator().manual_seed(7)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    grid = torch.tensor(C.E2M1_VALUES)
    ties = torch.cat([mids, grid, -mids, -grid]).repeat(k // 30 + 1)[:k]
    ties[0] = 6.0
    rows = [ties * 2.0**p for p in (-140, -130, -127, -126, -100, -3, 0, 7, 100, 125)]
    rows += [torch.nextafter(ties, torch.full_like(ties, d)) for d in (1e30, -1e30)]
    rows += [(_INT4_TIES * 2.0**5).repeat(k // 8) * 2.0**p for p in (-5, 0, 9)]
    rows += [torch.randn(k, generator=g) * s for s in (1e-3, 0.02, 1.0, 1e3, 1e-40, 1e37)]
    edge = torch.randn(6, k, generator=g) * 0.02
    edge[0] = 0.0
    edge[1] = -0.0
    edge[2, :32] = 0.0
    edge[2, 32:64] = -0.0
    edge[2, 64:96] = 1e-42
    edge[2, 96:128] = -1e-40
    edge[3, :64] = torch.tensor([1.4e-45, -2.8e-45] * 32)
    edge[3, 64:96] = 1e-38
    edge[4, :32] = 3.4e38
    edge[4, 32:64] = -2.6e38
    edge[4, 64] = 1.7e38
    edge[5, 7] = 500.0  # a saturating outlier
    return torch.cat([torch.stack(rows), edge])


def _mxfp4_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Divide by the ldexp block scale, encode with fp4_encode, pack: what Quark computes."""
    x = w.float().reshape(*w.shape[:-1], -1, 32)
    e = C.mxfp4_scale_even(x.abs().amax(-1, keepdim=True))
    codes = C.fp4_encode(x / torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)).reshape(w.shape)
    return C.fp4_pack(codes), (e.clamp(min=-126) + 127).to(torch.uint8).reshape(*w.shape[:-1], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mxfp4_fast_path_matches_reference_on_edge_cases(dtype):
    w = _edge_weight().to(dtype)
    keep = w.clone()
    packed, scale = C.mxfp4_quantize(w)
    ref_packed, ref_scale = _mxfp4_reference(w)
    assert torch.equal(packed, ref_packed) and torch.equal(scale, ref_scale)
    assert _bits_equal(w, keep)  # the caller reuses its chunk to measure the error
    assert torch.equal(C.mxfp4_quantize(w.t().contiguous().t())[0], packed)  # any strides
    assert scale.min() >= 1 and scale.max() == 254  # the e = 127 block (amax ~3.4e38) is in there


def test_mxfp4_table_is_fp4_encode_on_every_class():
    """Every fp32 whose bits share (sign, exponent, 2 mantissa bits, sticky rest) encodes alike: check
    each table entry on its lowest, a middle and its highest member (the full 2**32 sweep was run
    offline)."""
    i = torch.arange(4096, dtype=torch.int32)
    base = (i >> 1) << 21  # sign, exponent, 2 mantissa bits; an odd index has some lower bit set
    for low in (1, 0x100000, 0x1FFFFF):  # lowest, middle and highest member of an odd class
        y = (base | torch.where((i & 1) == 1, low, 0).to(torch.int32)).view(torch.float32)
        keep = ~torch.isnan(y)
        want = C.fp4_encode(y)[keep].to(torch.int32)
        got = C._FP4_X17_LUT.to(torch.int32)[keep]
        assert torch.equal(got & 0xF, want) and torch.equal(got >> 4, want)


def _w4a8_reference(w: torch.Tensor, s1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2 element-wise on the fp32 values of the FP8 stage (Quark file-to-file)."""
    x8 = C._fp8_cast(w / s1)
    q, s2 = C.quark_int4_quantize(x8.to(torch.float32))
    return C.quark_int4_pack(q, True), s2.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_w4a8_table_stage2_matches_elementwise_on_edge_cases(dtype):
    w = _edge_weight().to(dtype)
    w = w[torch.isfinite(w).all(1)]  # inf (bf16 of 3.4e38) -> NaN scales: no defined output
    keep = w.clone()
    for s1 in (None, C.fp8_per_tensor_scale(torch.tensor(0.05)), C.fp8_per_tensor_scale(torch.tensor(1e-30))):
        packed, got_s1, s2 = C.w4a8_quantize(w, True, torch.float32, s1)
        ref_packed, ref_s2 = _w4a8_reference(w, got_s1)
        assert torch.equal(packed, ref_packed) and _bits_equal(s2, ref_s2)
        assert _bits_equal(w, keep)


def test_quark_import_shim_only_skips_files_without_the_decorator(quark, tmp_path, monkeypatch):
    """tests/quark_speed.py lets Quark's transformers scan skip the modeling files that do not name
    the decorator it looks for: the unfiltered scan finds nothing in a sample of them, the filter
    passes the scan a file that names it and every other caller's source untouched, and Quark
    registered the decorated classes."""
    import random

    from quark.torch.utils.llm.module_replacement import quark_experts as qe
    from quark.torch.utils.llm.module_replacement.preprocess_registry import PREPROCESS_REGISTRY

    from tests import quark_speed

    assert qe.ast.parse is quark_speed._parse_unless_unmarked  # installed by tests/conftest.py
    assert any(c.__module__.startswith("transformers.models.") and v is qe.QuarkExperts
               for c, v in PREPROCESS_REGISTRY.items())
    files = sorted(qe.MODELS_ROOT.rglob("modeling_*.py"))
    texts = {f: f.read_text(encoding="utf-8") for f in files}
    unmarked = [f for f in files if quark_speed.MARKER not in texts[f]]
    root = tmp_path / "transformers"
    for f in random.Random(0).sample(unmarked, 24):  # the same relative paths: the scan's module names
        link = root / f.relative_to(qe.REPO_ROOT)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(f)
    with monkeypatch.context() as m:
        m.setattr(qe, "REPO_ROOT", root)
        m.setattr(qe, "MODELS_ROOT", root / "models")
        m.setattr(qe.ast, "parse", quark_speed._parse)
        assert qe._find_decorated_experts_classes() == []

    marked = next(t for t in texts.values() if quark_speed.MARKER in t)
    as_scanner = {"__name__": quark_speed.SCANNER, "parse": quark_speed._parse_unless_unmarked}
    assert eval("parse(src).body", as_scanner, {"src": "x = 1"}) == []
    assert eval("parse(src).body", as_scanner, {"src": marked}) != []
    assert qe.ast.unparse(qe.ast.parse("x = 1")) == "x = 1"
