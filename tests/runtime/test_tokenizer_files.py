"""The runtime's tokenizer loading refuses special files (issue 10, item 11: a FIFO hangs a reader)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def test_fifo_tokenizer_json_is_refused_not_a_hang(tiny_dir: Path, tmp_path: Path) -> None:
    """A FIFO named tokenizer.json would block transformers' loader forever (issue 10, item 11)."""
    t = tmp_path / "t"
    shutil.copytree(tiny_dir / "kimi-k2.5", t)
    (t / "tokenizer.json").unlink()
    os.mkfifo(t / "tokenizer.json")
    p = subprocess.run([sys.executable, "-m", "eagle3.cli", "serve", str(t), "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "tokenizer.json" in lines[0] and "FIFO" in lines[0]
