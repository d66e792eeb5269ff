"""Running lm-evaluation-harness offline from the tests (in a subprocess: lm-eval and datasets
read HF_* variables at import time, and must not leak them into the rest of the test session).

One such process per test process, started by the first run and reused by the next ones (a job at a
time over a pipe): lm-eval's, datasets' and transformers' imports and a fresh datasets cache were
~3 CPU-s of every run, and five tests run lm-eval.

The task is lm-eval's own installed ``gsm8k.yaml`` (``include:`` by absolute path) with only the
dataset pointed at the local JSONL files, so the prompts, stop strings and filters under test are
lm-eval's, not a transcription of them.
"""

from __future__ import annotations

import atexit
import functools
import gzip
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

TASK = "gsm8k_local"


@functools.cache
def gsm8k_dir() -> Path:
    """The GSM8K copy eagle3 ships, unpacked once per test process into a directory in the
    openai/grade-school-math layout (``train.jsonl``, ``test.jsonl``): what ``--dataset DIR`` and
    lm-eval's json loader read."""
    from eagle3.validate import gsm8k

    out = Path(tempfile.mkdtemp(prefix="eagle3-gsm8k-"))
    atexit.register(shutil.rmtree, out, True)
    for split, src in gsm8k.packaged_files().items():
        with gzip.open(src, "rb") as f:
            (out / f"{split}.jsonl").write_bytes(f.read())
    return out


def lm_eval_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        pytest.skip("lm-eval is not installed (pip install 'eagle3[eval]')")
    return Path(spec.origin).parent


def write_task(task_dir: Path) -> Path:
    """A task that is lm-eval's gsm8k with the data read from the local JSONL files."""
    data = gsm8k_dir()
    task_dir.mkdir(parents=True, exist_ok=True)
    path = task_dir / f"{TASK}.yaml"
    path.write_text(
        f"include: {lm_eval_dir() / 'tasks' / 'gsm8k' / 'gsm8k.yaml'}\n"
        f"task: {TASK}\n"
        "dataset_path: json\n"
        "dataset_name: null\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    train: {data / 'train.jsonl'}\n"
        f"    test: {data / 'test.jsonl'}\n")
    return task_dir


# A job: run with ``args`` (its JSON arguments) defined, in the job's working directory.
_SCRIPT = r"""
import json
from lm_eval.tasks import TaskManager, get_task_dict
tm = TaskManager(include_path=args["task_dir"], include_defaults=False)
if args.get("mode") == "contexts":
    task = get_task_dict([args["task"]], tm)[args["task"]]
    task.set_fewshot_seed(1234)
    task.build_all_requests(limit=args["limit"])
    inst = sorted(task.instances, key=lambda i: i.doc_id)
    out = {"contexts": [i.args[0] for i in inst], "gen_kwargs": inst[0].args[1]}
else:
    import lm_eval
    kw = {}
    if args.get("num_fewshot") is not None:
        kw["num_fewshot"] = args["num_fewshot"]
    if args.get("apply_chat_template"):
        kw["apply_chat_template"] = True
    res = lm_eval.simple_evaluate(model=args["model"], model_args=args["model_args"], tasks=[args["task"]],
                                  task_manager=tm, limit=args["limit"], log_samples=True, **kw)
    samples = sorted(res["samples"][args["task"]], key=lambda s: (s["doc_id"], s["filter"]))
    out = {"results": res["results"][args["task"]],
           "samples": [{"doc_id": s["doc_id"], "filter": s["filter"], "context": s["arguments"][0][0]
                        if isinstance(s["arguments"][0][0], str) else None,
                        "resps": s["resps"], "filtered_resps": s["filtered_resps"],
                        "exact_match": s["exact_match"]} for s in samples]}
json.dump(out, open(args["out"], "w"))
"""


_WORKER = r"""
import json, os, sys, traceback
# lm-eval's own prints must not mix with the replies: they go to stderr (the log), replies to a copy
# of the original stdout
reply = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
# simple_evaluate's environment section (torch's collect_env: imports torch, runs pip list and more)
# is never read here, and was ~2.5 CPU-s of every evaluation
import lm_eval.evaluator
lm_eval.evaluator.add_env_info = lambda storage: None
for line in sys.stdin:
    job = json.loads(line)
    os.chdir(job["cwd"])
    try:
        exec(compile(job["script"], "<lm-eval job>", "exec"), {"args": job["args"], "__name__": "__lm_eval_job__"})
        out = {"ok": True}
    except BaseException:
        out = {"ok": False, "error": traceback.format_exc()}
    reply.write(json.dumps(out) + "\n")
    reply.flush()
# stdin closed: the tests are done (or their process died without closing it); the home goes too
import shutil
shutil.rmtree(os.environ["EAGLE3_LMEVAL_HOME"], ignore_errors=True)
"""


class _Worker:
    """The lm-eval process of this test process (offline, its own HF_HOME, stderr to a log file)."""

    def __init__(self) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="eagle3-lmeval-"))
        self.log = self.home / "lm-eval.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(self.home / "hf"),
                   HF_UPDATE_DOWNLOAD_COUNTS="0", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
                   OPENAI_API_KEY="", TOKENIZERS_PARALLELISM="false", EAGLE3_LMEVAL_HOME=str(self.home))
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=env, cwd=self.home)

    def call(self, script: str, args: dict[str, Any], cwd: Path, timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        start = self.log.stat().st_size
        self.proc.stdin.write((json.dumps({"script": script, "args": args, "cwd": str(cwd)}) + "\n").encode())
        self.proc.stdin.flush()
        fd, line, deadline = self.proc.stdout.fileno(), b"", time.monotonic() + timeout
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"lm-eval gave no answer within {timeout:.0f} s:\n{self.tail(start)}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"lm-eval exited with status {self.proc.wait()}:\n{self.tail(start)}")
            line += chunk
        return {**json.loads(line), "log": self.tail(start)}

    def tail(self, start: int, n: int = 4000) -> str:
        return self.log.read_bytes()[start:].decode(errors="replace")[-n:]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.home, ignore_errors=True)


_worker: list[_Worker] = []


def run_script(script: str, args: dict[str, Any], cwd: Path, timeout: float = 600) -> None:
    """Run ``script`` (Python with ``args`` defined) in this test process's lm-eval process, in
    ``cwd``; a failure fails the test with the script's traceback and lm-eval's log. A process that
    timed out or died is replaced by the next run."""
    lm_eval_dir()  # skips without lm-eval
    if not _worker or _worker[0].proc.poll() is not None:
        if _worker:
            _worker.pop().close()
        _worker.append(_Worker())
        atexit.register(_worker[0].close)
    try:
        got = _worker[0].call(script, args, cwd, timeout)
    except BaseException:  # no answer (a timeout, pytest-timeout's, a dead process): its answer must not
        _worker.pop().close()  # reach the next run
        raise
    assert got["ok"], got["error"] + "\n" + got["log"]


def run(tmp_path: Path, **args: Any) -> dict[str, Any]:
    """Run lm-eval offline (in this test process's lm-eval process); returns what _SCRIPT wrote."""
    lm_eval_dir()
    out = tmp_path / f"lmeval-{args.get('mode', 'eval')}-{len(list(tmp_path.glob('lmeval-*')))}.json"
    args = {"task": TASK, "task_dir": str(write_task(tmp_path / "tasks")), "out": str(out), **args}
    run_script(_SCRIPT, args, tmp_path)
    return json.loads(out.read_text())
