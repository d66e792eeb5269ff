"""One rich progress bar per phase of ``train-draft`` (teacher, training, held-out acceptance), each
with its count, elapsed time and ETA; nothing at all when disabled (``--quiet``, ``--json``, no
terminal)."""

from __future__ import annotations

from typing import Any


class PhaseBar:
    def __init__(self, label: str, total: int, enabled: bool, done: int = 0, fields: dict[str, str] | None = None) -> None:
        self._p: Any = None
        if not enabled or total <= 0:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        cols: list[Any] = [TextColumn(f"{label:<9}"), BarColumn(), MofNCompleteColumn()]
        cols += [TextColumn(f"{k} {{task.fields[{k}]}}") for k in (fields or {})]
        cols += [TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
        self._p = Progress(*cols, transient=False)
        self._p.start()
        self._task = self._p.add_task(label, total=total, completed=done, **(fields or {}))

    def advance(self, n: int = 1, **fields: str) -> None:
        if self._p is not None:
            self._p.update(self._task, advance=n, **fields)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()
            self._p = None

    def __enter__(self) -> PhaseBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
