"""NaN/Inf detection for the passes that write weights (``convert``, ``quantize``).

A non-finite weight is almost always a broken checkpoint (a diverged training run, a bad cast, a
corrupted copy); passed through, it turns every logit of a forward pass into NaN far from its
cause. So the writers refuse it with one line naming the tensor and its file, unless the user
asks for it (``--allow-nonfinite``), and then the reports say which tensors hold them.

Only floating-point tensors are checked (integer and packed tensors cannot hold NaN); FP8 E4M3
has NaN but no Inf and torch cannot test it directly, so it is widened first.
"""

from __future__ import annotations

import math
import os

import torch

from eagle3.checkpoint import TensorInfo, dtype_from_tag
from eagle3.errors import CheckpointError, Eagle3Error

_FLOAT_TAGS = frozenset({"BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2"})
_CHUNK_BYTES = 64 * 1024 * 1024


class NonFiniteError(Eagle3Error):
    """A weight holds NaN or Inf values."""


def nonfinite_message(where: str, what: str) -> str:
    return f"{where}: {what} holds NaN or Inf values (pass --allow-nonfinite to write it anyway)"


def all_finite(t: torch.Tensor) -> bool:
    """True when ``t`` holds no NaN/Inf (always for integer tensors).

    By min and max, which propagate NaN and are Inf where any element is: one vectorised
    reduction, ~15x cheaper than ``isfinite(t).all()`` on bf16 (1 ms vs 15 ms for 1.8M elements
    on one core, about what quantizing them to W4A8 costs)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = t.to(torch.float16)  # no FP8 reduction kernels; fp16 holds every FP8 value
    lo, hi = t.aminmax()
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def raw_all_finite(info: TensorInfo) -> bool:
    """The same test on a tensor's bytes in its source file, read in 64 MB chunks (copied tensors
    never pass through Python memory whole: an embedding is GBs)."""
    if info.dtype not in _FLOAT_TAGS or info.nbytes == 0:
        return True
    dt = dtype_from_tag(info.dtype)
    step = max(dt.itemsize, _CHUNK_BYTES // dt.itemsize * dt.itemsize)
    buf = bytearray(min(step, info.nbytes))
    try:
        fd = os.open(info.file, os.O_RDONLY)
        try:
            done = 0
            while done < info.nbytes:
                n = min(step, info.nbytes - done)
                view = memoryview(buf)[:n]
                got = 0
                while got < n:
                    k = os.preadv(fd, [view[got:]], info.offset + done + got)
                    if k <= 0:
                        return True  # a truncated file is the reader's to report, not this check's
                    got += k
                if not all_finite(torch.frombuffer(view, dtype=dt)):
                    return False
                done += n
        finally:
            os.close(fd)
    except OSError as e:  # the source side: never blamed on the output being written
        raise CheckpointError(f"{info.file}: cannot read tensor {info.name!r} ({e.strerror or e})") from None
    return True
