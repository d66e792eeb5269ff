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

import atexit
import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import stat
import struct
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from eagle3.errors import CheckpointError, OutputError, OutputExistsError, UsageError, VerifyError
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
# Every tag the safetensors library itself knows (0.8): a file with one of those that torch cannot
# hold is valid safetensors, only not something eagle3 reads; anything else is not safetensors.
_SAFETENSORS_TAGS = frozenset({
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
    "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
})

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit (MAX_HEADER_SIZE)
_U64 = 1 << 64  # safetensors reads shapes and offsets as 64-bit unsigned integers
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


def _file_kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "a special file"


def check_regular_file(path: str | os.PathLike[str]) -> os.stat_result:
    """``stat`` ``path`` (following symlinks) and refuse anything but a regular file, before anything
    opens it: opening a FIFO blocks until some writer appears (a hang, not an error), and a
    directory or a device is no data file whatever its name."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: is {_file_kind(st.st_mode)}, not a regular file")
    return st


def open_regular(path: str | os.PathLike[str], buffering: int = -1) -> Any:
    """Open a regular file for binary reading; anything else is refused with one line.

    Checked before the open (:func:`check_regular_file`) and again on the open descriptor: the open
    itself is non-blocking, so a FIFO swapped in between the two cannot hang it either."""
    check_regular_file(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{path}: is {_file_kind(mode)}, not a regular file")
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: a JSON object naming a key twice is refused (json keeps the last one
    silently, and which tensor a name then means is a guess)."""
    out = dict(pairs)
    if len(out) != len(pairs):  # rare: find the key to name it
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(f"duplicate key {k!r}")
            seen.add(k)
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str) -> Any:
    """``json.loads`` as strict as serde_json (the safetensors library's parser): no NaN/Infinity,
    no duplicate keys. A nesting too deep for Python raises ValueError, not RecursionError."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constants)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _show(value: Any) -> str:
    """A JSON value for an error message, cut short (it may come from a hostile file)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _json_kind(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")


def _u64(x: Any) -> bool:
    return type(x) is int and 0 <= x < _U64  # bool is an int subclass; safetensors refuses it


# name -> (dtype tag, shape, begin, end), in header order
_Entries = dict[str, tuple[str, tuple[int, ...], int, int]]


def _check_entries(where: Path, header: dict[str, Any]) -> tuple[_Entries, dict[str, str], list[tuple[int, int, str]]]:
    """Validate a parsed safetensors header as the safetensors library does (``Metadata::validate``):
    every entry has a known dtype tag, a shape of non-negative integers and ``data_offsets`` of two
    non-negative integers spanning exactly shape x dtype bytes, and the tensors, sorted by offset,
    tile the data region from byte 0 without gap or overlap. Returns the entries (header order),
    ``__metadata__`` and the spans (begin, end, name) sorted by offset: the last end is the data
    size the file must have. Hot for checkpoints of 100k+ tensors: plain loops, no objects."""
    meta = header.get("__metadata__")
    if meta is None:
        meta = {}
    elif not isinstance(meta, dict):
        raise CheckpointError(f"{where}: bad safetensors header (__metadata__ is {_show(meta)}, not an object)")
    else:
        for k, v in meta.items():
            if not isinstance(v, str):
                raise CheckpointError(f"{where}: bad safetensors header (__metadata__ maps {k!r} to {_show(v)}, "
                                      "not a string)")
    entries: _Entries = {}
    spans: list[tuple[int, int, str]] = []
    for name, ent in header.items():
        if name == "__metadata__":
            continue
        try:
            tag, shape, offs = ent["dtype"], ent["shape"], ent["data_offsets"]
            dt = _DTYPES[tag]
            numel = 1
            for d in shape:
                # bool is an int subclass (safetensors refuses it); the product is checked at each
                # step, as safetensors does, which also keeps a hostile 1M-dim shape cheap
                if type(d) is not int or d < 0 or d >= _U64:
                    raise TypeError
                numel *= d
                if numel >= _U64:
                    raise TypeError
            if type(shape) is not list or type(offs) is not list or len(offs) != 2:
                raise TypeError
            begin, end = offs
            if type(begin) is not int or type(end) is not int or begin < 0 or end < begin or end >= _U64:
                raise TypeError
            if end - begin != numel * dt.itemsize:
                raise TypeError
        except (KeyError, TypeError, ValueError):
            _entry_error(where, name, ent)
        entries[name] = (tag, tuple(shape), begin, end)
        spans.append((begin, end, name))
    spans.sort()
    pos, prev = 0, None
    for begin, end, name in spans:
        if begin < pos:
            raise CheckpointError(f"{where}: tensor {name!r}: data_offsets [{begin}, {end}] overlap tensor "
                                  f"{prev!r} (whose data ends at {pos})")
        if begin > pos:
            after = f"tensor {prev!r}, whose data ends at {pos}" if prev is not None else "the start of the data"
            raise CheckpointError(f"{where}: tensor {name!r}: data_offsets [{begin}, {end}] leave "
                                  f"{begin - pos} bytes unused after {after}")
        pos, prev = end, name
    return entries, meta, spans


def _entry_error(where: Path, name: str, ent: Any) -> NoReturn:
    """The one-line reason a header entry is invalid (the slow path of :func:`_check_entries`)."""
    at = f"{where}: tensor {name!r}"
    if not isinstance(ent, dict):
        raise CheckpointError(f"{at}: header entry is {_show(ent)}, not an object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in ent:
            raise CheckpointError(f"{at}: header entry has no {key!r}")
    tag, shape, offs = ent["dtype"], ent["shape"], ent["data_offsets"]
    if not isinstance(tag, str):
        raise CheckpointError(f"{at}: dtype {_show(tag)} is not a dtype tag (a string such as \"BF16\")")
    if tag not in _DTYPES:
        if tag in _SAFETENSORS_TAGS:
            raise CheckpointError(f"{at}: dtype {tag} is valid safetensors but not supported by eagle3")
        raise CheckpointError(f"{at}: unknown safetensors dtype {tag!r}")
    if not isinstance(shape, list) or not all(_u64(d) for d in shape):
        raise CheckpointError(f"{at}: shape {_show(shape)} is not a list of non-negative integers")
    if not isinstance(offs, list) or len(offs) != 2 or not all(_u64(x) for x in offs):
        raise CheckpointError(f"{at}: data_offsets {_show(offs)} are not two non-negative integers [begin, end]")
    begin, end = offs
    if end < begin:
        raise CheckpointError(f"{at}: data_offsets [{begin}, {end}] end before they begin")
    numel = 1
    for d in shape:
        numel *= d
        if numel >= _U64:
            break
    want = numel * _DTYPES[tag].itemsize
    if want >= _U64:
        raise CheckpointError(f"{at}: {_show(shape)} x {tag} is too large (its byte size overflows 64 bits)")
    raise CheckpointError(f"{at}: data_offsets [{begin}, {end}] hold {end - begin} bytes but {tag}{_show(shape)} "
                          f"needs {want}")


def read_header(file: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors header; returns (tensors, ``__metadata__``).

    As strict as the safetensors library (a file this accepts, safetensors loads): see
    :func:`_check_entries`; also the header length limit, UTF-8, JSON without duplicate keys, and a
    file that ends exactly where the last tensor's data ends. Every refusal is one line naming the
    file and, where there is one, the tensor."""
    file = Path(file)
    with open_regular(file) as f:
        try:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header)")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > MAX_HEADER_BYTES:
                raise CheckpointError(f"{file}: bad safetensors header (header length {hlen} is over the "
                                      f"safetensors limit of {MAX_HEADER_BYTES} bytes; the file has {size} bytes)")
            if 8 + hlen > size:
                raise CheckpointError(
                    f"{file}: bad safetensors header (header length {hlen} but the file has {size} bytes)"
                )
            hdr_bytes = f.read(hlen)
        except OSError as e:
            raise CheckpointError(f"{file}: cannot read ({e.strerror or e})") from None
    if len(hdr_bytes) != hlen:
        raise CheckpointError(f"{file}: truncated safetensors file (header cut short)")
    try:
        header = loads_strict(hdr_bytes.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file}: bad safetensors header (not UTF-8: {e.reason} at byte {8 + e.start})") from None
    except _DuplicateKey as e:
        raise CheckpointError(f"{file}: bad safetensors header ({e})") from None
    except ValueError as e:
        raise CheckpointError(f"{file}: bad safetensors header (not valid JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: bad safetensors header (a JSON {_json_kind(header)}, not an object)")
    entries, meta, spans = _check_entries(file, header)
    base = 8 + hlen
    data = size - base
    covered = spans[-1][1] if spans else 0
    if covered > data:
        name, end = next((n, e) for _, e, n in spans if e > data)
        raise CheckpointError(
            f"{file}: truncated shard: tensor {name!r} ends at byte {base + end} but the file has {size} bytes"
        )
    if covered < data:
        raise CheckpointError(f"{file}: {data - covered} bytes after the last tensor's data (the tensors must "
                              "cover the data region exactly, as safetensors requires)")
    out = {name: TensorInfo(name, tag, shape, file, base + begin, end - begin)
           for name, (tag, shape, begin, end) in entries.items()}
    return out, meta


class CheckpointReader:
    """Lazy view of a checkpoint: one ``.safetensors`` file or a directory (sharded with an index,
    or any set of ``*.safetensors`` files). Names, shapes and dtypes come from the headers only;
    :meth:`get` reads exactly one tensor."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        if not p.exists():
            raise CheckpointError(f"{p}: no such file or directory")
        self._infos: dict[str, TensorInfo] = {}
        self.metadata: dict[str, Any] = {}
        self._listing: list[str] | None = None
        if p.is_dir():
            self.path = p
            # Listed even when an index names the shards: side files are found by listing, and a
            # directory that cannot be listed is refused here in one line, not later mid-copy.
            self._listing = _list_dir(p)
            if os.path.lexists(p / INDEX_FILE):  # a FIFO or dangling link there is refused, not skipped
                files = self._files_from_index(p)
            else:
                files = [p / n for n in self._listing if n.endswith(".safetensors")]
        else:
            self.path = p.parent
            files = [p]  # read_header refuses anything that is not a regular file (a FIFO would hang)
        self.files: list[Path] = files
        for f in files:
            infos, _ = read_header(f)
            for name, info in infos.items():
                if name in self._infos:
                    raise CheckpointError(f"{f}: tensor {name!r} is also in {self._infos[name].file.name}")
                self._infos[name] = info
        if self._listing is not None and os.path.lexists(p / INDEX_FILE):
            self._check_index(p)

    @classmethod
    def from_headers(cls, path: str | os.PathLike[str], headers: dict[str, dict[str, dict[str, Any]]],
                     metadata: dict[str, Any] | None = None) -> CheckpointReader:
        """A header-only view: ``headers`` maps shard file names to their safetensors header
        entries (``dtype``, ``shape``, ``data_offsets``), e.g. fetched from the Hub with HTTP range
        requests. Names, shapes and dtypes work as usual; :meth:`get` refuses (no data is here).
        The entries are validated as :func:`read_header` validates a local file's (all but the file
        size, which is not known here)."""
        self = cls.__new__(cls)
        self.path = Path(path)
        self.metadata = metadata or {}
        self.files = [self.path / f for f in headers]
        self._listing = None
        self._infos = {}
        for fname, entries in headers.items():
            checked, _, _ = _check_entries(self.path / fname, {k: v for k, v in entries.items() if k != "__metadata__"})
            for name, (tag, shape, begin, end) in checked.items():
                if name in self._infos:
                    raise CheckpointError(f"{self.path / fname}: tensor {name!r} is also in "
                                          f"{self._infos[name].file.name}")
                self._infos[name] = TensorInfo(name, tag, shape, self.path / fname, -1, end - begin)
        return self

    def _files_from_index(self, d: Path) -> list[Path]:
        idx_path = d / INDEX_FILE
        try:
            with open_regular(idx_path) as f:
                text = f.read()
        except OSError as e:
            raise CheckpointError(f"{idx_path}: cannot read ({e.strerror or e})") from None
        try:
            idx = loads_strict(text.decode("utf-8"))
        except UnicodeDecodeError:
            raise CheckpointError(f"{idx_path}: not a valid index (not UTF-8)") from None
        except ValueError as e:
            raise CheckpointError(f"{idx_path}: not a valid index ({e})") from None
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict):
            raise CheckpointError(f"{idx_path}: not a valid index (needs a 'weight_map' object)")
        meta = idx.get("metadata")
        if meta is not None and not isinstance(meta, dict):
            raise CheckpointError(f"{idx_path}: field 'metadata' is {_show(meta)}, not an object")
        for name, fname in wm.items():
            # A shard is a file beside the index: a path (``../x``, ``/etc/x``) would read outside it.
            if (not isinstance(fname, str) or fname in ("", ".", "..") or "/" in fname or "\\" in fname
                    or "\0" in fname):
                raise CheckpointError(f"{idx_path}: weight_map maps tensor {name!r} to {_show(fname)}, "
                                      "not a shard file name")
        self.metadata = meta or {}
        self._weight_map: dict[str, str] = wm
        files = []
        for fname in dict.fromkeys(wm.values()):
            f = d / fname
            try:
                st = os.stat(f)
            except FileNotFoundError:
                raise CheckpointError(f"{idx_path}: names shard {fname} which does not exist") from None
            except OSError as e:
                raise CheckpointError(f"{idx_path}: names shard {fname}, which cannot be read "
                                      f"({e.strerror or e})") from None
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{idx_path}: names shard {fname}, but {f} is {_file_kind(st.st_mode)}, "
                                      "not a regular file")
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
            with open_regular(info.file, buffering=0) as f:
                n = _pread_into(f.fileno(), memoryview(buf.numpy()), info.offset)
        except OSError as e:
            raise CheckpointError(f"{info.file}: cannot read tensor {name!r} ({e.strerror or e})") from None
        if n != info.nbytes:
            raise CheckpointError(f"{info.file}: truncated shard while reading tensor {name!r}")
        return buf.view(dt).reshape(info.shape)

    def get_rows(self, name: str, r0: int, r1: int, c0: int | None = None, c1: int | None = None) -> torch.Tensor:
        """Rows ``r0 .. r1-1`` (dim 0) of one tensor, reading only their bytes; with ``c0``/``c1``
        (2-D tensors) only columns ``c0 .. c1-1`` of those rows, one read per row. For a
        tensor-parallel rank's shard: it never reads the parts other ranks own."""
        info = self.info(name)
        if info.offset < 0:
            raise CheckpointError(f"{info.file}: tensor {name!r} is not downloaded (header-only view)")
        shape = info.shape
        if not shape or not 0 <= r0 <= r1 <= shape[0]:
            raise CheckpointError(f"{info.file}: tensor {name!r} of shape {list(shape)} has no rows {r0}..{r1}")
        cols = c0 is not None or c1 is not None
        if cols:
            c0 = 0 if c0 is None else c0
            c1 = shape[1] if c1 is None else c1
            if len(shape) != 2 or not 0 <= c0 <= c1 <= shape[1]:
                raise CheckpointError(f"{info.file}: tensor {name!r} of shape {list(shape)} has no columns {c0}..{c1}")
        dt = info.torch_dtype
        row_bytes = info.nbytes // shape[0] if shape[0] else 0
        if cols and (c0, c1) != (0, shape[1]):
            el = row_bytes // shape[1] if shape[1] else 0
            out = torch.empty(r1 - r0, (c1 - c0) * el, dtype=torch.uint8)
            try:
                with open_regular(info.file, buffering=0) as f:
                    view = out.numpy()
                    for i in range(r1 - r0):
                        n = _pread_into(f.fileno(), memoryview(view[i]), info.offset + (r0 + i) * row_bytes + c0 * el)
                        if n != view.shape[1]:
                            raise CheckpointError(f"{info.file}: truncated shard while reading tensor {name!r}")
            except OSError as e:
                raise CheckpointError(f"{info.file}: cannot read tensor {name!r} ({e.strerror or e})") from None
            return out.view(dt).reshape(r1 - r0, c1 - c0)
        buf = torch.empty((r1 - r0) * row_bytes, dtype=torch.uint8)
        if buf.numel():
            try:
                with open_regular(info.file, buffering=0) as f:
                    n = _pread_into(f.fileno(), memoryview(buf.numpy()), info.offset + r0 * row_bytes)
            except OSError as e:
                raise CheckpointError(f"{info.file}: cannot read tensor {name!r} ({e.strerror or e})") from None
            if n != buf.numel():
                raise CheckpointError(f"{info.file}: truncated shard while reading tensor {name!r}")
        return buf.view(dt).reshape(r1 - r0, *shape[1:])

    def iter_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for n in self.names() if names is None else names:
            yield n, self.get(n)

    # -- side files ----------------------------------------------------------------------------
    def config(self) -> dict[str, Any] | None:
        f = self.path / "config.json"
        # A config.json that is there but not a readable regular file is an error, not "no config".
        return read_json(f) if os.path.lexists(f) else None

    def side_files(self, trust_remote_code: bool = False) -> list[Path]:
        """Tokenizer, chat template, generation config (and ``*.py`` with ``trust_remote_code``) of
        the checkpoint directory. Found by name from the directory listing, never opened here; one
        that is not a regular file (a FIFO, a directory) is refused with one line."""
        names = self._listing if self._listing is not None else _list_dir(self.path)
        out = []
        for n in names:
            if is_side_file(n, trust_remote_code):
                check_regular_file(self.path / n)
                out.append(self.path / n)
        return out


def _list_dir(d: Path) -> list[str]:
    """The names in ``d``, sorted; a directory that cannot be listed (no read permission, mode
    0111) is one line naming it."""
    try:
        return sorted(os.listdir(d))
    except OSError as e:
        raise CheckpointError(f"{d}: cannot list the directory ({e.strerror or e})") from None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a regular file (a FIFO or directory is refused before it is opened)."""
    try:
        with open_regular(path) as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not valid JSON (not UTF-8)") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def write_json(path: Path, data: Any) -> None:
    # allow_nan=False: Infinity/NaN are not JSON; every report must load in strict parsers.
    with writing(path):
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=False, allow_nan=False) + "\n")


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


def _copy_file(src: Any, dst: Any, n: int) -> None:
    """Copy ``n`` bytes from the current position of ``src`` to that of ``dst`` (file objects)."""
    with writing(getattr(dst, "name", "the output")):
        dst.flush()  # the copy works on the fds: buffered bytes must be out first
    start, out = src.tell(), dst.tell()
    _copy_range(src.fileno(), start, dst.fileno(), out, n,
                f"{getattr(src, 'name', src)}: ended early while copying {n} bytes", getattr(dst, "name", None))
    src.seek(start + n)
    dst.seek(out + n)


def _copy_range(src: int, src_off: int, dst: int, dst_off: int, n: int, short: str,
                dst_name: str | os.PathLike[str] | None = None) -> None:
    """Copy ``n`` bytes between two fds at explicit offsets (no file position is used, so threads
    may copy into one file at once): in the kernel where the platform allows it, else through a
    buffer. ``short`` is the error when the source ends early; a failed write (disk full) is an
    :class:`OutputError` naming ``dst_name``, a failed read stays an OSError for the caller."""
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
            try:
                _pwrite_all(dst, buf[:k], dst_off + done)
            except OSError as e:
                raise write_error(e, dst_name or "the output") from None
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


def _hf_blobs_dir(src_dir: Path) -> Path | None:
    """``.../models--owner--name/blobs`` when ``src_dir`` is a Hugging Face cache snapshot
    (``.../models--owner--name/snapshots/<rev>``), whose files are symlinks into that directory."""
    d = _real(src_dir)
    repo = d.parent.parent
    if d.parent.name == "snapshots" and repo.name.split("--")[0] in ("models", "datasets", "spaces"):
        return repo / "blobs"
    return None


def side_file_source(f: Path, src_dir: Path) -> Path:
    """The file whose bytes a side file ``f`` of ``src_dir`` stands for: itself, or where its
    symlink leads when that stays inside ``src_dir`` (or, for a Hugging Face cache snapshot, inside
    the repository's ``blobs``). Anything else is refused (:class:`CheckpointError`): a symlink to
    an arbitrary file would copy that file's contents into the output."""
    real = _real(f)
    if f.is_symlink():
        root = _real(src_dir)
        blobs = _hf_blobs_dir(src_dir)
        if not (_within(real, root) or (blobs is not None and _within(real, blobs))):
            raise CheckpointError(f"{f}: is a symbolic link to {real}, outside {src_dir}; side files are copied "
                                  f"only from inside the model directory (copy the file there)")
    if not real.is_file():
        raise CheckpointError(f"{f}: is not a regular file (side files must be regular files)")
    return real


def check_side_files(src_dir: Path, trust_remote_code: bool = False,
                     skip: Iterable[str] = ("config.json",)) -> list[tuple[str, Path]]:
    """The side files :func:`copy_side_files` will copy, as (name, file to read), each checked with
    :func:`side_file_source`. Call it before writing anything to refuse a bad one early."""
    skip = set(skip)
    todo = []
    for f in sorted(Path(src_dir).iterdir()):
        if f.name not in skip and is_side_file(f.name, trust_remote_code) and not (f.is_dir() and not f.is_symlink()):
            todo.append((f.name, side_file_source(f, Path(src_dir))))
    return todo


def copy_side_files(src_dir: Path, dst_dir: Path, trust_remote_code: bool = False,
                    skip: Iterable[str] = ("config.json",)) -> list[str]:
    """Copy tokenizer, chat template and generation config (and ``*.py`` only with
    ``trust_remote_code``) from a model directory. ``config.json`` is the caller's to write.
    Only regular files inside ``src_dir`` are copied (see :func:`side_file_source`); all are checked
    before the first is copied."""
    todo = check_side_files(src_dir, trust_remote_code, skip)
    for name, real in todo:
        try:
            shutil.copy2(real, Path(dst_dir) / name)
        except OSError as e:
            if e.filename == str(real):
                raise CheckpointError(f"{real}: cannot read ({e.strerror or e})") from None
            raise write_error(e, Path(dst_dir) / name) from None
    return [name for name, _ in todo]


# ----------------------------------------------------------------------------------------------
# Output safety: where an output may go, who may write it, what --overwrite may remove
# ----------------------------------------------------------------------------------------------
#
# One rule for every command that writes (convert, quantize, make-tiny, the validate/bench reports):
# the output must not be, contain or lie inside any input, after resolving symbolic links; an
# existing output is replaced (--overwrite) only when eagle3 wrote it (its manifest.json says so);
# and one run at a time writes a given output (a lock file beside it). All checks run before
# anything is written or removed.

PARTIAL_MARKER = ".eagle3-partial"  # inside OUT.partial: eagle3 created it, a rerun may remove it
_WRITE_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                 errno.EFBIG: "file too large (file size limit)", errno.EROFS: "read-only file system",
                 errno.EACCES: "permission denied", errno.EPERM: "operation not permitted"}


def write_error(e: OSError, path: str | os.PathLike[str]) -> OutputError:
    """One line for an OSError met while writing ``path`` (disk full, read-only, ...)."""
    what = _WRITE_ERRNOS.get(e.errno or 0) or (e.strerror or str(e)).lower()
    return OutputError(f"{what} while writing {path}")


@contextlib.contextmanager
def writing(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn an OSError raised while writing ``path`` into a one-line :class:`OutputError`."""
    try:
        yield
    except OSError as e:
        raise write_error(e, path) from None


def _real(p: str | os.PathLike[str]) -> Path:
    """Absolute, symlinks resolved (as far as the path exists)."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(p))))


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def companion_paths(out: Path) -> list[Path]:
    """Everything a run into ``out`` may create, replace or remove."""
    return [out, partial_path(out), lock_path(out)]


def check_output_path(out: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str] | None] = (),
                      what: str = "output") -> None:
    """Refuse an output that is, contains or lies inside an input (after resolving symlinks, so a
    source given through a link is recognised). ``inputs`` that do not exist locally (Hub ids,
    ``None``) are skipped. Raises :class:`UsageError`; touches nothing."""
    o = Path(os.path.expanduser(os.fspath(out)))
    if o.name in ("", ".", ".."):  # OUT.partial / OUT.lock need a name to live beside it
        raise UsageError(f"{out}: give the {what} a name (a path ending in '.' or '..' has none)")
    for inp in inputs:
        if inp is None or not os.path.lexists(os.path.expanduser(os.fspath(inp))):
            continue
        r_in = _real(inp)
        # Reports are files written as NAME.partial (figures NAME.partial.png) and renamed.
        report_paths = [o, o.with_name(o.name + ".partial"), o.with_name(o.name + ".partial.png")]
        for c in companion_paths(o) if what == "output" else report_paths:
            r_out = _real(c)
            if r_out == r_in:
                how = "is" if c == o else f"would write {c}, which is"
                raise UsageError(f"{out}: the {what} {how} the input {inp}; choose another {what} path")
            if _within(r_in, r_out):
                raise UsageError(f"{out}: the {what} would contain the input {inp}; choose a path outside it")
            if _within(r_out, r_in):
                raise UsageError(f"{out}: the {what} lies inside the input {inp}; choose a path outside it")


