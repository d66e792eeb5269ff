"""``LLM(..., speculative_eagle_topk=K, speculative_num_draft_tokens=N)``: the engine drafts and
verifies EAGLE-2 trees (torch reference, eager). Greedy output equals plain greedy output on the
trained tiny pair, alone and batched, in fp32 and bf16 (a tree node's attention sums the chain's
keys in the chain's tiles: its logits are the chain's bits), with more accepted tokens per verify
than the chain."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.errors import UsageError
from eagle3.runtime.engine.config import EngineConfig
from eagle3.runtime.sampling import SamplingParams
from eagle3.testing import tiny, trained
from tests.runtime.model_kit import single_thread

TARGET, DRAFT = trained.NAME, "kimi-k2.5-trained-eagle3"
EXEMPLAR, QUESTIONS = trained.EXEMPLAR, trained.QUESTIONS
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
ENGINE = {"num_blocks": 128, "max_num_seqs": 4, "tokenizer": None, "dtype": "float32", "block_size": 4}

_threads = pytest.fixture(scope="module", autouse=True)(single_thread)


MLA_DRAFT = "kimi-k2.5-trained-eagle3.1-mla"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llmtree") / "tiny"
    tiny.make_tiny(out, only=[TARGET, DRAFT, MLA_DRAFT])
    return out


def _prompts() -> list[list[int]]:
    tok = tiny.build_tokenizer()
    return [tok.encode(trained.gsm8k_style_prompt(q)).ids for q in QUESTIONS]


@pytest.fixture(scope="module")
def target(pair: Path):
    """The trained target in fp32, loaded once for the module's in-process engines (each engine
    keeps its KV cache in its own runner); the served, CLI and TP=2 engines load it themselves."""
    import torch

    from eagle3.runtime.loader import load_target

    return load_target(pair / TARGET, dtype=torch.float32)


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    from eagle3.runtime.engine.llm import LLM

    return [o.token_ids for o in LLM(target, None, **ENGINE).generate(_prompts(), GREEDY)]


def _run(target, pair: Path, prompts: list[list[int]], **kw) -> tuple[list[list[int]], float]:
    from eagle3.runtime.engine.llm import LLM

    llm = LLM(target, pair / DRAFT, num_speculative_tokens=3, **ENGINE, **kw)
    outs = llm.generate(prompts, GREEDY)
    return [o.token_ids for o in outs], llm.stats.mean_acceptance_length


def test_tree_engine_greedy_equals_plain_greedy(target, pair: Path, plain: list[list[int]]) -> None:
    chain, chain_len = _run(target, pair, _prompts())
    tree, tree_len = _run(target, pair, _prompts(), speculative_eagle_topk=4, speculative_num_draft_tokens=16)
    assert chain == plain
    assert tree == plain
    assert tree_len > chain_len > 1.5  # measured: 3.29 (chain, k = 3) vs 3.86 (K = 4, N = 16)


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llmtreebf16") / "tiny"
    tiny.make_tiny(out, only=[TARGET, DRAFT, MLA_DRAFT])
    return out


def _pen_prompts() -> list[list[int]]:
    """Questions on which trees summing their ancestors' keys in node-order tiles (before the
    virtual key positions) left plain greedy in bf16: the EAGLE-3 draft at K=2, N=16 from token
    105 of the first, the MLA draft at K=4, N=16 from token 78 of the first and 34 of the second."""
    tok = tiny.build_tokenizer()
    qs = [f"{name} has {3 + i * 7} boxes with {5 + i * 3} pens in each box. She gives away {i + 2} pens. "
          "How many pens are left?" for i, name in ((0, "Tom"), (2, "Sam"))]
    return [tok.encode(trained.gsm8k_style_prompt(q)).ids for q in qs]


BF16_ENGINE = dict(ENGINE, dtype="bfloat16")
BF16_GREEDY = SamplingParams(temperature=0.0, max_tokens=112, ignore_eos=True)


@pytest.fixture(scope="module")
def bf16_target(bf16_pair: Path):
    import torch

    from eagle3.runtime.loader import load_target

    return load_target(bf16_pair / TARGET, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def bf16_plain(bf16_target) -> list[list[int]]:
    """Plain greedy in bf16, once for every tree shape below."""
    from eagle3.runtime.engine.llm import LLM

    prompts = _prompts() + _pen_prompts()
    return [o.token_ids for o in LLM(bf16_target, None, **BF16_ENGINE).generate(prompts, BF16_GREEDY)]


@pytest.mark.parametrize(("draft", "topk", "nodes"), [(DRAFT, 4, 8), (DRAFT, 2, 16), (MLA_DRAFT, 4, 16)])
def test_tree_engine_greedy_equals_plain_greedy_in_bf16(bf16_target, bf16_pair: Path, bf16_plain: list[list[int]],
                                                        draft: str, topk: int, nodes: int) -> None:
    """bf16, where a rounding difference in a node's logits can flip a near tie: the tree's tokens
    are still plain greedy's, every one (the node rows are the chain's bits, not close to them)."""
    from eagle3.runtime.engine.llm import LLM

    prompts = _prompts() + _pen_prompts()
    llm = LLM(bf16_target, bf16_pair / draft, num_speculative_tokens=3, speculative_eagle_topk=topk,
              speculative_num_draft_tokens=nodes, **BF16_ENGINE)
    assert [o.token_ids for o in llm.generate(prompts, BF16_GREEDY)] == bf16_plain
    assert llm.stats.mean_acceptance_length > 1.5


def test_a_tree_request_alone_equals_batched(target, pair: Path, plain: list[list[int]]) -> None:
    alone, _ = _run(target, pair, _prompts()[1:2], speculative_eagle_topk=2, speculative_num_draft_tokens=7)
    assert alone == plain[1:2]


def test_tree_options_are_checked() -> None:
    assert EngineConfig(num_speculative_tokens=3, speculative_eagle_topk=4).tree == (4, 13)
    assert EngineConfig(num_speculative_tokens=3).tree is None
    with pytest.raises(UsageError, match="auto"):
        EngineConfig(num_speculative_tokens="auto", speculative_eagle_topk=2)
    with pytest.raises(UsageError, match="speculative_num_draft_tokens"):
        EngineConfig(num_speculative_tokens=3, speculative_eagle_topk=2, speculative_num_draft_tokens=65)
    with pytest.raises(UsageError, match="speculative_num_draft_tokens"):
        EngineConfig(num_speculative_tokens=3, speculative_num_draft_tokens=8)


def test_tree_engine_under_preemption(target, pair: Path, plain: list[list[int]]) -> None:
    """A KV cache too small for the batch: sequences are preempted and recomputed mid-tree."""
    from eagle3.runtime.engine.llm import LLM

    engine = dict(ENGINE, num_blocks=72)
    llm = LLM(target, pair / DRAFT, num_speculative_tokens=3, speculative_eagle_topk=3,
              speculative_num_draft_tokens=10, **engine)
    outs = llm.generate(_prompts(), GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.num_preemptions for o in outs) > 0


def test_sampled_tree_request_does_not_depend_on_the_batch(target, pair: Path) -> None:
    """A seeded sampled request: the same tokens alone and batched (its randomness is its own;
    the trees and the target's logits are batch invariant)."""
    params = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=11)
    others = SamplingParams(temperature=0.7, max_tokens=24, ignore_eos=True)
    from eagle3.runtime.engine.llm import LLM

    def llm() -> LLM:
        return LLM(target, pair / DRAFT, num_speculative_tokens=3, speculative_eagle_topk=2,
                   speculative_num_draft_tokens=8, **ENGINE)

    prompts = _prompts()
    alone = llm().generate(prompts[:1], params)[0].token_ids
    batched = llm().generate(prompts, [params, others, others])[0].token_ids
    assert alone == batched and len(alone) == 24


