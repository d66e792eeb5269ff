"""The fp8 KV cache in the Triton kernels (under the interpreter on a CPU), against the torch
reference over the same fp8 codes and scales.

Tolerance: the two differ only where the scales multiply (the reference scales the query by
``softmax_scale * k_scale`` before its score GEMM, the kernels the score tile after the dot) and in
the online softmax's rescaling: a few fp32 ulps of outputs of size ~10, so 1e-5 relative (fp32 as
in test_attention_kernels.py: the codes are exact in fp32). Chain shapes (decode, verify windows,
prefill chunks) and draft trees (virtual key positions), MLA latent and GQA with separate K / V
scales, e4m3 and e5m2; end to end, ``LLM(backend="triton", kv_cache_dtype="fp8")`` greedy agrees
with the torch reference's within the fp32 logit tolerance (fp32 model), and its speculative tree decoding
(the MLA draft's fp8 latent) equals its plain greedy bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from eagle3.errors import UsageError  # noqa: E402
from eagle3.runtime import kv_cache  # noqa: E402
from eagle3.runtime.engine.llm import LLM  # noqa: E402
from eagle3.runtime.kernels import get_backend  # noqa: E402
from eagle3.runtime.kernels.triton.backend import TritonBackend  # noqa: E402
from eagle3.runtime.sampling import SamplingParams  # noqa: E402
from eagle3.testing.numerics import FP32_LOGIT_TOL, FP32_ROUTER_TOL, assert_generations_agree  # noqa: E402
from tests.runtime.test_tree_attention import _Batch, _random_tree  # noqa: E402
from tests.runtime.triton.test_attention_kernels import SEQS, _meta, _randn, _slots  # noqa: E402
from tests.runtime.triton.test_triton_tree_attention import _to  # noqa: E402

REF = get_backend("torch")
TOL = 1e-5
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=TOL, atol=TOL * float(want.abs().max()))


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("case", [0, 1])
def test_mla_latent_fp8_matches_the_reference(device: torch.device, dtype: torch.dtype, case: int) -> None:
    be = get_backend("triton", device)
    meta = _meta(SEQS[case], 4, seed=case)
    sc = 0.02
    cache = kv_cache.quantize(_randn(_slots(meta), 48, dtype=torch.float32, seed=1) * 3, dtype, sc)
    q = _randn(meta.num_tokens, 1, 4, 48, dtype=torch.float32, seed=2)
    args = (q, cache[:, None, :], cache[:, None, :32], meta, 0.25)
    got = be.attention(*args, plan=be.plan_attention(meta), k_scale=sc, v_scale=sc)
    _close(got, REF.attention(*args, k_scale=sc, v_scale=sc))


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_paged_gqa_fp8_matches_the_reference(device: torch.device, dtype: torch.dtype) -> None:
    be = get_backend("triton", device)
    meta = _meta(SEQS[0], 4)
    kv = _randn(_slots(meta), 2, 2, 24, dtype=torch.float32, seed=5)
    c8 = torch.stack([kv_cache.quantize(kv[:, 0], dtype, 0.01), kv_cache.quantize(kv[:, 1], dtype, 0.03)], 1)
    q = _randn(meta.num_tokens, 2, 4, 24, dtype=torch.float32, seed=6)
    args = (q, c8[:, 0], c8[:, 1], meta, 24 ** -0.5)
    got = be.attention(*args, plan=be.plan_attention(meta), k_scale=0.01, v_scale=0.03)
    _close(got, REF.attention(*args, k_scale=0.01, v_scale=0.03))


@pytest.mark.parametrize("shared", [True, False], ids=["mla-latent", "paged-gqa"])
def test_tree_attention_fp8_matches_the_reference(device: torch.device, shared: bool) -> None:
    trees = [_random_tree(1), None, _random_tree(3, k=4, steps=2, n=6)]
    bt = _Batch(ctx=[40, 9, 33], pre=[0, 1, 3], trees=trees, seed=4)
    g = torch.Generator().manual_seed(5)
    dt = torch.float8_e4m3fn
    if shared:
        store = kv_cache.quantize(torch.randn(1024, 48, generator=g) * 2, dt, 0.02)
        kc, vc, ks, vs = store[:, None, :], store[:, None, :32], 0.02, 0.02
        q = torch.randn(bt.num_tokens, 1, 4, 48, generator=g)
    else:
        kv = torch.randn(1024, 2, 2, 16, generator=g)
        store = torch.stack([kv_cache.quantize(kv[:, 0], dt, 0.01), kv_cache.quantize(kv[:, 1], dt, 0.04)], 1)
        kc, vc, ks, vs = store[:, 0], store[:, 1], 0.01, 0.04
        q = torch.randn(bt.num_tokens, 2, 3, 16, generator=g)
    want = REF.attention(q, kc, vc, bt.meta, 0.25, k_scale=ks, v_scale=vs)
    be = get_backend("triton", device)
    meta = _to(bt.meta, device)
    got = be.attention(q.to(device), kc.to(device), vc.to(device), meta, 0.25, be.plan_attention(meta),
                       k_scale=ks, v_scale=vs)
    _close(got, want)


def test_an_old_nvidia_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton converts e4m3 from sm_89 on: an A100 is one line, not a silent bf16 cache."""
    be = TritonBackend.__new__(TritonBackend)
    be.device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(kv_cache, "fnuz_device", lambda d: False)
    with pytest.raises(UsageError, match=r"kernel backend 'triton' cannot hold it \(NVIDIA A100.*sm_80"):
        be.kv_storage("fp8_e4m3", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert be.kv_storage("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn


GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPTS = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 700, 12]]


@pytest.mark.slow  # ~25 s: three engines through the interpreter
def test_llm_fp8_matches_the_reference_and_trees_equal_plain(device: torch.device, tiny_dir: Path) -> None:
    """fp32 model, fp8 cache: the two backends quantize latents that differ by fp32 rounding, so an
    element on an fp8 rounding boundary may land on the neighbouring code (one e4m3 step) in one of
    them, which moves later logits by far more than rounding (one such code: 3.3e-4 on the CPU,
    0.01 on an H200; numerics.CacheTape). The teacher-forced comparison therefore writes the
    reference's codes into the Triton target's cache (the cache write is shared code): what is
    compared is the Triton kernels over the same codes, within the fp32 tolerance (1e-3)."""
    kw = dict(tokenizer=None, dtype="float32", num_blocks=32, block_size=4, kv_cache_dtype="fp8")
    llm = LLM(tiny_dir / "kimi-k2.5", None, backend="triton", device=device, **kw)
    assert llm.target.kv_cache_spec().dtype == torch.float8_e4m3fn
    expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    ref = LLM(tiny_dir / "kimi-k2.5", None, backend="torch", device=device, **kw)
    reference = [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]
    assert_generations_agree(ref.target, llm.target, PROMPTS, reference, expected, FP32_LOGIT_TOL,
                             "triton vs torch, fp8 KV cache", router=FP32_ROUTER_TOL)
    spec = LLM(llm.target, tiny_dir / "kimi-k2.6-eagle3.1-mla", num_speculative_tokens=3, speculative_eagle_topk=2,
               speculative_num_draft_tokens=6, **kw)
    assert spec.draft.kv_cache_spec().dtype == torch.float8_e4m3fn
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == expected
    assert spec.stats.num_drafts > 0
