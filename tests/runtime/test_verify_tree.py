"""``ModelRunner.verify_tree`` on the tiny Kimi-K2.5 target (torch reference): one forward over
draft trees gives, for every node, the logits of its root-to-node path run as a chain bit for bit
(fp32 and bf16); a chain-shaped tree gives the ordinary verify forward's logits bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.runtime.engine.config import EngineConfig
from eagle3.runtime.engine.model_runner import ModelRunner, compact_tree_kv
from eagle3.runtime.sampling import SamplingBatch, SamplingParams
from eagle3.runtime.spec.tree import DraftTree, build_tree, depths, path
from eagle3.runtime.spec.tree_rejection import tree_rejection_sample
from tests.runtime.model_kit import single_thread

BLOCK = 4

_threads = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from eagle3.testing.tiny import make_tiny

    out: Path = tmp_path_factory.mktemp("tree") / "tiny"
    return make_tiny(out, seed=0, only=["kimi-k2.5"])["kimi-k2.5"]


@pytest.fixture(scope="module")
def target(tiny_path: Path):
    from eagle3.runtime.loader import load_target

    return load_target(tiny_path, dtype=torch.float32)


@pytest.fixture(scope="module")
def target_bf16(tiny_path: Path):
    from eagle3.runtime.loader import load_target

    return load_target(tiny_path, dtype=torch.bfloat16)


def _runner(target) -> ModelRunner:
    return ModelRunner(target, None, EngineConfig(block_size=BLOCK), 32)


def _prefill(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]]) -> list[int]:
    """Cache every prompt token but the last (the tree's root); returns the roots' positions."""
    ids = torch.tensor([t for p in prompts for t in p[:-1]])
    runner.forward_target(ids, tables, [0] * len(prompts), [len(p) - 1 for p in prompts])
    return [len(p) - 1 for p in prompts]


def _trees(roots: list[int], vocab: int, seed: int) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    b, k = len(roots), 3
    lps = [torch.randn(b, 1 if s == 0 else k, vocab, generator=g).log_softmax(-1) for s in range(3)]
    return build_tree(torch.tensor(roots), lps, topk=k, num_nodes=8)


@pytest.mark.parametrize("model", ["target", "target_bf16"])
def test_each_node_gets_its_path_logits(request: pytest.FixtureRequest, model: str) -> None:
    target = request.getfixturevalue(model)
    g = torch.Generator().manual_seed(0)
    # the second prompt puts the tree across the key tile boundary at 64: node-order and chain
    # positions of the deeper nodes fall into different key tiles
    prompts = [torch.randint(0, 768, (n,), generator=g).tolist() for n in (9, 62)]
    tables = [[0, 1, 2, 3, 4], list(range(5, 23))]
    runner = _runner(target)
    starts = _prefill(runner, prompts, tables)
    tree = _trees([p[-1] for p in prompts], 768, seed=1)
    logits, aux = runner.verify_tree(tree, tables, starts)
    assert logits.shape == (2, 8, target.vocab_size) and aux is None
    for b in range(2):
        for i in range(8):
            nodes = path(tree.parents[b], i)
            ids = tree.tokens[b, nodes]
            hidden, _ = runner.forward_target(ids, [tables[b]], [starts[b]], [len(nodes)])
            chain = target.compute_logits(hidden[-1:])[0]
            assert torch.equal(logits[b, i], chain), (b, i, float((logits[b, i] - chain).abs().max()))
    # the logits feed the tree verifier directly
    out = tree_rejection_sample(logits, tree, SamplingBatch.build([SamplingParams(temperature=0)] * 2, [None] * 2))
    assert out.token_ids.shape == (2, tree.max_depth + 1)


def test_chain_shaped_tree_gives_verify_bits(target) -> None:
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 768, (11,), generator=g).tolist()
    drafts = torch.randint(0, 768, (4,), generator=g)
    table = [[3, 4, 5, 6, 7]]
    runner = _runner(target)
    (start,) = _prefill(runner, [prompt], table)
    parents = torch.arange(-1, 4)[None]
    tokens = torch.cat([torch.tensor([prompt[-1]]), drafts])[None]
    tree = DraftTree(parents, tokens, depths(parents), torch.zeros(1, 5))
    logits, _ = runner.verify_tree(tree, table, [start])
    hidden, _ = runner.forward_target(tokens[0], table, [start], [5])
    assert torch.equal(logits[0], target.compute_logits(hidden))


def _plain_greedy(runner: ModelRunner, prompt: list[int], table: list[int], n: int) -> list[int]:
    hidden, _ = runner.forward_target(torch.tensor(prompt), [table], [0], [len(prompt)])
    out = [int(runner.target.compute_logits(hidden[-1:]).argmax())]
    while len(out) < n:
        pos = len(prompt) + len(out) - 1
        hidden, _ = runner.forward_target(torch.tensor(out[-1:]), [table], [pos], [1])
        out.append(int(runner.target.compute_logits(hidden).argmax()))
    return out


def test_greedy_tree_speculation_equals_plain_greedy(target) -> None:
    """Tree steps (verify_tree, greedy tree acceptance, compact_tree_kv) generate exactly the plain
    greedy tokens. The trees hold the true continuation on a random branch, cut at a random depth,
    among random siblings, so steps accept 0 to 3 drafts."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 768, (7,), generator=g).tolist()
    table = list(range(8))
    n_new = 14
    want = _plain_greedy(_runner(target), prompt, table, n_new + 4)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 5]])  # depth 3 on two branches
    runner = _runner(target)
    (start,) = _prefill(runner, [prompt], [table])
    out: list[int] = []
    root, accepted = prompt[-1], []
    greedy = SamplingBatch.build([SamplingParams(temperature=0)], [None])
    while len(out) < n_new:
        truth = want[len(out): len(out) + 3]
        tokens = torch.randint(0, 768, (1, 8), generator=g)
        tokens[0, 0] = root
        branch = [1, 3, 6] if bool(torch.rand(1, generator=g) < 0.5) else [2, 5, 7]
        for node, tok in zip(branch[: int(torch.randint(0, 4, (1,), generator=g))], truth, strict=False):
            tokens[0, node] = tok
        tree = DraftTree(parents, tokens, depths(parents), torch.zeros(1, 8))
        logits, _ = runner.verify_tree(tree, [table], [start])
        res = tree_rejection_sample(logits, tree, greedy)
        nodes = res.node_ids[0, : int(res.num_accepted[0])].tolist()
        compact_tree_kv(runner.target_kv, table, BLOCK, start, nodes)
        emitted = res.rows()[0]
        out += emitted
        accepted.append(len(nodes))
        start += len(emitted)
        root = emitted[-1]
    assert out[:n_new] == want[:n_new]
    assert max(accepted) >= 2 and min(accepted) == 0  # the walk took real branches, and stopped early too


def test_tree_logits_do_not_depend_on_the_batch(target) -> None:
    """A tree verified alone or with another sequence's tree gives the same logits, bit for bit."""
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 768, (n,), generator=g).tolist() for n in (12, 6)]
    tables = [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    runner = _runner(target)
    starts = _prefill(runner, prompts, tables)
    tree = _trees([p[-1] for p in prompts], 768, seed=4)
    both, _ = runner.verify_tree(tree, tables, starts)
    for b in range(2):
        one = DraftTree(tree.parents[b: b + 1], tree.tokens[b: b + 1], tree.depth[b: b + 1], tree.scores[b: b + 1])
        alone, _ = runner.verify_tree(one, tables[b: b + 1], starts[b: b + 1])
        assert torch.equal(alone[0], both[b]), b
