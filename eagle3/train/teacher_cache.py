"""The teacher states on disk: computed once for the examples the steps use, then read per batch.

``train-draft`` computes the teacher's states (and, with ``--regenerate``, the target's own greedy
continuation) in a phase of its own before the first step, only for the examples the steps will
use (``steps x batch size``, at most the data set), one group per step (the new examples of that
step's batch), and writes each example's states to one safetensors file here. The loop then reads
a batch's files at each step, so memory holds one batch whatever the data set's size, and the cost
before the first step follows ``--steps``, not the data set (GSM8K's 7,473 train problems at
``--steps 10`` compute 80).

Layout: ``ROOT/<key>/`` where ``key`` is a hash of everything the states depend on besides the
example (the target's fingerprint, dtype, device type, aux layers, ``--regenerate`` and its token
count, ``--max-len``), with that description in ``key.json``; each example's file is named by a hash
of its tokens, so a run over other data, another seed or more steps reuses whatever
examples it shares with an earlier one. The default root is ``OUT.partial/teacher`` (kept by an
interrupted run for ``--resume``, removed when the draft is written); ``--teacher-cache DIR`` keeps
it across runs (a recipe search over one target computes the target's states once).

Reproducibility: a target's batched forward may round a sequence differently next to other
sequences, so an example is always computed in its own step's group: a group with any file missing
is computed again as a whole (only the missing files are written), and a run resumed after being
killed in this phase computes exactly what the uninterrupted run computed.

Before writing, the free space is checked against the group files' size (rows x (aux + hidden)
width x dtype size); too little stops the command with one line before anything is computed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import write_json
from eagle3.errors import CheckpointError, OutputError
from eagle3.train.teacher import Teacher, TeacherStates

FORMAT = 1
KEY_FILE = "key.json"
_MARGIN = 64 << 20  # kept free beyond the estimate (metadata, the file system's own needs)


@dataclass(frozen=True)
class Item:
    """One example as the cache sees it: the tokens the teacher runs on."""

    prompt: tuple[int, ...]  # --regenerate: the prompt continued by the target; else the whole sequence

    def digest(self) -> str:
        return hashlib.sha256(torch.tensor(self.prompt, dtype=torch.int32).numpy().tobytes()).hexdigest()[:32]


@dataclass
class CachedExample:
    ids: torch.Tensor  # int64 [L]
    aux: torch.Tensor  # [L, n*H]
    hidden: torch.Tensor  # [L, H] post-norm (every row: which rows carry loss is the trainer's choice)


class TeacherCache:
    def __init__(self, root: Path, key: dict[str, Any]) -> None:
        blob = json.dumps({"format": FORMAT, **key}, sort_keys=True)
        self.key = key
        self.dir = Path(root) / hashlib.sha256(blob.encode()).hexdigest()[:16]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"--teacher-cache {root}: cannot create {self.dir} ({e.strerror or e})") from None
        kf = self.dir / KEY_FILE
        if not kf.is_file():
            write_json(kf, {"format": FORMAT, **key})

    def path(self, digest: str) -> Path:
        return self.dir / f"{digest}.safetensors"

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def write(self, item: Item, st: TeacherStates) -> None:
        from safetensors.torch import save_file

        p = self.path(item.digest())
        tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")  # runs sharing a cache never write one file
        tensors = {"ids": torch.tensor(st.ids, dtype=torch.int32), "aux": st.aux.contiguous(),
                   "hidden": st.hidden.contiguous()}
        try:
            save_file(tensors, str(tmp))
            os.replace(tmp, p)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise OutputError(f"teacher cache {self.dir}: cannot write {p.name} ({e.strerror or e})") from None

    def _open(self, digest: str, read: Callable[[Any], Any]) -> Any:
        from safetensors import SafetensorError, safe_open

        p = self.path(digest)
        try:
            with safe_open(str(p), framework="pt") as f:
                return read(f)
        except (OSError, SafetensorError, KeyError, ValueError) as e:
            raise CheckpointError(f"teacher cache file {p}: unreadable ({e}); delete it to compute it again") \
                from None

    def read(self, digest: str) -> CachedExample:
        def get(f: Any) -> CachedExample:
            t = {k: f.get_tensor(k) for k in ("ids", "aux", "hidden")}
            return CachedExample(t["ids"].to(torch.int64), t["aux"], t["hidden"])

        ex = self._open(digest, get)
        if ex.aux.shape[0] != ex.ids.shape[0] or ex.hidden.shape[0] != ex.ids.shape[0]:
            raise CheckpointError(f"teacher cache file {self.path(digest)}: inconsistent rows; delete it to "
                                  f"compute it again")
        return ex

    def rows(self, digest: str) -> int:
        """The example's token count, from its file's header alone."""
        return int(self._open(digest, lambda f: f.get_slice("ids").get_shape()[0]))

    def check_space(self, need: int) -> None:
        free = shutil.disk_usage(self.dir).free
        if need + _MARGIN > free:
            raise OutputError(f"teacher cache {self.dir}: the teacher states need about {need / 2**30:.2f} GiB, "
                              f"{free / 2**30:.2f} GiB free (fewer --steps or --max-len, or --teacher-cache "
                              f"on a larger disk)")


def fill(cache: TeacherCache, teacher: Teacher, groups: Sequence[Sequence[int]], digests: dict[int, str],
         rows: dict[int, int], make_item: Callable[[int], Item], *, regen_tokens: int | None, eos: Sequence[int],
         max_len: int, row_bytes: int, progress: Callable[[int], None] | None = None) -> dict[str, int]:
    """Compute and write the states of every group of example indices with a file missing (see the
    module docstring); ``digests``/``rows``: each example's file name and upper bound of its rows;
    ``progress(n)`` after each group with its number of examples. Returns counts."""
    todo = {j for j, g in enumerate(groups) if any(not cache.has(digests[i]) for i in g)}
    missing = [i for j in sorted(todo) for i in groups[j] if not cache.has(digests[i])]
    if missing:
        cache.check_space(sum(rows[i] * (row_bytes + 4) + 1024 for i in missing))
    done = {"examples": sum(len(g) for g in groups), "computed": 0, "reused": 0}
    for j, g in enumerate(groups):
        if j in todo:
            items = [make_item(i) for i in g]
            if regen_tokens is None:
                states = teacher.states([it.prompt for it in items])
            else:
                states = teacher.generate([it.prompt for it in items], regen_tokens, eos, max_len)
            for it, st in zip(items, states, strict=True):
                new = not cache.has(it.digest())
                if new:
                    cache.write(it, st)
                done["computed" if new else "reused"] += 1
        else:
            done["reused"] += len(g)
        if progress:
            progress(len(g))
    return done


def estimated_rows(item: Item, regen_tokens: int | None, max_len: int) -> int:
    """Upper bound of an example's rows: with --regenerate, prompt + new tokens (at most max_len)."""
    return min(len(item.prompt) + regen_tokens, max_len) if regen_tokens is not None else len(item.prompt)
