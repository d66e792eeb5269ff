"""FAKE aiter for CI (see ../README.md): contracts of the documented API, torch-reference results."""

from __future__ import annotations

import enum
from typing import Any

CALLS: list[tuple[str, dict[str, Any]]] = []  # (entry point, what the call looked like)


class ActivationType(enum.Enum):
    No = -1
    Silu = 0
    Gelu = 1


class QuantType(enum.Enum):
    No = 0
    per_Tensor = 1
    per_Token = 2
    per_1x32 = 3
    per_1x128 = 4
    per_128x128 = 5


def contract(ok: bool, what: str) -> None:
    """A violated contract of the documented API: the adapter called aiter wrongly."""
    if not ok:
        raise AssertionError(f"fake aiter: contract violated: {what}")


from aiter import dtypes, fused_moe, mla, ops  # noqa: E402  (after the names they import)

__all__ = ["CALLS", "ActivationType", "QuantType", "contract", "dtypes", "fused_moe", "mla", "ops"]
