"""Low-level file I/O for checkpoints: positioned reads and writes that finish what one syscall
leaves, range copies between files, the one-line error for an OSError met while writing, and
writing a file aside then renaming it (a reader never sees half a file)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from eagle3.errors import CheckpointError, OutputError

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


def write_aside(path: Path, write: Callable[[Path], None], suffix: str = ".partial") -> None:
    """``write(tmp)`` beside ``path``, then rename: a reader never sees half a file. On failure the
    temporary file goes, and an OSError (disk full, unwritable) is one line naming ``path``."""
    path = Path(path)
    tmp = path.with_name(path.name + suffix)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise write_error(e, path) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


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
