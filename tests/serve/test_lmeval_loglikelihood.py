"""lm-eval's ``local-completions`` loglikelihood requests against ``eagle3 serve`` (the app on
loopback, the trained tiny pair with its chain draft), unchanged: ``echo: true``, ``logprobs: 1``,
``max_tokens: 1``, token-id prompts tokenized by the server's own ``/tokenize``
(``tokenizer_backend=remote``), two prompts per request.

The task is written here: the GSM8K copy eagle3 ships, each gold solution scored given its question
(``output_type: loglikelihood``, metrics ``acc``: the solution is the greedy continuation, and
``perplexity``). lm-eval's per-sample loglikelihoods must equal the server's own numbers for the
same tokens (echo with max_tokens 0) and the model's log_softmax (one independent prefill).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from eagle3.runtime.engine.llm import LLM
from eagle3.testing import trained
from eagle3.testing.numerics import forced_logits
from tests.serve.servers import serve_llm
from tests.validate import lmeval

TASK, LIMIT = "gsm8k_solution_ll", 4
pytestmark = pytest.mark.timeout(300)

# run with ``args`` defined (tests.validate.lmeval.run_script)
_SCRIPT = r"""
import json
import lm_eval
from lm_eval.tasks import TaskManager
tm = TaskManager(include_path=args["task_dir"], include_defaults=False)
res = lm_eval.simple_evaluate(model="local-completions", model_args=args["model_args"], tasks=[args["task"]],
                              task_manager=tm, limit=args["limit"], log_samples=True)
samples = sorted(res["samples"][args["task"]], key=lambda s: s["doc_id"])
json.dump({"results": res["results"][args["task"]],
           "samples": [{"doc_id": s["doc_id"], "arguments": s["arguments"], "resps": s["resps"], "acc": s["acc"]}
                       for s in samples]}, open(args["out"], "w"))
"""


def _write_task(task_dir: Path) -> None:
    data = lmeval.gsm8k_dir()
    task_dir.mkdir(parents=True, exist_ok=True)
    (task_dir / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        "dataset_name: null\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {data / 'test.jsonl'}\n"
        "test_split: test\n"
        "output_type: loglikelihood\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_target: "{{\' \' + answer}}"\n'
        "metric_list:\n"
        "  - metric: perplexity\n"
        "    aggregation: perplexity\n"
        "    higher_is_better: false\n"
        "  - metric: acc\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n")


def _run_lm_eval(tmp_path: Path, url: str) -> dict[str, Any]:
    lmeval.lm_eval_dir()  # skips without lm-eval
    _write_task(tmp_path / "tasks")
    out = tmp_path / "lmeval.json"
    args = {"task": TASK, "task_dir": str(tmp_path / "tasks"), "limit": LIMIT, "out": str(out),
            "model_args": f"base_url={url}/v1/completions,model=m,tokenizer_backend=remote,batch_size=2,"
                          "max_length=4096,max_retries=1"}
    lmeval.run_script(_SCRIPT, args, tmp_path, timeout=280)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def server(trained_pair: Path) -> Iterator[tuple[str, LLM, list[list[int]]]]:
    llm = LLM(trained_pair / trained.NAME, trained_pair / f"{trained.NAME}-eagle3", dtype="float32",
              num_speculative_tokens=3, num_blocks=256)
    seen: list[list[int]] = []
    add = llm.add_request

    def record(prompt: Any, params: Any = None, request_id: str | None = None) -> str:
        seen.append(list(prompt))
        return add(prompt, params, request_id)

    llm.add_request = record  # type: ignore[method-assign]
    with serve_llm(llm, "m") as url:
        yield url, llm, seen


def _context_and_target(arguments: Any) -> tuple[str, str]:
    args = arguments[0] if isinstance(arguments, list) else next(iter(arguments.values()))
    return tuple(args) if isinstance(args, list) else (args["arg_0"], args["arg_1"])  # type: ignore[return-value]


def test_lm_eval_loglikelihood_equals_the_servers_numbers(server: Any, tmp_path: Path) -> None:
    url, llm, seen = server
    theirs = _run_lm_eval(tmp_path, url)
    assert len(theirs["samples"]) == LIMIT and len(seen) == LIMIT  # one engine request per document
    assert 0 <= theirs["results"]["acc,none"] <= 1 and theirs["results"]["perplexity,none"] > 1
    target = llm.target
    c = httpx.Client(base_url=url, trust_env=False, timeout=120)
    for s in theirs["samples"]:
        context, continuation = _context_and_target(s["arguments"])
        ctx = c.post("/tokenize", json={"prompt": context}).json()["tokens"]
        whole = c.post("/tokenize", json={"prompt": context + continuation}).json()["tokens"]
        assert whole in seen  # lm-eval sent exactly these tokens (context + solution)
        lp = c.post("/v1/completions", json={"model": "m", "prompt": whole, "echo": True, "max_tokens": 0,
                                             "logprobs": 1, "return_tokens_as_token_ids": True}).json()
        lp = lp["choices"][0]["logprobs"]
        ours = sum(lp["token_logprobs"][len(ctx):])
        greedy = all(v == max(top.values()) for v, top in
                     zip(lp["token_logprobs"][len(ctx):], lp["top_logprobs"][len(ctx):], strict=True))
        ll, is_greedy = s["resps"][0][0]
        assert float(ll) == ours and bool(is_greedy) == greedy == bool(s["acc"]), (s["doc_id"], ll, ours)
        ref = forced_logits(target, whole).log_softmax(-1)[len(ctx) - 1: -1]
        want = ref.gather(1, torch.tensor(whole[len(ctx):])[:, None]).sum().item()
        assert ours == pytest.approx(want, abs=1e-4)  # ~100 tokens, each within fp32 rounding
