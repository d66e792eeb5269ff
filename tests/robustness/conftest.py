"""Fixtures of the robustness corpus: the tiny models plus one eagle3 output, shared by every case."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.robustness import corpus


@pytest.fixture(scope="session")
def corpus_sources(tiny_dir: Path) -> dict[str, Path]:
    """Name -> read-only source directory (cases copy what they break)."""
    return corpus.build_sources(tiny_dir)
