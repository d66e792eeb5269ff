"""Validation of a served model through its OpenAI-compatible HTTP API, on one or more workloads.

``eagle3 serve ... --validate gsm8k,mtbench`` and ``eagle3 validate --base-url URL --task ...`` share
these steps:

1. :func:`prepare`: build every workload's items (:mod:`eagle3.validate.workloads`: GSM8K and
   HumanEval as lm-eval sends them, MT-Bench through the chat template, your FILE.jsonl);
2. :func:`evaluate`: send them (streamed, greedy) group by group (a workload, or one category of it)
   at the first concurrency level, reading the speculative counters from ``/metrics`` around each
   group, then everything at each further level (:mod:`eagle3.validate.runner`);
3. optionally :func:`evaluate` the same items on the target without speculation (the baseline);
4. :func:`finish`: score each workload, check that greedy speculative output is identical to the
   baseline's (the lossless property), compare speed, write the JSON report and PNG figure and check
   the thresholds (:mod:`eagle3.validate.report`, :mod:`eagle3.validate.figure`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.errors import UsageError
from eagle3.validate.endpoint import served_model

TASKS = ("gsm8k", "humaneval", "mtbench")  # and any FILE.jsonl


@dataclass
class ValidateOptions:
    task: str = "gsm8k"  # comma-separated workloads
    limit: int | None = None  # per workload (MT-Bench: per category)
    num_fewshot: int = 5  # gsm8k
    concurrency: tuple[int, ...] | int | str = (1,)  # levels; the first gives acceptance and lossless
    dataset: Path | None = None  # gsm8k
    max_tokens: int | None = None  # None: each workload's own (gsm8k 256, humaneval 1024, mtbench 1024)
    model: str | None = None
    api_key: str | None = None
    report: Path | None = None
    figure: Path | None = None
    overwrite: bool = False
    min_accuracy: float | None = None
    min_acceptance: float | None = None
    accuracy_filter: str = "strict-match"
    allow_code_execution: bool = False  # humaneval: run the completions' tests for pass@1
    # The comparison against the source (eagle3.validate.twopass): pass 1 writes record_reference,
    # pass 2 reads reference; logprobs is N (pass 1: default 20; pass 2: the reference's).
    record_reference: Path | None = None
    reference: Path | None = None
    source: Path | None = None  # serve --reference SRC_DIR: recorded in this run, then compared
    logprobs: int | None = None
    tokenizer: Path | None = None  # prompts tokenized here instead of by the server's /tokenize
    max_kld: float | None = None  # None: the defaults of reference.Thresholds
    min_top1: float | None = None
    max_flips: float | None = None
    inputs: tuple[Path | None, ...] = ()  # what else the run reads (serve: target, draft): no report there
    echo: Callable[[str], None] | None = field(default=None, repr=False)  # progress lines

    @property
    def levels(self) -> tuple[int, ...]:
        from eagle3.validate.bench import parse_levels

        if isinstance(self.concurrency, int):
            return parse_levels(str(self.concurrency))
        if isinstance(self.concurrency, str):
            return parse_levels(self.concurrency)
        return parse_levels(",".join(str(c) for c in self.concurrency))

    def tasks(self) -> list[str]:
        from eagle3.validate.workloads import parse_tasks

        return parse_tasks(self.task)

    def check(self) -> None:
        from eagle3.validate import gsm8k
        from eagle3.validate.workloads import is_file_task

        tasks = self.tasks()
        if self.limit is not None and self.limit < 1:
            raise UsageError(f"--limit must be >= 1, got {self.limit}")
        _ = self.levels  # raises on a bad --concurrency
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UsageError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.accuracy_filter not in gsm8k.FILTERS:
            raise UsageError(f"--accuracy-filter must be one of {', '.join(gsm8k.FILTERS)}")
        for name, v in (("--min-accuracy", self.min_accuracy), ("--min-acceptance", self.min_acceptance)):
            if v is not None and not 0.0 <= v <= 1.0:
                raise UsageError(f"{name} must be in [0, 1], got {v}")
        if self.dataset is not None and "gsm8k" not in tasks:
            raise UsageError("--dataset is GSM8K's data; it goes with --task gsm8k")
        if self.allow_code_execution and "humaneval" not in tasks:
            raise UsageError("--allow-code-execution runs HumanEval's tests; it goes with --task humaneval")
        scored = "gsm8k" in tasks or ("humaneval" in tasks and self.allow_code_execution)
        if self.min_accuracy is not None and not scored:
            raise UsageError(f"--min-accuracy: none of {', '.join(tasks)} scores accuracy (gsm8k does; humaneval "
                             f"with --allow-code-execution)")
        self._check_reference()
        from eagle3.checkpoint import check_output_path

        files = [Path(t) for t in tasks if is_file_task(t)]
        for flag, p in (("report", self.report), ("figure", self.figure_path())):
            if p is None:
                continue
            check_output_path(p, [self.dataset, *files, *self.inputs], what=flag)
            if p.is_dir():
                raise UsageError(f"{p}: --{flag} names a directory; give a file path")
            if p.exists() and not self.overwrite:
                raise UsageError(f"{p} exists; pass --overwrite to replace it")

    def _check_reference(self) -> None:
        from eagle3.checkpoint import check_output_path

        if self.record_reference is not None and self.reference is not None:
            raise UsageError("--record-reference (pass 1, the source's server) and --reference (pass 2) are two "
                             "runs; give one")
        if self.logprobs is not None and not 1 <= self.logprobs <= 100:
            raise UsageError(f"--logprobs must be in 1..100, got {self.logprobs}")
        compare = self.reference is not None or self.source is not None
        given = [f for f, v in (("--max-kld", self.max_kld), ("--min-top1", self.min_top1),
                                ("--max-flips", self.max_flips)) if v is not None]
        if given and not compare:
            raise UsageError(f"{', '.join(given)} go with --reference (the comparison against the source)")
        if self.logprobs is not None and self.record_reference is None and not compare:
            raise UsageError("--logprobs goes with --record-reference / --reference")
        self.thresholds().check()
        p = self.record_reference
        if p is not None:
            files = [Path(t) for t in self.tasks() if t.lower().endswith(".jsonl")]
            check_output_path(p, [self.dataset, *files, *self.inputs], what="record-reference")
            if p.is_dir():
                raise UsageError(f"{p}: --record-reference names a directory; give a file path (e.g. ref.jsonl.gz)")
            if p.exists() and not self.overwrite:
                raise UsageError(f"{p} exists; pass --overwrite to replace it")

    def thresholds(self) -> Any:
        from eagle3.validate.reference import Thresholds

        d = Thresholds()
        return Thresholds(d.max_kld if self.max_kld is None else self.max_kld,
                          d.min_top1 if self.min_top1 is None else self.min_top1,
                          d.max_flips if self.max_flips is None else self.max_flips)

    def figure_path(self) -> Path | None:
        if self.figure is not None:
            return self.figure
        return self.report.with_suffix(".png") if self.report is not None else None

    def load_options(self) -> Any:
        from eagle3.validate.workloads import LoadOptions

        return LoadOptions(limit=self.limit, max_tokens=self.max_tokens, num_fewshot=self.num_fewshot,
                           dataset=self.dataset, accuracy_filter=self.accuracy_filter,
                           allow_code_execution=self.allow_code_execution, echo=self.echo)


@dataclass
class Prepared:
    workloads: list[Any]  # eagle3.validate.workloads.Workload, in --task order

    @property
    def items(self) -> list[Any]:
        return [it for w in self.workloads for it in w.items]

    @property
    def num_requests(self) -> int:
        return sum(it.num_turns for it in self.items)

    def describe(self) -> str:
        return ", ".join(f"{w.name} {len(w.items)}" for w in self.workloads)

    def workload(self, name: str) -> Any | None:
        return next((w for w in self.workloads if w.name == name), None)


def prepare(opts: ValidateOptions) -> Prepared:
    from eagle3.validate.workloads import load_all

    opts.check()
    return Prepared(load_all(opts.tasks(), opts.load_options()))


def evaluate(base_url: str, prep: Prepared, opts: ValidateOptions, label: str = "speculative") -> Any:
    """One pass over every workload against ``base_url``: a :class:`eagle3.validate.runner.EvalRun`."""
    from eagle3.validate import runner

    model = opts.model or served_model(base_url, opts.api_key)
    return runner.run_workloads(base_url, prep.workloads, model, opts.levels, opts.api_key, label, opts.echo)


def finish(run: Any, baseline: Any | None, prep: Prepared, opts: ValidateOptions,
           meta: dict[str, Any] | None = None,
           sections: Sequence[Callable[[dict[str, Any]], None]] = ()) -> dict[str, Any]:
    """Build the report, write it (and the figure) when asked, and return it.

    ``sections``: further report builders, called in order on the finished report before it is
    written (each may add its own key and failure lines with :func:`eagle3.validate.report.add_failure`).
    ``report["passed"]`` is False when a threshold, the lossless check or a request failed."""
    from eagle3.validate import figure
    from eagle3.validate import report as rep

    out = rep.build_report(run, baseline, prep, opts, meta or {})
    for section in sections:
        section(out)
    fig = opts.figure_path()
    if fig is not None:
        figure.plot(out, fig)
        out["figure"] = str(fig)
    if opts.report is not None:
        rep.write_json_atomic(opts.report, out)
    return out
