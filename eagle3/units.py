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


def parse_size(text: str, flag: str) -> int:
    """A size flag: ``"4GiB"``, ``"512MB"``, ``"5gb"``, ``"1000000"`` -> bytes (binary units with ``i``);
    one line naming ``flag`` when it is not one."""
    import re

    from eagle3.errors import UsageError

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", str(text).lower())
    if not m:
        raise UsageError(f"{flag} {text!r}: expected a size such as 4GiB or 512MB")
    base = 1024 if m.group(3) else 1000
    n = int(float(m.group(1)) * base ** " kmgt".index(m.group(2) or " "))
    if n <= 0:
        raise UsageError(f"{flag} {text!r}: must be positive")
    return n
