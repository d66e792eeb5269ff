"""Output safety: where an output may go, who may write it, what --overwrite may remove, and the
atomic commit of a finished output directory (``OUT.partial`` renamed onto ``OUT``)."""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import shutil
import stat
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from eagle3.checkpoint.files import MANIFEST_FILE
from eagle3.checkpoint.rawio import _WRITE_ERRNOS, write_error, writing
from eagle3.errors import OutputExistsError, UsageError

# One rule for every command that writes (convert, quantize, make-tiny, the validate/bench reports):
# the output must not be, contain or lie inside any input, after resolving symbolic links; an
# existing output is replaced (--overwrite) only when eagle3 wrote it (its manifest.json says so);
# and one run at a time writes a given output (a lock file beside it). All checks run before
# anything is written or removed.

PARTIAL_MARKER = ".eagle3-partial"  # inside OUT.partial: eagle3 created it, a rerun may remove it



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
                # imported here: the manifest reads safetensors headers (torch), and a process
                # that only takes or checks output locks never needs it
                from eagle3.checkpoint.manifest import write_manifest

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
