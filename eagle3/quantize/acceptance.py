"""``eagle3 quantize DRAFT OUT --recipe int4-draft|fp8-draft --target T``: what quantization costs the
draft where it counts, its acceptance beside the target it serves.

The source draft and the quantized one are each served by the runtime with ``T`` on the same
held-out prompts (lm-eval's GSM8K 5-shot prompts of the first test problems, never training data;
greedy, ``k`` speculative tokens; :mod:`eagle3.train.acceptance`), against one plain greedy run of
``T`` (the lossless check). The result goes into ``quantization_report.json`` as ``acceptance``
(``before``, ``after``, their ``ratio`` of mean accept lengths, ``T``'s fingerprint) before the
output is published, and ``eagle3 quantize`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.errors import UsageError


@dataclass(frozen=True)
class AcceptanceCheck:
    target: Path
    prompts: int = 24
    tokens: int = 96
    k: int = 3
    fewshot: int = 5
    dataset: Path | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    progress: bool = False

    section = "acceptance"  # the report key
    role = "draft"  # what SRC must be

    def wrong_role(self, src: Path) -> str:
        return f"--target: {src} is not an EAGLE draft (acceptance is measured for drafts; a target: --eval)"

    def check(self) -> None:
        """Before anything is quantized: the target is a model eagle3 loads, the numbers are sane."""
        from eagle3.formats.check import require_valid

        if not Path(self.target).is_dir():
            raise UsageError(f"--target {self.target}: not a checkpoint directory")
        require_valid(self.target)
        for name, v, lo in (("--eval-prompts", self.prompts, 1), ("--eval-tokens", self.tokens, 1),
                            ("--eval-k", self.k, 1), ("--eval-fewshot", self.fewshot, 0)):
            if v < lo:
                raise UsageError(f"{name} must be >= {lo}, got {v}")

    def __call__(self, src: Path, out: Path) -> dict[str, Any]:
        return measure_pair(self, src, out)


def measure_pair(c: AcceptanceCheck, src: Path, out: Path) -> dict[str, Any]:
    """The draft at ``src`` and its quantized copy at ``out``, each with ``c.target``."""
    import time

    from eagle3.runtime.engine.config import dtype_by_name
    from eagle3.runtime.loader import load_target
    from eagle3.runtime.tokenizer import load_tokenizer
    from eagle3.train import acceptance
    from eagle3.train.adapt import target_fingerprint

    t0 = time.perf_counter()
    target = load_target(c.target, dtype=dtype_by_name(c.dtype), device=c.device)
    tokenizer = load_tokenizer(c.target)
    if tokenizer is None:
        raise UsageError(f"--target {c.target}: no tokenizer beside its config (the held-out prompts are text)")
    prompts = acceptance.gsm8k_prompts(tokenizer, c.prompts, c.fewshot, c.dataset)
    plain = acceptance.plain_outputs(target, prompts, c.tokens, c.progress)

    def run(draft: Path, label: str) -> dict[str, Any]:
        return acceptance.measure(target, draft, prompts, k=c.k, max_tokens=c.tokens, plain=plain, label=label,
                                  progress=c.progress)

    before, after = run(src, "source"), run(out, "quantized")
    from eagle3.validate import gsm8k

    return {"target": target_fingerprint(c.target),
            "prompts": f"lm-eval GSM8K {c.fewshot}-shot prompts of the first {len(prompts)} test problems "
                       f"({gsm8k.dataset_name(c.dataset)})",
            "before": before, "after": after,
            "ratio": after["mean_acceptance_length"] / before["mean_acceptance_length"],
            "seconds": round(time.perf_counter() - t0, 3)}
