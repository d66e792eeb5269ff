"""Human-readable sizes for what eagle3 prints (the JSON reports keep exact byte counts)."""

from __future__ import annotations


def human_bytes(n: int | None, digits: int = 2) -> str:
    """``1536 -> '1.50 KiB'``; binary units, ``'?'`` for an unknown size."""
    if n is None:
        return "?"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024:
            return f"{int(x)} B" if unit == "B" else f"{x:.{digits}f} {unit}"
        x /= 1024
    return f"{x:.{digits}f} TiB"
