"""``backend="aiter"`` (eagle3/runtime/kernels/aiter.py) against a FAKE aiter (tests/runtime/fake_aiter/):
the fake asserts the documented argument contracts and computes with the torch reference, so these
tests check the adapter's layouts (head folding / repeating, CSR indices, packed INT4 pairs, group
scales, shuffled weights, keyword calls) end to end, down to ``LLM(tiny, backend="aiter")`` greedy ==
``LLM(tiny, backend="torch")`` greedy. Nothing here runs on ROCm (unverified there, docs/kernels.md)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from eagle3.errors import UsageError
from eagle3.runtime.context import AttnMetadata
from eagle3.runtime.engine.llm import LLM
from eagle3.runtime.engine.model_runner import build_attn_metadata
from eagle3.runtime.kernels import DenseWeight, Int4Weight, get_backend
from eagle3.runtime.kernels.aiter import AiterBackend, head_layout, pack_int4_pairs
from eagle3.runtime.sampling import SamplingParams
from eagle3.testing.numerics import BF16_LOGIT_TOL, assert_generations_agree

FAKE = Path(__file__).resolve().parent / "fake_aiter"


@pytest.fixture
def fake_aiter(monkeypatch: pytest.MonkeyPatch):
    for name in [m for m in sys.modules if m == "aiter" or m.startswith("aiter.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(FAKE))
    mod = importlib.import_module("aiter")
    mod.CALLS.clear()
    yield mod
    for name in [m for m in sys.modules if m == "aiter" or m.startswith("aiter.")]:
        sys.modules.pop(name, None)


def test_without_aiter_the_backend_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "aiter", None)  # import aiter -> ImportError
    with pytest.raises(UsageError, match=r"kernel backend 'aiter' needs ROCm's aiter package \(import aiter failed"):
        get_backend("aiter")


def test_head_layouts() -> None:
    assert head_layout(16) == (1, 1) and head_layout(128) == (1, 1)
    assert head_layout(64) == (4, 1) and head_layout(32) == (2, 1)  # Kimi at TP=1 / TP=2: folded
    assert head_layout(8) == (1, 2) and head_layout(4) == (1, 4) and head_layout(1) == (1, 16)  # repeated
    assert head_layout(24) is None and head_layout(6) is None


def test_int4_pairs_low_nibble_first() -> None:
    codes = torch.tensor([[-8, 7, -1, 0, 3, -3]], dtype=torch.int8)
    assert pack_int4_pairs(codes).tolist() == [[0x78, 0x0F, 0xD3]]


@pytest.mark.parametrize("heads", [64, 16, 4])
def test_mla_attention_matches_the_reference(fake_aiter, heads: int) -> None:
    """Decode (1 query) and verify (4 queries) rows of three sequences; 64 heads are folded into four
    16-head pseudo-sequences, 4 heads repeated to 16."""
    g = torch.Generator().manual_seed(0)
    d_lat, d_rope, bs = 32, 16, 4
    cache = torch.randn(64, d_lat + d_rope, generator=g).to(torch.bfloat16)
    tables, starts, counts = [[0, 1, 2], [5, 6], [9, 3, 4, 7]], [9, 4, 12], [1, 4, 4]
    meta = build_attn_metadata(tables, starts, counts, bs)
    t = sum(counts)
    q = torch.randn(t, 1, heads, d_lat + d_rope, generator=g).to(torch.bfloat16)
    be, ref = get_backend("aiter"), get_backend("torch")
    flat = cache[:, None, :]
    got = be.attention(q, flat, flat[..., :d_lat], meta, 0.125, be.plan_attention(meta))
    want = ref.attention(q, flat, flat[..., :d_lat], meta, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # bf16 outputs, fp32 softmax either way
    calls = [c for n, c in fake_aiter.CALLS if n == "mla_decode_fwd"]
    groups = max(1, heads // 16)
    assert calls == [{"heads": 16, "max_seqlen_q": 4, "batch": 3 * groups}]
    assert be.calls == {"mla": 1, "mla_fallback": 0}


def test_mla_falls_back_when_queries_are_not_the_last_positions(fake_aiter) -> None:
    """aiter's causal convention is bottom-right; a query window that is not at the end of its
    sequence's keys goes to the base backend."""
    cache = torch.randn(32, 48).to(torch.bfloat16)
    meta = build_attn_metadata([[0, 1]], [2], [2], 4)
    meta = AttnMetadata(meta.positions, meta.cu_seqlens_q, meta.context_lens, meta.slot_mapping,
                        meta.block_tables, 4)
    meta.positions = torch.tensor([5, 2])  # not ascending to the end
    q = torch.randn(2, 1, 16, 48).to(torch.bfloat16)
    be = get_backend("aiter")
    be.attention(q, cache[:, None], cache[:, None, :32], meta, 0.1)
    assert be.calls == {"mla": 0, "mla_fallback": 1} and not fake_aiter.CALLS


