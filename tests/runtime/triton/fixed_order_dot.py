"""A ``tl.dot`` for the Triton interpreter whose bits do not depend on the CPU.

The interpreter (triton 3.9, ``InterpreterBuilder.create_dot``) computes ``tl.dot`` with
``np.matmul``, i.e. with whatever GEMM kernel OpenBLAS picks for the CPU it runs on. Those kernels
block the rows of a tile: on AVX2-only machines (OpenBLAS's Haswell and Zen kernels) a row's bits
depend on where it sits in the 16-row tile, on AVX-512 ones (SkylakeX) they happen not to. A
kernel that gives a token the same tile inputs alone and in a batch then produced different bits
for it on one CPU and the same bits on another, so a bitwise batch-invariance test proved
something about OpenBLAS, not about the kernel.

A GPU's MMA reduces each output element over K in an order fixed by the instruction, the same for
every row and column of the tile; that is what the kernels' batch invariance rests on. The product
here has that property on every CPU: each element of ``a @ b`` is the pairwise sum, in an order
that depends on K alone, of its own row's and column's products (elementwise numpy operations:
IEEE-exact per element whatever vector width runs them). Any difference left between a row alone
and the same row in a batch then comes from the kernel (its tiles, splits, masks or loads), which
is what the tests must catch.
"""

from __future__ import annotations

import numpy as np
import pytest


def fixed_order_product(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``a [..., M, K] @ b [..., K, N]`` in ``dtype``: products rounded to ``dtype``, then summed
    over K by halves (element k with element k + K//2, an odd last one carried), level by level."""
    p = a.astype(dtype)[..., :, :, None] * b.astype(dtype)[..., None, :, :]  # [..., M, K, N]
    while p.shape[-2] > 1:
        k = p.shape[-2]
        half = k // 2
        s = p[..., :half, :] + p[..., half: 2 * half, :]
        p = s if k % 2 == 0 else np.concatenate([s, p[..., 2 * half:, :]], axis=-2)
    return p[..., 0, :]


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace the interpreter's ``create_dot`` with :func:`fixed_order_product` (for the test's
    duration: ``monkeypatch`` undoes it)."""
    from triton.runtime import interpreter as ti

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        a_data, b_data = a.data, b.data
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):
            # fp8 operands: widened to fp16 first, as the interpreter's own create_dot does
            a_data = ti._convert_float(a_data, a.dtype, ti.tl.float16, None).view(np.float16)
            b_data = ti._convert_float(b_data, b.dtype, ti.tl.float16, None).view(np.float16)
        out = fixed_order_product(a_data, b_data, d.data.dtype) + d.data
        return ti.TensorHandle(out, d.dtype.scalar)

    monkeypatch.setattr(ti.InterpreterBuilder, "create_dot", create_dot)
