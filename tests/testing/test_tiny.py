"""The tiny fixtures: determinism, on-disk layout, and that independent loaders (transformers,
compressed-tensors through transformers, the tokenizers library) read them as the real models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle3.errors import OutputExistsError, UsageError
from eagle3.formats.codecs import ct_int4_dequantize
from eagle3.testing import tiny

H = 128
V = 1024


def _files(d: Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint dir, read with the safetensors library (independent of eagle3's
    reader); also checks that the index, when present, names exactly these tensors."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            assert sf.metadata() == {"format": "pt"}
            for k in sf.keys():
                assert k not in out
                out[k] = sf.get_tensor(k)
    idx = d / "model.safetensors.index.json"
    if idx.exists():
        wm = json.loads(idx.read_text())["weight_map"]
        assert set(wm) == set(out)
        for k, fname in wm.items():
            with safe_open(d / fname, "pt") as sf:
                assert k in sf.keys()
    return out


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


# ---------------------------------------------------------------------------------------------
# determinism and the CLI
# ---------------------------------------------------------------------------------------------


def test_cli_writes_the_same_bytes_and_refuses_existing_out(tiny_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x"
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "make-tiny", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for name in tiny.MODEL_NAMES:
        assert str(out / name) in r.stdout
    # Another process, same seed: byte-identical to the session fixture (tokenizer training included).
    assert _files(out) == _files(tiny_dir)
    assert not (tmp_path / "x.partial").exists()

    # The refusals, in-process through the console-script entry point (one line, exit 2).
    from eagle3.cli import main

    capsys.readouterr()
    for argv, needle in ((["make-tiny", str(out)], "--overwrite"),
                         (["make-tiny", str(tmp_path / "y"), "--only", "kimi-k3"], "kimi-k3")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2
        assert err.count("\n") == 1 and err.startswith("error: ") and needle in err
    assert not (tmp_path / "y").exists() and _files(out) == _files(tiny_dir)


def test_other_seed_differs_and_subsets_match_the_full_run(tiny_dir: Path, tmp_path: Path) -> None:
    names = ["kimi-k2.5-eagle3", "kimi-k2.5-eagle3-d2t"]
    same = tiny.make_tiny(tmp_path / "s0", seed=0, only=names)
    other = tiny.make_tiny(tmp_path / "s1", seed=1, only=names)
    assert list(same) == names
    for name in names:
        assert _files(same[name]) == _files(tiny_dir / name)
        a, b = _tensors(same[name]), _tensors(other[name])
        assert a.keys() == b.keys()
        assert not torch.equal(a["fc.weight"], b["fc.weight"])
        assert (same[name] / "config.json").read_bytes() == (other[name] / "config.json").read_bytes()
    with pytest.raises(OutputExistsError):
        tiny.make_tiny(tmp_path / "s0", only=names)
    with pytest.raises(UsageError):
        tiny.make_tiny(tmp_path / "s2", only=["nope"])


def test_manifest_covers_every_file(tiny_dir: Path) -> None:
    from eagle3.checkpoint import verify_manifest

    res = verify_manifest(tiny_dir)
    assert res.problems == [] and res.checked > 20


# ---------------------------------------------------------------------------------------------
# targets
# ---------------------------------------------------------------------------------------------


def _check_text_stack(t: dict[str, torch.Tensor], m: str, head: str) -> None:
    """``m`` is the prefix of the text model (``model.`` or ``language_model.model.``)."""
    d = tiny.TEXT_DIMS
    n = d["num_hidden_layers"]
    assert n == 7
    assert t[m + "embed_tokens.weight"].shape == (V, H)
    assert t[head].shape == (V, H)
    assert t[m + "norm.weight"].shape == (H,)
    for L in range(n):
        p = f"{m}layers.{L}."
        shapes = {
            # Kimi's real latent and head dims: kv_lora 512, rope 64, nope 128, v 128; 4 heads
            "self_attn.q_a_proj.weight": (64, H), "self_attn.q_a_layernorm.weight": (64,),
            "self_attn.q_b_proj.weight": (4 * (128 + 64), 64), "self_attn.kv_a_proj_with_mqa.weight": (512 + 64, H),
            "self_attn.kv_a_layernorm.weight": (512,), "self_attn.kv_b_proj.weight": (4 * (128 + 128), 512),
            "self_attn.o_proj.weight": (H, 4 * 128),
            "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        }
        if L == 0:
            shapes |= {"mlp.gate_proj.weight": (256, H), "mlp.up_proj.weight": (256, H),
                       "mlp.down_proj.weight": (H, 256)}
        else:
            shapes |= {"mlp.gate.weight": (8, H), "mlp.gate.e_score_correction_bias": (8,),
                       "mlp.shared_experts.gate_proj.weight": (64, H),
                       "mlp.shared_experts.up_proj.weight": (64, H),
                       "mlp.shared_experts.down_proj.weight": (H, 64)}
            for e in range(8):
                for proj, (o, i) in (("gate_proj", (64, H)), ("up_proj", (64, H)), ("down_proj", (H, 64))):
                    k = f"mlp.experts.{e}.{proj}."
                    shapes |= {k + "weight_packed": (o, i // 8), k + "weight_scale": (o, i // 32),
                               k + "weight_shape": (2,)}
        layer_keys = {k[len(p):] for k in t if k.startswith(p)}
        assert layer_keys == set(shapes), L
        for k, shape in shapes.items():
            x = t[p + k]
            assert tuple(x.shape) == shape, (p + k, x.shape)
            want = {"weight_packed": torch.int32, "weight_shape": torch.int32,
                    "e_score_correction_bias": torch.float32}.get(k.rsplit(".", 1)[-1], torch.bfloat16)
            assert x.dtype == want, (p + k, x.dtype)
            if k.endswith("weight_shape"):
                assert x.tolist() == ([H, 64] if "down_proj" in k else [64, H])
            if k.endswith("weight_scale"):
                assert (x > 0).all()
    assert not any(".mlp.experts." in k and k.endswith(".weight") for k in t)  # routed experts are INT4 only


def test_kimi_k25_layout(tiny_dir: Path) -> None:
    d = tiny_dir / "kimi-k2.5"
    t = _tensors(d)
    assert len(list(d.glob("model-*-of-*.safetensors"))) >= 2
    assert {k.split(".")[0] for k in t} == {"language_model", "vision_tower", "mm_projector"}
    _check_text_stack(t, "language_model.model.", "language_model.lm_head.weight")
    assert t["vision_tower.patch_embed.proj.weight"].shape == (32, 3, 14, 14)
    assert t["vision_tower.patch_embed.pos_emb.weight"].shape == (4, 4, 32)
    assert t["vision_tower.encoder.blocks.0.wqkv.weight"].shape == (96, 32)
    assert t["mm_projector.proj.0.weight"].shape == (128, 128)
    assert t["mm_projector.proj.2.weight"].shape == (H, 128)

    c = _config(d)
    assert c["architectures"] == ["KimiK25ForConditionalGeneration"] and c["model_type"] == "kimi_k25"
    assert c["tie_word_embeddings"] is False and c["text_config"]["tie_word_embeddings"] is False
    assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (768, 769, 1023)
    assert c["media_placeholder_token_id"] == c["image_token_id"] == 789
    tc = c["text_config"]
    assert tc["model_type"] == "kimi_k2" and tc["architectures"] == ["DeepseekV3ForCausalLM"]
    assert tc["rope_scaling"] == {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert tc["routed_scaling_factor"] == 2.827 and tc["rms_norm_eps"] == 1e-5
    q = tc["quantization_config"]
    assert "quantization_config" not in c
    assert q["format"] == "pack-quantized" and q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert q["ignore"] == ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                           "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"]
    vc = c["vision_config"]
    assert vc["hidden_size"] == vc["vt_hidden_size"] == c["projection_hidden_size"] == 32
    assert vc["num_hidden_layers"] == vc["vt_num_hidden_layers"] == 1


def test_kimi_k2_thinking_layout_and_shared_weights(tiny_dir: Path) -> None:
    d = tiny_dir / "kimi-k2-thinking"
    t = _tensors(d)
    assert len(list(d.glob("model-*-of-*.safetensors"))) >= 2
    _check_text_stack(t, "model.", "lm_head.weight")
    assert {k.split(".")[0] for k in t} == {"model", "lm_head"}
    c = _config(d)
    assert c["architectures"] == ["DeepseekV3ForCausalLM"] and c["model_type"] == "kimi_k2"
    assert c["rope_scaling"]["beta_fast"] == 1.0 and c["rope_scaling"]["beta_slow"] == 1.0
    assert c["eos_token_id"] == 770
    assert c["quantization_config"]["ignore"] == ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                                  "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
    # Same text weights as the K2.5 wrapper (same seed streams).
    k25 = _tensors(tiny_dir / "kimi-k2.5")
    for k, x in t.items():
        assert torch.equal(x, k25["language_model." + k]), k


def test_linear_dims_are_quantizer_friendly(tiny_dir: Path) -> None:
    """Every Linear's input and output dims are multiples of 32 (group size), MLA's
    kv_a_proj_with_mqa (512 + 64 = 576) included; only the MoE router is narrower."""
    for name in tiny.MODEL_NAMES:
        for k, x in _tensors(tiny_dir / name).items():
            if x.dim() != 2 or not x.is_floating_point() or "weight_scale" in k:
                continue
            assert x.shape[1] % 32 == 0, (name, k)
            # The MoE router (8 experts; 384 in the real model) is never quantized.
            if not k.endswith("mlp.gate.weight"):
                assert x.shape[0] % 32 == 0, (name, k)


# ---------------------------------------------------------------------------------------------
# drafts
# ---------------------------------------------------------------------------------------------


def _llama_layer(p: str) -> dict[str, tuple[int, ...]]:
    return {p + "self_attn.q_proj.weight": (128, 2 * H), p + "self_attn.k_proj.weight": (128, 2 * H),
            p + "self_attn.v_proj.weight": (128, 2 * H), p + "self_attn.o_proj.weight": (H, 128),
            p + "mlp.gate_proj.weight": (256, H), p + "mlp.up_proj.weight": (256, H),
            p + "mlp.down_proj.weight": (H, 256), p + "input_layernorm.weight": (H,),
            p + "hidden_norm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}


def _check_shapes(t: dict[str, torch.Tensor], want: dict[str, tuple[int, ...]]) -> None:
    assert set(t) == set(want)
    for k, shape in want.items():
        assert tuple(t[k].shape) == shape, (k, t[k].shape)
        if k not in ("d2t", "t2d"):
            assert t[k].dtype == torch.bfloat16, k


def _check_d2t(t: dict[str, torch.Tensor]) -> None:
    d2t, t2d = t["d2t"], t["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    target = torch.arange(256) + d2t  # offsets, not absolute ids
    assert torch.all(target[1:] > target[:-1]) and target.min() >= 0 and target.max() < V
    assert t2d.sum() == 256 and torch.equal(t2d.nonzero().flatten(), target)
    assert set(tiny.SPECIAL_TOKENS) <= set(target.tolist())
    assert target.tolist() == tiny.draft_vocab_ids()


def test_eagle3_lightseek_layout(tiny_dir: Path) -> None:
    d = tiny_dir / "kimi-k2.5-eagle3"
    t = _tensors(d)
    want = {"embed_tokens.weight": (V, H), "fc.weight": (H, 3 * H), "norm.weight": (H,),
            "lm_head.weight": (V, H), **_llama_layer("midlayer.")}
    _check_shapes(t, want)
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(wm.values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert [k for k, f in wm.items() if f.startswith("model-00002")] == ["lm_head.weight"]
    c = _config(d)
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
    assert not {"draft_vocab_size", "eagle_config", "target_hidden_size"} & set(c)
    assert (c["num_attention_heads"], c["head_dim"], c["intermediate_size"], c["rms_norm_eps"]) == (4, 32, 256, 1e-6)
    assert (c["bos_token_id"], c["eos_token_id"], c["vocab_size"]) == (768, 769, V)
    # The draft's embedding is the target's (trainers initialise it from the target).
    assert torch.equal(t["embed_tokens.weight"], _tensors(tiny_dir / "kimi-k2.5")[
        "language_model.model.embed_tokens.weight"])


def test_eagle3_d2t_specforge_layout(tiny_dir: Path) -> None:
    d = tiny_dir / "kimi-k2.5-eagle3-d2t"
    t = _tensors(d)
    want = {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (256, H), "d2t": (256,),
            "t2d": (V,), **_llama_layer("midlayer.")}
    _check_shapes(t, want)
    _check_d2t(t)
    c = _config(d)
    assert c["draft_vocab_size"] == 256 and c["vocab_size"] == V
    assert c["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}


def test_eagle31_mla_layout(tiny_dir: Path) -> None:
    d = tiny_dir / "kimi-k2.6-eagle3.1-mla"
    t = _tensors(d)
    p = "layers.0."
    want = {"embed_tokens.weight": (V, H), "fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (V, H),
            **{f"fc_norm.{i}.weight": (H,) for i in range(3)},
            p + "self_attn.q_a_proj.weight": (64, 2 * H), p + "self_attn.q_a_layernorm.weight": (64,),
            p + "self_attn.q_b_proj.weight": (4 * 192, 64), p + "self_attn.kv_a_proj_with_mqa.weight": (576, 2 * H),
            p + "self_attn.kv_a_layernorm.weight": (512,), p + "self_attn.kv_b_proj.weight": (4 * 256, 512),
            p + "self_attn.o_proj.weight": (H, 4 * 128), p + "mlp.gate_proj.weight": (256, H),
            p + "mlp.up_proj.weight": (256, H), p + "mlp.down_proj.weight": (H, 256),
            p + "input_layernorm.weight": (H,), p + "hidden_norm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,)}
    _check_shapes(t, want)
    c = _config(d)
    assert c["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and c["model_type"] == "kimi_k2"
    assert c["fc_norm"] is True and c["norm_output"] is True
    assert (c["target_hidden_size"], c["num_aux_hidden_states"], c["draft_vocab_size"]) == (H, 3, V)
    assert c["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 3, 4], "use_aux_hidden_state": True}
    assert (c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]) == (
        64, 512, 128, 64, 128)


def test_speculators_layout(tiny_dir: Path) -> None:
    d = tiny_dir / "speculators-eagle3"
    t = _tensors(d)
    want = {"embed_tokens.weight": (V, H), "fc.weight": (H, 3 * H), "norm.weight": (H,),
            "lm_head.weight": (256, H), "d2t": (256,), "t2d": (V,), **_llama_layer("layers.0.")}
    _check_shapes(t, want)
    _check_d2t(t)
    c = _config(d)
    assert c["architectures"] == ["Eagle3Speculator"] and c["speculators_model_type"] == "eagle3"
    sc = c["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert sc["verifier"]["name_or_path"] and sc["verifier"]["architectures"]
    assert c["transformer_layer_config"]["model_type"] == "llama"
    assert c["transformer_layer_config"]["vocab_size"] == V and c["draft_vocab_size"] == 256
    assert c["norm_before_residual"] is False and c["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]


# ---------------------------------------------------------------------------------------------
# tokenizer and chat template (transformers as the reader)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,eos", [("kimi-k2.5", "[EOS]"), ("kimi-k2-thinking", "<|im_end|>")])
def test_tokenizer_loads_round_trips_and_renders_chat(tiny_dir: Path, name: str, eos: str) -> None:
    from transformers import AutoTokenizer, DeepseekV3Config

    if name == "kimi-k2.5":
        tok = AutoTokenizer.from_pretrained(tiny_dir / name)
    else:
        # AutoTokenizer reads config.json first; transformers does not know the text-only
        # model_type kimi_k2 and its generic fallback config crashes on rope_scaling (5.23), as it
        # would for the real Kimi-K2-Thinking. Passing the config (or using
        # PreTrainedTokenizerFast directly) is the workaround.
        tok = AutoTokenizer.from_pretrained(tiny_dir / name,
                                            config=DeepseekV3Config.from_pretrained(tiny_dir / name))
    assert len(tok) == V
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("[BOS]", eos, "[PAD]")
    assert tok.pad_token_id == 1023 and tok.bos_token_id == 768
    ids = {s: tok.convert_tokens_to_ids(s) for s in ("[BOS]", "[EOS]", "<|im_end|>", "[EOT]", "<|im_user|>",
                                                     "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                                                     "<think>", "</think>", "<|media_pad|>", "[PAD]")}
    assert ids == {"[BOS]": 768, "[EOS]": 769, "<|im_end|>": 770, "[EOT]": 777, "<|im_user|>": 771,
                   "<|im_assistant|>": 772, "<|im_system|>": 778, "<|im_middle|>": 785, "<think>": 790,
                   "</think>": 791, "<|media_pad|>": 789, "[PAD]": 1023}
    assert tok.convert_ids_to_tokens(800) == "<|reserved_token_800|>"

    gsm = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
           "clips in May. How many clips did she sell altogether?\nAnswer: 48 / 2 = <<48/2=24>>24\n#### 72")
    for text in (gsm, "Unicode: naïve café — 東京 🙂", "  spaces\tand\nnewlines  "):
        enc = tok(text).input_ids
        assert max(enc) < 768  # plain text never produces special tokens
        assert tok.decode(enc) == text
    assert len(tok(gsm).input_ids) < len(gsm) / 2  # BPE merges words and number groups
    assert tok("#### 42").input_ids[-1] == tok.convert_tokens_to_ids("42")

    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "What is 6*7?"}]
    s = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert s == ("<|im_system|>system<|im_middle|>You are helpful.<|im_end|><|im_user|>user<|im_middle|>"
                 "What is 6*7?<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    s = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "42"}], tokenize=False, thinking=False)
    assert s.endswith("<|im_assistant|>assistant<|im_middle|><think></think>42<|im_end|>")
    enc = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, thinking=False),
              add_special_tokens=False).input_ids
    assert enc[0] == 778 and enc[-4:] == [772, *tok("assistant").input_ids, 785, 790, 791][-4:]
    gen = json.loads((tiny_dir / name / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 768 and set(gen["eos_token_id"]) == {769, 770, 777}


# ---------------------------------------------------------------------------------------------
# transformers loads the targets with an empty load report (as transformers loads the real checkpoints)
# ---------------------------------------------------------------------------------------------


def _assert_clean(info: dict) -> None:
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info


def _to_fp32(m: torch.nn.Module) -> None:
    # INT4 experts come back as bf16 even with dtype=float32, and m.float() is refused on a
    # "quantized" model: cast the parameters by hand.
    for p in m.parameters():
        p.data = p.data.float()


@pytest.fixture(scope="module")
def hf_models(tiny_dir: Path):
    pytest.importorskip("compressed_tensors")
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        CompressedTensorsConfig,
        DeepseekV3Config,
    )

    k25, info = AutoModelForImageTextToText.from_pretrained(
        tiny_dir / "kimi-k2.5", dtype=torch.bfloat16, output_loading_info=True,
        quantization_config=CompressedTensorsConfig(dequantize=True))
    _assert_clean(info)
    cfg = DeepseekV3Config.from_pretrained(tiny_dir / "kimi-k2-thinking")
    cfg.model_type = "deepseek_v3"  # the expert-fusing conversion is keyed on it
    # K2-Thinking's YaRN betas (1, 1) differ from K2.5's (32, 1); align them so that the two text
    # stacks (identical weights) must give identical logits.
    assert cfg.rope_parameters["beta_fast"] == 1.0
    cfg.rope_parameters.update(beta_fast=32.0, beta_slow=1.0)
    text, info = AutoModelForCausalLM.from_pretrained(tiny_dir / "kimi-k2-thinking", config=cfg,
                                                      dtype=torch.bfloat16, output_loading_info=True)
    _assert_clean(info)
    assert type(k25).__name__ == "Kimi_K25ForConditionalGeneration"
    assert type(text).__name__ == "DeepseekV3ForCausalLM"
    return k25, text


def test_transformers_experts_equal_codec_dequant(tiny_dir: Path, hf_models) -> None:
    k25, text = hf_models
    t = _tensors(tiny_dir / "kimi-k2-thinking")
    for layers in (k25.model.language_model.layers, text.model.layers):
        for L in (1, 6):
            ex = layers[L].mlp.experts
            for e in (0, 7):
                p = f"model.layers.{L}.mlp.experts.{e}."
                deq = {proj: ct_int4_dequantize(t[p + proj + ".weight_packed"], t[p + proj + ".weight_scale"],
                                                t[p + proj + ".weight_shape"])
                       for proj in ("gate_proj", "up_proj", "down_proj")}
                assert deq["gate_proj"].dtype == torch.bfloat16
                assert torch.equal(ex.gate_up_proj[e], torch.cat([deq["gate_proj"], deq["up_proj"]], 0))
                assert torch.equal(ex.down_proj[e], deq["down_proj"])
            assert torch.equal(layers[L].mlp.gate.e_score_correction_bias,
                               t[f"model.layers.{L}.mlp.gate.e_score_correction_bias"])
    assert torch.equal(text.lm_head.weight, t["lm_head.weight"])
    assert torch.equal(k25.lm_head.weight, t["lm_head.weight"])


def test_transformers_forward_finite_and_text_logits_agree(tiny_dir: Path, hf_models) -> None:
    k25, text = hf_models
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 768, (2, 24), generator=g)
    with torch.no_grad():
        out = k25(input_ids=ids, output_hidden_states=True)
        assert torch.isfinite(out.logits).all() and out.logits.shape == (2, 24, V)
        # bf16 through 7 layers stays tame (no blow-up of the residual stream).
        assert max(h.float().abs().max().item() for h in out.hidden_states) < 100
        # An image prompt: 4x4 patches -> 2x2 merge -> 4 <|media_pad|> placeholders.
        img_ids = torch.tensor([[771, 300, 786, 789, 789, 789, 789, 788, 301, 770]])
        pv = torch.randn(16, 3, 14, 14, generator=g).to(torch.bfloat16)
        img = k25(input_ids=img_ids, pixel_values=pv, image_grid_thw=torch.tensor([[1, 4, 4]])).logits
        assert torch.isfinite(img).all()
        _to_fp32(k25)
        _to_fp32(text)
        a = k25(input_ids=ids).logits
        b = text(input_ids=ids).logits
    assert torch.isfinite(a).all() and a.dtype == torch.float32
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
