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

Speed (the same bits): an output element depends on its own row of ``a`` and column of ``b`` only,
so the product runs on the rows of ``a`` and columns of ``b`` that hold a nonzero value, and every
other element, whose products are all signed zeros when the operands are finite, is the sum of
those: -0 when all of them are -0 (the sign of each product is the XOR of its factors' signs), else
+0, whatever the order. Tiles padded past the valid rows (16 token rows for one decoding token,
masked keys) loaded zeros there: about two thirds of the interpreted GEMMs' products were of zero
rows or columns in an end-to-end generation. Operands with an infinity or NaN go the full way.
Integer products of int8 operands (the W4A8 paths' digits) are exact sums in any order: numpy's
integer matmul (no BLAS) computes them.
"""

from __future__ import annotations

import numpy as np
import pytest


def fixed_order_product(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``a [..., M, K] @ b [..., K, N]`` in ``dtype``: products rounded to ``dtype``, then summed
    over K by halves (element k with element k + K//2, an odd last one carried), level by level."""
    if a.dtype == b.dtype == np.int8 and np.issubdtype(dtype, np.integer) and dtype.itemsize >= 4 \
            and a.shape[-1] < 2 ** 16:
        # int8 x int8 products (|p| <= 2^14) summed over K < 2^16 stay below 2^30: exact in any order
        return np.matmul(a.astype(dtype), b.astype(dtype))
    a, b = a.astype(dtype), b.astype(dtype)
    if a.ndim != 2 or b.ndim != 2 or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return _pairwise(a, b)
    row_nz, col_nz = (a != 0).any(axis=1), (b != 0).any(axis=0)
    if row_nz.all() and col_nz.all():
        return _pairwise(a, b)
    out = np.zeros((a.shape[0], b.shape[1]), dtype)
    if np.issubdtype(dtype, np.floating):
        _signed_zeros(out, a, b, np.flatnonzero(~row_nz), np.flatnonzero(~col_nz))
    rows, cols = np.flatnonzero(row_nz), np.flatnonzero(col_nz)
    if len(rows) and len(cols):
        out[np.ix_(rows, cols)] = _pairwise(a[rows], b[:, cols])
    return out


def _signed_zeros(out: np.ndarray, a: np.ndarray, b: np.ndarray, zero_rows: np.ndarray, zero_cols: np.ndarray) -> None:
    """The elements of ``out = a [M, K] @ b [K, N]`` (finite) in a zero row of ``a`` or a zero column
    of ``b``, all of whose products are zeros: -0 where every product is -0, i.e. where the signs of
    ``a[m, k]`` and ``b[k, n]`` differ for every k, else +0 (an IEEE sum of signed zeros is -0 only
    from -0 + -0). Against a row or column of +0 (what masked loads pad with) that is where the other
    operand's signs are all set."""
    sa, sb = np.signbit(a), np.signbit(b)
    if len(zero_cols):
        plus = ~sb[:, zero_cols].any(axis=0)
        out[:, zero_cols[plus]] = np.where(sa.all(axis=1), -0.0, 0.0)[:, None]
        for n in zero_cols[~plus]:
            out[:, n] = np.where((sa != sb[:, n]).all(axis=1), -0.0, 0.0)
    if len(zero_rows):
        plus = ~sa[zero_rows].any(axis=1)
        out[zero_rows[plus], :] = np.where(sb.all(axis=0), -0.0, 0.0)
        for m in zero_rows[~plus]:
            out[m, :] = np.where((sa[m][:, None] != sb).all(axis=0), -0.0, 0.0)


def _pairwise(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.ndim == 2 and b.ndim == 2:
        return _pairwise_2d(a, b)
    p = a[..., :, :, None] * b[..., None, :, :]  # [..., M, K, N]
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


def _pairwise_2d(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """:func:`_pairwise` of 2-D operands, the same sums in the same order: the products laid out
    ``[K, M, N]`` so that each level adds two contiguous halves, in place (no new array and no
    concatenation per level; an odd level's last element moves down to join the next one). About
    a third less time for the attention kernels' ``p @ v`` tiles (64 x 32 x 512)."""
    p = a.T[:, :, None] * b[:, None, :]
    k = p.shape[0]
    while k > 1:
        half = k // 2
        np.add(p[:half], p[half: 2 * half], out=p[:half])
        if k % 2:
            p[half] = p[2 * half]
            half += 1
        k = half
    return p[0]
