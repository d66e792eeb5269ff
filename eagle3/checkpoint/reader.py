"""A lazy view of a checkpoint (one file or a sharded directory): names, shapes and dtypes from the
headers alone, one tensor (or a row range of one) read with a single positioned read.

Memory: the reader holds one tensor at a time, so peak memory is bounded by the largest tensor,
whatever the checkpoint size.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3.checkpoint.files import INDEX_FILE, is_side_file
from eagle3.checkpoint.header import (
    TensorInfo,
    _check_entries,
    _file_kind,
    _show,
    check_regular_file,
    loads_strict,
    open_regular,
    read_header,
)
from eagle3.checkpoint.jsonio import read_json
from eagle3.checkpoint.rawio import _pread_into
from eagle3.errors import CheckpointError

if TYPE_CHECKING:
    import torch


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
            file = self.path / fname  # once per shard: a Path join per tensor cost more than the checks
            checked, _, _ = _check_entries(file, {k: v for k, v in entries.items() if k != "__metadata__"})
            for name, (tag, shape, begin, end) in checked.items():
                if name in self._infos:
                    raise CheckpointError(f"{file}: tensor {name!r} is also in {self._infos[name].file.name}")
                self._infos[name] = TensorInfo(name, tag, shape, file, -1, end - begin)
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
        import torch  # here, not at the top: a reader used for its headers alone needs no torch

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
        import torch

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