def is_eagle3_output(d: Path) -> bool:
    """True when ``d`` is a real directory carrying the manifest :func:`write_manifest` writes."""
    m = d / MANIFEST_FILE
    if d.is_symlink() or not d.is_dir() or m.is_symlink() or not m.is_file():
        return False
    try:
        data = json.loads(m.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("eagle3_version"), str) and isinstance(data.get("files"), dict)


def _check_replaceable(dst: Path, overwrite: bool, resume: bool) -> None:
    if os.path.lexists(dst):
        if not overwrite:
            raise OutputExistsError(f"{dst}: already exists (pass --overwrite to replace it)")
        if not is_eagle3_output(dst):
            raise OutputExistsError(f"{dst}: already exists and is not an output eagle3 wrote (no eagle3 "
                                    f"{MANIFEST_FILE}); --overwrite replaces only those: remove it yourself")
    tmp = partial_path(dst)
    if os.path.lexists(tmp) and not resume:
        try:
            ours = not tmp.is_symlink() and tmp.is_dir() and (not any(tmp.iterdir()) or (tmp / PARTIAL_MARKER).is_file())
        except OSError:
            ours = False
        if not ours:
            raise OutputExistsError(f"{tmp}: exists and was not started by eagle3; remove it yourself")


def check_output(out: str | os.PathLike[str], overwrite: bool,
                 inputs: Iterable[str | os.PathLike[str] | None] = (), resume: bool = False) -> Path:
    """The output rules, checked before doing any work: not an input (see
    :func:`check_output_path`), and an existing output only with ``overwrite`` and only when eagle3
    wrote it. Touches nothing."""
    p = Path(out)
    check_output_path(p, inputs)
    _check_replaceable(p, overwrite, resume)
    return p


