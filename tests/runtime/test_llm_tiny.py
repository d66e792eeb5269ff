"""The LLM API on the tiny Kimi-K2.5 target with every draft fixture and weight format.

The invariant: greedy output with speculation is token-for-token the output without it, for
every batch size, k, draft and format, across KV block boundaries and preemption. Each axis value
appears at least once; the cross product is deliberately not run (runtime). References are plain
greedy runs at batch 8, so a speculative run at batch 1 or 3 also checks batch invariance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.runtime.engine.llm import LLM
from eagle3.runtime.interfaces import default_aux_layer_ids
from eagle3.runtime.sampling import SamplingParams
from eagle3.testing.toy_models import ReplayDraft
from tests.runtime.model_kit import single_thread

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Compute dtype per format: the dequantized-bf16 checkpoint also runs in bf16 (the real models'
# dtype); the others in fp32, which this CPU (AVX2, no native bf16) runs ~10x faster.
DTYPES = {"int4": torch.float32, "bf16": torch.bfloat16, "w4a8": torch.float32, "mxfp4": torch.float32}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 768, (n,), generator=g).tolist() for n in (3, 11, 6, 19, 4, 8, 14, 5)]


PROMPTS = _prompts()


_threads = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def variants(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny target in each weight format: INT4 experts as shipped (compressed-tensors), bf16
    (dequantized by ``convert``), Quark W4A8 and MXFP4 (``quantize``, native engine)."""
    from eagle3.convert.target import TargetOptions, convert_target
    from eagle3.quantize import pipeline

    src = tiny_dir / "kimi-k2.5"
    out = tmp_path_factory.mktemp("formats")
    convert_target(src, out / "bf16", TargetOptions(dequantize="bf16", progress=False))
    for recipe in ("w4a8", "mxfp4"):
        pipeline.quantize(str(src), out / recipe, recipe, None, workers=1, engine="native", verify=False,
                          progress=False)
    return {"int4": src, "bf16": out / "bf16", "w4a8": out / "w4a8", "mxfp4": out / "mxfp4"}


class _Models:
    """Loaded targets and plain-greedy references, shared by the module's tests."""

    def __init__(self, variants: dict[str, Path]) -> None:
        self.variants = variants
        self.targets: dict[str, object] = {}
        self.refs: dict[str, list[list[int]]] = {}

    def target(self, fmt: str):
        if fmt not in self.targets:
            from eagle3.runtime.loader import load_target

            self.targets[fmt] = load_target(self.variants[fmt], dtype=DTYPES[fmt])
        return self.targets[fmt]

    def reference(self, fmt: str) -> list[list[int]]:
        """Plain greedy outputs, run at the largest batch any test uses with ``fmt``."""
        if fmt not in self.refs:
            n = REF_BATCH[fmt]
            llm = LLM(self.target(fmt), None, tokenizer=None, num_blocks=64, max_num_seqs=8)
            self.refs[fmt] = [o.token_ids for o in llm.generate(PROMPTS[:n], GREEDY)]
        return self.refs[fmt]


@pytest.fixture(scope="module")
def models(variants: dict[str, Path]) -> _Models:
    return _Models(variants)


def _check(llm: LLM, prompts: list[list[int]], expected: list[list[int]]) -> list:
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    return outs


CASES = [  # (format, draft, k, batch, engine kwargs)
    ("int4", "kimi-k2.5-eagle3", 1, 1, {}),
    ("int4", "kimi-k2.5-eagle3-d2t", 3, 3, {"block_size": 2}),
    ("int4", "kimi-k2.6-eagle3.1-mla", 5, 8, {"block_size": 4, "num_blocks": 16}),  # preemption
    ("int4", "speculators-eagle3", 3, 8, {"max_num_batched_tokens": 16}),  # chunked prefill
    ("bf16", "kimi-k2.5-eagle3-d2t", 5, 3, {}),
    ("w4a8", "kimi-k2.5-eagle3", 3, 3, {"block_size": 4, "num_blocks": 10}),  # preemption
    ("mxfp4", "kimi-k2.6-eagle3.1-mla", 1, 3, {"block_size": 2}),
    ("bf16", "speculators-eagle3", 3, 1, {}),
]


REF_BATCH = {"int4": 8, "bf16": 8, "w4a8": 3, "mxfp4": 3}


