"""A size-capped streaming safetensors writer and its index (``model.safetensors.index.json``).

The writer holds one tensor at a time (tensor bytes go straight to a data file; the header is
written when the shard closes), so peak memory is bounded by the largest tensor.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint.files import INDEX_FILE
from eagle3.checkpoint.header import MAX_HEADER_BYTES, TensorInfo, tag_from_dtype
from eagle3.checkpoint.jsonio import write_json
from eagle3.checkpoint.rawio import _copy_file, writing
from eagle3.errors import CheckpointError

DEFAULT_SHARD_BYTES = 5 * 1024**3


class _ShardBuilder:
    """One output shard. The header needs every name and offset, so it can only be written when
    the shard closes; how the data gets behind it depends on the shard's size:

    * small shards (< ``DIRECT_WRITE_BYTES``): tensor bytes go to a data file, and :meth:`finish`
      writes header + data into the shard (the extra copy is cheap, and the file has no padding);
    * large shards: once the data would pass that size, the shard file itself is opened with room
      reserved for the header (estimated from the entries so far, the safetensors spec allows
      trailing spaces in the header), the bytes written so far move there once, and every later
      tensor is written exactly once. If the final header does not fit the reservation, the shard
      falls back to the copy."""

    DIRECT_WRITE_BYTES = 64 * 1024 * 1024

    def __init__(self, data_path: Path, out_path: Path | None = None,
                 max_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        self.data_path = data_path
        self.out_path = out_path
        self.max_bytes = max_bytes
        with writing(data_path):
            self._f = open(data_path, "wb")
        self.entries: dict[str, dict[str, Any]] = {}
        self.nbytes = 0
        self._reserved: int | None = None  # header bytes reserved in out_path once writing directly

    def _go_direct(self, next_bytes: int) -> None:
        """Switch to writing into ``out_path`` behind a reserved header."""
        assert self.out_path is not None
        per_entry = len(json.dumps(self.entries, separators=(",", ":"))) / max(len(self.entries), 1) + 16
        expect = max(self.max_bytes, self.nbytes + next_bytes)
        entries = len(self.entries) * expect / max(self.nbytes, 1) + 16
        reserve = int(min(max(2 * per_entry * entries + 4096, 1 << 20), MAX_HEADER_BYTES // 2))
        reserve += -reserve % 8
        with writing(self.data_path):
            self._f.close()
        with writing(self.out_path):
            out = open(self.out_path, "wb")
            out.seek(8 + reserve)
            with open(self.data_path, "rb") as data:
                _copy_file(data, out, self.nbytes)
            self.data_path.unlink()
        self._f = out
        self._reserved = reserve

    def _entry(self, name: str, tag: str, shape: list[int], n: int) -> None:
        if self._reserved is None and self.out_path is not None and self.nbytes + n >= self.DIRECT_WRITE_BYTES:
            self._go_direct(n)
        self.entries[name] = {"dtype": tag, "shape": shape, "data_offsets": [self.nbytes, self.nbytes + n]}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu").contiguous()
        n = t.numel() * t.element_size()
        self._entry(name, tag_from_dtype(t.dtype), list(t.shape), n)
        if n:
            # A uint8 view of the storage: no copy for contiguous tensors of any dtype.
            with writing(self._f.name):
                self._f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self.nbytes += n

    def add_raw(self, name: str, info: TensorInfo) -> None:
        self._entry(name, info.dtype, list(info.shape), info.nbytes)
        if info.nbytes:
            with writing(self._f.name):
                self._f.flush()  # a full disk shows here or in the copy (named as the output's)
            try:
                with open(info.file, "rb") as src:
                    src.seek(info.offset)
                    _copy_file(src, self._f, info.nbytes)
            except OSError as e:  # write errors are OutputError (not an OSError): this is the read
                raise CheckpointError(f"{info.file}: cannot read tensor {info.name!r} ({e.strerror or e})") from None
        self.nbytes += info.nbytes

    def _header(self, metadata: dict[str, str]) -> bytes:
        return _header_json(metadata, self.entries)

    def finish(self, out_path: Path, metadata: dict[str, str]) -> None:
        with writing(out_path):
            self._finish(out_path, metadata)

    def _finish(self, out_path: Path, metadata: dict[str, str]) -> None:
        raw = self._header(metadata)
        if self._reserved is not None:
            assert out_path == self.out_path
            if len(raw) <= self._reserved:
                self._f.seek(0)
                self._f.write(struct.pack("<Q", self._reserved))
                self._f.write(raw + b" " * (self._reserved - len(raw)))
                self._f.close()
                return
            # The header outgrew its reservation: move the data behind a header of the right size.
            self._f.close()
            os.replace(out_path, self.data_path)
            skip = 8 + self._reserved
        else:
            self._f.close()
            skip = 0
        with open(out_path, "wb") as out, open(self.data_path, "rb") as data:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            data.seek(skip)
            _copy_file(data, out, self.nbytes)
        self.data_path.unlink()


def _header_json(metadata: dict[str, str], entries: dict[str, dict[str, Any]]) -> bytes:
    """The safetensors header JSON (compact), padded with spaces so that the data starts 8-aligned."""
    raw = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


class CheckpointWriter:
    """Writes tensors into size-capped shards ``model-0000i-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` (with ``metadata.total_size``). A checkpoint that fits in one
    shard is written as ``model.safetensors`` with no index, as transformers does.

    Tensors go to the current shard in call order; a tensor larger than the cap gets a shard of its
    own. Use :meth:`start_shard` to force a shard boundary (e.g. to keep the source's layout)."""

    def __init__(self, out_dir: str | os.PathLike[str], max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 metadata: dict[str, str] | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self._done: list[tuple[Path, list[str], int]] = []  # temp path, names, bytes
        self._cur: _ShardBuilder | None = None
        self._names: set[str] = set()
        self._closed = False

    def _new_shard(self) -> _ShardBuilder:
        i = len(self._done)
        return _ShardBuilder(self.out_dir / f".shard-{i:05d}.data", self.out_dir / f".shard-{i:05d}.safetensors",
                             self.max_shard_bytes)

    def start_shard(self) -> None:
        """Close the current shard (if it holds anything); the next tensor starts a new one."""
        if self._cur is not None and self._cur.entries:
            self._finish_current()

    def _finish_current(self) -> None:
        assert self._cur is not None
        tmp = self.out_dir / f".shard-{len(self._done):05d}.safetensors"
        self._cur.finish(tmp, self.metadata)
        self._done.append((tmp, list(self._cur.entries), self._cur.nbytes))
        self._cur = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("writer is closed")
        if name in self._names:
            raise CheckpointError(f"tensor {name!r} written twice")
        self._names.add(name)
        self._room(tensor.numel() * tensor.element_size())
        assert self._cur is not None
        self._cur.add(name, tensor)

    def add_raw(self, name: str, info: TensorInfo) -> None:
        """Write the tensor ``info`` describes (from a :class:`CheckpointReader`) under ``name``,
        copying its bytes file to file (in the kernel where the platform allows it): a tensor that
        is only renamed never passes through Python memory."""
        if self._closed:
            raise RuntimeError("writer is closed")
        if name in self._names:
            raise CheckpointError(f"tensor {name!r} written twice")
        self._names.add(name)
        self._room(info.nbytes)
        assert self._cur is not None
        self._cur.add_raw(name, info)

    def _room(self, n: int) -> None:
        """Make the current shard able to take ``n`` more bytes (a new shard past the cap)."""
        if self._cur is not None and self._cur.entries and self._cur.nbytes + n > self.max_shard_bytes:
            self._finish_current()
        if self._cur is None:
            self._cur = self._new_shard()

    def close(self) -> list[Path]:
        """Finish the last shard, give shards their final names, write the index."""
        if self._closed:
            raise RuntimeError("writer is closed")
        self._closed = True
        if self._cur is not None and (self._cur.entries or not self._done):
            self._finish_current()
        total = len(self._done)
        final: list[Path] = []
        weight_map: dict[str, str] = {}
        total_size = 0
        for i, (tmp, names, nbytes) in enumerate(self._done):
            fname = "model.safetensors" if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            dst = self.out_dir / fname
            tmp.rename(dst)
            final.append(dst)
            total_size += nbytes
            for n in names:
                weight_map[n] = fname
        if total > 1:
            write_json(self.out_dir / INDEX_FILE, {"metadata": {"total_size": total_size},
                                                    "weight_map": dict(sorted(weight_map.items()))})
        return final

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None and not self._closed:
            self.close()
