"""The validation report: JSON (stable keys), a PNG figure and a short text summary.

JSON keys (top level): ``task``, ``num_fewshot``, ``n_samples``, ``generation``, ``server``,
``accuracy`` (``strict-match`` / ``flexible-extract``: ``exact_match``, ``stderr``), ``speculative``
(or null), ``latency`` (``ttft_ms`` / ``tpot_ms`` / ``itl_ms`` / ``e2el_ms``: mean, median, std,
p50, p90, p99), ``throughput``, ``baseline`` (the same for the run without speculation, or null),
``speedup`` (baseline / speculative TPOT and E2EL, speculative / baseline output throughput),
``lossless`` (``checked``, ``passed``, ``num_mismatches``, ``mismatches``), ``thresholds``,
``failures`` (one line each), ``passed``, ``figure``, ``samples`` (per document).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

_MAX_MISMATCHES_LISTED = 50


def _first_diff(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def lossless(run: Any, baseline: Any) -> dict[str, Any]:
    """Greedy speculative decoding must reproduce the target's own greedy output exactly."""
    mismatches = []
    for i, (r, b) in enumerate(zip(run.results, baseline.results, strict=True)):
        if not (r.ok and b.ok):
            mismatches.append({"doc_id": i, "error": r.error or b.error})
        elif r.text != b.text:
            at = _first_diff(r.text, b.text)
            mismatches.append({"doc_id": i, "first_difference_at_char": at,
                               "speculative": r.text[max(0, at - 40): at + 80],
                               "baseline": b.text[max(0, at - 40): at + 80],
                               "speculative_tokens": r.output_tokens, "baseline_tokens": b.output_tokens})
    return {"checked": True, "passed": not mismatches, "num_compared": len(run.results),
            "num_mismatches": len(mismatches), "mismatches": mismatches[:_MAX_MISMATCHES_LISTED]}


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0 or math.isnan(num) or math.isnan(den):
        return None
    return num / den


def _latency(m: dict[str, Any]) -> dict[str, Any]:
    return {k: m[k] for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "itl_convention")}


def _throughput(m: dict[str, Any]) -> dict[str, Any]:
    return {k: m[k] for k in ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
                              "request_throughput", "output_throughput", "total_token_throughput", "concurrency")}


