"""Draft trees: EAGLE-2 selection on hand-made distributions, and the mask / position helpers."""

from __future__ import annotations

import math

import pytest
import torch

from eagle3.errors import UsageError
from eagle3.runtime.spec.tree import (
    TreeBuilder,
    ancestor_mask,
    build_tree,
    check_parents,
    children,
    depths,
    leaf_paths,
    path,
    tree_positions,
)


def _logp(*rows: dict[int, float], v: int = 8) -> torch.Tensor:
    """[1, len(rows), v] log-probs: the given token probabilities, the rest spread evenly."""
    out = torch.empty(1, len(rows), v)
    for i, row in enumerate(rows):
        rest = (1.0 - sum(row.values())) / (v - len(row))
        p = torch.full((v,), rest)
        for tok, pr in row.items():
            p[tok] = pr
        out[0, i] = p.log()
    return out


def test_topk_one_is_the_top1_chain() -> None:
    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(2, 1, 16, generator=g).log_softmax(-1) for _ in range(4)]
    tree = build_tree(torch.tensor([3, 5]), steps, topk=1, num_nodes=5)
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 3]] * 2
    assert tree.depth.tolist() == [[0, 1, 2, 3, 4]] * 2
    assert tree.tokens[:, 0].tolist() == [3, 5]
    want = torch.stack([s[:, 0].argmax(-1) for s in steps], 1)
    assert torch.equal(tree.tokens[:, 1:], want)
    assert torch.equal(ancestor_mask(tree.parents)[0], torch.ones(5, 5, dtype=torch.bool).tril())


def test_hand_made_tree_keeps_the_best_by_cumulative_log_prob() -> None:
    # Step 0 (root): tokens 1 (0.6), 2 (0.3). Step 1, frontier [1, 2]: under 1 -> 3 (0.5), 4 (0.4);
    # under 2 -> 5 (0.9), 6 (0.05). Cumulative: 1:.6 2:.3 [1,3]:.30 [1,4]:.24 [2,5]:.27 [2,6]:.015.
    steps = [_logp({1: 0.6, 2: 0.3}), _logp({3: 0.5, 4: 0.4}, {5: 0.9, 6: 0.05})]
    tree = build_tree(torch.tensor([7]), steps, topk=2, num_nodes=5)
    got = {tuple(tree.tokens[0, path(tree.parents[0], i)].tolist()[1:]) for i in range(1, 5)}
    assert got == {(1,), (2,), (1, 3), (2, 5)}  # [1,4] (.24) and [2,6] (.015) are dropped
    assert tree.parents[0].tolist() == [-1, 0, 0, 1, 2]
    assert tree.tokens[0].tolist() == [7, 1, 2, 3, 5]
    assert tree.depth[0].tolist() == [0, 1, 1, 2, 2]
    expect = [0.0, math.log(0.6), math.log(0.3), math.log(0.6) + math.log(0.5), math.log(0.3) + math.log(0.9)]
    assert torch.allclose(tree.scores[0], torch.tensor(expect), atol=1e-6)


def test_frontier_is_the_best_k_of_the_step_and_the_tree_is_ancestor_closed() -> None:
    g = torch.Generator().manual_seed(1)
    k, s, n, v = 3, 4, 12, 10
    builder = TreeBuilder(torch.zeros(4, dtype=torch.int64), topk=k)
    lp = torch.randn(4, 1, v, generator=g).log_softmax(-1)
    for step in range(s):
        before = builder.scores.shape[1]
        builder.expand(lp)
        new = builder.scores[:, before:]
        # the frontier holds the k best new candidates, best first
        assert torch.equal(builder.scores.gather(1, builder.frontier), new.sort(-1, descending=True).values[:, :k])
        assert builder.steps == step + 1
        lp = torch.randn(4, k, v, generator=g).log_softmax(-1)
    tree = builder.build(n)
    check_parents(tree.parents)
    assert tree.parents.shape == (4, n)
    for b in range(4):
        # the chosen N-1 candidates are the N-1 best scores overall
        best = builder.scores[b].sort(descending=True).values[: n - 1]
        assert torch.equal(tree.scores[b, 1:].sort(descending=True).values, best)
        # a child never scores above its parent, and depth = parent depth + 1
        for i in range(1, n):
            p = int(tree.parents[b, i])
            assert p < i and tree.scores[b, i] <= tree.scores[b, p]
            assert tree.depth[b, i] == tree.depth[b, p] + 1


def test_ties_keep_parents_before_children() -> None:
    # A probability-1 draft step: children tie with their parents; the parent must still be chosen.
    v = 4
    certain = torch.full((1, 1, v), float("-inf"))
    certain[..., 2] = 0.0
    tree = build_tree(torch.tensor([0]), [certain, certain, certain], topk=1, num_nodes=3)
    assert tree.parents[0].tolist() == [-1, 0, 1]
    assert tree.tokens[0].tolist() == [0, 2, 2]


def test_keep_probs_rows_of_expanded_nodes() -> None:
    steps = [_logp({1: 0.6, 2: 0.3}), _logp({3: 0.5, 4: 0.4}, {5: 0.9, 6: 0.05})]
    tree = build_tree(torch.tensor([7]), steps, topk=2, num_nodes=5, keep_probs=True)
    q = tree.draft_probs
    assert q is not None and q.shape == (1, 5, 8)
    assert torch.allclose(q[0, 0], steps[0][0, 0].exp())  # root
    assert torch.allclose(q[0, 1], steps[1][0, 0].exp())  # node 1 (token 1) was frontier row 0
    assert torch.allclose(q[0, 2], steps[1][0, 1].exp())  # node 2 (token 2) was frontier row 1
    assert bool((q[0, 3:] == 0).all())  # leaves never expanded


def test_mask_positions_children_and_paths_of_a_hand_made_tree() -> None:
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    #   |
    #   6            (7: padding)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, -1]])
    check_parents(parents)
    assert depths(parents).tolist() == [[0, 1, 1, 2, 2, 2, 3, 0]]
    mask = ancestor_mask(parents)[0]
    want = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5], 6: [0, 1, 3, 6], 7: [7]}
    for i, anc in want.items():
        assert torch.nonzero(mask[i]).flatten().tolist() == anc
    assert tree_positions(depths(parents), torch.tensor([100])).tolist() == [[100, 101, 101, 102, 102, 102, 103, 100]]
    ch = children(parents)
    assert ch.shape == (1, 8, 2)
    assert ch[0].tolist() == [[1, 2], [3, 4], [5, -1], [6, -1], [-1, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert path(parents[0], 6) == [0, 1, 3, 6]
    assert leaf_paths(parents[0]) == [[0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 2, 0], [-1, -1, 0], [-1, -3]])
def test_malformed_parents_are_refused(parents: list[int]) -> None:
    with pytest.raises(UsageError):
        check_parents(torch.tensor([parents]))