@pytest.mark.parametrize(("name", "draft"), [(TARGET, MLA_DRAFT), ("kimi-k2.5", "kimi-k2.5-eagle3-d2t")])
def test_other_drafts_draft_trees(tmp_path_factory: pytest.TempPathFactory, target, pair: Path,
                                  plain: list[list[int]], name: str, draft: str) -> None:
    """The MLA EAGLE-3.1 draft (tree attention through the MLA layer) and a draft with its own
    vocabulary (d2t): greedy trees still give plain greedy output."""
    from eagle3.runtime.engine.llm import LLM

    prompts = _prompts()[:2]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    if name == TARGET:  # the module's pair: plain greedy's first 24 tokens are the reference's
        out, model, want = pair, target, [p[:24] for p in plain[:2]]
    else:
        out = tmp_path_factory.mktemp("llmtree2") / "tiny"
        tiny.make_tiny(out, only=[name, draft])
        model = out / name
        want = [o.token_ids for o in LLM(model, None, **ENGINE).generate(prompts, params)]
    llm = LLM(model, out / draft, num_speculative_tokens=3, speculative_eagle_topk=3,
              speculative_num_draft_tokens=9, **ENGINE)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.stats.num_drafts > 0


def test_served_tree_engine_answers_like_plain_greedy(pair: Path, plain: list[list[int]]) -> None:
    import httpx

    from eagle3.runtime.engine.config import EngineConfig
    from eagle3.serve.launcher import ServerThread, build_app, build_llm, engine_info

    cfg = EngineConfig(num_speculative_tokens=3, speculative_eagle_topk=2, speculative_num_draft_tokens=8,
                       num_blocks=96, max_num_seqs=4, dtype="float32", block_size=4)
    llm = build_llm(pair / TARGET, pair / DRAFT, cfg)
    assert engine_info(llm)["speculative_eagle_topk"] == 2
    with ServerThread(build_app(llm, "tiny", root=str(pair / TARGET))) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": _prompts()[0], "max_tokens": 40,
                                                       "temperature": 0, "ignore_eos": True},
                       trust_env=False, timeout=120)
    assert r.status_code == 200, r.text
    assert llm.stats.num_drafts > 0
    want = tiny.build_tokenizer().decode(plain[0])
    assert r.json()["choices"][0]["text"] == want


