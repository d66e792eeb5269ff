"""The byte progress bar of ``eagle3 quantize`` (rich, on stderr)."""

from __future__ import annotations

import threading


class Progress:
    """A rich progress bar over work bytes (source bytes, quantized ones counted twice when verified)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._p = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            # stderr: stdout stays clean for the summary (or --json).
            self._p = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                               TransferSpeedColumn(), TimeRemainingColumn(), transient=False,
                               console=Console(stderr=True))
            self._p.start()
            self._task = self._p.add_task("quantize", total=total)
        self._lock = threading.Lock()

    def advance(self, n: int) -> None:
        if self._p is not None:
            with self._lock:
                self._p.advance(self._task, n)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()
            self._p = None
