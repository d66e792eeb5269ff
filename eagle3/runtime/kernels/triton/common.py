"""Shared helpers of the Triton kernels: interpreter detection, compute dtypes, block sizes.

Under ``TRITON_INTERPRET=1`` (CPU CI) Triton runs kernels through numpy, which has no bfloat16:
bf16 loads, arithmetic and ``tl.dot`` all operate on raw bit patterns (verified with triton 3.9;
triton-lang/triton#11584). The wrappers therefore widen bf16 operands to fp32 when interpreting
(:func:`widen`) and round results back in torch; on a GPU bf16 goes straight to the kernels.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when ``@triton.jit`` builds interpreted functions (decided when a kernel module is
    imported, so ``TRITON_INTERPRET`` must be set before that)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


INTERPRET = interpreting()

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    return _TL_DTYPES[dtype]


def widen(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels may read it: bf16 widened to fp32 under the interpreter (see above)."""
    if INTERPRET and x.dtype == torch.bfloat16:
        return x.float()
    return x


def dot_dtype(dtype: torch.dtype) -> torch.dtype:
    """``tl.dot`` operand dtype for activations in ``dtype``: the model dtype on a GPU (bf16/fp16
    tensor cores, fp32 accumulation), fp32 for fp32 models and for bf16 under the interpreter."""
    if dtype == torch.bfloat16 and INTERPRET:
        return torch.float32
    return dtype


def block(n: int, minimum: int = 16) -> int:
    """Power-of-two block covering ``n`` (``tl.dot`` needs every dim >= 16 on GPUs)."""
    return max(minimum, triton.next_power_of_2(max(int(n), 1)))


@triton.jit
def mma(a, b, IEEE: tl.constexpr):
    """``tl.dot`` with fp32 accumulation; fp32 operands in full IEEE precision (not TF32: the
    reference is fp32) when ``IEEE``."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def tree_visible(k, lo, bits):
    """Draft-tree mask ``[rows, keys]`` for keys ``k [keys]``: a key before the row's tree region
    (``k < lo``) is context; inside it, key ``lo + j`` is visible iff bit ``j`` of the row's
    ancestor mask ``bits`` (int64) is set. Keys past the row's own position are masked by the
    caller (``k <= pos``), so ``j`` stays below 64 wherever the bit decides."""
    rel = k[None, :] - lo[:, None]
    shift = tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)
    return (rel < 0) | (((bits[:, None] >> shift) & 1) != 0)
