"""The DeepSeek-V3 / Kimi target model: logits against transformers, aux states against
transformers' hidden states, paged prefill/decode/verify against a full forward, absorbed MLA
against the naive form, and batch invariance for every weight format."""

from __future__ import annotations

import pytest
import torch

from eagle3.runtime.interfaces import TargetModel, default_aux_layer_ids
from eagle3.runtime.loader import load_target
from eagle3.testing.numerics import assert_greedy_agrees
from tests.runtime.model_kit import PagedKV, requantize_target, single_thread

N_LAYERS = 7
HF_LATENT_EPS = 1e-6  # transformers builds q_a/kv_a_layernorm with the default eps


_threads = pytest.fixture(scope="module", autouse=True)(single_thread)


def _hf_model(path, wrapper: bool):
    """transformers' reference in fp32 (DeepseekV3ForCausalLM with the tiny config)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        CompressedTensorsConfig,
        DeepseekV3Config,
    )

    if wrapper:
        m, info = AutoModelForImageTextToText.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True,
            quantization_config=CompressedTensorsConfig(dequantize=True))
    else:
        cfg = DeepseekV3Config.from_pretrained(path)
        cfg.model_type = "deepseek_v3"  # else the expert-fusing conversion is skipped (random experts)
        m, info = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32,
                                                       output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
    for p in m.parameters():  # INT4 experts come back bf16 even with dtype=float32
        p.data = p.data.float()
    return m.eval()


def _forward(model, ids: list[int], aux=None):
    kv = PagedKV(model)
    x, meta = kv.step({0: ids})
    with torch.no_grad():
        h, a = model(x, meta, kv.caches, aux)
    return h, a, model.compute_logits(h)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 768, (16,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.mark.parametrize("name,wrapper", [("kimi-k2.5", True), ("kimi-k2-thinking", False)])
def test_logits_and_aux_match_transformers(tiny_dir, prompt, name: str, wrapper: bool) -> None:
    hf = _hf_model(tiny_dir / name, wrapper)
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([prompt]), output_hidden_states=True)
    ref_logits = out.logits[0].float()
    hs = out.hidden_states  # [0..N-1] = input to layer k, [N] = after the final norm

    m = load_target(tiny_dir / name, dtype=torch.float32, latent_norm_eps=HF_LATENT_EPS)
    assert isinstance(m, TargetModel) and m.num_layers == N_LAYERS
    h, aux, logits = _forward(m, prompt, tuple(range(N_LAYERS + 1)))
    assert logits.dtype == torch.float32 and logits.shape == (16, 1024)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    assert_greedy_agrees(ref_logits, logits, 1e-4, "eagle3 vs transformers")
    aux = aux.view(16, N_LAYERS + 1, -1)
    for k in range(N_LAYERS):  # aux id k == the residual stream entering layer k (vLLM convention)
        torch.testing.assert_close(aux[:, k], hs[k][0], rtol=0, atol=1e-4)
    torch.testing.assert_close(h, hs[N_LAYERS][0], rtol=0, atol=1e-4)
    # id N is the last layer's output before the final norm
    torch.testing.assert_close(m.norm(aux[:, N_LAYERS]), h, rtol=0, atol=1e-6)

    # The runtime default uses rms_norm_eps for the latent norms, as vLLM/SGLang/ATOM do: a small,
    # systematic gap to transformers (measured ~8e-5 here).
    m2 = load_target(tiny_dir / name, dtype=torch.float32)
    assert m2.layers[0].self_attn.kv_a_layernorm.eps == 1e-5
    _, _, logits2 = _forward(m2, prompt)
    gap = (logits2 - ref_logits).abs().max()
    assert 0 < gap < 2e-3


def test_aux_ids_and_cache_spec(tiny_dir, prompt) -> None:
    m = load_target(tiny_dir / "kimi-k2.5", dtype=torch.bfloat16)
    shape, dtype = m.kv_cache_spec()
    assert shape == (512 + 64,)  # Kimi's latent: kv_lora_rank + rope dim
    # stored as the reference computes attention: fp32 on the CPU (the same bf16-rounded values)
    assert dtype == (torch.float32 if m.backend.device.type == "cpu" else torch.bfloat16)
    ids = default_aux_layer_ids(m.num_layers)
    assert ids == (2, 3, 4)
    _, aux, _ = _forward(m, prompt, ids)
    _, all_aux, _ = _forward(m, prompt, tuple(range(N_LAYERS + 1)))
    all_aux = all_aux.view(16, N_LAYERS + 1, -1)
    assert torch.equal(aux, torch.cat([all_aux[:, 2], all_aux[:, 3], all_aux[:, 4]], -1))


def test_the_wide_cpu_cache_holds_the_model_dtype_values(tiny_dir, prompt) -> None:
    """The CPU reference stores a bf16 model's KV cache in fp32 (no widening per read), holding the
    bf16-rounded values: every cached number is a bf16 number, and the logits equal, bit for bit,
    those of the same forward over a bf16 cache (prefill, then two decode steps)."""
    m = load_target(tiny_dir / "kimi-k2.5", dtype=torch.bfloat16)
    wide, narrow = PagedKV(m), PagedKV(m)
    narrow.caches = [c.to(torch.bfloat16) for c in narrow.caches]
    assert wide.caches[0].dtype == torch.float32
    steps = [{0: prompt}, {0: [7]}, {0: [300]}]
    with torch.no_grad():
        for batch in steps:
            (x, meta), (x2, meta2) = wide.step(batch), narrow.step(batch)
            lw = m.compute_logits(m(x, meta, wide.caches)[0])
            ln = m.compute_logits(m(x2, meta2, narrow.caches)[0])
            assert torch.equal(lw, ln)
    for c in wide.caches:
        assert c.abs().sum() > 0 and torch.equal(c, c.to(torch.bfloat16).float())
    _, none, _ = _forward(m, prompt, None)
    assert none is None
    with pytest.raises(Exception, match="ascending"):
        _forward(m, prompt, (4, 2))


def test_absorbed_mla_equals_naive_form(tiny_dir, prompt) -> None:
    m = load_target(tiny_dir / "kimi-k2-thinking", dtype=torch.float32)
    _, _, absorbed = _forward(m, prompt)
    m.set_absorbed(False)
    _, _, naive = _forward(m, prompt)
    torch.testing.assert_close(absorbed, naive, rtol=0, atol=2e-5)
    # and decode through the cache in both forms
    m.set_absorbed(True)


# ---------------------------------------------------------------------------------------------
# Paged execution and batch invariance
# ---------------------------------------------------------------------------------------------


def _reference_rows(model, seqs: dict[str, list[int]], aux_ids):
    """Each sequence alone, one full prefill forward: per-token (hidden, aux, logits)."""
    ref = {}
    for sid, toks in seqs.items():
        kv = PagedKV(model, seed=len(toks))
        x, meta = kv.step({sid: toks})
        with torch.no_grad():
            h, a = model(x, meta, kv.caches, aux_ids)
        ref[sid] = (h, a, model.compute_logits(h))
    return ref


def _check_rows(model, kv, batch, ref, offsets, aux_ids, start=None):
    """Run ``batch`` in one forward and compare every row with the single-sequence reference."""
    x, meta = kv.step(batch, start)
    with torch.no_grad():
        h, a = model(x, meta, kv.caches, aux_ids)
    lg = model.compute_logits(h)
    row = 0
    for sid, toks in batch.items():
        p0 = (start or {}).get(sid, offsets[sid])
        n = len(toks)
        rh, ra, rl = ref[sid]
        assert torch.equal(h[row: row + n], rh[p0: p0 + n]), (sid, p0, n)
        assert torch.equal(a[row: row + n], ra[p0: p0 + n]), (sid, p0, n)
        assert torch.equal(lg[row: row + n], rl[p0: p0 + n]), (sid, p0, n)
        offsets[sid] = p0 + n
        row += n


def _schedule(model, seqs, aux_ids):
    """Chunked prefill mixed with other sequences, a k+1 verify whose tail is rejected and
    overwritten, and single-token decodes - every token must reproduce its reference bits."""
    ref = _reference_rows(model, seqs, aux_ids)
    a, b, c = seqs["a"], seqs["b"], seqs["c"]
    kv = PagedKV(model, seed=5)
    off = {"a": 0, "b": 0, "c": 0}
    _check_rows(model, kv, {"a": a[:7], "b": b[:9]}, ref, off, aux_ids)  # two prefill chunks
    _check_rows(model, kv, {"c": c[:6], "a": a[7:11]}, ref, off, aux_ids)  # prefill + 4-token verify
    # verify of 4 at positions 11..14 where only the first survives, as after a rejection: the
    # engine re-runs from position 12 and overwrites slots 12..14
    bogus = [(t + 7) % 768 for t in a[12:15]]
    x, meta = kv.step({"a": [a[11]] + bogus}, {"a": 11})
    with torch.no_grad():
        model(x, meta, kv.caches, aux_ids)
    off["a"] = 12
    _check_rows(model, kv, {"a": a[12:16], "b": b[9:10], "c": c[6:7]}, ref, off, aux_ids, start={"a": 12})
    for t in range(16, len(a)):  # plain decode
        _check_rows(model, kv, {"a": a[t: t + 1]}, ref, off, aux_ids)


def _seqs():
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randint(0, 768, (20,), generator=g).tolist(),
            "b": torch.randint(0, 768, (10,), generator=g).tolist(),
            "c": torch.randint(0, 768, (7,), generator=g).tolist()}


@pytest.fixture(scope="module")
def quantized(tiny_dir, tmp_path_factory):
    """Quark re-quantizations of the tiny INT4 target (W4A8, MXFP4) plus dense references."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for scheme in ("w4a8", "mxfp4"):
        out[scheme] = requantize_target(tiny_dir / "kimi-k2-thinking", root / scheme, scheme, root / f"{scheme}-ref")
        out[scheme + "-ref"] = root / f"{scheme}-ref"
    return out


