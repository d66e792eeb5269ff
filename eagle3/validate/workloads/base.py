"""The pieces every workload is made of: :class:`Item` (one prompt or conversation, all that is needed
to send it again), :class:`Workload` (items, their source, a scorer), :class:`Scores` (a scorer's
verdict) and :class:`LoadOptions` (what the workloads read from the command line)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.errors import UsageError

REQUEST_SEED = 1234  # lm-eval's TemplateAPI sends "seed": 1234 with every request; so do we, everywhere


@dataclass(frozen=True)
class Item:
    """One prompt (or conversation) of a workload."""

    id: str  # "<workload>/<id in its data set>": the same across runs of the same --task
    workload: str
    category: str | None  # MT-Bench's category, a FILE row's "category"; None: the workload has none
    prompt: str | None = None  # /v1/completions
    messages: tuple[dict[str, Any], ...] | None = None  # /v1/chat/completions (the first turn)
    followups: tuple[str, ...] = ()  # later user turns, each sent after the model's previous answer
    stop: tuple[str, ...] = ()
    max_tokens: int = 256
    doc: Any = None  # what the workload's scorer reads (a GSM8K Doc, a HumanEval problem, ...)

    @property
    def endpoint(self) -> str:
        return "/v1/completions" if self.prompt is not None else "/v1/chat/completions"

    @property
    def num_turns(self) -> int:
        return 1 + len(self.followups)

    def messages_for(self, answers: Sequence[str] = ()) -> list[dict[str, Any]]:
        """The conversation for turn ``len(answers)``: the first turn's messages, then for every
        earlier turn the model's answer and the next user turn (as MT-Bench's generation does)."""
        msgs = [dict(m) for m in self.messages or ()]
        for answer, user in zip(answers, self.followups, strict=False):
            msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": user}]
        return msgs

    def body(self, model: str | None, answers: Sequence[str] = ()) -> dict[str, Any]:
        """The request body for turn ``len(answers)`` (0: the first), greedy; not streamed
        (the client adds ``stream`` when it streams)."""
        if len(answers) >= self.num_turns:
            raise ValueError(f"{self.id} has {self.num_turns} turn(s)")
        body: dict[str, Any] = ({"prompt": self.prompt} if self.prompt is not None
                                else {"messages": self.messages_for(answers)})
        body.update(max_tokens=self.max_tokens, temperature=0.0)
        if self.stop:
            body["stop"] = list(self.stop)
        body["seed"] = REQUEST_SEED
        if model is not None:
            body["model"] = model
        return body


@dataclass
class Scores:
    """A scorer's verdict on one run: ``metrics`` go into the report as they are; ``per_item`` (one
    dict per item, or empty) into its samples; ``accuracy`` is the number ``--min-accuracy`` checks
    (None: this workload scores no accuracy) under the name ``accuracy_name``; ``errors``: what kept
    the scorer from judging (the report lists them as failures); ``correct``: per item, whether its
    answer counts as right (empty: not judged), what answer flips against a source compare."""

    metrics: dict[str, Any] = field(default_factory=dict)
    per_item: list[dict[str, Any]] = field(default_factory=list)
    accuracy: float | None = None
    accuracy_name: str | None = None
    errors: list[str] = field(default_factory=list)  # the scoring itself went wrong: failure lines
    correct: list[bool] = field(default_factory=list)  # per item (empty: not judged)


# answers[i][t]: item i's answer to turn t ("" for a failed request)
Scorer = Callable[[Sequence[Item], Sequence[Sequence[str]]], Scores]


@dataclass
class Workload:
    name: str  # "gsm8k", "humaneval", "mtbench", or a FILE.jsonl's file name
    items: list[Item]
    source: str  # where the data came from (the report says it)
    settings: dict[str, Any] = field(default_factory=dict)  # e.g. num_fewshot: into the report
    score: Scorer | None = None  # None: nothing to score (acceptance, speed and lossless only)

    def __post_init__(self) -> None:
        if not self.items:
            raise UsageError(f"{self.name}: no items to send")

    @property
    def has_categories(self) -> bool:
        return any(it.category is not None for it in self.items)

    def groups(self) -> list[tuple[str, list[int]]]:
        """``(category, item indices)`` in order of first appearance; one group named after the
        workload when it has no categories. Each group is run (and its /metrics read) on its own,
        so a server's global counters give per-category acceptance."""
        if not self.has_categories:
            return [(self.name, list(range(len(self.items))))]
        out: dict[str, list[int]] = {}
        for i, it in enumerate(self.items):
            out.setdefault(it.category if it.category is not None else "uncategorized", []).append(i)
        return list(out.items())

    @property
    def endpoints(self) -> list[str]:
        return sorted({it.endpoint for it in self.items})


@dataclass
class LoadOptions:
    """What the workloads read from the command line."""

    limit: int | None = None  # first N items (MT-Bench: first N questions of every category)
    max_tokens: int | None = None  # None: each workload's own default
    num_fewshot: int = 5  # gsm8k
    dataset: Path | str | None = None  # gsm8k: None (packaged), a directory or "hub"
    accuracy_filter: str = "strict-match"  # gsm8k: the filter --min-accuracy reads
    allow_code_execution: bool = False  # humaneval: run the tests of the completions (pass@1)
    echo: Callable[[str], None] | None = None  # progress lines (the code execution)
