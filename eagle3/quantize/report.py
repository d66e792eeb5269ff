"""The verification report: per quantized tensor, how far its decode (read back from the output
files, eagle3's codecs) is from the source weight it was quantized from.

``quantization_report.json`` holds one row per quantized module (relative Frobenius error, SNR in
dB, max abs error, whether it is within the scheme's expected error) and a summary;
``quantization_report.png`` plots error and SNR by layer (matplotlib, Agg backend: no display).
:func:`summary_table` is what ``eagle3 quantize`` prints.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import write_json
from eagle3.formats import keys

REPORT_JSON = "quantization_report.json"
REPORT_PNG = "quantization_report.png"


@dataclass
class ErrorAccumulator:
    """Running sums over row chunks. Each chunk's sums are fp32 BLAS dot products (~5x cheaper than
    float64 norms; relative error ~1e-6 on a 512K-element chunk), the totals over chunks are
    Python floats (float64), so a 132M-element weight loses no digits across chunks."""

    sq_err: float = 0.0
    sq_ref: float = 0.0
    max_abs: float = 0.0
    nonfinite: int = 0
    src_nonfinite: int = 0  # chunks whose source rows hold NaN/Inf (their sum of squares is not finite)

    def add(self, decoded: torch.Tensor, ref: torch.Tensor) -> None:
        diff = decoded.sub_(ref).reshape(-1)  # decoded is a fresh fp32 buffer: reuse it
        r = ref.reshape(-1)
        r = r if r.dtype == torch.float32 else r.float()
        err, ref2 = _sq(diff), _sq(r)
        if not math.isfinite(err):  # an inf/nan anywhere in the decode (or the source) shows up here
            self.nonfinite += 1
        if not math.isfinite(ref2):  # exact: _sq redoes an fp32 overflow in float64
            self.src_nonfinite += 1
        self.sq_err += err
        self.sq_ref += ref2
        if diff.numel():
            lo, hi = diff.aminmax()
            self.max_abs = max(self.max_abs, -float(lo), float(hi))


def _sq(x: torch.Tensor) -> float:
    """Sum of squares; in float64 only when the fp32 sum overflows (|x| beyond ~1e17)."""
    v = float(torch.dot(x, x))
    return v if math.isfinite(v) else float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2


@dataclass
class TensorReport:
    module: str
    kind: str  # routed-expert | shared-expert | dense-mlp | attention | mlp | other
    layer: int | None
    shape: list[int]
    rel_error: float  # ||W' - W|| / ||W||
    snr_db: float  # 10 log10(||W||^2 / ||W' - W||^2); inf when exact
    max_abs_error: float
    ok: bool  # finite and rel_error <= the scheme's expected bound

    @classmethod
    def from_acc(cls, module: str, shape: tuple[int, int], acc: ErrorAccumulator, bound: float) -> TensorReport:
        rel = math.sqrt(acc.sq_err / acc.sq_ref) if acc.sq_ref > 0 else (0.0 if acc.sq_err == 0 else math.inf)
        snr = 10 * math.log10(acc.sq_ref / acc.sq_err) if acc.sq_err > 0 else math.inf
        ok = acc.nonfinite == 0 and rel <= bound
        return cls(module, module_kind(module), layer_index(module), list(shape), rel, snr, acc.max_abs, ok)


    def to_json(self) -> dict[str, Any]:
        """JSON-safe: a non-finite number (inf SNR of an exact decode; inf/NaN error of a weight
        that holds NaN/Inf, written with --allow-nonfinite) becomes null, never Infinity/NaN,
        which strict JSON parsers refuse."""
        return {k: (_finite(v) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorReport:
        """Inverse of :meth:`to_json` (null SNR was an exact decode; a null error was non-finite)."""
        d = dict(d)
        d["snr_db"] = math.inf if d["snr_db"] is None else d["snr_db"]
        for k in ("rel_error", "max_abs_error"):
            d[k] = math.nan if d[k] is None else d[k]
        return cls(**d)


def module_kind(name: str) -> str:
    if keys.expert_index(name) is not None:
        return "routed-expert"
    if ".shared_experts." in name:
        return "shared-expert"
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "dense-mlp" if keys.target_layer_index(name) is not None else "mlp"
    return "other"


def layer_index(name: str) -> int | None:
    i = keys.target_layer_index(name)
    if i is not None:
        return i
    p = keys.draft_layer_prefix(name)
    if p is None:
        return None
    return 0 if p == keys.MIDLAYER else int(p.split(".")[1])


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def summarize(rows: list[TensorReport]) -> dict[str, Any]:
    """Totals and per-kind aggregates (JSON-safe: inf SNR -> null)."""
    by_kind: dict[str, list[TensorReport]] = defaultdict(list)
    for r in rows:
        by_kind[r.kind].append(r)

    def agg(rs: list[TensorReport]) -> dict[str, Any]:
        rel = [r.rel_error for r in rs]
        snr = [r.snr_db for r in rs]
        return {"tensors": len(rs), "mean_rel_error": _finite(sum(rel) / len(rel)) if rel else None,
                "max_rel_error": _finite(max(rel)) if rel else None, "min_snr_db": _finite(min(snr)) if snr else None,
                "failed": sum(not r.ok for r in rs),
                "nonfinite": sum(not math.isfinite(r.rel_error) for r in rs)}

    return {"all": agg(rows), "by_kind": {k: agg(v) for k, v in sorted(by_kind.items())}}


def write_report(out_dir: Path, rows: list[TensorReport], meta: dict[str, Any]) -> list[Path]:
    """Write the JSON report (always) and the PNG plot (when there are rows and matplotlib is installed)."""
    rows = sorted(rows, key=lambda r: (r.layer if r.layer is not None else -1, r.module))
    data = {**meta, "summary": summarize(rows),
            "tensors": [r.to_json() for r in rows]}
    written = [out_dir / REPORT_JSON]
    write_json(written[0], data)
    # Nothing to plot without verification rows (--no-verify): the JSON says "verified": false.
    png = plot(rows, out_dir / REPORT_PNG, title=f"{meta.get('recipe', '')} ({meta.get('scope', '')})") if rows else None
    if png is not None:
        written.append(png)
    return written


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:  # matplotlib ships with eagle3[eval]; the JSON report carries the same numbers
        return None
    return plt


def preload_plotting() -> threading.Thread:
    """Import matplotlib on a background thread while the quantization runs (~0.4 s that would
    otherwise be spent after the last shard, when the report is drawn)."""
    t = threading.Thread(target=_pyplot, name="eagle3-preload-matplotlib", daemon=True)
    t.start()
    return t


def plot(rows: list[TensorReport], path: Path, title: str = "") -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    kinds = sorted({r.kind for r in rows})
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for i, kind in enumerate(kinds):
        rs = [r for r in rows if r.kind == kind]
        # Spread kinds side by side within a layer so that they do not hide each other.
        x = [(r.layer if r.layer is not None else -1) + (i - (len(kinds) - 1) / 2) * 0.12 for r in rs]
        ax1.scatter(x, [r.rel_error for r in rs], s=10, label=kind, alpha=0.7)
        ax2.scatter(x, [min(r.snr_db, 99.0) for r in rs], s=10, label=kind, alpha=0.7)
    ax1.set_ylabel("relative error ||W'-W||/||W||")
    ax2.set_ylabel("SNR (dB)")
    ax2.set_xlabel("layer (-1: outside the decoder layers)")
    ax1.set_title(f"eagle3 quantize: per-tensor error {title}")
    ax1.legend(fontsize=8, loc="best")
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    # Fixed margins that hold the labels of this fixed layout: tight_layout measured them by
    # drawing the figure an extra time (~40% of the plot's CPU, paid by every quantize run).
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.08, top=0.95, hspace=0.08)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summary_table(rows: list[TensorReport], title: str) -> Any:
    """A rich Table: one line per module kind plus a total."""
    from rich.table import Table

    s = summarize(rows)
    t = Table(title=title)
    for col in ("kind", "tensors", "mean rel err", "max rel err", "min SNR dB", "over bound"):
        t.add_column(col, justify="left" if col == "kind" else "right")

    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for kind, a in [*s["by_kind"].items(), ("all", s["all"])]:
        t.add_row(kind, str(a["tensors"]), fmt(a["mean_rel_error"], ".4f"), fmt(a["max_rel_error"], ".4f"),
                  fmt(a["min_snr_db"], ".1f") if a["tensors"] else "-", str(a["failed"]))
    return t


def add_section(out_dir: Path, key: str, value: dict[str, Any]) -> dict[str, Any]:
    """Add ``key`` to the written JSON report (before the output is published and hashed)."""
    from eagle3.checkpoint import read_json

    data = read_json(out_dir / REPORT_JSON)
    data[key] = value
    write_json(out_dir / REPORT_JSON, data)
    return value


def acceptance_line(acc: dict[str, Any]) -> str:
    """``acceptance with T (24 prompts, k=3): mean accept length 3.10 -> 3.05 (0.984x), lossless PASS``."""
    b, a = acc["before"], acc["after"]
    return (f"acceptance with {acc['target']['path']} ({a['num_prompts']} held-out prompts, k="
            f"{a['num_speculative_tokens']}, greedy): mean accept length {b['mean_acceptance_length']:.2f} -> "
            f"{a['mean_acceptance_length']:.2f} ({acc['ratio']:.3f}x), lossless {'PASS' if a['lossless'] else 'FAIL'}")


def print_summary(result: Any) -> None:
    """The table ``eagle3 quantize`` prints (a :class:`~eagle3.quantize.pipeline.QuantizeResult`): error
    per module kind, then one line of totals, then the calibration, acceptance and fidelity lines."""
    from rich.console import Console

    from eagle3.quantize import calibrated

    con = Console()
    title = (f"{result.recipe} ({result.scope}), engine {result.engine}, method {result.method}: verification of "
             f"{result.out.name}")
    if result.rows:
        con.print(summary_table(result.rows, title))
    mb = result.src_bytes / 1e6
    con.print(f"quantized {result.quantized} modules ({result.unquantized} Linear modules left unquantized) "
              f"from a {result.source_kind} source: {mb:.1f} MB in {result.seconds:.1f} s "
              f"({mb / max(result.seconds, 1e-9):.1f} MB/s), output {result.out_bytes / 1e6:.1f} MB"
              + (f", {result.shards_resumed} of {result.shards} shards resumed" if result.shards_resumed else ""))
    con.print(f"wrote {result.out} (report: {', '.join(f.name for f in result.files)})")
    if result.calibration:
        con.print(calibrated.summary_line(result.calibration), highlight=False)
    if result.acceptance:
        con.print(acceptance_line(result.acceptance))
    if result.fidelity:
        con.print(fidelity_line(result.fidelity), highlight=False)
    if result.failed:
        con.print(f"[yellow]warning: {len(result.failed)} tensor(s) exceed the scheme's expected error, e.g. "
                  f"{result.failed[0].module} (rel. error {result.failed[0].rel_error:.3f})[/yellow]")


def fidelity_line(f: dict[str, Any]) -> str:
    """``fidelity vs SRC (8 held-out GSM8K prompts x 64 tokens, top-20): KLD mean ... p99 ..., top-1 ...``."""
    k, d = f["kld"], f["divergence"]
    first = d.get("mean_first_divergence")
    return (f"fidelity vs {f['source']} ({f['prompts']} held-out GSM8K prompts x {f['tokens']} tokens, top-"
            f"{f['logprobs']} logprobs, {k['tokens']} tokens): KLD mean {_g(k['mean'])} p99 {_g(k['p99'])}, "
            f"top-1 agreement {_pct(f['top1_agreement'])}, identical continuations {d['identical']}/{d['sequences']}"
            + (f", first divergence at token {first:.1f} on average" if first is not None else "")
            + ("" if f["passed"] else f" [{'; '.join(f['failures'])}]"))


def _g(v: Any) -> str:
    return "-" if v is None else f"{v:.4g}"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"