FORMATS = ["int4-w4a16", "w4a8-fp8", "w4a8-int8", "mxfp4"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batch_invariance(tiny_dir, quantized, fmt: str, dtype: torch.dtype) -> None:
    if fmt == "int4-w4a16":
        m = load_target(tiny_dir / "kimi-k2.5", dtype=dtype)
    elif fmt.startswith("w4a8"):
        m = load_target(quantized["w4a8"], dtype=dtype, act_override=fmt.split("-")[1])
        assert m.layers[1].mlp.experts.mode == fmt.split("-")[1]
    else:
        m = load_target(quantized["mxfp4"], dtype=dtype)
        assert m.layers[1].mlp.experts.mode == "mxfp4"
    _schedule(m, _seqs(), default_aux_layer_ids(m.num_layers))


@pytest.mark.parametrize("scheme,act,bound", [("w4a8", "fp8", 0.08), ("w4a8", "int8", 0.03), ("mxfp4", None, 0.35)])
def test_quantized_moe_layers_within_scheme_error(quantized, scheme: str, act, bound: float) -> None:
    """Same input, same routing: the quantized experts' output vs the dequantized-weight reference
    (the gap is the activation quantization: ~4% for FP8 E4M3, ~1.5% for INT8, ~20% for MXFP4)."""
    m = load_target(quantized[scheme], dtype=torch.float32, act_override=act if scheme == "w4a8" else None)
    r = load_target(quantized[scheme + "-ref"], dtype=torch.float32)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(0))
    for layer in (1, 6):
        qa, ra = m.layers[layer].mlp, r.layers[layer].mlp
        ids, w = ra.route(x)
        rel = (qa.experts(x, ids, w) - ra.experts(x, ids, w)).norm() / ra.experts(x, ids, w).norm()
        assert 0 < rel < bound, (layer, float(rel))


