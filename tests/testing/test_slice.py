"""``eagle3 make-slice``: a Kimi-K2.5 slice at the real widths in Moonshot's format.

The test writes a 1-layer, 2-expert slice with the hidden ``--vocab`` override (1024 rows instead of
163840: the full embedding and lm_head alone are 4.7 GB); every other tensor has its real shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle3.formats import detect, sizing
from eagle3.testing import slice as slice_mod

GiB = 2**30


@pytest.fixture(scope="module")
def small_slice(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from eagle3.cli import main

    out = tmp_path_factory.mktemp("slice") / "k25-slice"
    with pytest.raises(SystemExit) as e:  # the console entry point exits like the installed command
        main(["make-slice", str(out), "--layers", "1", "--experts", "2", "--vocab", "1024", "--seed", "3"])
    assert e.value.code == 0
    return out


def _tensor(d: Path, name: str) -> torch.Tensor:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    with safe_open(d / index["weight_map"][name], "pt") as f:  # the safetensors library, not eagle3's reader
        return f.get_tensor(name)


def test_slice_is_a_kimi_k25_target_at_real_widths(small_slice: Path) -> None:
    s = detect.detect(small_slice)
    assert (s.role, s.family, s.architecture) == ("target", detect.KIMI_K25, "KimiK25ForConditionalGeneration")
    assert s.quant.scheme == detect.CT_INT4 and s.quant.group_size == 32 and s.quant.config_location == "text_config"
    assert s.quant.modules == {detect.CT_INT4: 6, "bf16": 16}  # 2 experts x 3 INT4; attention, shared, vision bf16
    d = s.dims
    assert (d.hidden_size, d.num_attention_heads, d.q_lora_rank, d.kv_lora_rank) == (7168, 64, 1536, 512)
    assert (d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.vocab_size) == (128, 64, 128, 1024)
    assert s.target is not None and s.target.n_routed_experts == 2 and s.target.moe_intermediate_size == 2048
    assert s.target.first_k_dense_replace == 0 and s.target.layers_in_files == 1  # one MoE layer
    assert s.warnings == []
    # The runtime's config parser takes it (the loader reads this spec first).
    from eagle3.runtime.loader import target_spec

    spec = target_spec(small_slice)
    assert spec.hidden_size == 7168 and spec.n_routed_experts == 2 and spec.num_experts_per_tok == 2
    assert spec.topk_method == "noaux_tc" and spec.scoring_func == "sigmoid" and spec.prefix == "language_model."
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
              "manifest.json"):
        assert (small_slice / f).is_file()


def test_slice_headers_are_the_planned_tensors(small_slice: Path) -> None:
    cfg = json.loads((small_slice / "config.json").read_text())
    planned = {t.name: (t.dtype, t.shape) for t in sizing.config_tensors(cfg)}
    written = {t.name: (t.dtype, t.shape) for t in sizing.header_tensors(small_slice) or []}
    assert written == planned
    p = "language_model.model.layers.0."
    assert written[p + "mlp.experts.1.gate_proj.weight_packed"] == ("I32", (2048, 896))
    assert written[p + "mlp.experts.1.down_proj.weight_scale"] == ("BF16", (7168, 64))
    assert written[p + "self_attn.kv_b_proj.weight"] == ("BF16", (16384, 512))
    assert written[p + "mlp.shared_experts.down_proj.weight"] == ("BF16", (7168, 2048))
    assert written[p + "mlp.gate.e_score_correction_bias"] == ("F32", (2,))
    index = json.loads((small_slice / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == slice_mod.slice_bytes(1, 2, vocab=1024)


def test_slice_values(small_slice: Path) -> None:
    p = "language_model.model.layers.0.mlp.experts.0.up_proj."
    assert _tensor(small_slice, p + "weight_shape").tolist() == [2048, 7168]
    codes = _tensor(small_slice, p + "weight_packed")[:4].view(torch.uint8)
    nibbles = torch.cat([codes & 0xF, codes >> 4]).flatten()
    assert set(torch.bincount(nibbles.to(torch.int64), minlength=16).nonzero().flatten().tolist()) == set(range(16))
    scale = _tensor(small_slice, p + "weight_scale").float()
    assert (scale > 0).all() and 0.5 < scale.mean().item() * 4.6 * 7168**0.5 < 2
    norm = _tensor(small_slice, "language_model.model.layers.0.input_layernorm.weight").float()
    assert abs(norm.mean().item() - 1) < 0.05
    w = _tensor(small_slice, "language_model.model.layers.0.self_attn.o_proj.weight").float()
    assert abs(w.std().item() * 8192**0.5 - 1) < 0.05  # std 1/sqrt(fan_in): activations keep their scale


def test_slice_is_a_function_of_the_seed(small_slice: Path) -> None:
    """Each tensor is one random stream of the seed and its name, written in fixed row blocks."""
    name = "language_model.model.layers.0.self_attn.q_b_proj.weight"
    spec = sizing.TensorSpec(name, "BF16", (12288, 1536))
    assert slice_mod._rows_per_block(spec.shape) < 12288  # written in several blocks
    step = slice_mod._rows_per_block(spec.shape)
    again = slice_mod._fill(spec, 3)(0, step)
    assert torch.equal(_tensor(small_slice, name)[:step], again)
    assert not torch.equal(slice_mod._fill(spec, 4)(0, step), again)


def test_slice_refuses_existing_output(small_slice: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from eagle3.cli import main

    with pytest.raises(SystemExit) as e:
        main(["make-slice", str(small_slice), "--layers", "1", "--experts", "2", "--vocab", "1024"])
    assert e.value.code == 2 and "--overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["make-slice", str(small_slice.parent / "x"), "--layers", "0"])
    assert e.value.code == 2 and "--layers 0" in capsys.readouterr().err


def test_full_slice_sizes_match_the_issue() -> None:
    """The slices issue 11 measured: 2 layers x 32 experts = 6.31 GiB, x 8 experts = 5.76 GiB."""
    assert round(slice_mod.slice_bytes(2, 32) / GiB, 2) == 6.31
    assert round(slice_mod.slice_bytes(2, 8) / GiB, 2) == 5.76
    cfg = slice_mod.slice_config(2, 32)
    tc = cfg["text_config"]
    assert tc["vocab_size"] == 163840 and tc["first_k_dense_replace"] == 1 and tc["num_experts_per_tok"] == 8


def test_slice_passes_its_schema_and_each_sampled_change_fails(small_slice: Path) -> None:
    """make-slice's output (real widths) against the kimi-k2.5 schema; deleting, renaming or reshaping
    any tensor of its layer, embedding, head or first vision block fails with one line naming it."""
    from eagle3.formats.check import check_checkpoint
    from tests.formats.test_schema import _headers, _mutations, _problems

    assert [str(p) for p in check_checkpoint(small_slice)] == []
    headers = _headers(small_slice)
    keep = ("language_model.model.layers.0.", "language_model.model.embed", "language_model.lm_head",
            "vision_tower.encoder.blocks.0.", "mm_projector.")
    muts = [m for m in _mutations(headers) if m[1].startswith(keep)]
    assert len(muts) > 60
    for what, name, h in muts:
        probs = _problems(small_slice, h)
        assert probs and all("\n" not in p for p in probs), f"{what} {name}: {probs}"
        assert any(name in p for p in probs), f"{what} {name}: {probs}"


@pytest.fixture(scope="module")
def draft_slice(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from eagle3.cli import main

    out = tmp_path_factory.mktemp("slice") / "draft-slice"
    with pytest.raises(SystemExit) as e:
        main(["make-slice", str(out), "--layers", "2", "--draft", "eagle3.1-mla", "--vocab", "1024", "--seed", "3"])
    assert e.value.code == 0
    return out


def test_draft_slice_is_an_eagle31_mla_draft_at_real_widths(draft_slice: Path) -> None:
    s = detect.detect(draft_slice)
    assert (s.role, s.family, s.architecture) == ("draft", "eagle3-mla", "Eagle3DeepseekV2ForCausalLM")
    d = s.dims
    assert (d.hidden_size, d.num_attention_heads, d.q_lora_rank, d.kv_lora_rank) == (7168, 64, 1536, 512)
    assert s.warnings == []
    cfg = json.loads((draft_slice / "config.json").read_text())
    planned = {t.name: (t.dtype, t.shape) for t in sizing.config_tensors(cfg)}
    assert {t.name: (t.dtype, t.shape) for t in sizing.header_tensors(draft_slice) or []} == planned
    assert planned["layers.0.mlp.gate_proj.weight"] == ("BF16", (18432, 7168))
    assert planned["fc.weight"] == ("BF16", (7168, 3 * 7168))
    from eagle3.runtime.loader import draft_spec

    assert draft_spec(draft_slice).aux_layer_ids == (0, 1, 2)  # in a 2-layer slice
    llama = slice_mod.draft_slice_config("eagle3", 61)
    assert llama["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]  # Kimi's, at 61 layers
    assert round(slice_mod.draft_slice_bytes("eagle3", 2) / GiB, 2) > 5  # full vocab: embedding + head 4.4 GiB


def test_draft_slice_runs_speculative_decoding_with_a_slice(draft_slice: Path,
                                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    """The draft drafts a tree for a 2-layer slice through ``LLM`` on the CPU (what a GPU benchmark
    runs at the real widths), and the target verifies it; its random drafts are rejected."""
    from eagle3.runtime.engine.llm import LLM
    from eagle3.runtime.sampling import SamplingParams

    target = slice_mod.make_slice(tmp_path_factory.mktemp("slice") / "t2", layers=2, experts=2, vocab=1024)
    llm = LLM(target, draft_slice, num_speculative_tokens=2, tokenizer=None, dtype="bfloat16", num_blocks=8,
              block_size=16, speculative_eagle_topk=2, speculative_num_draft_tokens=5)
    # max_tokens 4 leaves room for one full-depth tree after the prefill. Two engine steps: the
    # prefill, whose proposer drafts the tree, then the target's verification of it (one token
    # emitted: the drafts are random). The two steps left would be plain decode steps (too close to
    # max_tokens for another tree), ~2 CPU-s each at these widths, and check nothing of the slice.
    llm.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    emitted = [len(o.token_ids) for _ in range(2) for o in llm.step()]
    stats = llm.stats.as_dict()
    assert emitted == [1, 2] and stats["num_drafts"] == 1 and stats["num_draft_tokens"] > 0, (emitted, stats)
    assert stats["num_accepted_tokens"] == 0
    assert llm.draft.spec.hidden_size == 7168


def test_draft_slice_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from eagle3.cli import main

    for args, msg in ((["--layers", "1", "--draft", "eagle3"], "--layers 1"), (["--draft", "medusa"], "--draft 'medusa'")):
        with pytest.raises(SystemExit) as e:
            main(["make-slice", str(tmp_path / "d"), *args])
        assert e.value.code == 2 and msg in capsys.readouterr().err
        assert not (tmp_path / "d").exists()
