"""aiter.ops.shuffle (fake): ``shuffle_weight`` permutes (16, 16)-layout tiles as the documented one
does in spirit (rows by 16, columns by 2 x 16 elements: 32 bytes, or 16 bytes of INT4 pairs) and sets ``is_shuffled``; the
fake kernels undo it with :func:`unshuffle` (not part of aiter)."""

from __future__ import annotations

import torch

from aiter import contract


def _tiles(x: torch.Tensor, layout: tuple[int, int], use_int4: bool) -> tuple[int, int]:
    rows, cols = layout[0], 2 * layout[1]  # elements; two INT4 elements per byte
    cols = cols // 2 if use_int4 else cols
    contract(x.dim() >= 2 and x.shape[-2] % rows == 0 and x.shape[-1] % cols == 0,
             f"shuffle_weight: shape {list(x.shape)} must tile by {rows} x {cols}")
    return rows, cols


def shuffle_weight(x: torch.Tensor, layout: tuple[int, int] = (16, 16), use_int4: bool = False) -> torch.Tensor:
    contract(x.is_contiguous(), "shuffle_weight: weight must be contiguous")
    contract(not use_int4 or x.dtype == torch.uint8, f"shuffle_weight(use_int4=True) of {x.dtype}")
    rows, cols = _tiles(x, layout, use_int4)
    n, k = x.shape[-2:]
    y = x.reshape(-1, n // rows, rows, k // cols, cols).permute(0, 1, 3, 2, 4).contiguous().view(x.shape)
    y.is_shuffled = True  # type: ignore[attr-defined]
    y.fake_layout = (layout, use_int4)  # type: ignore[attr-defined]
    return y


def unshuffle(y: torch.Tensor) -> torch.Tensor:
    contract(getattr(y, "is_shuffled", False), "weights must be preshuffled with aiter.ops.shuffle.shuffle_weight")
    layout, use_int4 = y.fake_layout  # type: ignore[attr-defined]
    rows, cols = _tiles(y, layout, use_int4)
    n, k = y.shape[-2:]
    return y.reshape(-1, n // rows, k // cols, rows, cols).permute(0, 1, 3, 2, 4).contiguous().view(y.shape)