# -- one run per output --------------------------------------------------------------------------


def lock_path(out: Path) -> Path:
    return out.with_name(out.name + ".lock")


@dataclass
class _Lock:
    path: Path
    fd: int
    depth: int = 1


_LOCKS: dict[Path, _Lock] = {}
_LOCKS_ATEXIT: list[bool] = []


def _lock_holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return f"pid {info['pid']}: {info['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid unknown"


def _is_lock_file(fd: int) -> bool:
    """Empty (just created, or a run died before writing it) or what :func:`lock_output` writes:
    anything else is someone's file that happens to be named ``OUT.lock`` and is left alone."""
    st = os.fstat(fd)
    if st.st_size == 0:
        return True
    if st.st_size > 65536 or not stat.S_ISREG(st.st_mode):
        return False
    try:
        info = json.loads(os.pread(fd, st.st_size, 0))
    except ValueError:
        return False
    return isinstance(info, dict) and set(info) == {"pid", "command"}


def lock_output(out: str | os.PathLike[str]) -> None:
    """Take ``OUT.lock`` (``fcntl.flock``, so a lock left by a killed run does not block). A second
    run into the same output gets one line naming the first. Re-entrant within a process; every
    call needs a matching :func:`unlock_output`."""
    import fcntl

    key = _real(out)
    held = _LOCKS.get(key)
    if held is not None:
        held.depth += 1
        return
    path = lock_path(Path(out))
    with writing(path.parent):  # OUT's parent may not exist yet (`make-tiny demo-out/tiny`): create it
        path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(20):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UsageError(f"{path}: is a symbolic link, not an eagle3 lock file; remove it yourself") from None
            raise write_error(e, path) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"{out}: another eagle3 run is writing it ({_lock_holder(path)}); "
                             f"wait for it to finish or choose another output") from None
        # The previous holder unlinks the file when it ends: a lock on an unlinked file is no lock.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            if not _is_lock_file(fd):
                os.close(fd)
                raise UsageError(f"{path}: exists and is not an eagle3 lock file; remove it yourself")
            break
        os.close(fd)
    else:
        raise UsageError(f"{path}: could not take the output lock")
    info = json.dumps({"pid": os.getpid(), "command": " ".join(["eagle3", *sys.argv[1:]])}).encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
    except OSError as e:
        os.close(fd)
        raise write_error(e, path) from None
    if not _LOCKS_ATEXIT:
        _LOCKS_ATEXIT.append(True)
        atexit.register(release_output_locks)  # a library caller that never reached its release
    _LOCKS[key] = _Lock(path, fd)


