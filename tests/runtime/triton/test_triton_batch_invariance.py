"""The existing batch-invariance schedule of ``tests/runtime/test_models_target.py`` run on the
Triton backend: chunked prefill mixed with other sequences, a k+1 verify whose rejected tail is
overwritten, then single-token decodes (one under the interpreter); every token's hidden state,
aux states and logits must be bitwise those of its sequence run alone. Every Linear and MoE of the
target runs the Triton GEMM / fused MoE kernels (asserted), attention the Triton MLA kernel.

fp32 (under the interpreter its bf16 dot is wrong; the torch-backend test covers bf16), on the GPU
when there is one (the caches and metadata follow the model's device), else interpreted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from eagle3.runtime.interfaces import default_aux_layer_ids  # noqa: E402
from eagle3.runtime.kernels.triton.linear import TritonLinear  # noqa: E402
from eagle3.runtime.kernels.triton.moe import TritonMoE  # noqa: E402
from eagle3.runtime.loader import load_target  # noqa: E402
from tests.runtime.model_kit import requantize_target  # noqa: E402
from tests.runtime.test_models_target import _schedule, _seqs  # noqa: E402


@pytest.fixture(scope="module")
def w4a8(tiny_dir, tmp_path_factory) -> Path:
    """The W4A8 re-quantization of test_models_target.py's ``quantized`` alone (that fixture also
    writes MXFP4 and the dense references, which these tests do not read)."""
    return requantize_target(tiny_dir / "kimi-k2-thinking", tmp_path_factory.mktemp("triton-bi") / "w4a8", "w4a8")


@pytest.mark.parametrize("fmt", ["int4-w4a16", "w4a8-int8"])
def test_batch_invariance_on_triton(tiny_dir, request: pytest.FixtureRequest, fmt: str, device: torch.device) -> None:
    if fmt == "int4-w4a16":
        m = load_target(tiny_dir / "kimi-k2.5", dtype=torch.float32, device=device, backend="triton")
    else:
        m = load_target(request.getfixturevalue("w4a8"), dtype=torch.float32, device=device, act_override="int8",
                        backend="triton")
    ops = [getattr(mod, a) for mod in m.modules() for a in ("op", "experts") if hasattr(mod, a)]
    assert any(isinstance(op, TritonMoE) for op in ops) and any(isinstance(op, TritonLinear) for op in ops)
    seqs = _seqs()
    if not torch.cuda.is_available():
        # Interpreter time: sequence a ends one token after the schedule's last verify, so it runs
        # one single-token decode (position 16), not the torch-backend test's four (16..19: the
        # same step shape again, a forward each). A GPU runs all four.
        seqs["a"] = seqs["a"][:17]
    _schedule(m, seqs, default_aux_layer_ids(m.num_layers))
