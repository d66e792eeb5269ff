"""``manifest.json``: sha256 and size of every file of an output, and ``eagle3 verify``."""

from __future__ import annotations

import hashlib
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from eagle3.checkpoint.files import MANIFEST_FILE
from eagle3.checkpoint.header import _file_kind, _show, _u64, open_regular, read_header
from eagle3.checkpoint.jsonio import read_json, write_json
from eagle3.checkpoint.reader import CheckpointReader
from eagle3.errors import CheckpointError, VerifyError


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
    from eagle3.version import __version__

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
