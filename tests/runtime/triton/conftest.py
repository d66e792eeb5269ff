"""Triton kernel tests. Without a GPU the kernels run under the Triton interpreter, which must be
switched on before triton is first imported (``@triton.jit`` decides at decoration time); each
test module skips itself cleanly when triton is not installed.

Under the interpreter ``tl.dot`` is replaced by a product whose bits do not depend on the CPU's
BLAS kernels (``fixed_order_dot.py`` says why): the bitwise batch-invariance tests then hold or
fail because of the kernels, on every x86-64 CPU alike (it skips the zero rows and columns of padded
tiles, with the same bits). The interpreter also patches the language once per launch, looks its
numpy dtypes, shapes, builtin names and promotion types up instead of rebuilding them, passes
operands that need no cast or broadcast straight through, reuses the decoded weight tiles of the
GEMMs' repeated decodes, and skips the int32 overflow checks whose assert it never makes
(``interpreter_speed.py``: speed, the same bits)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny shapes: a second torch thread only spins on the shared CI cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True, scope="session")
def _fixed_order_dot() -> Iterator[None]:
    """Under the interpreter, ``tl.dot`` as a GPU computes it: each output element reduced over K in
    one order, the same for every row and column, on any CPU (not numpy's BLAS). Session-wide, so
    that a module fixture (a plain-greedy LLM, say) computes with the same dot as the tests that
    compare against it: a function-scoped patch came after them, and bf16 speculative decoding
    parted from a plain greedy that numpy's BLAS had computed."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        yield
        return
    try:
        import triton.runtime.interpreter  # noqa: F401
    except ImportError:  # no triton: the test modules skip themselves
        yield
        return
    from tests.runtime.triton import fixed_order_dot, interpreter_speed

    with pytest.MonkeyPatch.context() as mp:
        fixed_order_dot.install(mp)
        interpreter_speed.install(mp)
        yield


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