def build_report(run: Any, baseline: Any | None, prep: Any, opts: Any, meta: dict[str, Any]) -> dict[str, Any]:
    from eagle3.validate import gsm8k

    scored = [gsm8k.score_one(r.text if r.ok else "", d) for r, d in zip(run.results, prep.docs, strict=True)]
    acc = gsm8k.accuracy(scored)
    failures: list[str] = []
    failed = [i for i, r in enumerate(run.results) if not r.ok]
    if failed:
        failures.append(f"{len(failed)} request(s) failed, e.g. doc {failed[0]}: {run.results[failed[0]].error}")
    loss = None
    base_block = None
    speedup = None
    if baseline is not None:
        loss = lossless(run, baseline)
        if not loss["passed"]:
            failures.append(f"lossless check failed: {loss['num_mismatches']} of {loss['num_compared']} greedy "
                            f"completions differ from the run without speculation "
                            f"(first: doc {loss['mismatches'][0]['doc_id']})")
        base_scored = [gsm8k.score_one(r.text if r.ok else "", d)
                       for r, d in zip(baseline.results, prep.docs, strict=True)]
        bm = baseline.metrics
        base_block = {"base_url": baseline.base_url, "accuracy": gsm8k.accuracy(base_scored),
                      "latency": _latency(bm), "throughput": _throughput(bm), **baseline.server}
        sm = run.metrics
        speedup = {
            "tpot": _ratio(bm["tpot_ms"]["mean"], sm["tpot_ms"]["mean"]),
            "e2el": _ratio(bm["e2el_ms"]["mean"], sm["e2el_ms"]["mean"]),
            "output_throughput": _ratio(sm["output_throughput"], bm["output_throughput"]),
        }
    value = acc[opts.accuracy_filter]["exact_match"]
    if opts.min_accuracy is not None and not (value >= opts.min_accuracy):
        failures.append(f"accuracy ({opts.accuracy_filter}) {value:.4f} < --min-accuracy {opts.min_accuracy}")
    if opts.min_acceptance is not None:
        rate = (run.spec or {}).get("acceptance_rate")
        if rate is None:
            failures.append("--min-acceptance given but the server reports no speculative acceptance")
        elif rate < opts.min_acceptance:
            failures.append(f"acceptance rate {rate:.4f} < --min-acceptance {opts.min_acceptance}")
    samples = []
    for i, (r, d, s) in enumerate(zip(run.results, prep.docs, scored, strict=True)):
        samples.append({"doc_id": i, "question": d.question, "target": d.answer.split("####")[-1].strip(),
                        "completion": r.text, "strict": s.strict, "flexible": s.flexible,
                        "strict_correct": s.strict_correct, "flexible_correct": s.flexible_correct,
                        "prompt_tokens": r.prompt_tokens, "completion_tokens": r.output_tokens,
                        "finish_reason": r.finish_reason, "error": r.error,
                        "ttft_ms": None if r.ttft is None else 1000 * r.ttft,
                        "tpot_ms": None if r.tpot is None else 1000 * r.tpot, "e2el_ms": 1000 * r.latency})
    return {
        "task": opts.task,
        "num_fewshot": opts.num_fewshot,
        "n_samples": len(prep.prompts),
        "dataset": gsm8k.dataset_name(opts.dataset),
        "generation": {"max_tokens": opts.max_tokens, "temperature": 0.0, "stop": list(gsm8k.STOP),
                       "seed": gsm8k.REQUEST_SEED, "fewshot_seed": gsm8k.FEWSHOT_SEED,
                       "concurrency": opts.concurrency, "endpoint": "/v1/completions (streamed)"},
        "server": {"base_url": run.base_url, "model": run.model, **meta, **run.server},
        "accuracy": acc,
        "speculative": run.spec,
        "latency": _latency(run.metrics),
        "throughput": _throughput(run.metrics),
        "baseline": base_block,
        "speedup": speedup,
        "lossless": loss if loss is not None else {"checked": False},
        "thresholds": {"min_accuracy": opts.min_accuracy, "accuracy_filter": opts.accuracy_filter,
                       "min_acceptance": opts.min_acceptance},
        "failures": failures,
        "passed": not failures,
        "figure": None,
        "samples": samples,
    }


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``path.partial`` then rename: a reader never sees half a report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(data, indent=2, allow_nan=True) + "\n")
    os.replace(tmp, path)


