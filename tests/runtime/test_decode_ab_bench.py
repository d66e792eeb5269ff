"""benchmarks/decode_ab.py on the tiny Kimi target: both decode modes of the torch reference (reused
scratch, per-call tensors) run every step and give bit-identical logits. No timing asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_ab_runs_both_modes_bit_identically(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_ab.py"), str(tiny_dir / "kimi-k2.5"),
                          "--batches", "1,3", "--steps", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    j = json.loads(out.read_text())
    assert set(j["batches"]) == {"1", "3"}
    for b in j["batches"].values():
        assert b["bit_identical"] is True
        assert len(b["step_s"]["scratch"]) == len(b["step_s"]["per_call"]) == 2
        assert b["tokens_per_s"]["scratch"] > 0 and b["tokens_per_s"]["per_call"] > 0
    assert "bit-identical" in res.stdout


def test_decode_ab_refuses_bad_arguments(tiny_dir: Path) -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_ab.py"), str(tiny_dir / "kimi-k2.5"),
                          "--batches", "0"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--batches" in res.stderr
