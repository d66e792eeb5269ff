"""The validation report's figure: one PNG, one panel per question a deployer asks.

Panels (:data:`PANELS`, drawn left to right when they apply to the report): mean accept length and
acceptance rate by workload and category, acceptance by draft position per workload, and the
speedup by concurrency level. A further panel (e.g. a KLD histogram for a reference comparison) is
one more :class:`Panel` in the list, drawn from its own key of the report; the figure grows a column.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COLORS = ("#4C72B0", "#55A868", "#C44E52", "#8172B2", "#CCB974", "#64B5CD", "#8C8C8C", "#E17C05")


@dataclass(frozen=True)
class Panel:
    name: str
    draw: Callable[[Any, dict[str, Any]], None]  # (matplotlib Axes, report)
    applies: Callable[[dict[str, Any]], bool] = lambda report: True


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _bars(report: dict[str, Any]) -> list[tuple[str, dict[str, Any] | None, bool]]:
    """(label, speculative summary, is a category) for each workload, then its categories."""
    out: list[tuple[str, dict[str, Any] | None, bool]] = []
    for name, s in report["workloads"].items():
        out.append((name, s.get("speculative"), False))
        for cat, c in (s.get("categories") or {}).items():
            out.append((f"{name}/{cat}", c.get("speculative"), True))
    return out


def draw_acceptance_by_workload(ax: Any, report: dict[str, Any]) -> None:
    bars = [(label, spec, cat) for label, spec, cat in _bars(report)
            if spec and spec.get("mean_acceptance_length") is not None]
    ax.set_title("mean accept length by workload (rate above)")
    if not bars:
        _empty(ax, "no speculative metrics")
        return
    xs = list(range(len(bars)))
    heights = [spec["mean_acceptance_length"] for _, spec, _ in bars]
    colors = ["#A1B7DB" if cat else "#4C72B0" for _, _, cat in bars]
    ax.bar(xs, heights, color=colors)
    for x, (_, spec, _) in zip(xs, bars, strict=True):
        rate = spec.get("acceptance_rate")
        if rate is not None:
            ax.text(x, spec["mean_acceptance_length"] + 0.03, f"{rate:.2f}", ha="center", fontsize=8)
    ax.set_xticks(xs, [label for label, _, _ in bars], rotation=45, ha="right", fontsize=8)
    k = max((spec.get("num_speculative_tokens") or 0) for _, spec, _ in bars)
    ax.set_ylim(0, max(max(heights) * 1.15, k + 1.2 if k else 1.0))
    ax.set_ylabel("tokens per verify step (bonus included)")


def draw_acceptance_by_position(ax: Any, report: dict[str, Any]) -> None:
    ax.set_title("acceptance per draft position")
    drawn = 0
    for i, (name, s) in enumerate(report["workloads"].items()):
        pp = [x for x in ((s.get("speculative") or {}).get("per_position_acceptance") or []) if x is not None]
        if pp:
            ax.plot(range(1, len(pp) + 1), pp, marker="o", color=COLORS[i % len(COLORS)], label=name)
            drawn += 1
    if not drawn:
        _empty(ax, "no speculative metrics")
        return
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8)


def draw_speedup_by_concurrency(ax: Any, report: dict[str, Any]) -> None:
    levels = [lv for lv in report.get("concurrency") or [] if lv.get("speedup")]
    ax.set_title("speedup over the target alone, by concurrency")
    if not levels:
        _empty(ax, "no baseline run (the speedup needs one)")
        return
    xs = list(range(len(levels)))
    w = 0.38
    top = 1.0
    for off, key, label, color in ((-w / 2, "tpot", "TPOT", "#4C72B0"),
                                   (w / 2, "output_throughput", "output throughput", "#55A868")):
        vals = [lv["speedup"].get(key) or 0.0 for lv in levels]
        ax.bar([x + off for x in xs], vals, w, label=label, color=color)
        top = max(top, *vals)
        for x, v in zip(xs, vals, strict=True):
            ax.text(x + off, v + 0.02, f"{v:.2f}", ha="center", fontsize=8)
    ax.axhline(1.0, color="#444444", lw=0.8, ls="--")
    ax.set_xticks(xs, [str(lv["concurrency"]) for lv in levels])
    ax.set_ylim(0, top * 1.3)
    ax.set_xlim(-0.9, len(levels) - 0.1)
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("speculative / plain (x)")
    ax.legend(fontsize=8, loc="upper left", ncol=2)


def draw_kld_histogram(ax: Any, report: dict[str, Any]) -> None:
    """The comparison against the source: how many generated positions fall in each decade of
    per-token KLD (the first bar: identical or float-eps close), with the summary in the title."""
    block = report["reference"]
    hist = block["kld_histogram"]
    edges, counts = hist["edges"], hist["counts"]
    labels = [("0" if lo == 0 else f"{lo:g}") + ("+" if hi is None else f"-{hi:g}")
              for lo, hi in zip(edges[:-1], edges[1:], strict=True)]
    xs = list(range(len(counts)))
    ax.bar(xs, counts, color="#C44E52")
    ax.set_xticks(xs, labels, rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("per-token KLD (source || served)")
    ax.set_ylabel("generated positions")
    k = block["kld"]
    t1 = block.get("top1_agreement")
    ax.set_title(f"vs the source: mean KLD {k['mean']:.3g}, top-1 {t1:.3f}" if t1 is not None and k["tokens"]
                 else "vs the source")


PANELS: list[Panel] = [
    Panel("acceptance_by_workload", draw_acceptance_by_workload),
    Panel("acceptance_by_position", draw_acceptance_by_position),
    Panel("speedup_by_concurrency", draw_speedup_by_concurrency),
    Panel("kld_histogram", draw_kld_histogram, lambda report: bool(report.get("reference"))),
]


def title(report: dict[str, Any]) -> str:
    parts = [f"{', '.join(report['tasks'])}: n={report['n_samples']}"]
    acc = report.get("accuracy")
    if acc:
        parts.append(f"GSM8K strict {acc['strict-match']['exact_match']:.3f}")
    he = ((report["workloads"].get("humaneval") or {}).get("scores") or {})
    if he.get("executed"):
        parts.append(f"HumanEval pass@1 {he['pass@1']:.3f}")
    loss = report.get("lossless") or {}
    if loss.get("checked"):
        parts.append(f"lossless {'PASS' if loss['passed'] else 'FAIL'}")
    parts.append("PASS" if report.get("passed") else "FAIL")
    return " | ".join(parts)


def plot(report: dict[str, Any], path: Path, panels: Sequence[Panel] | None = None) -> None:
    """Draw the panels that apply to ``report`` into ``path`` (written aside, then renamed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [p for p in (PANELS if panels is None else panels) if p.applies(report)]
    fig, axes = plt.subplots(1, len(chosen), figsize=(5.2 * len(chosen), 4.6), squeeze=False)
    for ax, panel in zip(axes[0], chosen, strict=True):
        panel.draw(ax, report)
    fig.suptitle(title(report))
    fig.tight_layout()
    from eagle3.checkpoint.rawio import write_aside

    try:
        write_aside(Path(path), lambda tmp: fig.savefig(tmp, dpi=100), suffix=".partial.png")
    finally:
        plt.close(fig)
