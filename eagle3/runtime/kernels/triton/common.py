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
def bf16_round(x, ON: tl.constexpr):
    """fp32 ``x`` rounded to bfloat16 precision (nearest, ties to even), kept in fp32: the
    interpreter's stand-in for bf16 arithmetic (see above; torch's bf16 ops round the fp32 result
    the same way); identity unless ``ON``."""
    if ON:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def mma(a, b, IEEE: tl.constexpr):
    """``tl.dot`` with fp32 accumulation; fp32 operands in full IEEE precision (not TF32: the
    reference is fp32) when ``IEEE``."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def tree_key_positions(k, km, lo_ptr, path_ptr, t, PATH: tl.constexpr):
    """Cache positions of the virtual key positions ``k [keys]`` (``km``: the ones read) of a
    chunk whose deepest query token is ``t``: a tree chunk (one root-to-node path) reads virtual
    key ``lo + d`` at the cache position ``path[t, d]`` of the path's depth-``d`` node, the context
    below ``lo`` in place; ordinary chunks have ``lo`` = 2**31 - 1 and read every key in place.
    Keys past the deepest query's virtual position are not read (``km``), so ``d`` stays below
    ``PATH`` wherever it is read."""
    lo = tl.load(lo_ptr + t)
    rel = k - lo
    on = km & (rel >= 0)
    cp = tl.load(path_ptr + t * PATH + rel, mask=on, other=0)
    return tl.where(on, cp, k)
