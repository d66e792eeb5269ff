"""``LLM(target, backend="triton")`` on targets that ``eagle3 quantize`` wrote (W4A8 and MXFP4
routed experts; the Moonshot INT4 target is tests/runtime/triton/test_triton_backend_llm.py's):
every Linear and MoE of target and draft runs the Triton kernels, and greedy speculative decoding
with the Llama-style and the MLA draft equals plain greedy decoding (so the quantized GEMMs and the
fused MoE kept batch invariance: verifying k+1 tokens gives the bits of decoding them one by one).

One short prompt, fp32, few tokens: under the interpreter every kernel program is Python."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from eagle3.runtime.engine.llm import LLM  # noqa: E402
from eagle3.runtime.kernels.triton.backend import TritonBackend  # noqa: E402
from eagle3.runtime.kernels.triton.linear import TritonLinear  # noqa: E402
from eagle3.runtime.kernels.triton.moe import TritonMoE  # noqa: E402
from eagle3.runtime.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = [[9, 8, 7, 6, 5, 700, 12]]
MODE = {"w4a8": "fp8", "mxfp4": "mxfp4"}  # the MoE's activation path each recipe records
DRAFT_ON_CPU = {"w4a8": "kimi-k2.5-eagle3", "mxfp4": "kimi-k2.6-eagle3.1-mla"}


def _ops(model: torch.nn.Module) -> list[object]:
    """The kernel ops of a loaded model (Linear layers' ``op``, MoE layers' ``experts``)."""
    return [getattr(m, a) for m in model.modules() for a in ("op", "experts") if hasattr(m, a)]


@pytest.fixture(scope="module", params=["w4a8", "mxfp4"])
def target(request: pytest.FixtureRequest, tiny_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, list[list[int]]]:
    from eagle3.quantize import pipeline

    out = tmp_path_factory.mktemp("triton-q") / request.param
    pipeline.quantize(str(tiny_dir / "kimi-k2.5"), out, request.param, None, workers=1, engine="native", verify=False,
                      progress=False)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(out, None, tokenizer=None, backend="triton", dtype=torch.float32, device=dev, num_blocks=16,
              block_size=4)
    experts = [op for op in _ops(llm.target) if isinstance(op, TritonMoE)]
    assert experts and {op.mode for op in experts} == {MODE[request.param]}
    assert any(isinstance(op, TritonLinear) for op in _ops(llm.target))
    return llm, [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("draft", ["kimi-k2.5-eagle3", "kimi-k2.6-eagle3.1-mla"], ids=["llama-draft", "mla-draft"])
def test_speculative_greedy_equals_plain_greedy(target: tuple[LLM, list[list[int]]], tiny_dir: Path,
                                                draft: str, request: pytest.FixtureRequest) -> None:
    fmt = request.node.callspec.params["target"]
    if not torch.cuda.is_available() and DRAFT_ON_CPU[fmt] != draft:
        # Interpreter time: the quantized target verifies k+1 rows with either draft alike (the
        # drafts' own kernels are test_triton_backend_llm.py's), so the CPU pairs each target with
        # one draft, both drafts covered. A GPU runs every pair.
        pytest.skip(f"interpreter: {fmt} runs with {DRAFT_ON_CPU[fmt]}")
    target_llm, expected = target
    llm = LLM(target_llm.target, tiny_dir / draft, num_speculative_tokens=3, tokenizer=None, num_blocks=16,
              block_size=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.stats.num_drafts > 0
    assert isinstance(llm.draft.backend, TritonBackend)
    assert any(isinstance(op, TritonLinear) for op in _ops(llm.draft))


class _Counted:
    """A Triton kernel that still runs, counting its launches."""

    def __init__(self, fn: object) -> None:
        self.fn, self.calls = fn, 0

    def __getitem__(self, grid: object) -> object:
        def launch(*args: object, **kw: object) -> object:
            self.calls += 1
            return self.fn[grid](*args, **kw)  # type: ignore[index]
        return launch


def test_norms_hand_their_quantization_to_the_gemms(target: tuple[LLM, list[list[int]]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """W4A8: each norm in front of per-token-quantized GEMMs makes their activation codes in its own
    launch (rmsnorm.rms_norm_quant) and the GEMMs read them, with each residual add fused into the
    norm after it; a forward's hidden states are bit for bit those of the separate ops."""
    from eagle3.runtime.kernels import base
    from eagle3.runtime.kernels.triton import act_quant
    from tests.runtime.model_kit import PagedKV

    llm, _ = target
    model = llm.target
    quantized = [m for m in model.modules() if getattr(m, "token_quant", None) is not None]
    if not quantized:
        pytest.skip("no per-token activation quantization in this recipe")

    def forward() -> tuple[torch.Tensor, int]:
        counted = _Counted(act_quant._quant_kernel)
        monkeypatch.setattr(act_quant, "_quant_kernel", counted)
        kv = PagedKV(model, num_blocks=8)
        ids, meta = kv.step({"a": [5, 9, 300], "b": [44]})
        with torch.no_grad():
            h, _ = model(ids, meta, kv.caches)
        return h, counted.calls

    fused, fused_calls = forward()
    monkeypatch.setattr(TritonBackend, "add_rms_norm_quant", base.KernelBackend.add_rms_norm_quant)
    separate, separate_calls = forward()
    assert torch.equal(fused, separate)
    moe_layers = sum(1 for m in quantized if m.__class__.__name__ == "MoE")
    assert moe_layers and fused_calls <= separate_calls - moe_layers  # the experts' GEMM 1 input
