"""Triton kernels and the ``triton`` kernel backend (import-guarded: without the ``triton``
package the backend is registered as unavailable, with a one-line reason)."""

from __future__ import annotations

import torch

from eagle3.errors import UsageError
from eagle3.runtime.kernels.base import KernelBackend, register_backend

try:
    import triton  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without triton
    _REASON = f"kernel backend 'triton' needs the triton package (pip install 'eagle3[gpu]'): {exc}"

    class _Unavailable(KernelBackend):  # type: ignore[misc]
        name = "triton"

        def __init__(self, device: torch.device | str = "cpu") -> None:
            raise UsageError(_REASON)

    register_backend("triton", _Unavailable)  # type: ignore[type-abstract]
else:
    from eagle3.runtime.kernels.triton.backend import TritonBackend  # noqa: F401  (registers "triton")
