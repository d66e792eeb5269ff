"""Tree verification: greedy semantics, exactness of recursive rejection sampling (chi-square), and
bit-for-bit agreement with the chain sampler on chains.

The statistical test reuses the chain test's first-order Markov "model" on a 4-token vocabulary:
each speculative step drafts a full tree (K children per node, depth S; children either the
draft's top-K, a point mass each, or K draws from q without replacement), and the joint
distribution of the first 3 generated tokens (64 cells) is compared with the target's exact one
at significance 1e-6. Fixed seeds: the test is deterministic.
"""

from __future__ import annotations

import pytest
import torch

from eagle3.runtime.sampling import SamplingBatch, SamplingParams, logits_to_probs
from eagle3.runtime.spec import tree_rejection
from eagle3.runtime.spec.rejection import rejection_sample
from eagle3.runtime.spec.tree import DraftTree, depths
from eagle3.runtime.spec.tree_rejection import tree_rejection_sample
from tests.runtime.test_spec_rejection import ALPHA, L, N, V, _batch, _chi2_pvalue, _last, _markov


def _tree(parents: list[int], tokens: list[list[int]]) -> DraftTree:
    par = torch.tensor([parents] * len(tokens))
    return DraftTree(par, torch.tensor(tokens), depths(par), torch.zeros(par.shape))


def _onehot_logits(argmax: list[list[int]], v: int = 8) -> torch.Tensor:
    logits = torch.full((len(argmax), len(argmax[0]), v), -5.0)
    logits.scatter_(2, torch.tensor(argmax)[..., None], 5.0)
    return logits


def test_greedy_follows_the_argmax_child_then_emits_the_argmax() -> None:
    #      0
    #    /   \
    #   1     2       node tokens: 1:3 2:4 3:5 4:6 5:7
    #   |    / \
    #   3   4   5
    parents = [-1, 0, 0, 1, 2, 2]
    tokens = [[9, 3, 4, 5, 6, 7]] * 4
    argmax = [
        [4, 0, 7, 0, 0, 1],  # root -> 4 (node 2) -> 7 (node 5, a leaf) -> bonus 1
        [3, 2, 0, 0, 0, 0],  # root -> 3 (node 1) -> wants 2, child 3 has 5: stop, emit 2
        [1, 0, 0, 0, 0, 0],  # no child of the root matches: emit 1
        [4, 0, 6, 0, 2, 0],  # root -> node 2 -> node 4 (leaf) -> bonus 2
    ]
    out = tree_rejection_sample(_onehot_logits(argmax), _tree(parents, tokens), _batch(SamplingParams(temperature=0), 4))
    assert out.rows() == [[4, 7, 1], [3, 2], [1], [4, 6, 2]]
    assert out.num_accepted.tolist() == [2, 1, 0, 2]
    assert out.node_ids.tolist() == [[2, 5], [1, -1], [-1, -1], [2, 4]]
    assert out.last_node.tolist() == [5, 1, 0, 4]
    assert out.token_ids[2].tolist() == [1, -1, -1]


def test_padded_tree_and_root_only_tree() -> None:
    parents = [-1, 0, 1, -1]  # node 3 is padding: never a child of anything
    out = tree_rejection_sample(_onehot_logits([[3, 4, 5, 6]]), _tree(parents, [[0, 3, 4, 6]]),
                                _batch(SamplingParams(temperature=0), 1))
    assert out.rows() == [[3, 4, 5]]
    root = tree_rejection_sample(_onehot_logits([[2]]), _tree([-1], [[0]]), _batch(SamplingParams(temperature=1.0), 1),
                                 generator=torch.Generator().manual_seed(0))
    assert root.token_ids.shape == (1, 1) and root.num_accepted.tolist() == [0]


def _chain_inputs(b: int, k: int, v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, k + 1, v, generator=g) * 2.0
    q = torch.rand(b, k, v, generator=g) ** 3
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.multinomial(q.reshape(b * k, v), 1, generator=g).view(b, k)
    # make some drafts the target's argmax so that greedy rows accept a few
    drafts[::3] = logits[::3, :k].argmax(-1)
    return logits, drafts, q