@pytest.mark.parametrize(("args", "message"), [
    (["--speculative-eagle-topk", "0"], "--speculative-eagle-topk must be an integer >= 1"),
    (["--speculative-eagle-topk", "2", "--engine", "vllm", "--dry-run"], "no MLA tree backend"),
])
def test_serve_tree_flag_errors(pair: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli_run import run_cli

    # in-process (the CLI's own entry point): a subprocess spent ~2-5 s importing before the check
    code, _, err = run_cli(["serve", str(pair / TARGET), "--draft", str(pair / DRAFT), *args], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_tree_engine_at_tensor_parallel_size_2(target, pair: Path, plain: list[list[int]]) -> None:
    """The workers get the tree metadata with the forward and compact their own KV copies (gloo on
    CPU, 2 ranks). TP=2 sums each layer's partials in another order than TP=1 (rounding only), so
    its tokens are TP=1's up to the first near tie (tests/runtime/test_tensor_parallel.py), not
    bit for bit; a tree whose accepted path were compacted wrongly on a rank parts from them at a
    clear margin."""

    from eagle3.runtime.engine.llm import LLM
    from eagle3.testing.numerics import FP32_ROUTER_TOL, assert_tokens_until_near_tie
    from tests.runtime.test_tensor_parallel import LOGITS_ATOL

    prompts = _prompts()[:2]
    llm = LLM(pair / TARGET, pair / DRAFT, num_speculative_tokens=3, speculative_eagle_topk=2,
              speculative_num_draft_tokens=8, tensor_parallel_size=2, **ENGINE)
    try:
        tree = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.stats.num_drafts > 0
    finally:
        llm.close()
    assert_tokens_until_near_tie(target, prompts, plain[:2], {"tp=2 tree": tree}, LOGITS_ATOL, FP32_ROUTER_TOL,
                                 "TP=2 trees vs TP=1 plain")


def test_tree_engine_with_a_small_token_budget(target, pair: Path, plain: list[list[int]]) -> None:
    """Chunked prefill alongside trees, and trees that do not fit the step's budget wait (a tree is
    verified whole or not at all)."""
    from eagle3.runtime.engine.llm import LLM

    engine = dict(ENGINE, max_num_batched_tokens=20)
    llm = LLM(target, pair / DRAFT, num_speculative_tokens=3, speculative_eagle_topk=3,
              speculative_num_draft_tokens=10, **engine)
    assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == plain
    assert llm.stats.num_drafts > 0


def test_bench_cli_runs_trees(pair: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from tests.cli_run import run_cli

    # in-process (the CLI's own entry point; its server runs on a thread): a subprocess spent
    # seconds importing before a bench of two short prompts
    report = tmp_path / "bench.json"
    code, out, err = run_cli(["bench", str(pair / TARGET), "--draft", str(pair / DRAFT), "--speculative-eagle-topk",
                              "2", "--speculative-num-draft-tokens", "7", "--input-len", "16", "--output-len", "8",
                              "--num-prompts", "2", "--dtype", "float32", "--report", str(report)], capsys)
    assert code == 0, out + err
    got = json.loads(report.read_text())
    assert got["speculative_eagle_topk"] == 2 and got["speculative_num_draft_tokens"] == 7


def test_tree_observability(target, pair: Path, plain: list[list[int]]) -> None:
    """The tree shape and the per-depth acceptance in stats_line(), /metrics and the validation
    report's speculative section (the chain's per-position counter is the tree's per-depth one)."""
    from eagle3.runtime.engine.llm import LLM
    from eagle3.serve.metrics import metrics_for
    from eagle3.validate import metrics_client
    from eagle3.validate.report import speculative_lines

    llm = LLM(target, pair / DRAFT, num_speculative_tokens=3, speculative_eagle_topk=2,
              speculative_num_draft_tokens=8, **ENGINE)
    metrics = metrics_for("tiny", llm)
    before = metrics.render().decode()
    assert [o.token_ids for o in llm.generate(_prompts()[:2], GREEDY)] == plain[:2]
    metrics.observe_engine(llm)
    stats = llm.stats
    # the accepted path has one node per depth: summed over depths, the counter is the accepted tokens
    assert stats.num_drafts > 0 and len(stats.accepted_per_pos) == 3
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    line = llm.stats_line()
    assert "tree K/S/N: 2/3/8" in line and "depth>=1/2/3: " in line
    assert llm.spec_shape == (2, 3, 8)

    after = metrics.render().decode()
    assert 'eagle3:spec_decode_shape{model_name="tiny",num_draft_tokens="8",num_steps="3",topk="2"} 1.0' in after
    delta = metrics_client.spec_delta(before, after)
    assert delta is not None and delta["shape"] == {"topk": 2, "num_steps": 3, "num_draft_tokens": 8}
    assert delta["accepted_per_pos"] == [float(x) for x in stats.accepted_per_pos]
    assert delta["mean_acceptance_length"] == pytest.approx(stats.mean_acceptance_length)
    lines = speculative_lines(delta)
    assert any(x.strip().startswith("tree topk 2, 3 steps, 8 tokens verified: depth>=1..3") for x in lines)


def test_chain_shape_metric(target, pair: Path) -> None:
    from eagle3.runtime.engine.llm import LLM
    from eagle3.serve.metrics import metrics_for
    from eagle3.validate import metrics_client

    llm = LLM(target, pair / DRAFT, num_speculative_tokens=3, **ENGINE)
    assert llm.spec_shape == (1, 3, 4) and "tree" not in llm.stats_line()
    text = metrics_for("tiny", llm).render().decode()
    assert metrics_client.parse_shape(text) == {"topk": 1, "num_steps": 3, "num_draft_tokens": 4}
    assert LLM(target, None, **ENGINE).spec_shape is None
