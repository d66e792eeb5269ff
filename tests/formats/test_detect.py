"""formats.detect on small checkpoints in every upstream format: targets (Kimi-K2.5 wrapper,
text-only K2-Thinking) in bf16 / compressed-tensors INT4 / FP8 block / Quark W4A8, INT4, MXFP4, FP8
(real Quark 0.13 configs), EAGLE-3/3.1 drafts (midlayer / layers.0, MHA / MLA, d2t, speculators),
and the inconsistencies that must be errors or warnings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.checkpoint import CheckpointReader
from eagle3.errors import CheckpointError, FormatError
from eagle3.formats import detect, keys
from eagle3.formats.detect import (
    aux_convention,
    default_aux_layer_ids,
    load_config,
    new_draft_aux_layer_ids,
    text_config,
    to_input_convention,
    to_output_convention,
)
from tests.formats import builders as b

# Module counts of builders.target_tensors (4 layers, layer 0 dense, 4 routed experts):
ROUTED = 3 * b.EXPERTS * 3  # 36 routed-expert Linears
SHARED_DENSE = 3 * 3 + 3  # shared experts of layers 1-3 + the layer-0 dense MLP
OTHER_BF16 = 4 * 5 + 3 + 1  # attention (5 per layer) + routers + lm_head
VISION_LINEARS = 3  # vision wqkv + 2 projector Linears (the patch_embed conv is not a Linear)


# ---------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------


def test_text_only_ct_int4_target(tmp_path: Path) -> None:
    d = b.write(tmp_path / "k2t", b.text_config(b.CT_INT4_CONFIG), b.target_tensors("ct-int4"),
                max_shard_bytes=200_000)
    s = detect.detect(d)
    assert (s.role, s.family, s.architecture, s.model_type, s.text_model_type) == (
        "target", "deepseek-v3", "DeepseekV3ForCausalLM", "kimi_k2", None)
    q = s.quant
    assert (q.scheme, q.method, q.config_location, q.group_size) == ("ct-int4", "compressed-tensors", "top-level", 32)
    assert q.weights == "int4 group g32 sym" and q.activations is None and q.exclude == 4
    assert q.modules == {"ct-int4": ROUTED, "bf16": SHARED_DENSE + OTHER_BF16}
    assert s.target is not None and s.draft is None
    assert (s.target.text_prefix, s.target.has_vision, s.target.layers_in_files) == ("", False, b.LAYERS)
    assert s.target.n_routed_experts == b.EXPERTS and s.target.default_aux_layer_ids == [2, 2, 1]
    assert (s.dims.attention, s.dims.kv_lora_rank, s.dims.rope_type, s.dims.num_layers) == ("mla", b.KV_LORA, "yarn", 4)
    ts = s.tensors
    reader = CheckpointReader(d)
    assert ts.count == len(reader) and ts.total_bytes == reader.total_bytes
    assert len(ts.shards) > 1 and ts.indexed and sum(x.tensors for x in ts.shards) == ts.count
    assert sum(ts.dtype_bytes.values()) == ts.total_bytes and ts.dtypes["I32"] == 2 * ROUTED  # packed + shape
    assert s.warnings == []


def test_k25_wrapper_with_nested_quant_config(tmp_path: Path) -> None:
    """Moonshot ships quantization_config inside text_config."""
    cfg = b.k25_config(nested_quant=b.CT_INT4_CONFIG)
    d = b.write(tmp_path / "k25", cfg, b.target_tensors("ct-int4", prefix=keys.LM_PREFIX, vision=True))
    s = detect.detect(d)
    assert (s.family, s.model_type, s.text_model_type) == ("kimi-k25", "kimi_k25", "kimi_k2")
    assert (s.quant.scheme, s.quant.config_location) == ("ct-int4", "text_config")
    assert s.quant.modules == {"ct-int4": ROUTED, "bf16": SHARED_DENSE + OTHER_BF16 + VISION_LINEARS}
    t = s.target
    assert t is not None and (t.text_prefix, t.has_vision, t.vision_tensors, t.projector_tensors) == (
        "language_model.", True, 3, 2)
    assert s.text_config["model_type"] == "kimi_k2" and s.warnings == []
    assert not s.tensors.indexed and [x.file for x in s.tensors.shards] == ["model.safetensors"]


def test_stale_nested_quant_config_is_a_warning(tmp_path: Path) -> None:
    cfg = b.k25_config(quant=b.quark_config("quark-mxfp4", ["lm_head"]), nested_quant=b.CT_INT4_CONFIG)
    d = b.write(tmp_path / "k25", cfg, b.target_tensors("quark-mxfp4", prefix=keys.LM_PREFIX))
    s = detect.detect(d)
    assert s.quant.scheme == "quark-mxfp4" and s.quant.config_location == "top-level"
    assert any("text_config.quantization_config differs" in w for w in s.warnings)


QUARK_CASES = {
    # scheme: (weights, activations)
    "quark-w4a8": ("fp8_e4m3 per_tensor sym -> int4 per_channel sym", "fp8_e4m3 per_tensor sym dynamic"),
    "quark-int4": ("int4 per_channel sym", "int8 per_channel sym dynamic"),
    "quark-mxfp4": ("fp4 per_group g32 e8m0", "fp4 per_group g32 e8m0 dynamic"),
    "quark-fp8": ("fp8_e4m3 per_channel sym", "fp8_e4m3 per_channel sym dynamic"),
}


@pytest.mark.parametrize("scheme", sorted(QUARK_CASES))
def test_quark_exports(tmp_path: Path, scheme: str) -> None:
    exclude = ["language_model.lm_head", "re:.*self_attn\\..*", "re:.*mlp\\.gate$", "re:.*shared_experts\\..*"]
    cfg = b.k25_config(quant=b.quark_config(scheme, exclude))
    d = b.write(tmp_path / scheme, cfg, b.target_tensors(scheme, prefix=keys.LM_PREFIX))
    s = detect.detect(d)
    q = s.quant
    assert (q.scheme, q.method, q.schemes, q.pack_method, q.exclude) == (scheme, "quark", [scheme], "reorder", 4)
    assert (q.weights, q.activations) == QUARK_CASES[scheme]
    assert q.modules == {scheme: ROUTED, "bf16": SHARED_DENSE + OTHER_BF16}
    assert s.family == "kimi-k25" and s.warnings == []


def test_amd_mxfp4_revision_quantizes_shared_and_dense(tmp_path: Path) -> None:
    """amd/Kimi-K2.5-MXFP4 after 94d8c1bd: routed + shared experts + layer-0 dense MLP are MXFP4."""
    cfg = b.k25_config(quant=b.quark_config("quark-mxfp4", ["language_model.lm_head"]))
    d = b.write(tmp_path / "mx", cfg, b.target_tensors("quark-mxfp4", prefix=keys.LM_PREFIX, dense_scheme="quark-mxfp4"))
    assert detect.detect(d).quant.modules == {"quark-mxfp4": ROUTED + SHARED_DENSE, "bf16": OTHER_BF16}


def test_fp8_block_target(tmp_path: Path) -> None:
    d = b.write(tmp_path / "fp8", b.text_config(b.FP8_BLOCK_CONFIG), b.target_tensors("fp8-block"))
    q = detect.detect(d).quant
    assert (q.scheme, q.method, q.weights) == ("fp8-block", "fp8", "fp8_e4m3 block 128x128")
    assert q.modules == {"fp8-block": ROUTED, "bf16": SHARED_DENSE + OTHER_BF16}


def test_bf16_target_without_quant_config(tmp_path: Path) -> None:
    s = detect.detect(b.write(tmp_path / "bf", b.text_config(), b.target_tensors("bf16")))
    assert (s.quant.scheme, s.quant.method, s.quant.config_location) == ("bf16", None, None)
    assert s.quant.modules == {"bf16": ROUTED + SHARED_DENSE + OTHER_BF16} and not s.quant.quantized


def test_single_safetensors_file(tmp_path: Path) -> None:
    d = b.write(tmp_path / "bf", b.text_config(), b.target_tensors("bf16"))
    s = detect.detect(d / "model.safetensors")
    assert s.path == d and s.family == "deepseek-v3"


# -- config and tensors that contradict each other -------------------------------------------


def test_quantized_tensors_without_config(tmp_path: Path) -> None:
    d = b.write(tmp_path / "x", b.text_config(), b.target_tensors("ct-int4"))
    with pytest.raises(FormatError, match=r"weight_packed.*has no quantization_config"):
        detect.detect(d)


@pytest.mark.parametrize("declared,stored,what", [
    ("quark-mxfp4", "quark-w4a8", "weight_scale_2"),
    ("quark-w4a8", "quark-int4", "int32 weight \\+ weight_scale\\)"),
    ("quark-int4", "quark-fp8", "float8 weight"),
    ("quark-fp8", "fp8-block", "weight_scale_inv"),
])
def test_quark_config_contradicting_tensors(tmp_path: Path, declared: str, stored: str, what: str) -> None:
    cfg = b.text_config(b.quark_config(declared, []))
    d = b.write(tmp_path / "x", cfg, b.target_tensors(stored))
    with pytest.raises(FormatError, match=f"config.json: field 'quantization_config' declares {declared}.*{what}"):
        detect.detect(d)


def test_ct_config_with_mxfp4_tensors(tmp_path: Path) -> None:
    d = b.write(tmp_path / "x", b.text_config(b.CT_INT4_CONFIG), b.target_tensors("quark-mxfp4"))
    with pytest.raises(FormatError, match="declares ct-int4 but tensor 'model.layers.1.mlp.experts.0.gate_proj.weight'"):
        detect.detect(d)


def test_unknown_quant_method(tmp_path: Path) -> None:
    cfg = b.k25_config(nested_quant={"quant_method": "gptq", "bits": 4})
    d = b.write(tmp_path / "x", cfg, b.target_tensors("bf16", prefix=keys.LM_PREFIX))
    with pytest.raises(FormatError, match="field 'text_config.quantization_config.quant_method' is 'gptq'"):
        detect.detect(d)


def test_unsupported_quark_dtype(tmp_path: Path) -> None:
    qc = b.quark_config("quark-int4", [])
    qc["global_quant_config"]["weight"]["dtype"] = "int8"
    d = b.write(tmp_path / "x", b.text_config(qc), b.target_tensors("bf16"))
    with pytest.raises(FormatError, match="global_quant_config.weight.dtype' is 'int8'"):
        detect.detect(d)


def test_quant_config_but_nothing_quantized_is_a_warning(tmp_path: Path) -> None:
    d = b.write(tmp_path / "x", b.text_config(b.quark_config("quark-mxfp4", ["*"])), b.target_tensors("bf16"))
    s = detect.detect(d)
    assert s.quant.scheme == "quark-mxfp4" and any("no tensor is quantized" in w for w in s.warnings)


def test_mxfp4_weight_with_float_scale(tmp_path: Path) -> None:
    t = b.target_tensors("quark-mxfp4")
    name = "model.layers.1.mlp.experts.0.up_proj.weight_scale"
    t[name] = t[name].float()
    d = b.write(tmp_path / "x", b.text_config(b.quark_config("quark-mxfp4", [])), t)
    with pytest.raises(FormatError, match="experts.0.up_proj.weight' is uint8.*weight_scale F32"):
        detect.detect(d)


# -- identification errors ----------------------------------------------------------------------


def test_unknown_architecture(tmp_path: Path) -> None:
    cfg = b.text_config()
    cfg["architectures"] = ["MixtralForCausalLM"]
    d = b.write(tmp_path / "x", cfg, b.target_tensors("bf16"))
    with pytest.raises(FormatError) as e:
        detect.detect(d)
    msg = str(e.value)
    assert str(d / "config.json") in msg and "field 'architectures'" in msg and "MixtralForCausalLM" in msg
    assert "\n" not in msg


def test_missing_config_and_fields(tmp_path: Path) -> None:
    d = b.write(tmp_path / "x", b.text_config(), {"w": torch.zeros(2)})
    (d / "config.json").unlink()
    with pytest.raises(FormatError, match="config.json: no such file"):
        detect.detect(d)
    cfg = b.k25_config()
    del cfg["text_config"]
    b.write(tmp_path / "y", cfg, {"w": torch.zeros(2)})
    with pytest.raises(FormatError, match="field 'text_config' is missing"):
        detect.detect(tmp_path / "y")
    cfg = b.k25_config()
    del cfg["text_config"]["hidden_size"]
    b.write(tmp_path / "z", cfg, {"w": torch.zeros(2)})
    with pytest.raises(FormatError, match="field 'text_config.hidden_size' is missing"):
        detect.detect(tmp_path / "z")


def test_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(FormatError, match="not a checkpoint"):
        detect.detect(tmp_path / "notes.txt")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no .safetensors files"):
        detect.detect(tmp_path)


# ---------------------------------------------------------------------------------------------
# Drafts
# ---------------------------------------------------------------------------------------------


def test_lightseek_k25_llama_draft(tmp_path: Path) -> None:
    """lightseekorg/kimi-k2.5-eagle3: midlayer.*, full vocab, no d2t, no aux ids, no draft_vocab_size."""
    d = b.write(tmp_path / "d", b.llama_draft_config(), b.draft_tensors())
    s = detect.detect(d)
    assert (s.role, s.family, s.quant.scheme) == ("draft", "eagle3-llama", "bf16")
    r = s.draft
    assert r is not None and s.target is None
    assert (r.eagle_version, r.layer_prefix, r.attention, r.num_layers) == ("3", "midlayer", "mha", 1)
    assert not (r.fc_norm or r.norm_output or r.norm_before_fc or r.norm_before_residual)
    assert r.defaulted == ["fc_norm", "norm_output", "norm_before_fc", "norm_before_residual", "target_hidden_size"]
    a = r.aux_layers
    assert (a.count, a.ids, a.convention, a.input_ids, a.source) == (3, None, "default", None, None)
    assert (r.hidden_size, r.target_hidden_size) == (b.DH, b.DH)
    assert (r.vocab_size, r.draft_vocab_size, r.config_draft_vocab_size) == (b.VOCAB, b.VOCAB, None)
    assert (r.d2t, r.t2d, r.own_embedding, r.own_lm_head) == (False, False, True, True)
    assert not r.vocab_map.values_checked
    assert s.warnings == ["config has no draft_vocab_size: SGLang then replaces the draft's lm_head with the "
                          "target's (convert writes it explicitly)"]
    assert s.quant.modules == {"bf16": 9}  # fc, q, k, v, o, gate, up, down, lm_head


def test_specforge_reduced_vocab_draft(tmp_path: Path) -> None:
    """SpecForge to_sglang: no embedding, d2t/t2d, aux ids [1, 29, 57] in eagle_config (output convention)."""
    d2t, t2d = b.vocab_map(100)
    cfg = b.llama_draft_config(draft_vocab_size=100, eagle_config={
        "eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True})
    d = b.write(tmp_path / "d", cfg, b.draft_tensors(draft_vocab=100, embed=False, d2t=d2t, t2d=t2d))
    r = detect.detect(d).draft
    assert r is not None
    a = r.aux_layers
    assert (a.ids, a.convention, a.input_ids, a.source) == ([1, 29, 57], "output", [2, 30, 58], "eagle_config")
    assert (r.draft_vocab_size, r.vocab_size, r.d2t, r.t2d, r.own_embedding) == (100, b.VOCAB, True, True, False)
    vm = r.vocab_map
    assert (vm.d2t_length, vm.t2d_length, vm.values_checked) == (100, b.VOCAB, True)
    assert vm.d2t_length_ok and vm.d2t_in_range and vm.d2t_increasing and vm.t2d_consistent


def test_d2t_problems_are_warnings(tmp_path: Path) -> None:
    d2t, t2d = b.vocab_map(100)
    bad = d2t.clone()
    bad[-1] = b.VOCAB  # maps the last draft id past the target vocab
    cfg = b.llama_draft_config(draft_vocab_size=100)
    d = b.write(tmp_path / "a", cfg, b.draft_tensors(draft_vocab=100, d2t=bad, t2d=t2d))
    s = detect.detect(d)
    assert s.draft is not None and s.draft.vocab_map.d2t_in_range is False
    assert any("outside the target vocab" in w for w in s.warnings)
    # absolute ids stored under d2t instead of offsets: t2d no longer marks the mapped ids
    used = (d2t + torch.arange(100)) // 2
    d = b.write(tmp_path / "b", cfg, b.draft_tensors(draft_vocab=100, d2t=used, t2d=t2d))
    s = detect.detect(d)
    assert s.draft.vocab_map.t2d_consistent is False  # type: ignore[union-attr]
    assert any("absolute ids stored as d2t?" in w for w in s.warnings)
    # wrong length
    d = b.write(tmp_path / "c", cfg, b.draft_tensors(draft_vocab=100, d2t=d2t[:90]))
    s = detect.detect(d)
    assert s.draft.vocab_map.d2t_length_ok is False  # type: ignore[union-attr]
    assert any("d2t has 90 entries but the draft vocab (lm_head rows) is 100" in w for w in s.warnings)
    # reduced vocab without d2t
    d = b.write(tmp_path / "e", cfg, b.draft_tensors(draft_vocab=100))
    assert any("no d2t" in w for w in detect.detect(d).warnings)


def test_mla_eagle31_draft(tmp_path: Path) -> None:
    """lightseekorg/kimi-k2.6-eagle3.1-mla: layers.0.*, MLA, fc_norm, norm_output, ids [2, 30, 58]."""
    d = b.write(tmp_path / "d", b.mla_draft_config(), b.draft_tensors(prefix="layers.0.", mla=True, fc_norm=True))
    s = detect.detect(d)
    r = s.draft
    assert r is not None and (s.family, s.model_type) == ("eagle3-mla", "kimi_k2")
    assert (r.eagle_version, r.layer_prefix, r.attention) == ("3.1", "layers.0", "mla")
    assert (r.fc_norm, r.fc_norm_tensors, r.norm_output) == (True, 3, True)
    a = r.aux_layers
    assert (a.ids, a.convention, a.input_ids, a.count) == ([2, 30, 58], "input", [2, 30, 58], 3)
    assert r.config_draft_vocab_size == b.VOCAB and s.warnings == []
    assert (s.dims.attention, s.dims.kv_lora_rank, s.dims.q_lora_rank) == ("mla", b.KV_LORA, b.Q_LORA)


def test_fc_norm_tensors_make_31_even_without_flags(tmp_path: Path) -> None:
    d = b.write(tmp_path / "d", b.llama_draft_config(draft_vocab_size=b.VOCAB), b.draft_tensors(fc_norm=True))
    s = detect.detect(d)
    assert s.draft is not None and (s.draft.eagle_version, s.draft.fc_norm, s.draft.fc_norm_tensors) == ("3.1", False, 3)
    assert any("fc_norm tensors but the config does not set fc_norm" in w for w in s.warnings)
    d = b.write(tmp_path / "e", b.llama_draft_config(draft_vocab_size=b.VOCAB, fc_norm=True), b.draft_tensors())
    s = detect.detect(d)
    assert s.draft is not None and s.draft.eagle_version == "3.1"
    assert any("no fc_norm.{i}.weight tensors" in w for w in s.warnings)


def test_norm_before_fc_and_aux_count(tmp_path: Path) -> None:
    """gpt-oss / NVIDIA style: nested norm_before_fc + input_norm, 4 aux layers via num_aux_hidden_states."""
    cfg = b.llama_draft_config(draft_vocab_size=b.VOCAB, num_aux_hidden_states=4, eagle_config={
        "norm_before_fc": True, "use_aux_hidden_state": True})
    d = b.write(tmp_path / "d", cfg, b.draft_tensors(n_aux=4, input_norm=True))
    s = detect.detect(d)
    r = s.draft
    assert r is not None and (r.norm_before_fc, r.input_norm_tensor, r.aux_layers.count) == (True, True, 4)
    assert "norm_before_fc" not in r.defaulted and s.warnings == []
    cfg["num_aux_hidden_states"] = 3  # fc takes 4 * 64 inputs
    d = b.write(tmp_path / "e", cfg, b.draft_tensors(n_aux=4, input_norm=True))
    assert any("fc.weight takes 256 inputs but 3 aux states of width 64 need 192" in w
               for w in detect.detect(d).warnings)


def test_aux_ids_top_level_vs_eagle_config(tmp_path: Path) -> None:
    cfg = b.llama_draft_config(draft_vocab_size=b.VOCAB, eagle_aux_hidden_state_layer_ids=[2, 30, 58],
                               eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 29, 57]})
    s = detect.detect(b.write(tmp_path / "d", cfg, b.draft_tensors()))
    a = s.draft.aux_layers  # type: ignore[union-attr]
    assert (a.ids, a.source, a.convention) == ([2, 30, 58], "both", "input")
    assert any("aux ids differ" in w for w in s.warnings)
    assert any("ATOM then turns aux hidden states off" in w for w in s.warnings)
    cfg = b.llama_draft_config(eagle_aux_hidden_state_layer_ids=[2, "30", 58])
    with pytest.raises(FormatError, match="field 'eagle_aux_hidden_state_layer_ids' is \\[2, '30', 58\\]"):
        detect.detect(b.write(tmp_path / "e", cfg, b.draft_tensors()))


def test_speculators_draft(tmp_path: Path) -> None:
    d2t, t2d = b.vocab_map(128)
    cfg = b.speculators_config(eagle_aux_hidden_state_layer_ids=[1, 29, 57], fc_norm=True, norm_output=True)
    d = b.write(tmp_path / "d", cfg, b.draft_tensors(prefix="layers.0.", draft_vocab=128, d2t=d2t, t2d=t2d,
                                                     fc_norm=True))
    s = detect.detect(d)
    r = s.draft
    assert r is not None and (s.family, s.architecture, s.text_model_type) == (
        "speculators-eagle3", "Eagle3Speculator", "llama")
    assert (r.layer_prefix, r.eagle_version, r.norm_before_residual) == ("layers.0", "3.1", False)
    # speculators ids are input-to-layer even when the first id is 1 (nothing shifts them)
    assert (r.aux_layers.convention, r.aux_layers.input_ids) == ("input", [1, 29, 57])
    assert (r.vocab_size, r.draft_vocab_size, r.target_hidden_size) == (b.VOCAB, 128, b.DH)
    assert r.speculators == {"version": "0.1.0.dev14", "algorithm": "eagle3", "verifier": "moonshotai/Kimi-K2.5",
                             "verifier_architectures": ["KimiK25ForConditionalGeneration"], "speculative_tokens": 3}
    assert s.warnings == []
    # vLLM defaults norm_before_residual to True for speculators configs that omit it
    del cfg["norm_before_residual"]
    r = detect.detect(b.write(tmp_path / "e", cfg, b.draft_tensors(prefix="layers.0.", draft_vocab=128, d2t=d2t,
                                                                   fc_norm=True))).draft
    assert r is not None and r.norm_before_residual is True and "norm_before_residual" in r.defaulted


def test_speculators_other_algorithm(tmp_path: Path) -> None:
    cfg = b.speculators_config(speculators_model_type="mtp")
    with pytest.raises(FormatError, match="field 'speculators_model_type' is 'mtp'"):
        detect.detect(b.write(tmp_path / "d", cfg, b.draft_tensors(prefix="layers.0.")))


def test_draft_with_both_layer_prefixes(tmp_path: Path) -> None:
    t = b.draft_tensors()
    t["layers.0.hidden_norm.weight"] = t.pop("midlayer.hidden_norm.weight")
    with pytest.raises(FormatError, match="both 'midlayer.' and 'layers.0.'"):
        detect.detect(b.write(tmp_path / "d", b.llama_draft_config(), t))
    t = {k: v for k, v in b.draft_tensors().items() if not k.startswith("midlayer.")}
    with pytest.raises(FormatError, match="no draft decoder-layer tensors"):
        detect.detect(b.write(tmp_path / "e", b.llama_draft_config(), t))


def test_mismatched_attention_is_a_warning(tmp_path: Path) -> None:
    cfg = b.mla_draft_config()
    s = detect.detect(b.write(tmp_path / "d", cfg, b.draft_tensors(prefix="layers.0.", fc_norm=True)))
    assert s.draft is not None and s.draft.attention == "mha"
    assert any("layer tensors are MHA" in w for w in s.warnings)


def test_quark_fp8_draft(tmp_path: Path) -> None:
    """amd/Kimi-K2.5-Eagle3-FP8 style: ptpc FP8 draft layer, fc and lm_head excluded."""
    cfg = b.llama_draft_config(draft_vocab_size=b.VOCAB, quantization_config=b.quark_config(
        "quark-fp8", ["fc", "lm_head"]))
    s = detect.detect(b.write(tmp_path / "d", cfg, b.draft_tensors(layer_scheme="quark-fp8")))
    assert (s.role, s.quant.scheme) == ("draft", "quark-fp8")
    assert s.quant.modules == {"quark-fp8": 7, "bf16": 2}
    assert s.draft is not None and s.draft.attention == "mha"


def test_ct_int4_draft_lm_head_rows(tmp_path: Path) -> None:
    cfg = b.llama_draft_config(draft_vocab_size=b.VOCAB, quantization_config=b.CT_INT4_CONFIG)
    t = b.draft_tensors(layer_scheme="ct-int4")
    t.update(b.encode_linear("lm_head", t.pop("lm_head.weight"), "ct-int4"))
    s = detect.detect(b.write(tmp_path / "d", cfg, t))
    assert s.draft is not None and s.draft.draft_vocab_size == b.VOCAB and s.quant.modules["ct-int4"] == 8


# ---------------------------------------------------------------------------------------------
# Header-only reading, helpers, JSON form
# ---------------------------------------------------------------------------------------------


def test_reads_headers_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d2t, t2d = b.vocab_map(100)
    d = b.write(tmp_path / "d", b.llama_draft_config(draft_vocab_size=100), b.draft_tensors(draft_vocab=100, d2t=d2t,
                                                                                       t2d=t2d))
    read: list[str] = []
    real_get = CheckpointReader.get

    def spy(self: CheckpointReader, name: str) -> torch.Tensor:
        read.append(name)
        return real_get(self, name)

    monkeypatch.setattr(CheckpointReader, "get", spy)
    detect.detect(d, check_vocab_map=False)
    assert read == []
    detect.detect(d)
    assert sorted(read) == ["d2t", "t2d"]
    t = b.write(tmp_path / "t", b.text_config(b.CT_INT4_CONFIG), b.target_tensors("ct-int4"))
    read.clear()
    detect.detect(t)
    assert read == []


def test_aux_helpers() -> None:
    assert default_aux_layer_ids(61) == (2, 30, 58)
    assert default_aux_layer_ids(32) == (2, 16, 29)
    with pytest.raises(ValueError):
        default_aux_layer_ids(3)
    out = [1, 29, 57]
    assert to_input_convention(out, "output") == [2, 30, 58]
    assert to_output_convention(to_input_convention(out, "output"), "input") == out
    assert to_input_convention([2, 30, 58], "input") == [2, 30, 58] == to_output_convention([2, 30, 58], "output")
    assert to_input_convention(None, "output") is None
    with pytest.raises(ValueError):
        to_output_convention([0, 5], "input")
    with pytest.raises(ValueError):
        to_input_convention([2], "default")
    # the default ids of both conventions are the same physical tensors
    n = 61
    specforge_default = [1, n // 2 - 1, n - 4]
    assert tuple(to_input_convention(specforge_default, "output") or []) == default_aux_layer_ids(n)
    assert aux_convention(None, False)[0] == "default"
    assert aux_convention([1, 29, 57], False)[0] == "output"
    assert aux_convention([2, 30, 58], False)[0] == "input"
    assert aux_convention([0, 30, 58], False)[0] == "input"
    assert aux_convention([1, 29, 57], True)[0] == "input"


def test_config_helpers(tmp_path: Path) -> None:
    k25 = b.k25_config()
    assert text_config(k25) is k25["text_config"]
    spec = b.speculators_config()
    assert text_config(spec) is spec["transformer_layer_config"]
    plain = b.text_config()
    assert text_config(plain) is plain
    d = b.write(tmp_path / "d", plain, {"w": torch.zeros(2)})
    assert load_config(d) == plain == load_config(d / "model.safetensors")


def test_keys_helpers() -> None:
    assert keys.rename_draft_layer("midlayer.self_attn.q_proj.weight", keys.LAYERS0) == "layers.0.self_attn.q_proj.weight"
    assert keys.rename_draft_layer("layers.0.mlp.up_proj.weight", keys.MIDLAYER) == "midlayer.mlp.up_proj.weight"
    assert keys.rename_draft_layer("fc.weight", keys.LAYERS0) == "fc.weight"
    assert keys.rename_draft_layer("layers.1.mlp.up_proj.weight", keys.MIDLAYER) == "layers.1.mlp.up_proj.weight"
    assert keys.strip_lm_prefix("language_model.model.norm.weight") == keys.TARGET_NORM
    assert keys.add_lm_prefix(keys.TARGET_LM_HEAD) == "language_model.lm_head.weight"
    assert keys.add_lm_prefix("vision_tower.x.weight") == "vision_tower.x.weight"
    assert keys.target_layer_index("language_model.model.layers.17.mlp.gate.weight") == 17
    assert keys.expert_index("model.layers.3.mlp.experts.383.down_proj.weight_packed") == 383
    assert keys.expert_index("model.layers.3.mlp.shared_experts.down_proj.weight") is None
    assert [keys.fc_norm_index(n) for n in ("fc_norm.2.weight", "aux_norm_mid.weight", "norm.weight")] == [2, 1, None]
    assert keys.draft_layer_prefix("layers.3.x") == "layers.3." and keys.draft_layer_prefix("fc.weight") is None
    assert keys.split_param("d2t") == ("", "d2t")


def _key_paths(obj: object, prefix: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            path = f"{prefix}{k}"
            out.add(path)
            if k not in ("dtypes", "dtype_bytes", "modules"):  # maps keyed by data, not schema
                out |= _key_paths(v, path + ".")
    elif isinstance(obj, list) and obj and isinstance(obj[0], dict):
        out |= _key_paths(obj[0], prefix.rstrip(".") + "[].")
    return out


def test_json_keys_are_documented(tmp_path: Path) -> None:
    """Every key of the JSON form appears in docs/inspect_json.md (the stable-keys contract)."""
    import json

    doc = (Path(__file__).resolve().parents[2] / "docs" / "inspect_json.md").read_text()
    t = detect.detect(b.write(tmp_path / "t", b.k25_config(nested_quant=b.CT_INT4_CONFIG),
                              b.target_tensors("ct-int4", prefix=keys.LM_PREFIX, vision=True)))
    cfg = b.speculators_config()
    dr = detect.detect(b.write(tmp_path / "d", cfg, b.draft_tensors(prefix="layers.0.", draft_vocab=128,
                                                                    d2t=b.vocab_map(128)[0])))
    paths: set[str] = set()
    for s in (t, dr):
        j = s.to_json()
        assert json.loads(json.dumps(j)) == j  # plain JSON types only
        paths |= _key_paths(j)
    missing = sorted(p for p in paths if f"`{p}`" not in doc)
    assert missing == []
    assert t.to_json()["schema_version"] == 1 and t.to_json()["draft"] is None


def test_summary_rows_cover_sections(tmp_path: Path) -> None:
    d2t, t2d = b.vocab_map(100)
    s = detect.detect(b.write(tmp_path / "d", b.llama_draft_config(), b.draft_tensors(draft_vocab=100, d2t=d2t)))
    rows = detect.summary_rows(s)
    secs = {r[0] for r in rows}
    assert {"model", "quant", "draft", "tensors", "warnings"} <= secs
    assert any(k == "d2t / t2d" and v.startswith("yes / no") for _, k, v in rows)


def test_a_new_draft_gets_three_ascending_aux_ids_at_every_depth() -> None:
    for n in range(2, 70):
        ids, rule = new_draft_aux_layer_ids(n)
        assert len(set(ids)) == 3 and list(ids) == sorted(ids) and 0 <= ids[0] and ids[-1] <= n, (n, ids)
        assert ids[-1] < n or n == 2, (n, ids)  # a layer's input, which every engine captures
        assert (n >= 7) is (n >= 4 and ids == default_aux_layer_ids(n)), (n, ids, rule)
    assert new_draft_aux_layer_ids(4)[0] == (1, 2, 3) and "[2, 2, 1]" in new_draft_aux_layer_ids(4)[1]
    assert new_draft_aux_layer_ids(61)[0] == (2, 30, 58)
    with pytest.raises(ValueError, match="1-layer target"):
        new_draft_aux_layer_ids(1)