@pytest.mark.parametrize("point_mass", [False, True])
def test_chain_shaped_tree_equals_the_chain_sampler_bit_for_bit(point_mass: bool) -> None:
    b, k, v = 24, 4, 16
    logits, drafts, q = _chain_inputs(b, k, v, seed=3)
    params = [SamplingParams(temperature=0.0 if i % 4 == 0 else 0.9, top_k=6 if i % 5 == 0 else 0,
                             seed=i if i % 2 else None) for i in range(b)]

    def batch() -> SamplingBatch:
        gens = [torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None for sp in params]
        return SamplingBatch.build(params, gens)

    chain = rejection_sample(logits, drafts, torch.full((b,), k), batch(), None if point_mass else q,
                             torch.Generator().manual_seed(11))
    tree = _tree(list(range(-1, k)), torch.cat([torch.zeros(b, 1, dtype=torch.int64), drafts], 1).tolist())
    tq = None if point_mass else torch.cat([q, torch.zeros(b, 1, v)], 1)  # node i's children came from q[i]
    got = tree_rejection_sample(logits, tree, batch(), tq, torch.Generator().manual_seed(11))
    assert torch.equal(got.token_ids, chain.token_ids)
    assert torch.equal(got.num_accepted, chain.num_accepted)
    assert got.node_ids.tolist() == [[i + 1 if i < a else -1 for i in range(k)] for a in chain.num_accepted.tolist()]


def _full_tree(k: int, s: int) -> list[int]:
    """Parents of the complete k-ary tree of depth s in breadth-first order."""
    parents, level = [-1], [0]
    for _ in range(s):
        nxt = []
        for p in level:
            for _ in range(k):
                parents.append(p)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents


def _speculate_tree(target: torch.Tensor, draft: torch.Tensor, params: SamplingParams, mode: str, k: int, s: int,
                    seed: int) -> torch.Tensor:
    """[N, L] tokens generated by tree-speculative steps from the start token 0. ``mode``:
    "topk" (point-mass children) or "sampled" (k children from q without replacement)."""
    gen = torch.Generator().manual_seed(seed)
    batch = _batch(params, N)
    parents = torch.tensor(_full_tree(k, s))
    n = parents.shape[0]
    par = parents.expand(N, n)
    depth = depths(par)
    seqs = torch.zeros(N, L + s + 2, dtype=torch.int64)
    length = torch.zeros(N, dtype=torch.int64)
    while bool((length < L).any()):
        tokens = torch.zeros(N, n, dtype=torch.int64)
        tokens[:, 0] = _last(seqs, length)
        qs = torch.zeros(N, n, V)
        for i in range(n):  # children of node i, in order
            kids = torch.nonzero(parents == i).flatten()
            if kids.numel() == 0:
                continue
            logits = draft[tokens[:, i]]
            if mode == "topk":
                tokens[:, kids] = logits.topk(k, dim=-1).indices
            else:
                q = logits_to_probs(logits, batch)
                tokens[:, kids] = torch.multinomial(q, k, replacement=False, generator=gen)
                qs[:, i] = q
        tree = DraftTree(par, tokens, depth, torch.zeros(N, n))
        out = tree_rejection_sample(target[tokens], tree, batch, None if mode == "topk" else qs, gen)
        for i in range(out.token_ids.shape[1]):
            tok = out.token_ids[:, i]
            take = (tok >= 0) & (length < L)
            seqs[take, 1 + length[take]] = tok[take]
            length = length + take.long()
    return seqs[:, 1: L + 1]


CASES = [
    pytest.param(SamplingParams(temperature=1.0), "sampled", 2, 2, id="sampled-k2-s2"),
    pytest.param(SamplingParams(temperature=0.8, top_k=3, top_p=0.9), "sampled", 2, 1, id="sampled-topk-topp"),
    pytest.param(SamplingParams(temperature=1.0), "sampled", 3, 1, id="sampled-k3"),
    pytest.param(SamplingParams(temperature=1.0), "topk", 2, 2, id="topk-point-mass"),
]


@pytest.mark.parametrize(("params", "mode", "k", "s"), CASES)
def test_tree_rejection_sampling_preserves_target_distribution(params: SamplingParams, mode: str, k: int,
                                                               s: int) -> None:
    target, draft = _markov(seed=1)
    samples = _speculate_tree(target, draft, params, mode, k, s, seed=2)
    assert _chi2_pvalue(samples, target, params) > ALPHA


def test_broken_residual_fails_the_same_test(monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = _markov(seed=1)
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(tree_rejection, "_residual", lambda p, q: p)
    samples = _speculate_tree(target, draft, params, "sampled", 2, 2, seed=2)
    assert _chi2_pvalue(samples, target, params) < ALPHA


def test_siblings_with_replacement_fail_the_same_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Treating the second sibling as drawn from q itself (not q without the first) is biased."""
    target, draft = _markov(seed=1)
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(tree_rejection, "_without", lambda q, x: q)
    samples = _speculate_tree(target, draft, params, "sampled", 3, 1, seed=2)
    assert _chi2_pvalue(samples, target, params) < ALPHA