def unlock_output(out: str | os.PathLike[str], force: bool = False) -> None:
    """Release the lock taken by :func:`lock_output` (the last release removes ``OUT.lock``)."""
    key = _real(out)
    held = _LOCKS.get(key)
    if held is None:
        return
    held.depth -= 1
    if held.depth > 0 and not force:
        return
    del _LOCKS[key]
    with contextlib.suppress(OSError):
        held.path.unlink()  # while still locked: a waiting run then sees a new file (see lock_output)
    os.close(held.fd)


def release_output_locks() -> None:
    """Drop every output lock this process holds (the CLI calls it when a command ends)."""
    for key in list(_LOCKS):
        unlock_output(key, force=True)


def claim_output(out: str | os.PathLike[str], overwrite: bool,
                 inputs: Iterable[str | os.PathLike[str] | None] = (), resume: bool = False) -> Path:
    """:func:`check_output`, then the output lock, then the existence checks again under the lock
    (another run may have finished meanwhile). For commands that must hold the lock before
    :func:`atomic_output` (which re-uses it and releases it at its end); on an error before that,
    call :func:`unlock_output`."""
    inputs = list(inputs)
    p = check_output(out, overwrite, inputs, resume)
    lock_output(p)
    try:
        _check_replaceable(p, overwrite, resume)
    except BaseException:
        unlock_output(p)
        raise
    return p


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _replace_dir(tmp: Path, dst: Path) -> None:
    """Rename ``tmp`` to ``dst``; an existing ``dst`` (checked replaceable) is moved aside under a
    name no one else uses, and moved back if the final rename fails: nothing is lost either way."""
    if not os.path.lexists(dst):
        tmp.rename(dst)
        return
    n = 0
    while os.path.lexists(old := dst.with_name(f".{dst.name}.eagle3-old-{os.getpid()}-{n}")):
        n += 1  # never remove what is there: it is not ours
    dst.rename(old)
    try:
        tmp.rename(dst)
    except BaseException:
        old.rename(dst)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_output(out: str | os.PathLike[str], overwrite: bool = False, resume: bool = False,
                  manifest: bool = True, known_digests: dict[str, str] | None = None,
                  inputs: Iterable[str | os.PathLike[str] | None] = ()) -> Iterator[Path]:
    """Yield ``<out>.partial``; on success write the manifest and rename it to ``<out>``.

    Checks the output rules (:func:`check_output` with ``inputs``: every path the command reads)
    and holds ``<out>.lock`` for the whole run. On an error the partial directory is removed
    (nothing half-written is left behind), except with ``resume=True``, where it is kept so that a
    rerun can skip finished work. An OSError from writing (disk full, read-only) becomes one line.
    ``known_digests`` (filled by the caller inside the block) spares re-hashing files it hashed."""
    dst = claim_output(out, overwrite, inputs, resume)
    tmp = partial_path(dst)
    try:
        try:
            if os.path.lexists(tmp) and not resume:
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / PARTIAL_MARKER).touch()
        except OSError as e:
            raise write_error(e, tmp) from None
        try:
            yield tmp
            if manifest:
                with writing(tmp / MANIFEST_FILE):
                    write_manifest(tmp, known=known_digests)
            (tmp / PARTIAL_MARKER).unlink(missing_ok=True)
            with writing(dst):
                _replace_dir(tmp, dst)
        except OSError as e:
            if not resume:
                shutil.rmtree(tmp, ignore_errors=True)
            # An OSError from writing into the output (not from reading an input) is the output's.
            name = e.filename if isinstance(e.filename, str) else None
            if e.errno in _WRITE_ERRNOS and (name is None or _within(_real(name), _real(tmp))):
                raise write_error(e, name or tmp) from None
            raise
        except BaseException:
            if not resume:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        unlock_output(dst, force=True)


