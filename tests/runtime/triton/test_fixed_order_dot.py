"""fixed_order_dot.py's product skips the zero rows of ``a`` and zero columns of ``b``: it must give
the bits of the full fixed-order product (the same pairwise sums over every row and column),
signed zeros included, and go the full way for operands with an infinity or a NaN."""

from __future__ import annotations

import numpy as np
import pytest

from tests.runtime.triton.fixed_order_dot import _pairwise, fixed_order_product


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32) if x.dtype == np.float32 else x.view(np.uint16) if x.dtype == np.float16 else x


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32])
def test_skipping_zero_rows_and_columns_keeps_the_bits(dtype: type) -> None:
    rng = np.random.default_rng(0)
    for trial in range(40):
        m, k, n = (int(v) for v in rng.integers(1, 24, 3))
        if np.issubdtype(dtype, np.integer):
            a, b = rng.integers(-128, 128, (m, k)).astype(np.int8), rng.integers(-128, 128, (k, n)).astype(np.int8)
        else:
            a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
        a[rng.random(m) < 0.5] = 0
        b[:, rng.random(n) < 0.5] = 0
        if not np.issubdtype(dtype, np.integer):  # signed zeros: some all -0 rows, columns, mixed ones
            a[rng.random((m, k)) < 0.3] = -0.0
            b[rng.random((k, n)) < 0.3] = -0.0
            if trial % 4 == 0:
                a[0] = -0.0
                b[:, -1] = np.where(rng.random(k) < 0.5, -0.0, 0.0) if trial % 8 else 0.0
        want = _pairwise(a.astype(dtype), b.astype(dtype))
        got = fixed_order_product(a, b, np.dtype(dtype))
        assert got.dtype == want.dtype and np.array_equal(_bits(got), _bits(want)), (trial, m, k, n)


def test_non_finite_operands_and_batches_take_the_full_product() -> None:
    a = np.zeros((4, 3), np.float32)
    b = np.ones((3, 2), np.float32)
    b[1, 0] = np.inf
    with np.errstate(invalid="ignore"):
        got = fixed_order_product(a, b, np.dtype(np.float32))  # 0 * inf: NaN in column 0, as in full
    assert np.isnan(got[:, 0]).all() and (got[:, 1] == 0).all()
    x = np.random.default_rng(1).standard_normal((2, 5, 6)).astype(np.float32)
    x[:, 1] = 0
    y = np.random.default_rng(2).standard_normal((2, 6, 3)).astype(np.float32)
    assert np.array_equal(fixed_order_product(x, y, np.dtype(np.float32)), _pairwise(x, y))


def test_int8_products_at_their_extremes() -> None:
    """The integer path's sums at the largest int8 products over a long K: still the exact ones."""
    a = np.full((3, 4099), -128, np.int8)
    b = np.full((4099, 2), -128, np.int8)
    b[::2, 1] = 127
    got = fixed_order_product(a, b, np.dtype(np.int32))
    assert got.dtype == np.int32 and np.array_equal(got, _pairwise(a.astype(np.int32), b.astype(np.int32)))
    assert got[0, 0] == 4099 * 128 * 128


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32])
def test_the_in_place_2d_sums_are_the_level_by_level_ones(dtype: type) -> None:
    """The 2-D product (contiguous halves added in place) against the batched form's level-by-level
    sums (new arrays per level, an odd level's last element carried): the same bits, odd and even
    K, signed zeros included."""
    rng = np.random.default_rng(3)
    for k in [1, 2, 3, 5, 7, 32, 33, 96, 127]:
        m, n = (int(v) for v in rng.integers(1, 20, 2))
        a, b = (rng.standard_normal(s) * 8 for s in ((m, k), (k, n)))
        if not np.issubdtype(dtype, np.integer):
            a[rng.random((m, k)) < 0.2] = -0.0
        a, b = a.astype(dtype), b.astype(dtype)
        got, want = _pairwise(a, b), _pairwise(a[None], b[None])[0]
        assert got.dtype == want.dtype and np.array_equal(_bits(got), _bits(want)), k
