"""Kernel backends: one interface (``base``), the exact torch reference (``torch_ref``); Triton and
aiter backends register themselves under the same interface when present."""

from eagle3.runtime.kernels import torch_ref  # noqa: F401  (registers the "torch" backend)
from eagle3.runtime.kernels.base import (
    ACT_QUANTS,
    BACKEND_CHOICES,
    ActQuant,
    DenseWeight,
    FP8Weight,
    Int4Weight,
    KernelBackend,
    LinearOp,
    LinearWeight,
    MoEOp,
    MXFP4Weight,
    get_backend,
    register_backend,
    resolve_backend_name,
)

__all__ = [
    "ACT_QUANTS",
    "BACKEND_CHOICES",
    "ActQuant",
    "DenseWeight",
    "FP8Weight",
    "Int4Weight",
    "KernelBackend",
    "LinearOp",
    "LinearWeight",
    "MoEOp",
    "MXFP4Weight",
    "get_backend",
    "register_backend",
    "resolve_backend_name",
]