def plot(report: dict[str, Any], run: Any, baseline: Any | None, path: Path) -> None:
    """Acceptance per position, accepted-count histogram, TPOT with vs without speculation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = report.get("speculative") or {}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    per_pos = [x for x in (spec.get("per_position_acceptance") or []) if x is not None]
    if per_pos:
        ax.bar([str(i + 1) for i in range(len(per_pos))], per_pos, color="#4C72B0")
        ax.set_ylim(0, 1)
        for i, v in enumerate(per_pos):
            ax.text(i, v + 0.02, f"{v:.2f}", ha="center", fontsize=9)
    else:
        ax.text(0.5, 0.5, "no speculative metrics", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("acceptance per draft position")
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")

    ax = axes[1]
    dist = [x for x in (spec.get("accepted_distribution") or []) if x is not None]
    if dist:
        ax.bar([str(j) for j in range(len(dist))], dist, color="#55A868")
        ax.set_ylim(0, 1)
        mal = spec.get("mean_acceptance_length")
        ax.set_title(f"accepted drafts per step (mean accept length {mal:.2f})" if mal else "accepted drafts per step")
    else:
        ax.text(0.5, 0.5, "no speculative metrics", ha="center", va="center", transform=ax.transAxes)
        ax.set_title("accepted drafts per step")
    ax.set_xlabel("accepted draft tokens")
    ax.set_ylabel("fraction of verify steps")

    ax = axes[2]
    series, labels = [], []
    for label, r in (("speculative", run), ("baseline", baseline)):
        if r is None:
            continue
        t = [1000 * x.tpot for x in r.results if x.ok and x.tpot is not None]
        if t:
            series.append(t)
            labels.append(label)
    if series:
        ax.boxplot(series, tick_labels=labels, showmeans=True)
    else:
        ax.text(0.5, 0.5, "no TPOT samples", ha="center", va="center", transform=ax.transAxes)
    sp = (report.get("speedup") or {}).get("tpot")
    ax.set_title(f"TPOT per request (speedup {sp:.2f}x)" if sp else "TPOT per request")
    ax.set_ylabel("ms / output token")
    acc = report["accuracy"]
    fig.suptitle(f"GSM8K {report['num_fewshot']}-shot, n={report['n_samples']}: strict "
                 f"{acc['strict-match']['exact_match']:.3f}, flexible {acc['flexible-extract']['exact_match']:.3f}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def speculative_lines(spec: dict[str, Any] | None) -> list[str]:
    """The summary's acceptance lines; a tree's shape and its per-depth acceptance (the per-position
    counters count, for trees, the verifies whose accepted path reached each depth)."""
    if not spec:
        return ["  speculative: no counters on the server's /metrics"]
    pp = "/".join(_fmt(x) for x in spec.get("per_position_acceptance") or [])
    dist = "/".join(_fmt(100 * x if x is not None else None, ".1f") for x in spec.get("accepted_distribution") or [])
    lines = [f"  acceptance rate {_fmt(spec.get('acceptance_rate'), '.4f')}  mean accept length "
             f"{_fmt(spec.get('mean_acceptance_length'))}  per position {pp or '-'}  "
             f"accepted 0..k {dist or '-'} %  [{spec.get('source')}]"]
    shape = spec.get("shape") or {}
    if shape.get("topk", 1) > 1:
        lines.append(f"  tree topk {shape['topk']}, {shape['num_steps']} steps, {shape['num_draft_tokens']} "
                     f"tokens verified: depth>=1..{shape['num_steps']} accepted {pp or '-'} of verifies")
    if spec.get("chosen_k_histogram"):
        lines.append(f"  chosen k (auto) 0..{len(spec['chosen_k_histogram']) - 1}: "
                     + "/".join(f"{n:g}" for n in spec["chosen_k_histogram"]) + " steps")
    return lines


def summary_lines(report: dict[str, Any]) -> list[str]:
    acc = report["accuracy"]
    lines = [f"GSM8K {report['num_fewshot']}-shot, {report['n_samples']} questions, server "
             f"{report['server'].get('base_url')} (model {report['server'].get('model')})"]
    for name in ("strict-match", "flexible-extract"):
        a = acc[name]
        lines.append(f"  exact_match {name:17s} {_fmt(a['exact_match'], '.4f')} ± {_fmt(a['stderr'], '.4f')}")
    lines += speculative_lines(report.get("speculative"))
    lat, thr = report["latency"], report["throughput"]
    lines.append(f"  TTFT ms mean/p50/p99 {_fmt(lat['ttft_ms']['mean'])}/{_fmt(lat['ttft_ms']['median'])}/"
                 f"{_fmt(lat['ttft_ms']['p99'])}  TPOT ms {_fmt(lat['tpot_ms']['mean'])}/"
                 f"{_fmt(lat['tpot_ms']['median'])}/{_fmt(lat['tpot_ms']['p99'])}  ITL ms "
                 f"{_fmt(lat['itl_ms']['mean'])}/{_fmt(lat['itl_ms']['median'])}/{_fmt(lat['itl_ms']['p99'])}  "
                 f"E2E ms {_fmt(lat['e2el_ms']['mean'])}/{_fmt(lat['e2el_ms']['median'])}/{_fmt(lat['e2el_ms']['p99'])}")
    lines.append(f"  output throughput {_fmt(thr['output_throughput'])} tok/s, {thr['completed']} ok, "
                 f"{thr['failed']} failed, {_fmt(thr['duration_s'])} s")
    if report.get("baseline"):
        b = report["baseline"]
        sp = report.get("speedup") or {}
        lines.append(f"  without speculation: TPOT mean {_fmt(b['latency']['tpot_ms']['mean'])} ms, output "
                     f"{_fmt(b['throughput']['output_throughput'])} tok/s; speedup TPOT {_fmt(sp.get('tpot'))}x, "
                     f"throughput {_fmt(sp.get('output_throughput'))}x")
    loss = report.get("lossless") or {}
    if loss.get("checked"):
        lines.append(f"  lossless (greedy output identical without speculation): "
                     f"{'PASS' if loss['passed'] else 'FAIL'} ({loss['num_mismatches']} of {loss['num_compared']} differ)")
    for f in report["failures"]:
        lines.append(f"  FAIL: {f}")
    lines.append(f"  result: {'PASS' if report['passed'] else 'FAIL'}")
    return lines
