"""Triton kernel tests. Without a GPU the kernels run under the Triton interpreter, which must be
switched on before triton is first imported (``@triton.jit`` decides at decoration time); each
test module skips itself cleanly when triton is not installed."""

from __future__ import annotations

import os

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


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
