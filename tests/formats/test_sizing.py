"""``eagle3.formats.sizing``: per-scheme tensor layouts against eagle3's own bit-exact encoders, and
the Linear selection of each quantization config. (Whole checkpoints, config vs headers, are checked
in tests/plan/test_plan.py.)"""

from __future__ import annotations

import pytest
import torch

from eagle3.checkpoint import tag_from_dtype
from eagle3.formats import codecs, sizing
from tests.formats.builders import CT_INT4_CONFIG, FP8_BLOCK_CONFIG, k25_config, text_config

N, K = 300, 256  # N not a multiple of the FP8 block: the scale grid rounds up


@pytest.mark.parametrize("scheme", [sizing.CT_INT4, sizing.QUARK_MXFP4, sizing.FP8_BLOCK])
def test_linear_layout_equals_the_encoders(scheme: str) -> None:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0))
    if scheme == sizing.CT_INT4:
        packed, scale = codecs.ct_int4_quantize(w.to(torch.bfloat16), 32)
        real = {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor([N, K], dtype=torch.int32)}
        fmt = sizing.LinearFormat(scheme, group_size=32)
    elif scheme == sizing.QUARK_MXFP4:
        packed, scale = codecs.mxfp4_quantize(w)
        real = {"weight": packed, "weight_scale": scale}
        fmt = sizing.LinearFormat(scheme, group_size=32)
    else:
        q, s = codecs.fp8_block_quantize(w.to(torch.bfloat16))
        real = {"weight": q, "weight_scale_inv": s}
        fmt = sizing.LinearFormat(scheme, block=(128, 128))
    got = {t.name.split(".", 1)[1]: (t.dtype, t.shape) for t in sizing.linear_tensors("m", N, K, fmt)}
    assert got == {k: (tag_from_dtype(v.dtype), tuple(v.shape)) for k, v in real.items()}


def _formats(cfg: dict) -> dict[str, str]:
    fmt = sizing.resolver(cfg)
    return {w.name: fmt(w.name, w.kind).scheme for w in sizing.logical_weights(cfg) if w.kind in ("linear", "router")}


def test_compressed_tensors_selection_routed_experts_only() -> None:
    f = _formats(k25_config(nested_quant=CT_INT4_CONFIG))
    quantized = {n for n, s in f.items() if s == sizing.CT_INT4}
    assert quantized and all(".mlp.experts." in n for n in quantized)
    assert all(".mlp.experts." not in n for n, s in f.items() if s == sizing.DENSE)


def test_fp8_block_selection_every_linear_but_head_and_router() -> None:
    f = _formats(text_config(FP8_BLOCK_CONFIG))
    assert f["lm_head"] == f["model.layers.1.mlp.gate"] == sizing.DENSE
    assert f["model.layers.0.self_attn.kv_a_proj_with_mqa"] == f["model.layers.1.mlp.experts.0.down_proj"] == \
        sizing.FP8_BLOCK


def test_quark_exclude_entries() -> None:
    qc = {"quant_method": "quark", "global_quant_config": {"weight": {"dtype": "fp4", "qscheme": "per_group",
                                                                      "group_size": 32}},
          "exclude": ["lm_head", "re:.*self_attn\\..*", "*mlp.gate", "model.layers.0.mlp.down_proj"]}
    f = _formats(text_config(qc))
    assert f["lm_head"] == f["model.layers.2.self_attn.o_proj"] == f["model.layers.3.mlp.gate"] == sizing.DENSE
    assert f["model.layers.0.mlp.down_proj"] == sizing.DENSE  # explicit name
    assert f["model.layers.0.mlp.up_proj"] == f["model.layers.3.mlp.experts.1.gate_proj"] == sizing.QUARK_MXFP4
    assert f["model.layers.3.mlp.shared_experts.down_proj"] == sizing.QUARK_MXFP4


def test_unknown_method_is_one_line() -> None:
    from eagle3.errors import FormatError

    with pytest.raises(FormatError, match="quant_method' is 'gptq'"):
        sizing.config_tensors(text_config({"quant_method": "gptq"}))
