"""``eagle3 convert`` on targets: Kimi-K2.5 wrapper -> text stack, config hygiene, INT4 / FP8-block
dequantization checked bit for bit against compressed-tensors and an independent numpy reference,
and the converted text stack checked against the wrapper in transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from eagle3.formats import codecs
from eagle3.testing import tiny
from tests.convert.helpers import cli, load_all
from tests.formats import builders as b


def cfg_of(d: Path) -> dict[str, Any]:
    return json.loads((d / "config.json").read_text())


def bits_equal(a: torch.Tensor, c: torch.Tensor) -> bool:
    return a.dtype == c.dtype and a.shape == c.shape and torch.equal(a.view(torch.uint8), c.view(torch.uint8))


# -- independent references (numpy, written from the compressed-tensors pack-quantized and FP8 block formats)


def ref_int4(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor) -> np.ndarray:
    """Exact float64 q * s from the bit layout: nibble j of word w is element 8w+j, stored as q + 8."""
    n, k = (int(x) for x in shape.tolist())
    words = packed.numpy().astype(np.int64) & 0xFFFFFFFF
    nib = np.stack([(words >> (4 * j)) & 0xF for j in range(8)], axis=-1).reshape(n, -1)[:, :k]
    q = nib.astype(np.float64) - 8.0
    s = scale.float().numpy().astype(np.float64)
    return q * np.repeat(s, k // s.shape[1], axis=1)


def ref_fp8_block(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> np.ndarray:
    out = w.float().numpy().astype(np.float64)
    si = s.float().numpy()
    for i in range(si.shape[0]):
        for j in range(si.shape[1]):
            out[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= float(si[i, j])
    return out


def to_torch(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    # float64 -> float32 is exact here (|q| <= 8 times an 8-bit-mantissa scale; fp8 times an fp32 scale
    # stays within fp32 for these test values), and the one rounding to bf16 happens last.
    return torch.from_numpy(x.astype(np.float32)).to(dtype)


# ---------------------------------------------------------------------------------------------
# INT4 (compressed-tensors) dequant
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k2_dense(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tgt")
    out = {}
    for dt in ("bf16", "fp32"):
        out[dt] = root / dt
        cli(str(tiny_dir / "kimi-k2-thinking"), str(out[dt]), "--dequantize", dt)
    return out


def test_int4_dequant_bit_exact(tiny_dir: Path, k2_dense: dict[str, Path]) -> None:
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    src = load_all(tiny_dir / "kimi-k2-thinking")
    dense = {dt: load_all(p) for dt, p in k2_dense.items()}
    ct = CompressedTensorsDequantizer(str(tiny_dir / "kimi-k2-thinking"), dtype=torch.bfloat16)
    mods = sorted({n.rsplit(".", 1)[0] for n in src if n.endswith(".weight_packed")})
    assert len(mods) == (tiny.TEXT_DIMS["num_hidden_layers"] - 1) * tiny.TEXT_DIMS["n_routed_experts"] * 3
    lib = ct.process({k: v for k, v in src.items() if k.rsplit(".", 1)[0] in mods})
    for m in mods:
        packed, scale, shape = (src[f"{m}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape"))
        exact = ref_int4(packed, scale, shape)
        assert bits_equal(dense["bf16"][f"{m}.weight"], lib[f"{m}.weight"]), m
        assert bits_equal(dense["bf16"][f"{m}.weight"], to_torch(exact, torch.bfloat16)), m
        assert bits_equal(dense["fp32"][f"{m}.weight"], to_torch(exact, torch.float32)), m  # no bf16 rounding
        assert f"{m}.weight_packed" not in dense["bf16"]
    # everything else is copied byte for byte
    for n, t in src.items():
        if n.rsplit(".", 1)[0] not in mods:
            assert bits_equal(dense["bf16"][n], t) and bits_equal(dense["fp32"][n], t), n
    for p in k2_dense.values():
        cfg = cfg_of(p)
        assert "quantization_config" not in cfg and cfg["model_type"] == "kimi_k2"
        assert (p / "tokenizer.json").is_file() and (p / "chat_template.jinja").is_file()
        assert (p / "generation_config.json").is_file()


def test_fp8_block_dequant_bit_exact(tmp_path: Path) -> None:
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    block = (32, 32)
    t = b.target_tensors()
    quantized = []
    for n in list(t):
        if n.endswith("_proj.weight") and ("experts" in n or "self_attn" in n):
            q, s = codecs.fp8_block_quantize(t[n].float() * 3.0, block)
            del t[n]
            m = n[: -len(".weight")]
            t[f"{m}.weight"], t[f"{m}.weight_scale_inv"] = q, s
            quantized.append(m)
    cfg = b.text_config({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": list(block)})
    src = b.write(tmp_path / "fp8", cfg, t)
    cli(str(src), str(tmp_path / "bf16"), "--dequantize", "bf16")
    cli(str(src), str(tmp_path / "fp32"), "--dequantize", "fp32")
    out16, out32 = load_all(tmp_path / "bf16"), load_all(tmp_path / "fp32")
    conv = FP8BlockDequantizer(targets=("Linear",), weight_block_size=block, dtype=torch.bfloat16)
    ragged = 0
    for m in quantized:
        w, s = t[f"{m}.weight"], t[f"{m}.weight_scale_inv"]
        ragged += any(d % 32 for d in w.shape)
        lib = conv.process({f"{m}.weight": w, f"{m}.weight_scale_inv": s})[f"{m}.weight"]
        exact = ref_fp8_block(w, s, block)
        assert bits_equal(out16[f"{m}.weight"], lib), m
        assert bits_equal(out16[f"{m}.weight"], to_torch(exact, torch.bfloat16)), m
        assert bits_equal(out32[f"{m}.weight"], to_torch(exact, torch.float32)), m
        assert f"{m}.weight_scale_inv" not in out16
    assert ragged  # some modules have partial edge blocks (e.g. kv_a_proj [24, 64])
    assert "quantization_config" not in cfg_of(tmp_path / "bf16")


# ---------------------------------------------------------------------------------------------
# Kimi-K2.5 wrapper -> text stack
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k25_text(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("k25") / "text"
    cli(str(tiny_dir / "kimi-k2.5"), str(out), "--engine", "vllm", "--text-only", "--dequantize", "bf16")
    return out


def test_text_only_layout_and_config(tiny_dir: Path, k25_text: Path) -> None:
    src = load_all(tiny_dir / "kimi-k2.5")
    out = load_all(k25_text)
    assert not [n for n in out if n.startswith(("vision_tower.", "mm_projector.", "language_model."))]
    assert "lm_head.weight" in out and "model.embed_tokens.weight" in out
    for n, t in src.items():
        if n.startswith("language_model.") and not n.rsplit(".", 1)[1].startswith("weight_"):
            assert bits_equal(out[n[len("language_model."):]], t), n
    cfg = cfg_of(k25_text)
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "kimi_k2"
    assert "quantization_config" not in cfg and "text_config" not in cfg and "auto_map" not in cfg
    assert cfg["tie_word_embeddings"] is False and cfg["num_hidden_layers"] == tiny.TEXT_DIMS["num_hidden_layers"]
    rep = json.loads((k25_text / "convert_report.json").read_text())
    assert rep["drops"] and "vision" in rep["drops"][0]["name"] and rep["engine"] == "vllm"
    from eagle3.checkpoint import verify_manifest

    assert verify_manifest(k25_text).problems == []


def test_text_only_logits_match_wrapper_in_transformers(tiny_dir: Path, k25_text: Path) -> None:
    """transformers: the wrapper via AutoModelForImageTextToText with
    CompressedTensorsConfig(dequantize=True); the text stack via DeepseekV3ForCausalLM with
    model_type forced to deepseek_v3 (kimi_k2 would leave the experts random)."""
    from transformers import (
        AutoModelForImageTextToText,
        CompressedTensorsConfig,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
    )

    wrapper, info_w = AutoModelForImageTextToText.from_pretrained(
        tiny_dir / "kimi-k2.5", dtype=torch.bfloat16, output_loading_info=True,
        quantization_config=CompressedTensorsConfig(dequantize=True))
    cfg = DeepseekV3Config.from_pretrained(k25_text)
    cfg.model_type = "deepseek_v3"
    text, info_t = DeepseekV3ForCausalLM.from_pretrained(k25_text, config=cfg, dtype=torch.bfloat16,
                                                         output_loading_info=True)
    for info in (info_w, info_t):
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    ids = torch.tensor([[tiny.BOS_ID, 5, 17, 300, 42, 7, 600, 11, 99, tiny.IM_END_ID]])
    with torch.no_grad():
        lw = wrapper(input_ids=ids).logits
        lt = text(input_ids=ids).logits
    assert lw.shape == lt.shape == (1, ids.shape[1], tiny.VOCAB_SIZE)
    assert torch.equal(lw, lt)


def test_model_type_alias_loads_without_override(tiny_dir: Path, tmp_path: Path) -> None:
    cli(str(tiny_dir / "kimi-k2.5"), str(tmp_path / "o"), "--text-only", "--model-type", "deepseek_v3")
    cfg = cfg_of(tmp_path / "o")
    assert cfg["model_type"] == "deepseek_v3"
    qc = cfg["quantization_config"]  # still INT4: the config sits at the top level, once
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    src = load_all(tiny_dir / "kimi-k2.5")
    out = load_all(tmp_path / "o")
    assert set(out) == {n[len("language_model."):] for n in src if n.startswith("language_model.")}
    for n, t in out.items():
        assert bits_equal(t, src["language_model." + n]), n


def test_wrapper_kept_with_config_hygiene(tiny_dir: Path, tmp_path: Path) -> None:
    cli(str(tiny_dir / "kimi-k2.5"), str(tmp_path / "o"))
    src_cfg, cfg = cfg_of(tiny_dir / "kimi-k2.5"), cfg_of(tmp_path / "o")
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert "quantization_config" not in cfg["text_config"]
    assert cfg["quantization_config"] == src_cfg["text_config"]["quantization_config"]
    assert cfg["tie_word_embeddings"] is False and cfg["text_config"]["tie_word_embeddings"] is False
    assert cfg["vision_config"] == src_cfg["vision_config"]
    src, out = load_all(tiny_dir / "kimi-k2.5"), load_all(tmp_path / "o")
    assert set(src) == set(out) and all(bits_equal(out[n], t) for n, t in src.items())
    assert not (tmp_path / "o" / "modeling_kimi_k25.py").exists()


def test_remote_code_only_with_flag(tiny_dir: Path, tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_dir / "kimi-k2.5", src)
    (src / "modeling_kimi_k25.py").write_text("# remote code\n")
    cli(str(src), str(tmp_path / "a"))
    cli(str(src), str(tmp_path / "b"), "--trust-remote-code")
    assert not (tmp_path / "a" / "modeling_kimi_k25.py").exists()
    assert (tmp_path / "b" / "modeling_kimi_k25.py").read_text() == "# remote code\n"
