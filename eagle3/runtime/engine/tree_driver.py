"""A reference driver of tree speculative decoding for one sequence, outside the engine.

It strings the tree pieces together over a :class:`~eagle3.runtime.engine.model_runner.ModelRunner`
(its models, KV caches and forwards), one request at a time, every block allocated up front:

1. prefill the prompt on the target, sample the first token (the first *root*), run draft step 0
   over the prompt (as the chain proposer does);
2. per step: :func:`~eagle3.runtime.spec.tree_proposer.draft_tree` grows a tree from the root,
   ``ModelRunner.verify_tree`` runs the target over its N nodes, ``tree_rejection_sample``
   walks it (point-mass children: the builder's top-K are deterministic),
   ``compact_tree_kv`` moves the accepted path's target KV to chain positions, and draft step 0
   runs over the committed positions (root + accepted nodes, their aux states from the verify);
   the emitted bonus / recovered token is the next root.

It exists to test the pieces end to end and to measure acceptance (benchmarks/tree_acceptance.py);
the engine runs the same pieces batched (``LLM(speculative_eagle_topk=K)``, docs/trees.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle3.runtime.engine.model_runner import ModelRunner, compact_tree_kv
from eagle3.runtime.sampling import Sampler, SamplingBatch, SamplingParams, make_generator
from eagle3.runtime.spec.tree_proposer import draft_tree
from eagle3.runtime.spec.tree_rejection import tree_rejection_sample


@dataclass
class TreeRun:
    token_ids: list[int]  # generated tokens (max_tokens of them)
    accepted: list[int] = field(default_factory=list)  # accepted drafts per verify step

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per target verify (accepted drafts + the bonus / recovered token)."""
        return sum(a + 1 for a in self.accepted) / max(len(self.accepted), 1)


@torch.inference_mode()
def tree_generate(runner: ModelRunner, prompt: list[int], max_tokens: int, topk: int, steps: int, num_nodes: int,
                  params: SamplingParams | None = None) -> TreeRun:
    """Generate ``max_tokens`` tokens for ``prompt`` with tree speculation (``topk = 1``,
    ``num_nodes = steps + 1``: the chain). Uses blocks ``0 ..`` of the runner's caches."""
    target, draft = runner.target, runner.draft
    if draft is None:
        raise ValueError("tree_generate needs a runner with a draft model")
    params = params or SamplingParams(temperature=0.0)
    gen = make_generator(params.seed)
    batch = SamplingBatch.build([params], [gen])
    bs = runner.block_size
    need = len(prompt) + max_tokens + max(num_nodes, (steps - 1) * topk + 1) + 1
    table = list(range(-(-need // bs)))
    if len(table) > runner.num_blocks:
        raise ValueError(f"{need} positions need {len(table)} blocks; the runner has {runner.num_blocks}")
    hidden, aux = runner.forward_target(torch.tensor(prompt, device=runner.device), [table], [0], [len(prompt)])
    assert aux is not None
    root = int(Sampler(runner.generator)(target.compute_logits(hidden[-1:]), batch)[0])
    out = [root]
    post, nxt = runner.forward_draft(torch.tensor(prompt[1:] + [root], device=runner.device),
                                     draft.combine_aux(aux), [table], [0], [len(prompt)])
    start = len(prompt)  # the root's position
    run = TreeRun(out)
    while len(out) < max_tokens:
        tree = draft_tree(draft, runner.forward_draft_tree, torch.tensor([root], device=runner.device), post[-1:],
                          nxt[-1:], [start - 1], [table], topk, steps, num_nodes)
        logits3, aux = runner.verify_tree(tree, [table], [start])
        assert aux is not None
        res = tree_rejection_sample(logits3, tree, batch, None, runner.generator)
        nodes = res.node_ids[0, : int(res.num_accepted[0])].tolist()
        compact_tree_kv(runner.target_kv, table, bs, start, nodes)
        emitted = res.rows()[0]
        run.accepted.append(len(nodes))
        out += emitted
        rows = torch.tensor([0] + nodes, device=aux.device)
        post, nxt = runner.forward_draft(torch.tensor(emitted, device=runner.device), draft.combine_aux(aux[rows]),
                                         [table], [start], [len(emitted)])
        start += len(emitted)
        root = emitted[-1]
    run.token_ids = out[:max_tokens]
    return run

