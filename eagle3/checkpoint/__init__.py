"""Sharded safetensors checkpoints: a lazy reader, a size-capped streaming writer, planned shards
filled in place, side files, output safety (locks, atomic commit) and a sha256 manifest.

One concept per module:

- :mod:`.files`: which files of a model directory are what (weights, index, config, tokenizer, side files)
- :mod:`.header`: the safetensors header, parsed and checked strictly; dtype tags; regular-file opens
- :mod:`.rawio`: positioned reads/writes, range copies, one-line write errors
- :mod:`.jsonio`: JSON files read strictly and written as strict JSON
- :mod:`.reader`: :class:`CheckpointReader`, a lazy view of one file or a sharded directory
- :mod:`.writer`: :class:`CheckpointWriter`, size-capped shards and the index
- :mod:`.layout`: :class:`ShardLayout` / :class:`ShardFile`, shards planned before any data is written
- :mod:`.sidefiles`: tokenizer/config side files and where they may be copied from
- :mod:`.manifest`: ``manifest.json`` and ``eagle3 verify``
- :mod:`.output`: where an output may go, locks, ``--overwrite`` and the atomic commit

``from eagle3.checkpoint import X`` keeps working for every name below. The names are resolved on
first use (PEP 562 module ``__getattr__``): the writer and layout modules import torch,
and ``eagle3 download`` (which needs only :mod:`.files`) would otherwise pay ~2 s of CPU for it at
every start. The header and reader modules import torch only when a tensor is read or a torch dtype
asked for, so ``eagle3 inspect`` and ``eagle3 plan`` run without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle3.checkpoint.header import (
        MAX_HEADER_BYTES,
        TensorInfo,
        check_regular_file,
        dtype_from_tag,
        loads_strict,
        open_regular,
        read_header,
        tag_from_dtype,
    )
    from eagle3.checkpoint.jsonio import read_json, write_json
    from eagle3.checkpoint.layout import PlannedTensor, ShardFile, ShardLayout
    from eagle3.checkpoint.manifest import VerifyResult, sha256_file, verify_manifest, write_manifest
    from eagle3.checkpoint.output import (
        PARTIAL_MARKER,
        atomic_output,
        check_output,
        check_output_path,
        claim_output,
        companion_paths,
        is_eagle3_output,
        lock_output,
        lock_path,
        partial_path,
        release_output_locks,
        unlock_output,
    )
    from eagle3.checkpoint.rawio import _pwrite_all, write_error, writing
    from eagle3.checkpoint.reader import CheckpointReader
    from eagle3.checkpoint.sidefiles import check_side_files, copy_side_files, side_file_source
    from eagle3.checkpoint.writer import DEFAULT_SHARD_BYTES, CheckpointWriter, _ShardBuilder
# name -> the submodule defining it
_WHERE = {
    "header": ("MAX_HEADER_BYTES", "TensorInfo", "check_regular_file", "dtype_from_tag", "loads_strict",
               "open_regular", "read_header", "tag_from_dtype"),
    "jsonio": ("read_json", "write_json"),
    "layout": ("PlannedTensor", "ShardFile", "ShardLayout"),
    "manifest": ("VerifyResult", "sha256_file", "verify_manifest", "write_manifest"),
    "output": ("PARTIAL_MARKER", "atomic_output", "check_output", "check_output_path", "claim_output",
               "companion_paths", "is_eagle3_output", "lock_output", "lock_path", "partial_path",
               "release_output_locks", "unlock_output"),
    "rawio": ("_pwrite_all", "write_error", "writing"),
    "reader": ("CheckpointReader",),
    "sidefiles": ("check_side_files", "copy_side_files", "side_file_source"),
    "writer": ("DEFAULT_SHARD_BYTES", "CheckpointWriter", "_ShardBuilder"),
}
_MODULE_OF = {name: mod for mod, names in _WHERE.items() for name in names}


def __getattr__(name: str) -> Any:
    mod = _MODULE_OF.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = [
    "_pwrite_all",
    "_ShardBuilder",
    "atomic_output",
    "check_output",
    "check_output_path",
    "check_regular_file",
    "check_side_files",
    "CheckpointReader",
    "CheckpointWriter",
    "claim_output",
    "companion_paths",
    "copy_side_files",
    "DEFAULT_SHARD_BYTES",
    "dtype_from_tag",
    "is_eagle3_output",
    "loads_strict",
    "lock_output",
    "lock_path",
    "MAX_HEADER_BYTES",
    "open_regular",
    "PARTIAL_MARKER",
    "partial_path",
    "PlannedTensor",
    "read_header",
    "read_json",
    "release_output_locks",
    "sha256_file",
    "ShardFile",
    "ShardLayout",
    "side_file_source",
    "tag_from_dtype",
    "TensorInfo",
    "unlock_output",
    "verify_manifest",
    "VerifyResult",
    "write_error",
    "write_json",
    "write_manifest",
    "writing",
]
