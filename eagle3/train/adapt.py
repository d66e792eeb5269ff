"""``train-draft --adapt``: fit a trained draft to the target it will be served beside.

A draft is trained against the bf16 (or INT4) target's hidden states and then served beside a
target that was requantized (MXFP4, W4A8, ...): its aux states and its greedy choices moved a
little, and the draft's acceptance with them (on the shipped tiny pair, -4% accept length against
an MXFP4 target; docs/train_draft.md). ``--adapt`` is the recipe that wins it back, as one preset:

* data: the target's own greedy continuations (``--regenerate``, with the quantized target) of
  GSM8K train problems in the validation's 5-shot context (lm-eval's prompts, as ``serve
  --validate gsm8k`` sends), the loss on the problem and its answer only (the exemplars are
  context);
* a short schedule from the draft's weights (``--init-from``, required), pulled back towards them
  each step (``anchor``), so that the draft keeps what it knew of the source target;
* acceptance measured on held-out GSM8K test prompts with this target before and after, and the
  target recorded (path and :func:`target_fingerprint`) in ``train_report.json``.

Explicit options win over the preset's values. :func:`adapt_command` is the command line a report
prints when a quantized target's acceptance fell (:data:`RECOMMENDED_MARGIN`).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from eagle3.checkpoint.files import MANIFEST_FILE

# The preset (each entry a TrainOptions field). Measured on the shipped trained tiny pair against
# its MXFP4 and W4A8 targets: docs/train_draft.md ("Adapting a draft to a quantized target").
PRESET: dict[str, Any] = {
    "data": "gsm8k",
    "regenerate": True,
    "regen_tokens": 96,
    "fewshot": 5,
    "context_loss": False,
    "max_len": 2048,
    "steps": 50,
    "batch_size": 8,
    "lr": 2e-4,
    "anchor": 0.0,
    "eval_prompts": 24,
    "eval_tokens": 96,
    "eval_fewshot": 5,
    "checkpoint_every": 25,
}

# A quantized target whose mean accept length falls more than this fraction below the source
# target's (same draft, same held-out prompts) is worth adapting the draft to: on the tiny pair,
# 24 prompts x 96 tokens measure one target's accept length to about +-1% (W4A8 vs its source:
# +2.3% / +0.6%), and MXFP4 costs 3.6-3.9%.
RECOMMENDED_MARGIN = 0.02


def acceptance_fell(source: float, quantized: float, margin: float = RECOMMENDED_MARGIN) -> bool:
    """Whether the mean accept length ``quantized`` (draft beside the quantized target) fell more than
    ``margin`` (a fraction) below ``source`` (the same draft and prompts beside the source target)."""
    return quantized < source * (1.0 - margin)


def adapt_command(quantized: str | Path, out: str | Path, draft: str | Path) -> list[str]:
    """``eagle3 train-draft QUANTIZED OUT --init-from DRAFT --adapt`` for these paths."""
    return ["eagle3", "train-draft", str(quantized), str(out), "--init-from", str(draft), "--adapt"]


def _header(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        return head + f.read(min(n, 100 << 20))


def target_fingerprint(path: Path) -> dict[str, str]:
    """A digest of a checkpoint that costs the same whatever its size: ``config.json``, and either
    its eagle3 ``manifest.json`` (sha256 of every file: the weights themselves) or, without one,
    every ``*.safetensors`` file's size and header (tensor names, dtypes, shapes, offsets)."""
    path = Path(path)
    h = hashlib.sha256()
    cfg = path / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    manifest = path / MANIFEST_FILE
    if manifest.is_file():
        files = json.loads(manifest.read_text(encoding="utf-8")).get("files", {})
        h.update(json.dumps(files, sort_keys=True).encode())
        basis = "config.json + manifest.json (sha256 of every file)"
    else:
        for f in sorted(path.glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}:".encode())
            h.update(_header(f))
        basis = "config.json + safetensors sizes and headers"
    return {"path": str(path.resolve()), "sha256": h.hexdigest(), "basis": basis}
