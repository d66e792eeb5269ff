"""Machinery shared by the draft and target converters: the streaming write loop (one tensor in
memory at a time, rich progress per tensor and per shard), the JSON report and its printed summary.

A conversion is planned first (every output tensor, with the function that produces it) and
executed second, so every error that can be found from headers and configs is raised before a
single byte is written, and nothing is left behind (``checkpoint.atomic_output``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import DEFAULT_SHARD_BYTES, CheckpointWriter, TensorInfo, write_json
from eagle3.units import human_bytes

REPORT_FILE = "convert_report.json"
REPORT_VERSION = 1


@dataclass
class Item:
    """One output tensor: its name, the source shard it belongs to (output shards follow the
    source's layout), its size in bytes (for the progress bar) and where it comes from: ``raw``, a
    source tensor whose bytes are copied unchanged (file to file, never through Python memory), or
    ``make``, a function that computes it (dequantization, dtype casts, generated tensors)."""

    name: str
    shard: str
    nbytes: int
    make: Callable[[], torch.Tensor] | None = None
    raw: TensorInfo | None = None


@dataclass
class Report:
    """What a conversion did, written as ``convert_report.json`` into the output."""

    kind: str  # "draft" | "target"
    source: str
    output: str
    engine: str | None
    source_format: dict[str, Any] = field(default_factory=dict)
    output_format: dict[str, Any] = field(default_factory=dict)
    renames: list[dict[str, str]] = field(default_factory=list)
    drops: list[dict[str, str]] = field(default_factory=list)
    generated: list[dict[str, str]] = field(default_factory=list)
    transformed: list[dict[str, str]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    aux: dict[str, Any] | None = None
    side_files: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    source_warnings: list[str] = field(default_factory=list)
    tensors_in: int = 0
    tensors_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    shards_out: int = 0
    seconds: float = 0.0

    def warn(self, msg: str) -> None:
        if msg not in self.warnings:
            self.warnings.append(msg)

    def drop(self, name: str, reason: str) -> None:
        self.drops.append({"name": name, "reason": reason})

    def to_json(self) -> dict[str, Any]:
        return {
            "report_version": REPORT_VERSION,
            "kind": self.kind,
            "source": self.source,
            "output": self.output,
            "engine": self.engine,
            "source_format": self.source_format,
            "output_format": self.output_format,
            "tensors": {"in": self.tensors_in, "out": self.tensors_out, "bytes_in": self.bytes_in,
                        "bytes_out": self.bytes_out, "shards_out": self.shards_out},
            "renames": self.renames,
            "drops": self.drops,
            "generated": self.generated,
            "transformed": self.transformed,
            "config": self.config,
            "aux_layers": self.aux,
            "side_files": self.side_files,
            "warnings": self.warnings,
            "source_warnings": self.source_warnings,
            "seconds": round(self.seconds, 3),
        }

    def summary_lines(self) -> list[str]:
        """The short human summary the CLI prints."""
        lines = [f"converted {self.kind} {self.source} -> {self.output}"
                 + (f" (engine {self.engine})" if self.engine else "")]
        lines.append(f"  tensors: {self.tensors_in} in, {self.tensors_out} out in {self.shards_out} shard(s), "
                     f"{human_bytes(self.bytes_out)} written in {self.seconds:.1f} s")
        if self.renames:
            lines.append(f"  renamed: {len(self.renames)} tensor(s), e.g. {self.renames[0]['from']} -> "
                         f"{self.renames[0]['to']}")
        if self.transformed:
            lines.append(f"  transformed: {len(self.transformed)} tensor(s) ({self.transformed[0]['how']})")
        if self.drops:
            names = ", ".join(d["name"] for d in self.drops[:3]) + (" ..." if len(self.drops) > 3 else "")
            lines.append(f"  dropped: {len(self.drops)} tensor(s): {names}")
        for g in self.generated:
            lines.append(f"  generated: {g['name']} ({g['reason']})")
        if self.aux:
            a = self.aux
            lines.append(f"  aux layers: {a['written']} ({a['convention']} convention; input form "
                         f"{a['input_ids']}; from {a['source']})")
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        lines.append(f"  report: {Path(self.output) / REPORT_FILE}")
        return lines


def _progress(enabled: bool) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    console = Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=console, transient=True,
                    disable=not enabled or not console.is_terminal)


def write_items(items: Iterable[Item], out_dir: Path, total_bytes: int, report: Report,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True,
                allow_nonfinite: bool = False) -> list[Path]:
    """Produce and write every item in order, one tensor in memory at a time.

    A new output shard starts where the source shard changes (and when one exceeds
    ``max_shard_bytes``), so a rename-only conversion reproduces the source's shard layout.
    Every floating-point tensor is checked for NaN/Inf as it goes by (a computed one in memory, a
    copied one from its source bytes in chunks): refused with one line naming it, or with
    ``allow_nonfinite`` written and listed as a warning in the report."""
    from eagle3 import finite

    def nonfinite(where: str, name: str) -> None:
        if not allow_nonfinite:
            raise finite.NonFiniteError(finite.nonfinite_message(where, f"tensor {name!r}"))
        report.warn(f"tensor {name!r} holds NaN or Inf values (written as is: --allow-nonfinite)")
    items = list(items)
    shard_sizes: dict[str, int] = {}
    for it in items:
        shard_sizes[it.shard] = shard_sizes.get(it.shard, 0) + it.nbytes
    t0 = time.perf_counter()
    with _progress(progress) as prog:
        overall = prog.add_task("tensors", total=max(total_bytes, 1))
        shard_task = None
        cur = None
        with CheckpointWriter(out_dir, max_shard_bytes=max_shard_bytes) as w:
            for i, it in enumerate(items):
                if it.shard != cur:
                    w.start_shard()
                    cur = it.shard
                    if shard_task is not None:
                        prog.remove_task(shard_task)
                    shard_task = prog.add_task(f"shard {Path(cur).name}", total=max(shard_sizes[cur], 1))
                if it.raw is not None:
                    if not finite.raw_all_finite(it.raw):
                        nonfinite(str(it.raw.file), it.raw.name)
                    w.add_raw(it.name, it.raw)
                    report.bytes_out += it.raw.nbytes
                else:
                    assert it.make is not None
                    t = it.make()
                    if not finite.all_finite(t):
                        nonfinite(str(it.shard), it.name)
                    w.add(it.name, t)
                    report.bytes_out += t.numel() * t.element_size()
                    del t
                report.tensors_out += 1
                prog.update(overall, advance=it.nbytes, description=f"tensors {i + 1}/{len(items)}")
                prog.update(shard_task, advance=it.nbytes)
            files = w.close()
    report.shards_out = len(files)
    report.seconds += time.perf_counter() - t0
    return files


def write_output(out: Path, out_cfg: dict[str, Any], items: list[Item], report: Report, src_dir: Path,
                 opts: Any, t0: float) -> Report:
    """Write a planned conversion atomically: shards, config, side files, report, manifest.
    ``opts`` is a DraftOptions or TargetOptions (overwrite, max_shard_bytes, progress,
    trust_remote_code)."""
    from eagle3.checkpoint import atomic_output, check_side_files, copy_side_files

    report.output = str(out)
    check_side_files(src_dir, opts.trust_remote_code)  # a bad one refused before anything is written
    # Every local path read is an input the output must stay clear of (checked under the lock).
    inputs = [src_dir, getattr(opts, "target", None)]
    with atomic_output(out, overwrite=opts.overwrite, inputs=inputs) as tmp:
        write_items(items, tmp, sum(i.nbytes for i in items), report, opts.max_shard_bytes, opts.progress,
                    getattr(opts, "allow_nonfinite", False))
        write_json(tmp / "config.json", out_cfg)
        report.side_files = copy_side_files(src_dir, tmp, trust_remote_code=opts.trust_remote_code)
        report.seconds = time.perf_counter() - t0
        write_report(tmp, report)
    return report


def write_report(out_dir: Path, report: Report) -> None:
    write_json(Path(out_dir) / REPORT_FILE, report.to_json())


def print_summary(report: Report, file: Any = None) -> None:
    f = file or sys.stdout
    for line in report.summary_lines():
        f.write(line + "\n")
