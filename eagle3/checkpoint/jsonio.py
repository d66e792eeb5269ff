"""JSON files of a checkpoint or a report: read strictly (regular files only, one line per error),
written as strict JSON (no NaN/Infinity) with write errors as one line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from eagle3.checkpoint.header import open_regular
from eagle3.checkpoint.rawio import writing
from eagle3.errors import CheckpointError


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a regular file (a FIFO or directory is refused before it is opened)."""
    try:
        with open_regular(path) as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not valid JSON (not UTF-8)") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def write_json(path: Path, data: Any) -> None:
    # allow_nan=False: Infinity/NaN are not JSON; every report must load in strict parsers.
    with writing(path):
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=False, allow_nan=False) + "\n")


def strict_json(data: Any) -> Any:
    """``data`` with NaN / Infinity as null: they are not JSON, and strict parsers (jq, JSON.parse)
    refuse the file (lm-eval's stderr of a single sample is NaN)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: strict_json(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [strict_json(v) for v in data]
    return data
