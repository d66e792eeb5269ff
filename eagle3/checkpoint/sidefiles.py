"""Side files of a model directory (tokenizer, chat template, generation config, remote code):
which ones travel with a checkpoint and from where they may be copied."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from eagle3.checkpoint.files import is_side_file
from eagle3.checkpoint.output import _real, _within
from eagle3.checkpoint.rawio import write_error
from eagle3.errors import CheckpointError


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
