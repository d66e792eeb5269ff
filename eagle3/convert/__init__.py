"""``eagle3 convert``: EAGLE-3/3.1 drafts for every engine, and the Kimi-K2.5 target.

:func:`convert` detects whether the source is a draft or a target and dispatches to
:func:`eagle3.convert.draft.convert_draft` or :func:`eagle3.convert.target.convert_target`.
Flags that only make sense for the other role are refused (one-line :class:`UsageError`) before
anything is read beyond the config and headers.
"""

from __future__ import annotations

import re
from pathlib import Path

from eagle3.checkpoint import DEFAULT_SHARD_BYTES, check_output
from eagle3.convert.common import REPORT_FILE, Report, print_summary
from eagle3.errors import UsageError
from eagle3.formats.profiles import ENGINES

__all__ = ["REPORT_FILE", "Report", "convert", "parse_aux_ids", "parse_bool", "print_summary"]


def parse_aux_ids(text: str | None) -> list[int] | None:
    """``"2,30,58"`` -> [2, 30, 58]."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(re.fullmatch(r"\d+", p) for p in parts):
        raise UsageError(f"--aux-layer-ids {text!r}: expected comma-separated layer ids, e.g. 2,30,58")
    ids = [int(p) for p in parts]
    if len(set(ids)) != len(ids):
        raise UsageError(f"--aux-layer-ids {text!r}: a layer id is repeated")
    return ids


def parse_bool(text: str | None, flag: str) -> bool | None:
    if text is None:
        return None
    t = text.strip().lower()
    if t in ("true", "1", "yes"):
        return True
    if t in ("false", "0", "no"):
        return False
    raise UsageError(f"{flag} {text!r}: expected true or false")


def convert(src: str | Path, out: str | Path, *, engine: str | None = None, target: str | None = None,
            aux_layer_ids: list[int] | None = None, aux_convention: str | None = None,
            norm_output: bool | None = None, drop: list[str] | None = None, verifier: str | None = None,
            text_only: bool = False, dequantize: str | None = None, model_type: str | None = None,
            trust_remote_code: bool = False, overwrite: bool = False,
            max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True,
            allow_nonfinite: bool = False) -> Report:
    """Convert ``src`` (a checkpoint directory or a Hub id) into ``out``; see the module docstrings
    of :mod:`eagle3.convert.draft` and :mod:`eagle3.convert.target`."""
    from eagle3 import hub
    from eagle3.formats import detect

    if engine is not None and engine not in ENGINES:
        raise UsageError(f"--engine {engine}: expected one of {', '.join(ENGINES)}")
    if aux_convention is not None and aux_convention not in ("input", "output"):
        raise UsageError(f"--aux-convention {aux_convention}: expected 'input' or 'output'")
    check_output(out, overwrite, inputs=[src, target])  # refuse early: before a Hub download or any work
    src_dir = hub.resolve(src, trust_remote_code=trust_remote_code)
    check_output(out, overwrite, inputs=[src_dir])
    summary = detect.detect(src_dir)
    drop = list(drop or [])
    if summary.role == "draft":
        given = [f for f, v in (("--text-only", text_only), ("--dequantize", dequantize),
                                ("--model-type", model_type)) if v]
        if given:
            raise UsageError(f"{given[0]} applies to target models; {src} is a {summary.family} draft")
        if engine is None:
            raise UsageError(f"--engine is required for a draft ({'|'.join(ENGINES)})")
        if verifier is not None and engine != "speculators":
            raise UsageError(f"--verifier applies to --engine speculators (its verifier.name_or_path), not {engine}")
        from eagle3.convert.draft import DraftOptions, convert_draft

        opts = DraftOptions(engine=engine, target=target, aux_layer_ids=aux_layer_ids, aux_convention=aux_convention,
                            norm_output=norm_output, drop=drop, verifier=verifier,
                            trust_remote_code=trust_remote_code, overwrite=overwrite,
                            max_shard_bytes=max_shard_bytes, progress=progress, allow_nonfinite=allow_nonfinite)
        return convert_draft(src_dir, out, opts, summary)
    given = [f for f, v in (("--target", target), ("--aux-layer-ids", aux_layer_ids),
                            ("--aux-convention", aux_convention), ("--norm-output", norm_output is not None),
                            ("--verifier", verifier)) if v]
    if given:
        raise UsageError(f"{given[0]} applies to EAGLE drafts; {src} is a {summary.family} target")
    if engine == "speculators":
        raise UsageError(f"--engine speculators is a draft format; {src} is a {summary.family} target")
    from eagle3.convert.target import TargetOptions, convert_target

    topts = TargetOptions(engine=engine, text_only=text_only, dequantize=dequantize, model_type=model_type,
                          drop=drop, trust_remote_code=trust_remote_code, overwrite=overwrite,
                          max_shard_bytes=max_shard_bytes, progress=progress, allow_nonfinite=allow_nonfinite)
    return convert_target(src_dir, out, topts, summary)
