"""``--task gsm8k``: lm-eval's gsm8k task (prompts, stop strings, scoring: :mod:`eagle3.validate.gsm8k`)
as a workload. Items are ``gsm8k/<test index>``; the scorer gives strict-match and flexible-extract
exact match with their standard errors."""

from __future__ import annotations

from collections.abc import Sequence

from eagle3.validate import gsm8k
from eagle3.validate.workloads.base import Item, LoadOptions, Scores, Workload

NAME = "gsm8k"


def load(opts: LoadOptions) -> Workload:
    train, test = gsm8k.load_dataset(opts.dataset)
    prompts = gsm8k.build_prompts(train, test, opts.num_fewshot, opts.limit)
    max_tokens = opts.max_tokens or gsm8k.MAX_GEN_TOKS
    items = [Item(f"{NAME}/{i}", NAME, None, prompt=p, stop=gsm8k.STOP, max_tokens=max_tokens, doc=d)
             for i, (p, d) in enumerate(zip(prompts, test, strict=False))]
    return Workload(NAME, items, gsm8k.dataset_name(opts.dataset),
                    {"num_fewshot": opts.num_fewshot, "fewshot_seed": gsm8k.FEWSHOT_SEED},
                    score=lambda its, answers: score(its, answers, opts.accuracy_filter))


def score(items: Sequence[Item], answers: Sequence[Sequence[str]], accuracy_filter: str) -> Scores:
    scored = [gsm8k.score_one(a[0] if a else "", it.doc) for it, a in zip(items, answers, strict=True)]
    acc = gsm8k.accuracy(scored)
    per_item = [{"question": it.doc.question, "target": it.doc.answer.split("####")[-1].strip(),
                 "strict": s.strict, "flexible": s.flexible, "strict_correct": s.strict_correct,
                 "flexible_correct": s.flexible_correct} for it, s in zip(items, scored, strict=True)]
    attr = "strict_correct" if accuracy_filter == "strict-match" else "flexible_correct"
    return Scores({"accuracy": acc}, per_item, acc[accuracy_filter]["exact_match"],
                  f"exact_match ({accuracy_filter})", correct=[bool(getattr(s, attr)) for s in scored])
