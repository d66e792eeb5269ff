"""Validation of a served model through its OpenAI-compatible HTTP API.

``eagle3 serve ... --validate gsm8k`` and ``eagle3 validate --base-url URL`` share these steps:

1. :func:`prepare`: load GSM8K and build lm-eval's exact prompts;
2. :func:`evaluate`: send them (streamed, greedy, lm-eval's stop strings) at the chosen
   concurrency, timing every request, and read the speculative counters from ``/metrics``
   before and after;
3. optionally :func:`evaluate` the same prompts on a server without speculation (the baseline);
4. :func:`finish`: score (strict / flexible exact match), check that greedy speculative output is
   identical to the baseline's (the lossless property), compare latency, write the JSON report
   and PNG figure and check the thresholds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.errors import UsageError
from eagle3.validate.endpoint import api_root, served_model

TASKS = ("gsm8k",)


@dataclass
class ValidateOptions:
    task: str = "gsm8k"
    limit: int | None = None
    num_fewshot: int = 5
    concurrency: int = 1
    dataset: Path | None = None
    max_tokens: int = 256
    model: str | None = None
    api_key: str | None = None
    report: Path | None = None
    figure: Path | None = None
    overwrite: bool = False
    min_accuracy: float | None = None
    min_acceptance: float | None = None
    accuracy_filter: str = "strict-match"
    inputs: tuple[Path | None, ...] = ()  # what else the run reads (serve: target, draft): no report there

    def check(self) -> None:
        from eagle3.validate import gsm8k

        if self.task not in TASKS:
            raise UsageError(f"--validate {self.task!r}: only {', '.join(TASKS)} is supported")
        if self.limit is not None and self.limit < 1:
            raise UsageError(f"--limit must be >= 1, got {self.limit}")
        if self.concurrency < 1:
            raise UsageError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.max_tokens < 1:
            raise UsageError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.accuracy_filter not in gsm8k.FILTERS:
            raise UsageError(f"--accuracy-filter must be one of {', '.join(gsm8k.FILTERS)}")
        for name, v in (("--min-accuracy", self.min_accuracy), ("--min-acceptance", self.min_acceptance)):
            if v is not None and not 0.0 <= v <= 1.0:
                raise UsageError(f"{name} must be in [0, 1], got {v}")
        from eagle3.checkpoint import check_output_path

        for flag, p in (("report", self.report), ("figure", self.figure_path())):
            if p is None:
                continue
            check_output_path(p, [self.dataset, *self.inputs], what=flag)
            if p.is_dir():
                raise UsageError(f"{p}: --{flag} names a directory; give a file path")
            if p.exists() and not self.overwrite:
                raise UsageError(f"{p} exists; pass --overwrite to replace it")

    def figure_path(self) -> Path | None:
        if self.figure is not None:
            return self.figure
        return self.report.with_suffix(".png") if self.report is not None else None


@dataclass
class Prepared:
    docs: list[Any]
    prompts: list[str]


@dataclass
class EvalRun:
    """One pass over the prompts against one server."""

    base_url: str
    model: str | None
    results: list[Any]  # bench.RequestResult, in document order
    duration: float
    metrics: dict[str, Any]
    spec: dict[str, Any] | None
    label: str = "speculative"
    server: dict[str, Any] = field(default_factory=dict)


def prepare(opts: ValidateOptions) -> Prepared:
    from eagle3.validate import gsm8k

    opts.check()
    train, test = gsm8k.load_dataset(opts.dataset)
    prompts = gsm8k.build_prompts(train, test, opts.num_fewshot, opts.limit)
    return Prepared(test[: len(prompts)], prompts)


def evaluate(base_url: str, prep: Prepared, opts: ValidateOptions, label: str = "speculative") -> EvalRun:
    from eagle3.validate import bench, gsm8k, metrics_client

    model = opts.model or served_model(base_url, opts.api_key)
    url = api_root(base_url) + "/v1/completions"
    bodies = [gsm8k.request_body(p, model, opts.max_tokens) for p in prep.prompts]
    before = metrics_client.scrape(base_url, opts.api_key)
    results, duration = asyncio.run(bench.run_requests(url, bodies, opts.concurrency, opts.api_key))
    after = metrics_client.scrape(base_url, opts.api_key)
    return EvalRun(base_url, model, results, duration, bench.compute_metrics(results, duration),
                   metrics_client.spec_delta(before, after), label)


def finish(run: EvalRun, baseline: EvalRun | None, prep: Prepared, opts: ValidateOptions,
           meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build the report, write it (and the figure) when asked, and return it.
    ``report["passed"]`` is False when a threshold, the lossless check or a request failed."""
    from eagle3.validate import report as rep

    out = rep.build_report(run, baseline, prep, opts, meta or {})
    fig = opts.figure_path()
    if fig is not None:
        rep.plot(out, run, baseline, fig)
        out["figure"] = str(fig)
    if opts.report is not None:
        rep.write_json_atomic(opts.report, out)
    return out
