"""The workloads ``--task`` / ``--validate`` take: what is sent, how it is grouped, how it is scored.

A :class:`Workload` is a list of :class:`Item`\\ s plus a scorer. An item is everything another
module needs to send the same request again (the reference comparison does): a stable ``id``, the
workload's name, a category, the text ``prompt`` (``/v1/completions``) or the chat ``messages``
(``/v1/chat/completions``, through the model's chat template), later user turns (MT-Bench's second
turn, sent after the model's own first answer), the stop strings and ``max_tokens``; every request is
greedy with lm-eval's seed. :meth:`Item.body` builds the request body for a turn.

Workloads: ``gsm8k`` (:mod:`.gsm8k`), ``humaneval`` (:mod:`.humaneval`), ``mtbench`` (:mod:`.mtbench`) and
any ``FILE.jsonl`` (:mod:`.jsonl`). :func:`parse_tasks` reads the comma-separated list, :func:`load` builds one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eagle3.errors import UsageError
from eagle3.validate.workloads.base import REQUEST_SEED, Item, LoadOptions, Scorer, Scores, Workload

__all__ = ["KNOWN", "REQUEST_SEED", "Item", "LoadOptions", "Scorer", "Scores", "Workload", "load", "load_all",
           "parse_tasks"]

KNOWN = ("gsm8k", "humaneval", "mtbench")
FILE_SUFFIX = ".jsonl"


def is_file_task(name: str) -> bool:
    return name.lower().endswith(FILE_SUFFIX)


def parse_tasks(text: str) -> list[str]:
    """``"gsm8k, mtbench,my.jsonl"`` -> ``["gsm8k", "mtbench", "my.jsonl"]``; one line naming the
    known workloads for anything else, and for a workload listed twice."""
    names = [t.strip() for t in text.split(",")]
    if not any(names):
        raise UsageError(f"--task {text!r}: no workload named; known: {known_line()}")
    out: list[str] = []
    for name in names:
        if not name:
            raise UsageError(f"--task {text!r}: an empty name in the list; known: {known_line()}")
        if name not in KNOWN and not is_file_task(name):
            raise UsageError(f"--task {name!r}: unknown workload; known: {known_line()}")
        if name in out:
            raise UsageError(f"--task {text!r}: {name} is listed twice")
        out.append(name)
    return out


def known_line() -> str:
    return ", ".join(KNOWN) + " or a FILE.jsonl (rows with 'prompt' or 'messages')"


def load(name: str, opts: LoadOptions) -> Workload:
    """The workload ``name`` (as :func:`parse_tasks` returned it)."""
    if is_file_task(name):
        from eagle3.validate.workloads import jsonl

        return jsonl.load(Path(name), opts)
    if name == "gsm8k":
        from eagle3.validate.workloads import gsm8k

        return gsm8k.load(opts)
    if name == "humaneval":
        from eagle3.validate.workloads import humaneval

        return humaneval.load(opts)
    if name == "mtbench":
        from eagle3.validate.workloads import mtbench

        return mtbench.load(opts)
    raise UsageError(f"--task {name!r}: unknown workload; known: {known_line()}")


def load_all(names: Sequence[str], opts: LoadOptions) -> list[Workload]:
    out = [load(n, opts) for n in names]
    seen: dict[str, str] = {}
    for n, w in zip(names, out, strict=True):
        if w.name in seen:
            raise UsageError(f"--task: {seen[w.name]} and {n} are both named {w.name} in the report; rename one")
        seen[w.name] = n
    return out