@pytest.mark.parametrize(("fmt", "draft", "k", "batch", "kw"), CASES,
                         ids=[f"{c[0]}-{c[1]}-k{c[2]}-b{c[3]}" for c in CASES])
def test_speculative_greedy_equals_plain_greedy(models: _Models, tiny_dir: Path, fmt: str, draft: str, k: int,
                                                batch: int, kw: dict) -> None:
    kw = {"num_blocks": 128, "block_size": 16, **kw}
    llm = LLM(models.target(fmt), tiny_dir / draft, num_speculative_tokens=k, tokenizer=None,
              max_num_seqs=8, **kw)
    outs = _check(llm, PROMPTS[:batch], models.reference(fmt)[:batch])
    assert llm.stats.num_drafts > 0
    if kw["num_blocks"] < 64:
        assert sum(o.num_preemptions for o in outs) > 0


def _replay(models: _Models, fmt: str, corrupt_every: int) -> ReplayDraft:
    target = models.target(fmt)
    seqs = [p + r for p, r in zip(PROMPTS, models.reference(fmt), strict=False)]
    return ReplayDraft(seqs, target.vocab_size, default_aux_layer_ids(target.num_layers), corrupt_every)


def test_perfect_draft_is_fully_accepted_on_the_real_target(models: _Models) -> None:
    """Drafts that are the target's own greedy tokens: every one accepted, output unchanged,
    i.e. the KV the target wrote for accepted drafts is kept and right."""
    k = 3
    llm = LLM(models.target("int4"), _replay(models, "int4", 0), num_speculative_tokens=k, tokenizer=None,
              num_blocks=64, block_size=4)
    _check(llm, PROMPTS[:3], models.reference("int4")[:3])
    assert llm.stats.acceptance_rate == 1.0
    assert llm.stats.accepted_hist[k] > 0 and llm.num_steps <= 1 + -(-(MAX_TOKENS - 1) // (k + 1))


def test_partly_wrong_draft_changes_nothing(models: _Models) -> None:
    llm = LLM(models.target("bf16"), _replay(models, "bf16", 3), num_speculative_tokens=5, tokenizer=None,
              num_blocks=30, block_size=2, max_num_seqs=8)
    outs = _check(llm, PROMPTS, models.reference("bf16"))
    assert 0.0 < llm.stats.acceptance_rate < 1.0
    assert sum(o.num_preemptions for o in outs) > 0


def test_text_prompts_from_checkpoint_paths(tiny_dir: Path) -> None:
    """Paths in, text out: loader, AutoTokenizer from the target directory, EOS from its
    generation config; seeded sampling gives the same text alone and in a batch."""
    llm = LLM(tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.5-eagle3", num_speculative_tokens=2, dtype="bfloat16",
              num_blocks=64)
    assert llm.tokenizer is not None and llm.eos_ids
    prompts = ["The capital of France is", "Question: what is 12 + 30? Answer:"]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, seed=11)
    both = llm.generate(prompts, seeded)
    alone = llm.generate(prompts[1], seeded)[0]
    assert alone.token_ids == both[1].token_ids
    for o in both:
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert o.prompt is not None and o.finish_reason in ("stop", "length")
    assert "acceptance:" in llm.stats_line()


def test_streamed_text_deltas_add_up_to_the_final_text(models: _Models, tiny_dir: Path) -> None:
    """Incremental detokenization: the deltas ``step()`` hands out (the server streams them)
    concatenate to the final text, which is one exact decode; the random tiny model emits plenty
    of partial UTF-8 byte tokens to trip over."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir / "kimi-k2.5")
    llm = LLM(models.target("int4"), tiny_dir / "kimi-k2.5-eagle3", num_speculative_tokens=3, tokenizer=tok,
              num_blocks=64)
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=3, ignore_eos=True)
    rids = [llm.add_request(p, params) for p in PROMPTS[:3]]
    streamed = dict.fromkeys(rids, "")
    final = {}
    while llm.has_unfinished():
        for o in llm.step():
            streamed[o.request_id] += o.new_text
            if o.finished:
                final[o.request_id] = o
    for r in rids:
        assert final[r].text == tok.decode(final[r].token_ids, skip_special_tokens=True)
        assert streamed[r] == final[r].text
    assert all(final[r].text for r in rids)
