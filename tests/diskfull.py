"""A full disk, simulated in-process for one output directory: every write into a file under
``under`` fails with ENOSPC, as it would on a full file system, whichever way eagle3 writes it
(buffered file objects, ``os.pwrite``, ``copy_file_range``, ``sendfile``). Reads and writes
elsewhere are untouched. Used by the convert and make-tiny tests (the CLI runs in-process)."""

from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path
from typing import Any

import pytest


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FullFile:
    """A file object whose writes fail; everything else is the real file's."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def write(self, data: Any) -> int:
        raise _enospc()

    def writelines(self, lines: Any) -> None:
        raise _enospc()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _FullFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def __iter__(self) -> Any:
        return iter(self._f)


def fill_disk(monkeypatch: pytest.MonkeyPatch, under: Path) -> None:
    """Make every write below ``under`` (which need not exist yet) fail with ENOSPC."""
    root = str(Path(os.path.realpath(under)))

    def inside(path: Any) -> bool:
        try:
            p = os.path.realpath(os.fspath(path))
        except TypeError:  # an fd passed to open()
            return False
        return p == root or p.startswith(root + os.sep)

    def fd_inside(fd: int) -> bool:
        try:
            return inside(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            return False

    real_open, real_pwrite, real_write = io.open, os.pwrite, os.write
    real_cfr, real_sendfile = getattr(os, "copy_file_range", None), os.sendfile

    def fake_open(file: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
        f = real_open(file, mode, *args, **kw)
        if any(c in mode for c in "wax+") and inside(file):
            return _FullFile(f)
        return f

    def fake_pwrite(fd: int, data: Any, offset: int) -> int:
        if fd_inside(fd):
            raise _enospc()
        return real_pwrite(fd, data, offset)

    def fake_write(fd: int, data: Any) -> int:
        if fd_inside(fd):
            raise _enospc()
        return real_write(fd, data)

    def fake_cfr(src: int, dst: int, *args: Any, **kw: Any) -> int:
        if fd_inside(dst):
            raise _enospc()
        assert real_cfr is not None
        return real_cfr(src, dst, *args, **kw)

    def fake_sendfile(out_fd: int, in_fd: int, *args: Any) -> int:
        if fd_inside(out_fd):
            raise _enospc()
        return real_sendfile(out_fd, in_fd, *args)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(os, "pwrite", fake_pwrite)
    monkeypatch.setattr(os, "write", fake_write)
    if real_cfr is not None:
        monkeypatch.setattr(os, "copy_file_range", fake_cfr)
    monkeypatch.setattr(os, "sendfile", fake_sendfile)
