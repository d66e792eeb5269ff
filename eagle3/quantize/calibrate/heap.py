"""Handing freed memory back to the OS between the calibration pass's solves.

The pass frees hundreds of MB after every MLP (its fp32 source values, Hessians, factors) and
allocates the same shapes again for the next one. glibc keeps freed blocks below its mmap threshold
inside its heaps, and the pages of free chunks stay resident until something trims them, so where
the next MLP's blocks land, and the resident peak, depended on the layers run before.
:func:`release_freed` after each MLP and each layer returns every free page (``malloc_trim(0)``
also releases whole free pages inside a heap, not only at its top); ``eagle3 quantize --calibrate``
also lowers the mmap threshold (``eagle3.cli.convert``), so large tensors are unmapped when freed.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return None


def release_freed() -> None:
    """Return the allocator's free pages to the OS (glibc ``malloc_trim(0)``; a no-op elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
