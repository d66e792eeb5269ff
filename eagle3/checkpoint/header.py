"""The safetensors header, parsed and checked as strictly as the safetensors library does.

Why not ``safetensors.safe_open`` for reading: it maps whole files, and the touched pages of a
multi-GB shard stay in the process's RSS. We parse the (tiny) JSON header ourselves, which also
lets us name the file and the tensor when a header is corrupt or a shard is truncated. The byte
layout is the safetensors format (8-byte little-endian header length, JSON header, raw
little-endian data); files written by :mod:`eagle3.checkpoint.writer` are read back by
``safetensors`` itself in the tests. Also here: the dtype tag table, and opening a file only when it
is a regular file (a FIFO would hang the reader).
"""

from __future__ import annotations

import functools
import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from eagle3.errors import CheckpointError

if TYPE_CHECKING:
    import torch

# safetensors dtype tag -> (torch dtype name, bytes per element). A header's checks need only the
# sizes: torch's dtypes are looked up on first use (:func:`_torch_dtypes`), so the commands that read
# headers alone (eagle3 inspect, plan) do not import torch (about 1.5 CPU-s per process).
_TAG_TYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
}
DTYPE_BYTES: dict[str, int] = {tag: size for tag, (_, size) in _TAG_TYPES.items()}  # formats.sizing sizes with it too


@functools.cache
def _torch_dtypes() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """(tag -> torch dtype, torch dtype -> tag), for the tags this torch has."""
    import torch

    dtypes = {tag: getattr(torch, name) for tag, (name, _) in _TAG_TYPES.items() if hasattr(torch, name)}
    return dtypes, {v: k for k, v in dtypes.items()}


# Every tag the safetensors library itself knows (0.8): a file with one of those that torch cannot
# hold is valid safetensors, only not something eagle3 reads; anything else is not safetensors.
_SAFETENSORS_TAGS = frozenset({
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
    "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
})

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit (MAX_HEADER_SIZE)
_U64 = 1 << 64  # safetensors reads shapes and offsets as 64-bit unsigned integers
def dtype_from_tag(tag: str) -> torch.dtype:
    try:
        return _torch_dtypes()[0][tag]
    except KeyError:
        raise CheckpointError(f"unsupported safetensors dtype {tag!r}") from None


def tag_from_dtype(dtype: torch.dtype) -> str:
    try:
        return _torch_dtypes()[1][dtype]
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
            itemsize = DTYPE_BYTES[tag]
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
            if end - begin != numel * itemsize:
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
    if tag not in DTYPE_BYTES:
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
    want = numel * DTYPE_BYTES[tag]
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
