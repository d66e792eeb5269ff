"""Layers against transformers' own building blocks: RoPE frequencies (YaRN as Kimi and the
drafts configure it, linear, llama3), the MLA softmax scale, interleaved and NeoX rotation,
RMSNorm (bit-exact in bf16) and the group-limited sigmoid router."""

from __future__ import annotations

import pytest
import torch

from eagle3.runtime.config import MLASpec, RopeSpec
from eagle3.runtime.kernels import get_backend
from eagle3.runtime.layers.moe import MoE
from eagle3.runtime.layers.norm import RMSNorm
from eagle3.runtime.layers.rotary import RotaryEmbedding, compute_inv_freq
from tests.runtime.model_kit import single_thread

_threads = pytest.fixture(scope="module", autouse=True)(single_thread)

BE = get_backend("torch")
K25_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
MLA_DIMS = {"num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16, "v_head_dim": 32, "hidden_size": 128, "max_position_embeddings": 262144}


def _hf_deepseek(rope_scaling: dict | None):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**MLA_DIMS, rope_theta=50000.0, rope_scaling=rope_scaling, num_hidden_layers=1,
                            vocab_size=64, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
                            num_experts_per_tok=2)


@pytest.mark.parametrize("scaling", [K25_YARN, {**K25_YARN, "beta_fast": 1.0}, {**K25_YARN, "mscale": 0.707},
                                     None], ids=["k2.5", "k2-thinking", "mscale-ratio", "default"])
def test_mla_rope_and_softmax_scale_match_transformers(scaling) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    hf = _hf_deepseek(scaling)
    cfg = {**MLA_DIMS, "rope_theta": 50000.0, "rope_scaling": scaling}
    spec = MLASpec.from_config(cfg, "test", 1e-5, None)
    inv, factor = compute_inv_freq(spec.rope)
    rtype = hf.rope_parameters["rope_type"]
    hf.head_dim = MLA_DIMS["qk_rope_head_dim"]  # transformers' DeepSeek rotary uses the rope dim
    if rtype == "default":
        want = 1.0 / (50000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
        hf_factor = 1.0
    else:
        want, hf_factor = ROPE_INIT_FUNCTIONS[rtype](hf)
    assert torch.equal(inv, want) and factor == pytest.approx(hf_factor, abs=0)
    attn = DeepseekV3Attention(_hf_deepseek(scaling), 0)
    assert spec.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    if scaling is K25_YARN:
        assert spec.softmax_scale == pytest.approx(48 ** -0.5 * 2.004740, rel=1e-5)


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                                     {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}])
def test_llama_draft_rope_matches_transformers(scaling) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32, rope_theta=50000.0,
                     rope_scaling=dict(scaling), max_position_embeddings=262144)
    spec = RopeSpec.from_config({"rope_theta": 50000.0, "rope_scaling": scaling, "max_position_embeddings": 262144},
                                32, interleaved=False, where="test")
    inv, factor = compute_inv_freq(spec)
    want, hf_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf)
    torch.testing.assert_close(inv, want, rtol=1e-6, atol=0)
    assert factor == pytest.approx(hf_factor)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotation_is_bit_exact_with_transformers_in_bf16(interleaved: bool) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    spec = RopeSpec(dim=16, theta=50000.0, interleaved=interleaved, kind="yarn", factor=64.0,
                    original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
    rot = RotaryEmbedding(spec, BE)
    pos = torch.tensor([0, 1, 7, 300, 5000])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 16, generator=g).to(torch.bfloat16)
    k = torch.randn(5, 1, 16, generator=g).to(torch.bfloat16)
    cos, sin = rot.cos_sin(pos, torch.bfloat16)
    freqs = pos[:, None].float() * rot.inv_freq
    emb = torch.cat([freqs, freqs], -1)
    hcos, hsin = emb.cos().to(torch.bfloat16)[None], emb.sin().to(torch.bfloat16)[None]
    fn = apply_rotary_pos_emb_interleave if interleaved else apply_rotary_pos_emb
    # transformers works on [batch, heads, seq, dim]
    hq, hk = fn(q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None], hcos, hsin)
    assert torch.equal(rot(q, cos, sin), hq[0].permute(1, 0, 2))
    assert torch.equal(rot(k, cos, sin), hk[0].permute(1, 0, 2))



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_rows_equal_per_step_cos_sin(dtype: torch.dtype) -> None:
    """The per-position cos/sin table (CPU) gives the bits of computing them for the step's
    positions, whatever the table's size or the positions' order and count."""
    spec = RopeSpec(dim=64, theta=50000.0, interleaved=True, kind="yarn", factor=32.0,
                    original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
    rot = RotaryEmbedding(spec, BE)
    for pos in (torch.tensor([5]), torch.tensor([3, 0, 255, 256, 1000, 7]), torch.arange(700, 300, -3)):
        cos, sin = rot.cos_sin(pos, dtype)
        ref_cos, ref_sin = rot._compute(pos, dtype)
        assert cos.dtype == dtype and torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert rot._tables[dtype][0].shape[0] == 1024  # grown by doubling, not per step

def test_rms_norm_is_bit_exact_with_transformers() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    g = torch.Generator().manual_seed(1)
    w = (1 + 0.1 * torch.randn(128, generator=g)).to(torch.bfloat16)
    x = (3 * torch.randn(9, 128, generator=g)).to(torch.bfloat16)
    ours = RMSNorm(128, 1e-5, BE)
    ours.load(w, torch.bfloat16)
    hf = DeepseekV3RMSNorm(128, eps=1e-5).to(torch.bfloat16)
    hf.weight.data = w.clone()
    assert torch.equal(ours(x), hf(x))


def test_group_limited_router_matches_transformers() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = _hf_deepseek(None)
    cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, cfg.routed_scaling_factor = 4, 2, 3, 2.5
    hf = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(2)
    hf.weight.data = torch.randn(8, 128, generator=g)
    hf.e_score_correction_bias.data = 0.1 * torch.randn(8, generator=g)
    moe = MoE(128, 16, 8, 3, 1, 4, 2, "sigmoid", True, 2.5, BE)
    moe.load_router(hf.weight.data, hf.e_score_correction_bias.data, torch.device("cpu"))
    x = torch.randn(30, 128, generator=g)
    ids, w = moe.route(x)
    _, hw, hids = hf(x)
    order = hids.argsort(-1)
    hids, hw = hids.gather(1, order), hw.gather(1, order)
    order = ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hids)
    torch.testing.assert_close(w.gather(1, order), hw, rtol=1e-5, atol=1e-6)
    # group limiting matters here: some token's plain top-3 would use a third group
    scores = torch.sigmoid(x @ hf.weight.data.t()) + hf.e_score_correction_bias
    plain = scores.topk(3, dim=-1)[1] // 2
    assert any(len(set(r.tolist())) > 2 for r in plain)
