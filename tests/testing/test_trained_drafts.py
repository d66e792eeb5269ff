"""The drafts shipped for ``kimi-k2.5-trained`` (trained with ``eagle3 train-draft``,
``scripts/train_tiny_drafts.py``): make-tiny writes them, the runtime accepts most of what they
propose on GSM8K-style prompts (a random draft of the same shape: ~0%), and speculative greedy
output equals plain greedy output, and the aux-layer convention matters: the same draft fed the target's
hidden states one layer off (the vLLM / SGLang convention mix-up) loses a large share of its
acceptance (the Llama draft fed one layer early: more than half)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eagle3.testing import tiny, trained
from tests.runtime.model_kit import single_thread

TARGET = trained.NAME

# GSM8K-style prompts of our own (lm-eval's exemplar format: one worked example, then a question).
EXEMPLAR = ("Question: Sam has 4 bags with 6 apples in each bag. He gives 5 apples to Tara. How many apples "
            "does Sam have left?\nAnswer: Sam has 4 * 6 = <<4*6=24>>24 apples.\nHe has 24 - 5 = <<24-5=19>>19 "
            "apples left.\n#### 19\n\n")
QUESTIONS = (
    "A shop sells pencils for $2 each. Anna buys 7 pencils and pays with a $20 bill. How much change does "
    "she get?",
    "Tom reads 12 pages every day. How many pages does he read in 3 weeks?",
    "A farmer has 45 cows. He sells a third of them and buys 8 more. How many cows does he have now?",
)
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from eagle3.cli import main

    out = tmp_path_factory.mktemp("pair") / "tiny"
    names = [TARGET, *trained.DRAFTS]
    cmd = ["make-tiny", str(out)]
    for n in names:
        cmd += ["--only", n]
    with pytest.raises(SystemExit) as e:  # the CLI in-process: a Python process would only add imports
        main(cmd)
    assert e.value.code in (0, None)
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, "manifest.json"])
    return out


_threads = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def target(pair: Path) -> Any:
    from eagle3.runtime.loader import load_target

    return load_target(pair / TARGET)


@pytest.fixture(scope="module")
def plain(target: Any) -> list[list[int]]:
    from eagle3.runtime.engine.llm import LLM

    return [o.token_ids for o in LLM(target, None, tokenizer=None).generate(_prompts(), _params())]


def _prompts() -> list[list[int]]:
    tok = tiny.build_tokenizer()
    return [tok.encode(f"{EXEMPLAR}Question: {q}\nAnswer:").ids for q in QUESTIONS]


def _params() -> Any:
    from eagle3.runtime.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _speculate(target: Any, draft_dir: Path,
               aux_layer_ids: tuple[int, ...] | None = None) -> tuple[dict[str, Any], list[list[int]]]:
    from eagle3.runtime.engine.llm import LLM
    from eagle3.runtime.loader import load_draft

    llm = LLM(target, load_draft(draft_dir, target, aux_layer_ids=aux_layer_ids), num_speculative_tokens=3,
              tokenizer=None)
    outs = llm.generate(_prompts(), _params())
    return llm.stats.as_dict(), [o.token_ids for o in outs]


def test_shipped_drafts_are_described() -> None:
    for name, sub in trained.DRAFTS.items():
        meta = trained.draft_meta(name)
        assert meta["target"] == TARGET and meta["command"][:2] == ["eagle3", "train-draft"]
        assert meta["heldout"]["lossless"] is True
        stage = meta.get("continued_from")  # the stage it was fine-tuned from (--init-from), if any
        if stage is not None:
            assert "--init-from" in meta["command"] and stage["command"][:2] == ["eagle3", "train-draft"]
        for f in trained.DRAFT_FILES:
            assert (trained.data_path(sub) / f).stat().st_size < trained.MAX_FILE_BYTES


@pytest.fixture(scope="module")
def speculated(pair: Path, target: Any) -> dict[str, tuple[dict[str, Any], list[list[int]]]]:
    """Each shipped draft served with its own aux layers, once: the lossless test and the aux-layer
    tests' reference acceptance read the same run."""
    return {name: _speculate(target, pair / name) for name in trained.DRAFTS}


@pytest.mark.parametrize("name", sorted(trained.DRAFTS))
def test_trained_draft_is_accepted_losslessly(speculated: dict[str, tuple[dict[str, Any], list[list[int]]]],
                                              plain: list[list[int]], name: str) -> None:
    stats, spec = speculated[name]
    assert spec == plain  # lossless: speculative greedy == plain greedy
    # a random draft of this shape is accepted ~0% (accept length 1.0)
    assert stats["mean_acceptance_length"] >= 2.0, stats


def _acceptance(target: Any, draft_dir: Path, aux_layer_ids: tuple[int, ...] | None = None) -> float:
    return _speculate(target, draft_dir, aux_layer_ids)[0]["acceptance_rate"]


# The largest share of its acceptance each draft may keep when served one layer off. The bar
# is half; on this 4-layer target only the Llama draft fed one layer early (which swaps in the token
# embedding) meets it. One layer late swaps the last aux state for the final layer's output, which
# predicts the next token at least as well (docs/trained_target.md, "The aux-layer convention").
# Measured on these prompts: Llama 0.76 -> 0.29 early / 0.42 late; MLA 0.78 -> 0.47 / 0.52.
KEEP = {("kimi-k2.5-trained-eagle3", -1): 0.5, ("kimi-k2.5-trained-eagle3", 1): 0.8,
        ("kimi-k2.5-trained-eagle3.1-mla", -1): 0.8, ("kimi-k2.5-trained-eagle3.1-mla", 1): 0.8}


@pytest.fixture(scope="module")
def right_acceptance(speculated: dict[str, tuple[dict[str, Any], list[list[int]]]]) -> dict[str, float]:
    return {name: stats["acceptance_rate"] for name, (stats, _) in speculated.items()}


@pytest.mark.parametrize(("name", "shift"), sorted(KEEP))
def test_aux_layer_ids_one_off_lose_acceptance(pair: Path, target: Any, right_acceptance: dict[str, float],
                                               name: str, shift: int) -> None:
    ids = tuple(i + shift for i in trained.AUX_LAYER_IDS)  # input-to-layer ids one layer early / late
    right, wrong = right_acceptance[name], _acceptance(target, pair / name, ids)
    assert right >= 0.5, right
    assert wrong <= KEEP[(name, shift)] * right, (name, ids, right, wrong)
