"""Tree drafting with the tiny EAGLE-3 draft of the tiny Kimi-K2.5 target (fp32, torch reference):
K = 1 is the chain proposer's greedy chain bit for bit, and every expanded node's draft
distribution equals the one of its path drafted as a chain, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.runtime.engine.config import EngineConfig
from eagle3.runtime.engine.model_runner import ModelRunner
from eagle3.runtime.engine.sequence import Sequence
from eagle3.runtime.engine.tree_driver import tree_generate
from eagle3.runtime.sampling import SamplingParams
from eagle3.runtime.spec.proposer import ProposeItem
from eagle3.runtime.spec.tree import check_parents, path
from eagle3.runtime.spec.tree_proposer import draft_tree
from tests.runtime.model_kit import single_thread

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=64)

_threads = pytest.fixture(scope="module", autouse=True)(single_thread)


def _pair(tmp_path_factory: pytest.TempPathFactory, target: str, draft: str):
    """(target, draft) of make-tiny's ``target`` and ``draft``, loaded in fp32."""
    from eagle3.runtime.loader import load_draft, load_target
    from eagle3.testing.tiny import make_tiny

    out: Path = tmp_path_factory.mktemp("treedraft") / "tiny"
    paths = make_tiny(out, seed=0, only=[target, draft])
    t = load_target(paths[target], dtype=torch.float32)
    return t, load_draft(paths[draft], t)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    return _pair(tmp_path_factory, "kimi-k2.5", "kimi-k2.5-eagle3")


class _Setup:
    """A prompt prefilled on the target, its greedy next token (the root), and draft step 0."""

    def __init__(self, models, prompt_len: int, k_chain: int, seed: int) -> None:
        target, draft = models
        self.runner = ModelRunner(target, draft, EngineConfig(num_speculative_tokens=k_chain, block_size=BLOCK), 32)
        g = torch.Generator().manual_seed(seed)
        self.prompt = torch.randint(0, 768, (prompt_len,), generator=g).tolist()
        self.table = list(range(16))
        hidden, self.aux = self.runner.forward_target(torch.tensor(self.prompt), [self.table], [0], [prompt_len])
        self.root = int(target.compute_logits(hidden[-1:]).argmax())
        self.draft = draft
        self.vocab = target.vocab_size

    def step0(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(self.prompt[1:] + [self.root])
        post, nxt = self.runner.forward_draft(ids, self.draft.combine_aux(self.aux), [self.table], [0],
                                              [len(self.prompt)])
        return post[-1:], nxt[-1:]

    def kv(self) -> torch.Tensor:
        return self.runner.draft_kv[0]

    def tree(self, topk: int, steps: int, num_nodes: int, keep: bool = False):
        post, nxt = self.step0()
        return draft_tree(self.draft, self.runner.forward_draft_tree, torch.tensor([self.root]), post, nxt,
                          [len(self.prompt) - 1], [self.table], topk, steps, num_nodes, self.vocab if keep else None)


def test_topk_one_is_the_chain_proposer(models) -> None:
    k = 4
    st = _Setup(models, prompt_len=9, k_chain=k, seed=0)
    seq = Sequence("r", st.prompt, GREEDY, None, k)
    seq.block_table = st.table
    item = ProposeItem(seq, 0, st.prompt[1:] + [st.root], st.aux, k)
    assert st.runner.proposer is not None
    chain = st.runner.proposer.propose([item], st.vocab)[0]
    assert chain is not None
    tree = st.tree(topk=1, steps=k, num_nodes=k + 1)
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 3]]
    assert tree.tokens[0, 1:].tolist() == chain.token_ids


@pytest.fixture(scope="module")
def mla_draft(tmp_path_factory: pytest.TempPathFactory):
    """The trained tiny target with its MLA EAGLE-3.1 draft (tree attention through MLA)."""
    return _pair(tmp_path_factory, "kimi-k2.5-trained", "kimi-k2.5-trained-eagle3.1-mla")