def _experts(kind: str, e: int = 4, h: int = 64, i: int = 32) -> tuple[list, list, list]:
    g = torch.Generator().manual_seed(1)

    def one(n: int, k: int):
        if kind == "bf16":
            return DenseWeight((torch.randn(n, k, generator=g) / 8).to(torch.bfloat16))
        codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
        return Int4Weight(codes, (torch.rand(n, k // 32, generator=g) / 20).to(torch.bfloat16), 32)

    return [one(i, h) for _ in range(e)], [one(i, h) for _ in range(e)], [one(h, i) for _ in range(e)]


@pytest.mark.parametrize("kind, quant", [("bf16", "No"), ("int4", "per_1x32")])
def test_moe_matches_the_reference(fake_aiter, kind: str, quant: str) -> None:
    gate, up, down = _experts(kind)
    be, ref = get_backend("aiter"), get_backend("torch")
    op, rop = be.moe(), ref.moe()
    op.prepare(gate, up, down, None, torch.bfloat16, torch.device("cpu"))
    rop.prepare(gate, up, down, None, torch.bfloat16, torch.device("cpu"))
    assert op.mode != "fallback"
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 4, (5, 2), generator=g)
    w = torch.rand(5, 2, generator=g)
    assert torch.equal(op(x, ids, w), rop(x, ids, w))
    assert fake_aiter.CALLS == [("fused_moe", {"quant_type": quant, "experts": 4, "tokens": 5})]


def test_moe_falls_back_where_aiter_has_no_kernel(fake_aiter) -> None:
    """INT4 x int8 activations (W4A8): no aiter MoE kernel on any arch (aiter's fused_moe has no int4 x int8 path)."""
    gate, up, down = _experts("int4")
    gate = [Int4Weight(w.codes, w.scale.float().amax(1), None) for w in gate]
    up = [Int4Weight(w.codes, w.scale.float().amax(1), None) for w in up]
    down = [Int4Weight(w.codes, w.scale.float().amax(1), None) for w in down]
    op = get_backend("aiter").moe()
    op.prepare(gate, up, down, "int8", torch.bfloat16, torch.device("cpu"))
    assert op.mode == "fallback"
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert op(x, torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)).shape == (3, 64)
    assert not fake_aiter.CALLS


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 700, 12]]


def test_llm_greedy_equals_the_torch_backend(fake_aiter, tiny_dir: Path) -> None:
    """Kimi's own format (INT4 group-32 experts) through aiter's a16w4 MoE and MLA, bf16; and with
    the MLA draft, speculative greedy == plain greedy through the adapter."""
    kw = dict(tokenizer=None, dtype="bfloat16", num_blocks=32, block_size=4)
    ref = LLM(tiny_dir / "kimi-k2.5", None, backend="torch", **kw)
    reference = [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]
    llm = LLM(tiny_dir / "kimi-k2.5", None, backend="aiter", **kw)
    assert llm.kernel_backend == "aiter" and isinstance(llm.target.backend, AiterBackend)
    expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    # Two implementations in bf16 agree within rounding, not bit for bit: the adapter folds heads
    # and pads differently, and the CPU's vector kernels (AVX2 / AVX-512 / AMX) round differently.
    assert_generations_agree(ref.target, llm.target, PROMPTS, reference, expected, BF16_LOGIT_TOL, "aiter vs torch")
    names = {(n, c.get("quant_type"), c.get("heads")) for n, c in fake_aiter.CALLS}
    assert ("fused_moe", "per_1x32", None) in names and ("mla_decode_fwd", None, 16) in names
    spec = LLM(tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.6-eagle3.1-mla", backend="aiter",
               num_speculative_tokens=3, **kw)
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == expected
    assert spec.stats.num_drafts > 0


