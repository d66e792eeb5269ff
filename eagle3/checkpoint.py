"""Sharded safetensors checkpoints: a lazy reader, a size-capped streaming writer, atomic output
directories and a sha256 manifest.

Why not ``safetensors.safe_open`` for reading: it maps whole files, and the touched pages of a
multi-GB shard stay in the process's RSS. We parse the (tiny) JSON header ourselves, which also
lets us name the file and the tensor when a header is corrupt or a shard is truncated, and read one
tensor's bytes with a single ``readinto``. The byte layout is the safetensors format
(8-byte little-endian header length, JSON header, raw little-endian data) and files written here
are read back by ``safetensors`` itself in the tests.

Memory: the reader holds one tensor at a time; the writer holds one tensor at a time too (tensor
bytes go straight to a data file; the header is written when the shard closes), so peak memory is
bounded by the largest tensor, whatever the checkpoint size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import struct
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.errors import CheckpointError, OutputExistsError, VerifyError
from eagle3.formats.files import INDEX_FILE, MANIFEST_FILE, is_side_file

# safetensors dtype tag <-> torch dtype. F8_E8M0 exists in newer safetensors/torch only.
_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):
    _DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
_TAGS: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
DEFAULT_SHARD_BYTES = 5 * 1024**3


def dtype_from_tag(tag: str) -> torch.dtype:
    try:
        return _DTYPES[tag]
    except KeyError:
        raise CheckpointError(f"unsupported safetensors dtype {tag!r}") from None


def tag_from_dtype(dtype: torch.dtype) -> str:
    try:
        return _TAGS[dtype]
    except KeyError:
        raise CheckpointError(f"cannot store torch dtype {dtype} in safetensors") from None


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, known from the header alone."""

    name: str
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset of the data in ``file``
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_tag(self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_header(file: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors header; returns (tensors, ``__metadata__``)."""
    file = Path(file)
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header)")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
                raise CheckpointError(
                    f"{file}: bad safetensors header (header length {hlen} but the file has {size} bytes)"
                )
            hdr_bytes = f.read(hlen)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(hdr_bytes.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{file}: bad safetensors header (not valid JSON: {e})") from None
    meta = header.pop("__metadata__", None) or {}
    base = 8 + hlen
    out: dict[str, TensorInfo] = {}
    for name, ent in header.items():
        try:
            tag = ent["dtype"]
            shape = tuple(int(d) for d in ent["shape"])
            begin, end = (int(x) for x in ent["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: bad safetensors header entry for tensor {name!r}") from None
        dt = dtype_from_tag(tag)
        numel = 1
        for d in shape:
            numel *= d
        want = numel * dt.itemsize
        if end - begin != want or begin < 0:
            raise CheckpointError(
                f"{file}: tensor {name!r} has {end - begin} bytes in the header but {tag}{list(shape)} needs {want}"
            )
        if base + end > size:
            raise CheckpointError(
                f"{file}: truncated shard: tensor {name!r} ends at byte {base + end} but the file has {size} bytes"
            )
        out[name] = TensorInfo(name, tag, shape, file, base + begin, want)
    return out, meta


class CheckpointReader:
    """Lazy view of a checkpoint: one ``.safetensors`` file or a directory (sharded with an index,
    or any set of ``*.safetensors`` files). Names, shapes and dtypes come from the headers only;
    :meth:`get` reads exactly one tensor."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        if not p.exists():
            raise CheckpointError(f"{p}: no such file or directory")
        self.path = p if p.is_dir() else p.parent
        self._infos: dict[str, TensorInfo] = {}
        self.metadata: dict[str, Any] = {}
        if p.is_file():
            files = [p]
        elif (p / INDEX_FILE).is_file():
            files = self._files_from_index(p)
        else:
            files = sorted(p.glob("*.safetensors"))
        self.files: list[Path] = files
        for f in files:
            infos, _ = read_header(f)
            for name, info in infos.items():
                if name in self._infos:
                    raise CheckpointError(f"{f}: tensor {name!r} is also in {self._infos[name].file.name}")
                self._infos[name] = info
        if p.is_dir() and (p / INDEX_FILE).is_file():
            self._check_index(p)

    @classmethod
    def from_headers(cls, path: str | os.PathLike[str], headers: dict[str, dict[str, dict[str, Any]]],
                     metadata: dict[str, Any] | None = None) -> CheckpointReader:
        """A header-only view: ``headers`` maps shard file names to their safetensors header
        entries (``dtype``, ``shape``, ``data_offsets``), e.g. fetched from the Hub with HTTP range
        requests. Names, shapes and dtypes work as usual; :meth:`get` refuses (no data is here)."""
        self = cls.__new__(cls)
        self.path = Path(path)
        self.metadata = metadata or {}
        self.files = [self.path / f for f in headers]
        self._infos = {}
        for fname, entries in headers.items():
            for name, ent in entries.items():
                begin, end = (int(x) for x in ent["data_offsets"])
                self._infos[name] = TensorInfo(name, ent["dtype"], tuple(int(d) for d in ent["shape"]),
                                               self.path / fname, -1, end - begin)
        return self

    def _files_from_index(self, d: Path) -> list[Path]:
        idx_path = d / INDEX_FILE
        try:
            idx = json.loads(idx_path.read_text())
            wm = idx["weight_map"]
            if not isinstance(wm, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"{idx_path}: not a valid index (needs a 'weight_map' object)") from None
        self.metadata = idx.get("metadata") or {}
        self._weight_map: dict[str, str] = wm
        files = []
        for fname in dict.fromkeys(wm.values()):
            f = d / fname
            if not f.is_file():
                raise CheckpointError(f"{idx_path}: names shard {fname} which does not exist")
            files.append(f)
        return files

    def _check_index(self, d: Path) -> None:
        for name, fname in self._weight_map.items():
            info = self._infos.get(name)
            if info is None or info.file.name != fname:
                raise CheckpointError(
                    f"{d / INDEX_FILE}: names tensor {name!r} in {fname}, but {fname} does not contain it"
                )

    # -- queries -------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}") from None

    def infos(self) -> list[TensorInfo]:
        return list(self._infos.values())

    def shards(self) -> dict[Path, list[str]]:
        """Tensor names per file, in file order."""
        out: dict[Path, list[str]] = {f: [] for f in self.files}
        for info in self._infos.values():
            out[info.file].append(info.name)
        return out

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self._infos.values())

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (a fresh, writable CPU tensor)."""
        info = self.info(name)
        if info.offset < 0:
            raise CheckpointError(f"{info.file}: tensor {name!r} is not downloaded (header-only view)")
        dt = info.torch_dtype
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dt)
        # Read straight into the tensor's storage: no zero-filled bytearray first (a fresh buffer's
        # first touch is the costly part of a read from the page cache).
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        try:
            with open(info.file, "rb", buffering=0) as f:
                n = _pread_into(f.fileno(), memoryview(buf.numpy()), info.offset)
        except OSError as e:
            raise CheckpointError(f"{info.file}: cannot read tensor {name!r} ({e.strerror or e})") from None
        if n != info.nbytes:
            raise CheckpointError(f"{info.file}: truncated shard while reading tensor {name!r}")
        return buf.view(dt).reshape(info.shape)

    def iter_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for n in self.names() if names is None else names:
            yield n, self.get(n)

    # -- side files ----------------------------------------------------------------------------
    def config(self) -> dict[str, Any] | None:
        return read_json(self.path / "config.json") if (self.path / "config.json").is_file() else None

    def side_files(self, trust_remote_code: bool = False) -> list[Path]:
        return sorted(
            f for f in self.path.iterdir() if f.is_file() and is_side_file(f.name, trust_remote_code)
        )


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def write_json(path: Path, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


# ----------------------------------------------------------------------------------------------
# Writer
# ----------------------------------------------------------------------------------------------


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
        self._f.close()
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
            self._f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self.nbytes += n

    def add_raw(self, name: str, info: TensorInfo) -> None:
        self._entry(name, info.dtype, list(info.shape), info.nbytes)
        if info.nbytes:
            try:
                with open(info.file, "rb") as src:
                    src.seek(info.offset)
                    _copy_file(src, self._f, info.nbytes)
            except OSError as e:
                raise CheckpointError(f"{info.file}: cannot read tensor {info.name!r} ({e.strerror or e})") from None
        self.nbytes += info.nbytes

    def _header(self, metadata: dict[str, str]) -> bytes:
        return _header_json(metadata, self.entries)

    def finish(self, out_path: Path, metadata: dict[str, str]) -> None:
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


def _copy_file(src: Any, dst: Any, n: int) -> None:
    """Copy ``n`` bytes from the current position of ``src`` to that of ``dst`` (file objects)."""
    dst.flush()  # the copy works on the fds: buffered bytes must be out first
    start, out = src.tell(), dst.tell()
    _copy_range(src.fileno(), start, dst.fileno(), out, n,
                f"{getattr(src, 'name', src)}: ended early while copying {n} bytes")
    src.seek(start + n)
    dst.seek(out + n)


def _copy_range(src: int, src_off: int, dst: int, dst_off: int, n: int, short: str) -> None:
    """Copy ``n`` bytes between two fds at explicit offsets (no file position is used, so threads
    may copy into one file at once): in the kernel where the platform allows it, else through a
    buffer. ``short`` is the error when the source ends early."""
    done = 0
    try:
        while done < n:
            k = os.copy_file_range(src, dst, n - done, src_off + done, dst_off + done)
            if k == 0:
                break
            done += k
    except (AttributeError, OSError):  # no copy_file_range here (or across these filesystems)
        pass
    if done < n:
        buf = memoryview(bytearray(min(16 << 20, n - done)))
        while done < n:
            k = min(len(buf), n - done)
            if _pread_into(src, buf[:k], src_off + done) != k:
                raise CheckpointError(short)
            _pwrite_all(dst, buf[:k], dst_off + done)
            done += k


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


# ----------------------------------------------------------------------------------------------
# Planned shards: every tensor's place is known before any data is written
# ----------------------------------------------------------------------------------------------


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
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
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
                        f"{info.file}: truncated shard while reading tensor {info.name!r}")
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


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``offset`` (one read returns at most ~2 GiB on Linux); bytes read."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def copy_side_files(src_dir: Path, dst_dir: Path, trust_remote_code: bool = False,
                    skip: Iterable[str] = ("config.json",)) -> list[str]:
    """Copy tokenizer, chat template and generation config (and ``*.py`` only with
    ``trust_remote_code``) from a model directory. ``config.json`` is the caller's to write."""
    copied = []
    skip = set(skip)
    for f in sorted(Path(src_dir).iterdir()):
        if f.is_file() and f.name not in skip and is_side_file(f.name, trust_remote_code):
            shutil.copy2(f, Path(dst_dir) / f.name)
            copied.append(f.name)
    return copied


# ----------------------------------------------------------------------------------------------
# Atomic output and manifest
# ----------------------------------------------------------------------------------------------


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def check_output(out: str | os.PathLike[str], overwrite: bool) -> Path:
    """Refuse an existing output unless ``overwrite`` (call before doing any work)."""
    p = Path(out)
    if p.exists() and not overwrite:
        raise OutputExistsError(f"{p}: already exists (pass --overwrite to replace it)")
    return p


@contextlib.contextmanager
def atomic_output(out: str | os.PathLike[str], overwrite: bool = False, resume: bool = False,
                  manifest: bool = True, known_digests: dict[str, str] | None = None) -> Iterator[Path]:
    """Yield ``<out>.partial``; on success write the manifest and rename it to ``<out>``.

    On an error the partial directory is removed (nothing half-written is left behind), except
    with ``resume=True``, where it is kept so that a rerun can skip finished work.
    ``known_digests`` (filled by the caller inside the block) spares re-hashing files it hashed."""
    dst = check_output(out, overwrite)
    tmp = partial_path(dst)
    if tmp.exists() and not resume:
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        yield tmp
        if manifest:
            write_manifest(tmp, known=known_digests)
    except BaseException:
        if not resume:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst.exists():
        old = dst.with_name(dst.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        dst.rename(old)
        tmp.rename(dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(dst)


def sha256_file(path: Path, chunk: int = 8 * 1024 * 1024) -> str:
    h = hashlib.sha256()
    buf = memoryview(bytearray(chunk))  # one buffer reused: no fresh 8 MB object per read
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(buf[:n])
    return h.hexdigest()


def _manifest_files(d: Path) -> list[Path]:
    return sorted(
        f for f in d.rglob("*")
        if f.is_file() and f.name != MANIFEST_FILE and not any(p.startswith(".") for p in f.relative_to(d).parts)
    )


def write_manifest(d: Path, workers: int = 2, known: dict[str, str] | None = None) -> Path:
    """``manifest.json``: sha256 and size of every file in ``d`` (hashing runs in threads:
    hashlib releases the GIL). ``known`` maps relative paths to digests the caller computed of
    files it finished writing (e.g. while other work was still running); the rest are hashed here."""
    d = Path(d)
    files = _manifest_files(d)
    known = known or {}
    with ThreadPoolExecutor(max_workers=workers) as ex:
        digests = list(ex.map(lambda f: known.get(str(f.relative_to(d))) or sha256_file(f), files))
    from eagle3 import __version__

    data = {
        "eagle3_version": __version__,
        "files": {str(f.relative_to(d)): {"sha256": h, "size": f.stat().st_size} for f, h in zip(files, digests, strict=False)},
    }
    write_json(d / MANIFEST_FILE, data)
    return d / MANIFEST_FILE


@dataclass
class VerifyResult:
    checked: int
    problems: list[str]


def verify_manifest(d: str | os.PathLike[str], workers: int = 2) -> VerifyResult:
    """Check every file listed in ``manifest.json`` (and that no file is unlisted)."""
    d = Path(d)
    mpath = d / MANIFEST_FILE
    if not mpath.is_file():
        raise VerifyError(f"{d}: no {MANIFEST_FILE} (only directories written by eagle3 carry one)")
    files = read_json(mpath).get("files")
    if not isinstance(files, dict):
        raise VerifyError(f"{mpath}: no 'files' object")
    problems: list[str] = []
    present = {str(f.relative_to(d)) for f in _manifest_files(d)}
    todo = []
    for rel, ent in files.items():
        f = d / rel
        if not f.is_file():
            problems.append(f"{rel}: missing")
        elif f.stat().st_size != ent.get("size"):
            problems.append(f"{rel}: size {f.stat().st_size} != {ent.get('size')}")
        else:
            todo.append((rel, f, ent.get("sha256")))
    with ThreadPoolExecutor(max_workers=workers) as ex:
        digests = list(ex.map(lambda t: sha256_file(t[1]), todo))
    for (rel, _, want), got in zip(todo, digests, strict=False):
        if got != want:
            problems.append(f"{rel}: sha256 mismatch")
    for rel in sorted(present - set(files)):
        problems.append(f"{rel}: not in the manifest")
    return VerifyResult(checked=len(files), problems=problems)