@pytest.mark.parametrize("scheme", ["w4a8", "mxfp4"])
def test_weight_only_emulation_is_the_dequantized_weights_exactly(quantized, scheme: str) -> None:
    """``act_override="none"`` (``EngineConfig.activation_quant="none"``): the quantized experts run
    their decoded weights on unquantized activations, i.e. the dense reference model to the bit,
    while the default path (activations quantized) differs from it."""
    r = load_target(quantized[scheme + "-ref"], dtype=torch.float32)
    none = load_target(quantized[scheme], dtype=torch.float32, act_override="none")
    full = load_target(quantized[scheme], dtype=torch.float32)
    x = torch.randn(24, 128, generator=torch.Generator().manual_seed(1))
    for layer in (1, 6):
        ids, w = r.layers[layer].mlp.route(x)
        want = r.layers[layer].mlp.experts(x, ids, w)
        assert none.layers[layer].mlp.experts.mode == "dense"
        assert torch.equal(none.layers[layer].mlp.experts(x, ids, w), want)
        assert not torch.equal(full.layers[layer].mlp.experts(x, ids, w), want)


def test_engine_option_reaches_the_loader(quantized) -> None:
    from eagle3.errors import UsageError
    from eagle3.runtime.engine.llm import LLM

    llm = LLM(quantized["mxfp4"], None, activation_quant="none", tokenizer=None, num_blocks=8)
    assert llm.target.layers[1].mlp.experts.mode == "dense"
    with pytest.raises(UsageError, match="pass the target as a checkpoint directory"):
        LLM(llm.target, None, activation_quant="none", tokenizer=None, num_blocks=8)
    with pytest.raises(UsageError, match="activation_quant must be one of auto, none"):
        LLM(quantized["mxfp4"], None, activation_quant="fp8", tokenizer=None, num_blocks=8)
