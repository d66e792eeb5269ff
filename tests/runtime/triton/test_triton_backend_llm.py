"""``backend="triton"`` end to end: selection through the kernel registry, and through ``LLM`` on
the tiny Kimi-K2.5 target greedy speculative decoding equals plain greedy decoding with the
Llama-style draft and with the MLA draft (so every Triton op kept batch invariance: the target
verifies k+1 tokens per sequence with the same bits as decoding them one by one).

Kept to two prompts and a few tokens: under the interpreter every kernel program is Python, and a
decode step of the two prompts costs about half their prefill (bf16: 1.9 s vs 3.9 s of CPU). A chain
runs 4 tokens (three verify steps a sequence after the prefill, each rejecting drafts: the random
tiny drafts are not accepted), a tree 5 (a tree is drafted only at its full depth, k = 3, within
max_tokens: one tree verify a sequence, then decode steps too close to max_tokens for a tree)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from eagle3.errors import UsageError  # noqa: E402
from eagle3.runtime.engine.llm import LLM  # noqa: E402
from eagle3.runtime.kernels import get_backend  # noqa: E402
from eagle3.runtime.kernels.triton import common  # noqa: E402
from eagle3.runtime.kernels.triton.backend import TritonBackend  # noqa: E402
from eagle3.runtime.sampling import SamplingParams  # noqa: E402
from eagle3.testing.numerics import BF16_LOGIT_TOL, assert_generations_agree, logit_tol, router_tol  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
CHAIN_TOKENS = 4  # a chain case compares plain greedy's first 4 tokens (greedy: a prefix is the shorter run)
PROMPTS = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 700, 12]]


def _logit_tol(dtype: torch.dtype) -> float:
    """The dtype's tolerance, plus one bf16 tolerance on a GPU for bf16 attention probabilities: the
    Triton attention kernels multiply them into the values as bf16 (a tensor-core dot, as
    FlashAttention does; mla_attention.py), the torch reference in fp32, and the interpreter's bf16
    dots run in fp32 (common.dot_dtype), so only a GPU rounds them. Rounding the reference's
    probabilities to bf16 alone moved these prompts' bf16 logits by up to 0.123 (on the CPU; 0.117
    at prompt 0, step 5, where an H200 measured 0.135 between the two backends), on top of the two
    backends' other bf16 rounding."""
    tol = logit_tol(dtype)
    return tol + BF16_LOGIT_TOL if common.dot_dtype(dtype) == torch.bfloat16 else tol


def test_backend_is_selected_by_name(device: torch.device) -> None:
    be = get_backend("triton", device)
    assert isinstance(be, TritonBackend) and be.name == "triton"


def test_backend_extra_ops(device: torch.device) -> None:
    """The ops the models do not call yet: fused residual + norm, per-token activation quant."""
    from eagle3.runtime.kernels import torch_ref

    be = get_backend("triton", device)
    g = torch.Generator().manual_seed(0)
    x, r, w = (torch.randn(*s, generator=g).to(device) for s in ((5, 64), (5, 64), (64,)))
    y, summed = be.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, x + r)
    torch.testing.assert_close(y, torch_ref.TorchBackend(device).rms_norm(x + r, w, 1e-6), rtol=2.4e-7, atol=2.4e-7)
    q, s = be.quantize_act(x, "int8")
    assert torch.equal(q, torch_ref.quantize_int8_per_token(x)[0]) and s.shape == (5,)
    assert be.quantize_act(x, "fp8")[0].dtype == torch.float8_e4m3fn
    with pytest.raises(UsageError, match="mxfp4"):
        be.quantize_act(x, "mxfp4")


def test_cpu_without_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "INTERPRET", False)
    with pytest.raises(UsageError, match="TRITON_INTERPRET=1"):
        TritonBackend("cpu")


# Interpreter time: the CPU runs bf16 only, the models' dtype. The interpreter's bf16 dots run in
# fp32 (common.dot_dtype), and the Triton backend in fp32 end to end stays covered on the CPU by
# test_triton_batch_invariance.py (this INT4 target's rows bitwise alone vs in a chunked-prefill /
# verify / decode schedule), test_triton_quantized_llm.py (speculative == plain greedy, Llama and
# MLA drafts), test_triton_graphs.py (this target and the Llama draft through LLM) and
# test_triton_fp8_kv.py (LLM vs the torch backend within the fp32 tolerance). A GPU runs both.
DTYPES = [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.bfloat16]


