"""Fixtures of the quantize tests: every shipped recipe run once (native engine) on the tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest

# (tiny model, recipe, scope): every recipe on a tiny Kimi target and on the tiny drafts.
CASES = [
    ("kimi-k2.5", "w4a8", None),
    ("kimi-k2.5", "w4a8-int8", None),
    ("kimi-k2.5", "mxfp4", "experts"),
    ("kimi-k2-thinking", "mxfp4", None),  # default scope experts+shared+dense
    ("kimi-k2.5-eagle3", "int4-draft", None),
    ("kimi-k2.6-eagle3.1-mla", "int4-draft", None),
    ("speculators-eagle3", "fp8-draft", None),
    ("kimi-k2.5-eagle3-d2t", "fp8-draft", None),
    ("kimi-k2.6-eagle3.1-mla", "fp8-draft", None),
]


def case_id(case: tuple[str, str, str | None]) -> str:
    m, r, s = case
    return f"{m}:{r}" + (f":{s}" if s else "")


@pytest.fixture(scope="session")
def native_runs(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{case id: output dir} of `quantize(..., engine="native", workers=1, method="rtn")` for every
    CASE: round to nearest, the numbers Quark computes (test_quark_engine compares these outputs with
    Quark's bit for bit); the recipes' own default methods are tested in test_methods.py."""
    from eagle3.quantize import quantize

    root = tmp_path_factory.mktemp("quantize-native")
    out = {}
    for case in CASES:
        m, r, s = case
        dst = root / case_id(case).replace(":", "_")
        quantize(tiny_dir / m, dst, r, s, workers=1, engine="native", method="rtn")
        out[case_id(case)] = dst
    return out
