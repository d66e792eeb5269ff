"""Planned shards: every tensor's place is known before any data is written, so workers can fill
one shard file at arbitrary offsets (quantize, slice) and a rerun can resume."""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint.header import TensorInfo, dtype_from_tag, tag_from_dtype
from eagle3.checkpoint.rawio import _copy_range, _pread_into, _pwrite_all, writing
from eagle3.checkpoint.writer import _header_json
from eagle3.errors import CheckpointError


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str  # safetensors tag
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class ShardLayout:
    """The byte layout of one safetensors file whose tensors (names, dtypes, shapes, order) are
    known up front, e.g. planned from the source headers. The header is then final before any data
    exists and every tensor has a fixed offset, so tensors can be written in any order and from
    several threads at once (:class:`ShardFile`). The bytes equal what :class:`CheckpointWriter`
    writes for the same tensors in the same order (compact JSON header padded to 8 bytes)."""

    def __init__(self, entries: Iterable[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, dict[str, Any]] = {}
        pos = 0
        for name, tag, shape in entries:
            if name in header:
                raise CheckpointError(f"tensor {name!r} planned twice")
            shape = tuple(int(d) for d in shape)
            n = math.prod(shape) * dtype_from_tag(tag).itemsize
            header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [pos, pos + n]}
            pos += n
        raw = _header_json({"format": "pt", **(metadata or {})}, header)
        self.header = struct.pack("<Q", len(raw)) + raw
        base = len(self.header)
        self.tensors = {name: PlannedTensor(name, e["dtype"], tuple(e["shape"]), base + e["data_offsets"][0],
                                            e["data_offsets"][1] - e["data_offsets"][0]) for name, e in header.items()}
        self.data_bytes = pos
        self.size = base + pos


class ShardFile:
    """A planned shard written in place: the header first, the file sized to its final length, then
    each tensor with positional writes (``pwrite`` / ``copy_file_range`` at explicit offsets, no
    shared file position), so worker threads can fill different tensors concurrently. A tensor
    whose dtype or shape differs from the plan is refused with the file and tensor named."""

    def __init__(self, path: Path, layout: ShardLayout) -> None:
        self.path = Path(path)
        self.layout = layout
        with writing(self.path):
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with writing(self.path):
                _pwrite_all(self._fd, memoryview(layout.header), 0)
                os.ftruncate(self._fd, layout.size)
        except BaseException:
            os.close(self._fd)
            raise

    def _slot(self, name: str, tag: str, shape: tuple[int, ...]) -> PlannedTensor:
        slot = self.layout.tensors.get(name)
        if slot is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the planned layout")
        if slot.dtype != tag or slot.shape != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {name!r} is {tag}{list(shape)}, "
                                  f"planned as {slot.dtype}{list(slot.shape)}")
        return slot

    def write(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu").contiguous()
        slot = self._slot(name, tag_from_dtype(t.dtype), tuple(t.shape))
        if slot.nbytes:
            with writing(self.path):
                _pwrite_all(self._fd, memoryview(t.reshape(-1).view(torch.uint8).numpy()), slot.offset)

    def write_rows(self, name: str, start: int, rows: torch.Tensor) -> None:
        """Write rows ``start : start + len(rows)`` (along dim 0) of a planned tensor, so that a
        tensor too large to hold (a full-width embedding) is filled a block of rows at a time."""
        slot = self.layout.tensors.get(name)
        if slot is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the planned layout")
        t = rows.detach().to("cpu").contiguous()
        if tag_from_dtype(t.dtype) != slot.dtype or tuple(t.shape[1:]) != slot.shape[1:] \
                or start < 0 or start + t.shape[0] > slot.shape[0]:
            raise CheckpointError(f"{self.path}: rows {start}..{start + t.shape[0]} of {name!r} "
                                  f"({tag_from_dtype(t.dtype)}{list(t.shape)}) do not fit {slot.dtype}{list(slot.shape)}")
        row_bytes = slot.nbytes // slot.shape[0] if slot.shape[0] else 0
        if t.numel():
            _pwrite_all(self._fd, memoryview(t.reshape(-1).view(torch.uint8).numpy()), slot.offset + start * row_bytes)

    def copy_raw(self, name: str, info: TensorInfo) -> None:
        """Copy a source tensor's bytes into its slot, in the kernel where the platform allows it."""
        slot = self._slot(name, info.dtype, info.shape)
        try:
            src = os.open(info.file, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{info.file}: cannot read tensor {info.name!r} ({e.strerror or e})") from None
        try:
            _copy_range(src, info.offset, self._fd, slot.offset, slot.nbytes,
                        f"{info.file}: truncated shard while reading tensor {info.name!r}", self.path)
        finally:
            os.close(src)

    def read(self, name: str) -> torch.Tensor:
        """Read a tensor back from the file (what a loader will see)."""
        slot = self.layout.tensors[name]
        buf = bytearray(slot.nbytes)
        got = _pread_into(self._fd, memoryview(buf), slot.offset)
        if got != slot.nbytes:
            raise CheckpointError(f"{self.path}: short read of tensor {name!r} ({got} of {slot.nbytes} bytes)")
        dt = dtype_from_tag(slot.dtype)
        if not slot.nbytes:
            return torch.empty(slot.shape, dtype=dt)
        return torch.frombuffer(buf, dtype=dt).reshape(slot.shape)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1