@pytest.mark.parametrize("pair", ["models", "mla_draft"])
def test_every_expanded_node_matches_its_path_drafted_as_a_chain(request: pytest.FixtureRequest, pair: str) -> None:
    st = _Setup(request.getfixturevalue(pair), prompt_len=10, k_chain=3, seed=1)
    # every candidate (3 + 9 + 9): the random tiny draft is nearly uniform, so a smaller tree
    # would keep only shallow nodes
    n = 22
    tree = st.tree(topk=3, steps=3, num_nodes=n, keep=True)
    check_parents(tree.parents)
    assert tree.draft_probs is not None and tree.depth.max() == 3
    expanded = [i for i in range(n) if bool(tree.draft_probs[0, i].sum() > 0)]
    assert len(expanded) == 1 + 3 + 3 and any(int(tree.depth[0, i]) == 2 for i in expanded)
    d2t = st.draft.to_target_ids(torch.arange(st.draft.vocab_size)).to(torch.int64)
    root_pos = len(st.prompt) - 1
    for i in expanded:
        post, nxt = st.step0()
        for depth, node in enumerate(path(tree.parents[0], i)[1:], start=1):
            meta = st.runner.meta([st.table], [root_pos + depth], [1])
            post, nxt = st.draft.forward(tree.tokens[0, node: node + 1], nxt, meta, st.kv())
        q = torch.zeros(st.vocab)
        # the builder's own arithmetic (log-softmax, clamped, exponentiated) on the chain's logits
        q[d2t] = st.draft.compute_logits(post)[0].float().log_softmax(-1).clamp_max(0.0).exp()
        assert torch.equal(tree.draft_probs[0, i], q), i


@pytest.fixture(scope="module")
def trained_pair(tmp_path_factory: pytest.TempPathFactory):
    """The trained tiny target and its EAGLE-3 draft: drafts are accepted, so trees are walked."""
    from eagle3.runtime.loader import load_draft, load_target
    from eagle3.testing.tiny import make_tiny

    out: Path = tmp_path_factory.mktemp("treetrained") / "tiny"
    paths = make_tiny(out, seed=0, only=["kimi-k2.5-trained", "kimi-k2.5-trained-eagle3"])
    target = load_target(paths["kimi-k2.5-trained"], dtype=torch.float32)
    return target, load_draft(paths["kimi-k2.5-trained-eagle3"], target)


def _gsm8k_prompt() -> list[int]:
    from eagle3.testing import tiny, trained

    text = trained.gsm8k_style_prompt(trained.QUESTIONS[0])
    return tiny.build_tokenizer().encode(text).ids


@pytest.mark.parametrize(("pair", "topk", "steps", "nodes"),
                         [("random", 3, 3, 8), ("trained", 1, 3, 4), ("trained", 3, 3, 10), ("trained", 2, 4, 12)])
def test_greedy_tree_generation_equals_plain_greedy(request: pytest.FixtureRequest, pair: str, topk: int, steps: int,
                                                    nodes: int) -> None:
    """The whole target + draft tree loop (engine/tree_driver.py): greedy output is the target's,
    with drafts accepted along real branches (the trained pair)."""
    target, draft = request.getfixturevalue("models" if pair == "random" else "trained_pair")
    prompt = _gsm8k_prompt() if pair == "trained" else torch.randint(0, 768, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    blocks = -(-(len(prompt) + 64) // BLOCK)
    plain = ModelRunner(target, None, EngineConfig(block_size=BLOCK), blocks)
    want = _plain_greedy(plain, prompt, 24)
    runner = ModelRunner(target, draft, EngineConfig(num_speculative_tokens=steps, block_size=BLOCK), blocks)
    run = tree_generate(runner, prompt, 24, topk, steps, nodes)
    assert run.token_ids == want
    assert all(0 <= a <= steps for a in run.accepted)
    if pair == "trained":
        assert max(run.accepted) >= 2 and run.mean_acceptance_length > 1.5


def _plain_greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    table = list(range(runner.num_blocks))
    hidden, _ = runner.forward_target(torch.tensor(prompt), [table], [0], [len(prompt)])
    out = [int(runner.target.compute_logits(hidden[-1:]).argmax())]
    while len(out) < n:
        hidden, _ = runner.forward_target(torch.tensor(out[-1:]), [table], [len(prompt) + len(out) - 1], [1])
        out.append(int(runner.target.compute_logits(hidden).argmax()))
    return out


def test_sampled_tree_generation_is_reproducible_per_seed(trained_pair) -> None:
    """Sampled decoding (point-mass tree verification): a seed fixes the output; tokens are valid."""
    target, draft = trained_pair
    prompt = _gsm8k_prompt()
    blocks = -(-(len(prompt) + 64) // BLOCK)

    def run(seed: int) -> list[int]:
        runner = ModelRunner(target, draft, EngineConfig(num_speculative_tokens=3, block_size=BLOCK), blocks)
        return tree_generate(runner, prompt, 16, 3, 3, 10, SamplingParams(temperature=0.8, seed=seed)).token_ids

    first = run(7)
    assert first == run(7) and len(first) == 16
    assert all(0 <= t < target.vocab_size for t in first)
