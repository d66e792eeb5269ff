"""Shared by the resume tests: a quantize run interrupted (KeyboardInterrupt) right after its first
finished shard, as Ctrl-C would leave it."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.quantize import pipeline
from eagle3.quantize.pipeline import quantize


def interrupt_after_first_shard(src: Path, out: Path, monkeypatch: pytest.MonkeyPatch, workers: int = 1) -> str:
    """Run ``quantize(src, out, "w4a8", method="rtn")`` (the numbers of ``native_runs``) until one
    shard is finished, then interrupt it; returns that shard's file name. ``pipeline.finish_shard``
    is restored afterwards."""
    real = pipeline.finish_shard
    first: list[str] = []

    def interrupted(shard):  # type: ignore[no-untyped-def]
        if first:
            raise KeyboardInterrupt
        first.append(shard.job.file)
        return real(shard)

    monkeypatch.setattr(pipeline, "finish_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize(src, out, "w4a8", workers=workers, method="rtn")
    monkeypatch.setattr(pipeline, "finish_shard", real)
    return first[0]
