"""Test engines and servers for the HTTP layer.

``ScriptedLLM`` implements the runtime LLM's incremental API (``add_request`` / ``step`` / ``abort`` /
``has_unfinished``, ``tokenizer``, ``max_model_len``, ``stats``, ``block_manager``) and answers with
text that is a function of the prompt, a few tokens per step. It lets the server, lm-eval and
eagle3's validator be compared on answers whose accuracy is known, in milliseconds.

``toy_llm`` is the real runtime engine (scheduler, paged KV, speculation) over the toy models of
:mod:`eagle3.testing.toy_models`, with the tiny Kimi tokenizer: real engine behaviour (KV blocks,
aborts, acceptance counters) without real model cost.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from eagle3.runtime.engine.llm import LLM, RequestOutput
from eagle3.runtime.spec.stats import SpecStats
from eagle3.testing.toy_models import ToyDraft, ToyTarget


def load_tiny_tokenizer(tiny_dir: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(tiny_dir / "kimi-k2.5"))


def toy_llm(tokenizer: Any, draft_mode: str | None = "noisy", k: int = 3, seed: int = 0, **kw: Any) -> LLM:
    target = ToyTarget(vocab_size=len(tokenizer), seed=seed)
    draft = ToyDraft(target, draft_mode) if draft_mode else None
    kw.setdefault("num_blocks", 1024)
    kw.setdefault("block_size", 16)
    return LLM(target, draft, num_speculative_tokens=k, tokenizer=tokenizer, **kw)


class _Blocks:
    num_blocks = 64
    block_size = 256

    def __init__(self) -> None:
        self.used = 0

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.used


class ScriptedLLM:
    """Answers ``respond(prompt_text)`` (then EOS), ``tokens_per_step`` tokens per step."""

    def __init__(self, tokenizer: Any, respond: Callable[[str], str], tokens_per_step: int = 3,
                 max_model_len: int = 8192) -> None:
        self.tokenizer = tokenizer
        self.respond = respond
        self.tokens_per_step = tokens_per_step
        self.max_model_len = max_model_len
        self.k = 0
        self.target = SimpleNamespace(vocab_size=len(tokenizer))
        self.stats = SpecStats(1)
        self.block_manager = _Blocks()
        self.requests_seen: list[list[int]] = []
        self._inbox: deque[tuple[str, Any]] = deque()
        self._running: dict[str, dict[str, Any]] = {}

    def add_request(self, prompt: Any, params: Any, request_id: str) -> str:
        ids = list(prompt) if not isinstance(prompt, str) else self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        self.requests_seen.append(ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        answer = self.tokenizer(self.respond(text), add_special_tokens=False)["input_ids"]
        if not params.ignore_eos:
            answer = answer + [self.tokenizer.eos_token_id]
        limit = params.max_tokens if params.max_tokens is not None else len(answer)
        self._inbox.append(("add", (request_id, ids, answer[:limit], "stop" if len(answer) <= limit else "length")))
        return request_id

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self._inbox or self._running)

    def step(self) -> list[RequestOutput]:
        outs = []
        while self._inbox:
            op, arg = self._inbox.popleft()
            if op == "add":
                rid, ids, answer, reason = arg
                self._running[rid] = {"prompt": ids, "answer": answer, "n": 0, "reason": reason}
                self.block_manager.used += 1
            elif arg in self._running:
                r = self._running.pop(arg)
                self.block_manager.used -= 1
                outs.append(self._out(arg, r, [], True, "abort"))
        for rid, r in list(self._running.items()):
            n0 = r["n"]
            r["n"] = min(n0 + self.tokens_per_step, len(r["answer"]))
            done = r["n"] == len(r["answer"])
            outs.append(self._out(rid, r, r["answer"][n0:r["n"]], done, r["reason"] if done else None))
            if done:
                del self._running[rid]
                self.block_manager.used -= 1
        return outs

    def _out(self, rid: str, r: dict[str, Any], new: list[int], finished: bool, reason: str | None) -> RequestOutput:
        ids = r["answer"][: r["n"]]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        prev = self.tokenizer.decode(ids[: len(ids) - len(new)], skip_special_tokens=True)
        return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=r["prompt"], token_ids=list(ids),
                             text=text, finished=finished, finish_reason=reason, new_token_ids=list(new),
                             new_text=text[len(prev):])


def gsm8k_oracle(gold: dict[str, str], wrong_every: int = 3) -> Callable[[str], str]:
    """A responder for GSM8K prompts: the gold answer for most questions, in a form that only
    one of the filters accepts for some, a wrong one for every ``wrong_every``-th, and a run-on
    "Question:" continuation that the server must cut at the stop string."""

    def respond(prompt: str) -> str:
        # plain prompts end "Answer:"; chat prompts have the template's (decoded) tail after it
        q = prompt.rsplit("Question:", 1)[-1].split("\nAnswer:")[0].strip()
        if q not in gold:
            return " I do not know."
        ans = gold[q]
        h = sum(map(ord, q))
        if h % wrong_every == 0:
            return f" The total is {int(ans.replace(',', '')) + 1}.\n#### {int(ans.replace(',', '')) + 1}\n\nQuestion: more 12"
        if h % wrong_every == 1:
            return f" So she has ${ans} left."  # flexible-extract only
        return f" Work it out: 2 + 2 = 4.\n#### {ans}\n\nQuestion: what is 99?"

    return respond
