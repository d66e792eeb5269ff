"""``eagle3 quantize SRC OUT --recipe R --eval``: a quantized target measured against its source
before the output is published.

The two passes of ``eagle3 serve OUT --validate gsm8k --reference SRC`` (:mod:`eagle3.validate.twopass`),
with the bundled runtime and one model loaded at a time: SRC is served and its greedy continuations
of held-out prompts (lm-eval's GSM8K ``fewshot``-shot prompts of the first ``prompts`` test problems,
never training data) recorded with their top-N log-probabilities; then the finished output (still
``OUT.partial``) is served and every recorded prompt + continuation teacher-forced through it. The
comparison (:func:`eagle3.validate.reference.compare`: mean / p99 KLD per token, top-1 agreement,
identical continuations and the first divergence) goes into ``quantization_report.json`` as
``fidelity``, so ``manifest.json`` covers it, and ``eagle3 quantize`` prints it in one line
(:func:`eagle3.quantize.report.fidelity_line`). It lives beside the server it runs (the quantizer
imports nothing of ``serve``): the CLI hands it to :func:`eagle3.quantize.quantize` as its ``check``.

Only the comparison runs: no speculative validation, no answer scoring (the served model is forced
along the source's tokens, it generates nothing of its own). The defaults (8 prompts x 64 tokens)
take well under a minute on the tiny target; the numbers in docs/recipes.md use 24 x 96, as
``serve --validate --limit 24 --max-tokens 96`` does.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.errors import UsageError

DEFAULT_PROMPTS = 8
DEFAULT_TOKENS = 64


@dataclass(frozen=True)
class FidelityCheck:
    prompts: int = DEFAULT_PROMPTS
    tokens: int = DEFAULT_TOKENS
    fewshot: int = 5
    logprobs: int = 20
    dataset: Path | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    echo: Callable[[str], None] | None = field(default=None, repr=False, compare=False)

    section = "fidelity"  # the report key
    role = "target"  # what SRC must be

    def wrong_role(self, src: Path) -> str:
        return (f"--eval: {src} is not a target (a quantized target is compared with its source; a draft's "
                f"acceptance beside a target is --target T)")

    def check(self) -> None:
        """Before anything is quantized: the numbers are sane."""
        for name, v, lo in (("--eval-prompts", self.prompts, 1), ("--eval-tokens", self.tokens, 1),
                            ("--eval-fewshot", self.fewshot, 0)):
            if v < lo:
                raise UsageError(f"{name} must be >= {lo}, got {v}")
        from eagle3.runtime.engine.config import EngineConfig

        EngineConfig(dtype=self.dtype, device=self.device)  # one line for a bad dtype

    def __call__(self, src: Path, out: Path) -> dict[str, Any]:
        return measure_fidelity(self, Path(src), Path(out))


def measure_fidelity(c: FidelityCheck, src: Path, out: Path) -> dict[str, Any]:
    """Record ``src`` on the held-out prompts, teacher-force ``out`` along it, compare."""
    from eagle3 import validate
    from eagle3.runtime.engine.config import EngineConfig
    from eagle3.serve import launcher
    from eagle3.validate import gsm8k, twopass
    from eagle3.validate import reference as refmod

    t0 = time.perf_counter()
    echo = c.echo or (lambda s: None)
    vopts = validate.ValidateOptions(task="gsm8k", limit=c.prompts, num_fewshot=c.fewshot, max_tokens=c.tokens,
                                     dataset=c.dataset, echo=echo)
    prep = validate.prepare(vopts)
    vopts.logprobs = c.logprobs  # N of both passes (set after the options' check, which ties it to --reference)
    eopts = EngineConfig(dtype=c.dtype, device=c.device)
    with tempfile.TemporaryDirectory(prefix="eagle3-eval-") as tmp:
        path = Path(tmp) / "reference.jsonl.gz"
        launcher.record_reference(src, None, eopts, vopts, path, model_name=src.resolve().name, prep=prep,
                                  echo=echo)
        loaded = twopass.load(path, prep, vopts)
        forced = launcher.teacher_force_reference(out, eopts, vopts, loaded, prep, model_name="quantized",
                                                  echo=echo)
    parts = []
    for w, turns, served in zip(prep.workloads, loaded.turns, forced.served, strict=True):
        refs = [r for ts in turns for r in ts]
        parts.append(refmod.WorkloadComparison(w.name, refs, served, [None] * len(w.items), [None] * len(w.items)))
    block = refmod.compare(loaded.ref, "(recorded by this run)", parts, {}, refmod.Thresholds())
    keep = ("logprobs", "kld_method", "kld", "top1_agreement", "divergence", "kld_histogram", "thresholds",
            "failures", "passed")
    return {"source": str(src), "prompts": c.prompts, "tokens": c.tokens, "fewshot": c.fewshot,
            "data": f"lm-eval GSM8K {c.fewshot}-shot prompts of the first {c.prompts} test problems "
                    f"({gsm8k.dataset_name(c.dataset)}), the source's greedy continuation of up to {c.tokens} tokens",
            "device": c.device, "dtype": c.dtype, **{k: block[k] for k in keep},
            "seconds": round(time.perf_counter() - t0, 3)}