def test_bench_cli_records_aiter(fake_aiter, tiny_dir: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    from eagle3.cli import main

    report = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as e:
        main(["bench", str(tiny_dir / "kimi-k2.5"), "--kernel-backend", "aiter", "--input-len", "8",
              "--output-len", "2", "--num-prompts", "1", "--report", str(report)])
    out = capsys.readouterr()
    assert not e.value.code, out.out + out.err
    assert json.loads(report.read_text())["kernel_backend"] == "aiter"
    assert any(n == "fused_moe" for n, _ in fake_aiter.CALLS)


# ---------------------------------------------------------------------------------------------
# fp8 KV cache (kv_cache_dtype="fp8"): aiter's a8w8 MLA decode over aiter.dtypes.fp8
# ---------------------------------------------------------------------------------------------


def test_mla_over_an_fp8_cache_uses_aiter_a8w8(fake_aiter) -> None:
    """fp8 queries (one dynamic scale per call) and the latent's fp8 codes with the layer's scale:
    the result is the reference attention of the dequantized fp8 queries over the same codes
    (bf16 outputs); the storage is aiter.dtypes.fp8 (the fake: gfx942's e4m3fnuz)."""
    be, ref = get_backend("aiter"), get_backend("torch")
    fp8 = be.kv_storage("fp8_e4m3", torch.bfloat16)
    assert fp8 == fake_aiter.dtypes.fp8 == torch.float8_e4m3fnuz
    g = torch.Generator().manual_seed(0)
    d_lat, heads = 32, 64
    cache = torch.zeros(64, d_lat + 16, dtype=fp8)
    be.write_cache(cache, torch.arange(64), torch.randn(64, d_lat + 16, generator=g), 0.02)
    meta = build_attn_metadata([[0, 1, 2], [5, 6], [9, 3, 4, 7]], [9, 4, 12], [1, 4, 2], 4)
    q = torch.randn(meta.num_tokens, 1, heads, d_lat + 16, generator=g).to(torch.bfloat16)
    flat = cache[:, None, :]
    got = be.attention(q, flat, flat[..., :d_lat], meta, 0.125, be.plan_attention(meta), k_scale=0.02, v_scale=0.02)
    q_scale = q.float().abs().max() / 240.0  # e4m3fnuz's largest value
    q8 = (q.float() / q_scale).clamp(-240, 240).to(fp8).float() * q_scale
    want = ref.attention(q8, flat, flat[..., :d_lat], meta, 0.125, k_scale=0.02, v_scale=0.02).to(torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert [c for n, c in fake_aiter.CALLS] == [{"heads": 16, "max_seqlen_q": 4, "batch": 12, "fp8": True}]
    # a verify window longer than aiter's fp8 limit (4 queries) reads the same codes on the base backend
    meta5 = build_attn_metadata([[0, 1, 2]], [4], [5], 4)
    q5 = torch.randn(5, 1, heads, d_lat + 16, generator=g).to(torch.bfloat16)
    out = be.attention(q5, flat, flat[..., :d_lat], meta5, 0.125, k_scale=0.02, v_scale=0.02)
    assert torch.equal(out, ref.attention(q5, flat, flat[..., :d_lat], meta5, 0.125, k_scale=0.02, v_scale=0.02))
    assert be.calls == {"mla": 1, "mla_fallback": 1}


def test_e5m2_is_refused_in_one_line(fake_aiter, tiny_dir: Path) -> None:
    with pytest.raises(UsageError, match=r"'fp8_e5m2': kernel backend 'aiter' cannot hold it \(its MLA kernels read "
                                         r"e4m3 only"):
        LLM(tiny_dir / "kimi-k2.5", None, backend="aiter", kv_cache_dtype="fp8_e5m2", tokenizer=None, num_blocks=8)


def test_llm_with_an_fp8_cache(fake_aiter, tiny_dir: Path) -> None:
    """The target's latent and the MLA draft's in aiter.dtypes.fp8; the decode rows go through aiter's
    a8w8 MLA. Its dynamic query scale follows the batch (not batch invariant, see aiter.py): the
    tokens are checked for length only, the numbers by the attention test above."""
    kw = dict(tokenizer=None, dtype="bfloat16", num_blocks=32, block_size=4, kv_cache_dtype="fp8")
    llm = LLM(tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.6-eagle3.1-mla", backend="aiter",
              num_speculative_tokens=3, **kw)
    assert llm.target.kv_cache_spec().dtype == llm.draft.kv_cache_spec().dtype == torch.float8_e4m3fnuz
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert any(c.get("fp8") for n, c in fake_aiter.CALLS if n == "mla_decode_fwd")