@pytest.fixture(scope="module", params=DTYPES, ids=lambda d: {torch.float32: "fp32", torch.bfloat16: "bf16"}[d])
def plain(request: pytest.FixtureRequest, tiny_dir: Path) -> tuple[LLM, list[list[int]]]:
    """Plain greedy on the Triton backend; bf16 is the real models' dtype (on the CPU it runs
    through the interpreter shim of kernels/triton/common.py)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(tiny_dir / "kimi-k2.5", None, tokenizer=None, backend="triton", dtype=request.param, device=dev,
              num_blocks=32, block_size=4)
    assert isinstance(llm.target.backend, TritonBackend)
    return llm, [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_plain_greedy_matches_the_torch_backend(plain: tuple[LLM, list[list[int]]], tiny_dir: Path) -> None:
    """Two implementations agree within rounding, not bit for bit (which vector kernels the CPU
    picks decides the bf16 rounding): logits within the dtype's tolerance over the reference's
    tokens, greedy tokens equal until the first near tie (eagle3.testing.numerics)."""
    llm, expected = plain
    dtype = llm.target.dtype
    ref = LLM(tiny_dir / "kimi-k2.5", None, tokenizer=None, backend="torch", dtype=dtype, num_blocks=32,
              block_size=4, device=llm.device)
    reference = [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]
    assert_generations_agree(ref.target, llm.target, PROMPTS, reference, expected, _logit_tol(dtype),
                             f"triton vs torch ({dtype})", router=router_tol(dtype))


CASES = [  # (draft, k, engine kwargs)
    ("kimi-k2.5-eagle3", 3, {}),
    ("kimi-k2.6-eagle3.1-mla", 3, {}),
    ("kimi-k2.5-eagle3-d2t", 5, {"block_size": 2, "max_num_batched_tokens": 8}),  # chunked prefill
    ("kimi-k2.6-eagle3.1-mla", 2, {"num_blocks": 5}),  # preemption (of one sequence, within 4 tokens)
    ("kimi-k2.5-eagle3", 3, {"speculative_eagle_topk": 2, "speculative_num_draft_tokens": 7}),  # draft trees
    ("kimi-k2.6-eagle3.1-mla", 3, {"speculative_eagle_topk": 3, "speculative_num_draft_tokens": 9}),
]


@pytest.mark.parametrize(("draft", "k", "kw"), CASES,
                         ids=["llama-draft", "mla-draft", "d2t-chunked-prefill", "mla-preemption", "llama-draft-tree",
                              "mla-draft-tree"])
def test_speculative_greedy_equals_plain_greedy(plain: tuple[LLM, list[list[int]]], tiny_dir: Path, draft: str,
                                                k: int, kw: dict) -> None:
    target_llm, expected = plain
    # Trees run in both dtypes: a tree query reads its virtual key positions (context, then its
    # ancestors in depth order), the chain's key tiles in the chain's order, so its rows are the
    # chain's bits and even a bf16 near-tie picks plain greedy's token.
    tree = "speculative_eagle_topk" in kw
    fp32 = target_llm.target.dtype == torch.float32
    if fp32 and not tree and draft != "kimi-k2.5-eagle3":
        pytest.skip("fp32 runs the llama-draft chain and the trees only")
    if not torch.cuda.is_available():
        # Interpreter time (every Linear and MoE runs Triton programs as Python): the CPU drops the
        # cases whose code path another case here runs already. bf16's plain llama / MLA chains are
        # the d2t chunked-prefill and the MLA preemption chains without their extras. A GPU runs
        # every case.
        if not tree and not kw:
            pytest.skip("interpreter: the d2t / preemption chains cover the plain chains")
        if tree and draft != "kimi-k2.5-eagle3":
            pytest.skip("interpreter: the MLA draft's tree runs through the graph path below")
    kw = {"num_blocks": 32, "block_size": 4, **kw}
    llm = LLM(target_llm.target, tiny_dir / draft, num_speculative_tokens=k, tokenizer=None, **kw)
    n = GREEDY.max_tokens if tree else CHAIN_TOKENS
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert [o.token_ids for o in outs] == [e[:n] for e in expected]
    assert llm.stats.num_drafts > 0
    assert isinstance(llm.draft.backend, TritonBackend)
    if kw["num_blocks"] < 32:
        assert sum(o.num_preemptions for o in outs) > 0


def test_tree_graph_steps_equal_plain_greedy(plain: tuple[LLM, list[list[int]]], tiny_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Draft trees through the graph path (``graphs.EagerCapturer`` stands in for CUDA graphs: the
    same static buffers and captured metadata, whose Triton plan computes each replay's tree
    arrays by device ops): speculative greedy still equals plain greedy. On the CPU this is the
    MLA draft's tree case (the eager one above runs on a GPU only)."""
    from eagle3.runtime.engine import graphs

    target_llm, expected = plain
    if target_llm.target.dtype == torch.float32:
        pytest.skip("interpreter time: bf16 only")
    monkeypatch.setattr(graphs, "available", lambda device: True)
    monkeypatch.setattr(graphs, "default_capturer", graphs.EagerCapturer)
    llm = LLM(target_llm.target, tiny_dir / "kimi-k2.6-eagle3.1-mla", num_speculative_tokens=3, tokenizer=None,
              num_blocks=32, block_size=4, speculative_eagle_topk=2, speculative_num_draft_tokens=7)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert llm.cuda_graphs and (7, 2, 7) in llm.runner.target_graphs.graphs
    assert (2, 2, 4) in llm.runner.draft_graphs.graphs