# ----------------------------------------------------------------------------------------------
# Manifest
# ----------------------------------------------------------------------------------------------


def sha256_file(path: Path, chunk: int = 8 * 1024 * 1024) -> str:
    h = hashlib.sha256()
    buf = memoryview(bytearray(chunk))  # one buffer reused: no fresh 8 MB object per read
    with open_regular(path, buffering=0) as f:  # a FIFO is refused, not read forever
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
    headers: int = 0  # .safetensors headers found sound


def verify_manifest(d: str | os.PathLike[str], workers: int = 2) -> VerifyResult:
    """Check every file listed in ``manifest.json`` (size and sha256, and that no file is unlisted),
    then every ``.safetensors`` file's header as strictly as the safetensors library does and each
    checkpoint directory's index against its shards: a shard whose manifest was recomputed after a
    bad write still fails. A malformed manifest is one line naming it and the entry."""
    d = Path(d)
    mpath = d / MANIFEST_FILE
    if not os.path.lexists(mpath):
        raise VerifyError(f"{d}: no {MANIFEST_FILE} (only directories written by eagle3 carry one)")
    files = read_json(mpath).get("files")
    if not isinstance(files, dict):
        raise VerifyError(f"{mpath}: no 'files' object")
    for rel, ent in files.items():
        if (not isinstance(ent, dict) or not _u64(ent.get("size")) or not isinstance(ent.get("sha256"), str)):
            raise VerifyError(f"{mpath}: entry {rel!r} is {_show(ent)}, not an object with an integer 'size' "
                              "and a 'sha256' string")
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts or rel != Path(rel).as_posix():
            raise VerifyError(f"{mpath}: entry {rel!r} is not a relative path inside {d}")
    problems: list[str] = []
    try:
        present = {str(f.relative_to(d)) for f in _manifest_files(d)}
    except OSError as e:
        raise VerifyError(f"{d}: cannot list the directory ({e.strerror or e})") from None
    todo = []
    for rel, ent in files.items():
        f = d / rel
        try:
            st = os.stat(f)
        except FileNotFoundError:
            problems.append(f"{rel}: missing")
            continue
        except OSError as e:
            problems.append(f"{rel}: cannot read ({e.strerror or e})")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{rel}: is {_file_kind(st.st_mode)}, not a regular file")
        elif st.st_size != ent["size"]:
            problems.append(f"{rel}: size {st.st_size} != {ent['size']}")
        else:
            todo.append((rel, f, ent["sha256"]))

    def digest(t: tuple[str, Path, str]) -> str | CheckpointError:
        try:
            return sha256_file(t[1])
        except CheckpointError as e:
            return e
        except OSError as e:
            return CheckpointError(f"{t[1]}: cannot read ({e.strerror or e})")

    with ThreadPoolExecutor(max_workers=workers) as ex:
        digests = list(ex.map(digest, todo))
    for (rel, _, want), got in zip(todo, digests, strict=True):
        if isinstance(got, CheckpointError):
            problems.append(str(got))
        elif got != want:
            problems.append(f"{rel}: sha256 mismatch")
    for rel in sorted(present - set(files)):
        problems.append(f"{rel}: not in the manifest")
    header_problems, headers = _check_checkpoints(d, sorted(set(files) | present))
    return VerifyResult(checked=len(files), problems=problems + header_problems, headers=headers)


def _check_checkpoints(d: Path, rels: list[str]) -> tuple[list[str], int]:
    """Header problems of every ``.safetensors`` among ``rels`` (regular files only: the others are
    reported already), then index consistency of each directory holding them (with every header
    sound, :class:`CheckpointReader` checks the index and duplicate tensor names). Also returns
    how many headers were sound."""
    problems: list[str] = []
    sound = 0
    dirs: dict[Path, bool] = {}
    for rel in rels:
        f = d / rel
        if not rel.endswith(".safetensors"):
            continue
        if not f.is_file():  # missing or not a regular file: reported already, once is enough
            dirs[f.parent] = False
            continue
        try:
            read_header(f)
            sound += 1
            dirs.setdefault(f.parent, True)
        except CheckpointError as e:
            problems.append(str(e))
            dirs[f.parent] = False
    for sub, headers_ok in dirs.items():
        if headers_ok:
            try:
                CheckpointReader(sub)
            except CheckpointError as e:
                problems.append(str(e))
    return problems, sound
