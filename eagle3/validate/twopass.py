"""The two passes of a comparison against the source, on top of a validation run.

``eagle3 validate --record-reference REF`` (pass 1, against the source's server) and ``eagle3
validate --reference REF`` (pass 2, against the served model's server), and ``eagle3 serve T
--validate ... --reference SRC`` (both, with the bundled runtime, one model loaded at a time), are
made of these steps; the file format, the requests and the comparison itself are
:mod:`eagle3.validate.reference`, the arithmetic :mod:`eagle3.validate.quality`.

Pass 1 records, per workload (its counters scraped around it, as the validation run does), every
turn of every item: the prompt's token ids, the source's greedy continuation as ids and its top-N
per position, and its text. Pass 2 runs the ordinary validation (acceptance, speed, lossless against
a baseline), then teacher-forces every recorded turn through the served model (after checking that
it tokenizes the prompts as the source did), and scores the served answers against the source's:
:func:`section` adds the ``reference`` block to the report.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.errors import UsageError
from eagle3.validate import reference as refmod

_Echo = Callable[[str], None]


def _echo(opts: Any) -> _Echo:
    return opts.echo or (lambda s: None)


def client_for(base_url: str, opts: Any, model: str | None) -> refmod.Client:
    """A reference client with the run's model, key, concurrency and (optional) local tokenizer."""
    tok = None
    if opts.tokenizer is not None:
        from eagle3.runtime.tokenizer import load_tokenizer

        tok = load_tokenizer(opts.tokenizer, False)
        if tok is None:
            raise UsageError(f"--tokenizer {opts.tokenizer}: no tokenizer there")
    return refmod.Client(base_url, model, opts.api_key, tok, concurrency=opts.levels[0])


def _progress(echo: _Echo, what: str) -> Callable[[int, int], None]:
    """A line at every tenth of the work (and at the end): long recordings show they advance."""
    t0 = time.perf_counter()

    def report(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            echo(f"{what}: {done}/{total} in {time.perf_counter() - t0:.1f} s")

    return report


# -- pass 1 ----------------------------------------------------------------------------------------
def record(base_url: str, prep: Any, opts: Any, path: Path, server_info: dict[str, Any] | None = None,
           model: str | None = None) -> refmod.Reference:
    """Record the reference of every workload of ``prep`` on ``base_url`` and write it to ``path``."""
    from eagle3.validate import metrics_client
    from eagle3.validate.endpoint import served_model

    model = model or opts.model or served_model(base_url, opts.api_key)
    client = client_for(base_url, opts, model)
    n = opts.logprobs or refmod.DEFAULT_LOGPROBS
    echo = _echo(opts)
    header = refmod.new_header(client, n, server_info)
    items: list[refmod.RefItem] = []
    for w in prep.workloads:
        before = metrics_client.scrape(base_url, opts.api_key)
        turns = refmod.record(client, w.items, n, _progress(echo, f"reference: {w.name}"))
        after = metrics_client.scrape(base_url, opts.api_key)
        header["acceptance"][w.name] = metrics_client.spec_delta(before, after)
        header.setdefault("scores", {})[w.name] = _scores(w, turns)
        items += [r for ts in turns for r in ts]
    ref = refmod.Reference(header, items)
    refmod.write(path, ref)
    return ref


def _scores(w: Any, turns: list[list[refmod.RefItem]]) -> dict[str, Any] | None:
    if w.score is None:
        return None
    return w.score(w.items, [[r.text for r in ts] for ts in turns]).metrics


def record_summary(ref: refmod.Reference, path: Path) -> list[str]:
    """What ``--record-reference`` prints: per workload the turns recorded and the acceptance."""
    from eagle3.validate.report import speculative_lines

    lines = [f"reference: {len(ref.items)} turn(s), top-{ref.logprobs} logprobs per position, written to {path}"]
    for name, spec in (ref.header.get("acceptance") or {}).items():
        turns = [r for r in ref.items if r.workload == name]
        lines.append(f"{name}: {len(turns)} turn(s), {sum(len(r.tokens) for r in turns)} tokens")
        lines += speculative_lines(spec)
    return lines


# -- pass 2 ----------------------------------------------------------------------------------------
@dataclass
class Loaded:
    """A reference checked against this run's items before anything is sent."""

    path: Path
    ref: refmod.Reference
    turns: list[list[list[refmod.RefItem]]]  # per workload, per item, per turn
    logprobs: int


def load(path: Path, prep: Any, opts: Any) -> Loaded:
    """Read ``path`` and match it to the run's items and N (one line, exit 2, on a mismatch)."""
    ref = refmod.read(path)
    n = refmod.check_logprobs(ref, opts.logprobs, path)
    return Loaded(path, ref, [refmod.match_items(ref, w.items, path) for w in prep.workloads], n)


@dataclass
class Forced:
    """The served model's side: its top-N at every recorded position, per workload and turn."""

    served: list[list[list[dict[Any, float]]]]  # per workload, per turn (flat), per position


def teacher_force(base_url: str, loaded: Loaded, prep: Any, opts: Any, model: str | None = None) -> Forced:
    """Check the served model's tokenizer, then send every recorded turn back through it."""
    from eagle3.validate.endpoint import served_model

    model = model or opts.model or served_model(base_url, opts.api_key)
    client = client_for(base_url, opts, model)
    echo = _echo(opts)
    served = []
    for w, turns in zip(prep.workloads, loaded.turns, strict=True):
        refmod.check_tokenizer(client, w.items, turns, loaded.path)
        flat = [r for ts in turns for r in ts]
        served.append(refmod.teacher_force(client, flat, loaded.logprobs, loaded.ref.token_ids,
                                           _progress(echo, f"reference: {w.name} teacher-forced")))
    return Forced(served)


def section(loaded: Loaded, forced: Forced, prep: Any, run: Any, opts: Any,
            adapt_command: str | None = None) -> Callable[[dict[str, Any]], None]:
    """The report builder that adds ``reference`` and its failure lines (``validate.finish``)."""
    from eagle3.validate.report import add_failure

    def build(report: dict[str, Any]) -> None:
        parts = []
        acceptance = {}
        for w, turns, served in zip(prep.workloads, loaded.turns, forced.served, strict=True):
            src = _correct(w, [[r.text for r in ts] for ts in turns])
            got = _correct(w, [[r.text if r.ok else "" for r in ts] for ts in run.item_results(w)])
            parts.append(refmod.WorkloadComparison(w.name, [r for ts in turns for r in ts], served, src, got))
            acceptance[w.name] = (report.get("workloads") or {}).get(w.name, {}).get("speculative")
        block = refmod.compare(loaded.ref, loaded.path, parts, acceptance, opts.thresholds(), adapt_command)
        report["reference"] = block
        for line in block["failures"]:
            add_failure(report, line)

    return build


def _correct(w: Any, answers: list[list[str]]) -> list[bool | None]:
    if w.score is None:
        return [None] * len(w.items)
    scores = w.score(w.items, answers)
    return list(scores.correct) if scores.correct else [None] * len(w.items)
