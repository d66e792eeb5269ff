"""Issue 10's corpus of malformed inputs, driven through the CLI (cases in ``corpus.py``).

Every (case, command) pair must end with exit code 2 and one ``error: ...`` line naming the file,
tensor or field, leave no OUT / OUT.partial / OUT.lock behind, and change no byte under the case's
directory (the source, its siblings, a pre-existing OUT)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.robustness import corpus, schema_cases  # noqa: F401 (registers the issue-21 cases)

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def test_corpus_is_large_enough() -> None:
    # Issue 10 asks for at least 40 malformed inputs.
    assert len(corpus.CASES) >= 40
    assert len({c.id for c in corpus.CASES}) == len(corpus.CASES)


@pytest.mark.parametrize(("case", "command"),
                         [pytest.param(c, cmd, id=f"{c.id}-{cmd}") for c, cmd in corpus.params()])
def test_malformed_input(case: corpus.Case, command: str, corpus_sources: dict[str, Path], tmp_path: Path) -> None:
    if case.non_root and IS_ROOT:
        pytest.skip("root reads and writes regardless of permissions")
    ctx = corpus.prepare(case, tmp_path / "case", corpus_sources, command)
    try:
        res, problems = corpus.check(case, command, ctx)
    finally:
        corpus.cleanup(ctx)
    assert not problems, f"{' '.join(ctx.argv(command))}\n" + "\n".join(problems) + f"\n{res.short()}"
