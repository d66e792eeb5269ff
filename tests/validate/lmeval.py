"""Running lm-evaluation-harness offline from the tests (in a subprocess: lm-eval and datasets
read HF_* variables at import time, and must not leak them into the rest of the test session).

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
import shutil
import subprocess
import sys
import tempfile
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


_SCRIPT = r"""
import json, sys
args = json.loads(sys.argv[1])
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


def run(tmp_path: Path, **args: Any) -> dict[str, Any]:
    """Run lm-eval offline in a subprocess; returns what _SCRIPT wrote."""
    lm_eval_dir()
    out = tmp_path / f"lmeval-{args.get('mode', 'eval')}-{len(list(tmp_path.glob('lmeval-*')))}.json"
    args = {"task": TASK, "task_dir": str(write_task(tmp_path / "tasks")), "out": str(out), **args}
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               HF_UPDATE_DOWNLOAD_COUNTS="0", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
               OPENAI_API_KEY="", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(args)], env=env, capture_output=True, text=True,
                       timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())
