"""Regenerate quark013_configs.json: the ``quantization_config`` that AMD Quark 0.13 really exports
for the four schemes eagle3 detects (W4A8 int4_fp8, INT4 per-channel + INT8 per-token, MXFP4,
ptpc FP8), taken from in-memory exports of a tiny random DeepseekV3.
The tests use them as the independent reference for the Quark config schema; ``exclude`` is
emptied because each test writes the module names of its own checkpoint.

Not run by the test suite (importing quark.torch takes 20-40 s):
    QUARK_DISABLE_COMPILE=1 .venv/bin/python tests/formats/data/make_quark_configs.py
"""

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")

import torch  # noqa: E402
from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors  # noqa: E402
from quark.torch.quantization.config.config import (  # noqa: E402
    Int4PerChannelSpec,
    Int8PerChannelSpec,
    OCP_MXFP4Spec,
    QConfig,
    QLayerConfig,
)
from quark.torch.utils.llm import preprocess_for_quantization  # noqa: E402
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

EXCLUDE = ["lm_head", "*embed_tokens*", "*norm*", "*mlp.gate", "*self_attn*"]


def tiny_model() -> DeepseekV3ForCausalLM:
    cfg = DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
                           first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                           n_group=1, topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                           kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                           vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).eval()
    preprocess_for_quantization(m)  # split fused experts, else they are silently left bf16
    return m


def main() -> None:
    int4 = Int4PerChannelSpec(ch_axis=0, symmetric=True, is_dynamic=False).to_quantization_spec()
    int8 = Int8PerChannelSpec(ch_axis=1, symmetric=True, is_dynamic=True).to_quantization_spec()
    mx_w = OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec()
    mx_a = OCP_MXFP4Spec(ch_axis=-1, is_dynamic=True).to_quantization_spec()
    configs = {
        "quark-w4a8": LLMTemplate.get("deepseek_v3").get_config(scheme="int4_fp8", exclude_layers=EXCLUDE),
        "quark-int4": QConfig(global_quant_config=QLayerConfig(weight=int4, input_tensors=int8), exclude=EXCLUDE),
        "quark-mxfp4": QConfig(global_quant_config=QLayerConfig(weight=mx_w, input_tensors=mx_a), exclude=EXCLUDE),
        "quark-fp8": LLMTemplate.get("deepseek_v3").get_config(scheme="ptpc_fp8", exclude_layers=EXCLUDE),
    }
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in configs.items():
            q = ModelQuantizer.freeze(ModelQuantizer(cfg).quantize_model(tiny_model(), None))
            export_safetensors(q, f"{tmp}/{name}")
            qc = json.loads(Path(f"{tmp}/{name}/config.json").read_text())["quantization_config"]
            qc["exclude"] = []
            out[name] = qc
    dst = Path(__file__).with_name("quark013_configs.json")
    dst.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
