"""Runs the models for one scheduled step (:meth:`ModelRunner.step`): owns the KV cache tensors,
builds the per-forward ``AttnMetadata``, runs the target once over the ragged batch, verifies /
samples its output and runs the proposer over the result.

The whole step is one target forward: prefill chunks, plain decode rows and speculative verify
rows (last token + drafts) of different sequences share it. Logits are computed only for the
rows that are sampled (a prefill chunk's rows never need the vocabulary projection).

A step changes no sequence (it writes KV slots that belong to the scheduled sequences and draws
random numbers), so the engine can run it again for a subset when it fails (failure isolation,
``LLM._isolated``); the scheduler applies its :class:`StepOutput` afterwards
(``Scheduler.postprocess``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3.runtime import kv_cache
from eagle3.runtime.context import AttnMetadata, TreeMask
from eagle3.runtime.engine.config import EngineConfig, SpecShape
from eagle3.runtime.engine.graphs import GraphRunner, TreeStep, capture_sizes, context_cap
from eagle3.runtime.engine.prompt_logprobs import step_prompt_logprobs
from eagle3.runtime.engine.sequence import ScheduledSeq
from eagle3.runtime.interfaces import DraftModel, TargetModel, allocate_kv_cache, compact_tree_kv
from eagle3.runtime.logprobs import TokenLogprob, emitted_logprobs
from eagle3.runtime.sampling import SamplingBatch
from eagle3.runtime.spec.adaptive import AdaptivePolicy, MeasuredCostModel
from eagle3.runtime.spec.proposer import EagleProposer, Proposal, ProposeItem
from eagle3.runtime.spec.rejection import pad_drafts, rejection_sample
from eagle3.runtime.spec.tree import DraftTree, ancestor_mask, check_parents, depths, tree_kv_slots
from eagle3.runtime.spec.tree_proposer import TreeDrafting
from eagle3.runtime.spec.tree_rejection import tree_rejection_sample

# Context length of auto's start-up profile (tokens already cached per dummy sequence): the profile
# gives the cost model its shape, serving steps its scale at the real contexts.
PROFILE_CONTEXT = 512


def build_attn_metadata(block_tables: Seq[Seq[int]], starts: Seq[int], counts: Seq[int], block_size: int,
                        device: torch.device | str = "cpu") -> AttnMetadata:
    """Metadata for ``counts[b]`` query tokens of sequence ``b`` at positions
    ``starts[b] .. starts[b] + counts[b] - 1``; keys are positions ``0 ..`` that end."""
    b = len(starts)
    width = max((len(t) for t in block_tables), default=0) or 1
    tables = torch.full((b, width), -1, dtype=torch.int32)
    for i, t in enumerate(block_tables):
        if t:
            tables[i, : len(t)] = torch.as_tensor(list(t), dtype=torch.int32)
    counts_t = torch.as_tensor(list(counts), dtype=torch.int64)
    starts_t = torch.as_tensor(list(starts), dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(b), counts_t)
    cu = torch.zeros(b + 1, dtype=torch.int64)
    torch.cumsum(counts_t, 0, out=cu[1:])
    positions = starts_t[seq_of_token] + (torch.arange(int(cu[-1])) - cu[:-1][seq_of_token])
    block_ids = tables[seq_of_token, positions // block_size].to(torch.int64)
    assert bool((block_ids >= 0).all()), "a query position has no KV block allocated"
    slots = block_ids * block_size + positions % block_size
    return AttnMetadata(
        positions=positions.to(device),
        cu_seqlens_q=cu.to(torch.int32).to(device),
        context_lens=(starts_t + counts_t).to(torch.int32).to(device),
        slot_mapping=slots.to(device),
        block_tables=tables.to(device),
        block_size=block_size,
        host_cu=cu.tolist(),
    )


def build_tree_attn_metadata(block_tables: Seq[Seq[int]], starts: Seq[int], tree: DraftTree, block_size: int,
                             device: torch.device | str = "cpu") -> AttnMetadata:
    """Metadata for verifying ``B`` draft trees of ``N`` nodes: sequence ``b``'s root (its last
    committed token, not cached yet) is at position ``starts[b]``; node ``j`` is cached at position
    ``starts[b] + j`` and rotated at ``starts[b] + depth[j]`` (see ``TreeMask``)."""
    b, n = tree.parents.shape
    meta = build_attn_metadata(block_tables, starts, [n] * b, block_size, device)
    root = torch.as_tensor(list(starts), dtype=torch.int64)
    meta.positions = (root[:, None] + tree.depth.cpu()).reshape(-1).to(device)
    meta.tree = TreeMask([n] * b, ancestor_mask(tree.parents.cpu()).to(device))
    return meta


def _tree_of(item: ScheduledSeq) -> DraftTree | None:
    """The draft tree ``item`` verifies this step (root: its last real token), or None (a chain,
    or no drafts). On the host, like the block tables: the step's attention metadata is built from
    it there and moved once; ``tree_rejection_sample`` walks it on the logits' device."""
    parents = item.seq.draft_parents
    if not item.samples or not item.draft_ids or parents is None or len(parents) != len(item.draft_ids) + 1:
        return None
    par = torch.tensor([parents], dtype=torch.int64)
    root = item.seq.token_ids[item.start + item.num_tokens - 1]
    tokens = torch.tensor([[root] + list(item.draft_ids)], dtype=torch.int64)
    return DraftTree(par, tokens, depths(par), torch.zeros(par.shape))


def _hidden_dtype(draft: DraftModel) -> torch.dtype:
    """The dtype of the draft's hidden states (its KV cache may be stored wider: kv_cache_dtype)."""
    return getattr(draft, "dtype", None) or draft.kv_cache_spec().dtype


def kv_bytes_per_block(model: TargetModel | DraftModel, block_size: int) -> int:
    """Bytes of one KV block of ``model``'s cache as stored (its per-token shape and storage dtype)."""
    spec = model.kv_cache_spec()
    return kv_cache.cache_bytes(torch.Size(spec.shape).numel(), model.num_layers,
                                torch.empty((), dtype=spec.dtype).element_size(), block_size)


@dataclass
class TargetStepOutput:
    """What one target forward gives the rest of the step."""

    emitted: list[list[int]]  # per scheduled sequence: tokens to append ([] for a non-final chunk)
    aux: torch.Tensor | None  # [T, n*H] aux states of every query row (None without a draft)
    row_starts: list[int]  # first query row of each scheduled sequence
    # per scheduled sequence that verified a draft tree: the accepted nodes (their rows follow the
    # root's, the last real token's, at node offsets); absent for chains
    tree_nodes: dict[int, list[int]] = field(default_factory=dict)
    # per scheduled sequence that asked (else None): its emitted tokens' / its chunk's prompt entries
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    prompt_logprobs: list[list[TokenLogprob | None] | None] = field(default_factory=list)


@dataclass
class StepOutput:
    """One step's result per scheduled sequence, for ``Scheduler.postprocess``."""

    emitted: list[list[int]]  # tokens to append ([] for a non-final prefill chunk)
    proposals: list[Proposal | None]  # the next step's drafts (None: no draft / nothing proposed)
    # logprob entries per sequence (None: not asked for), see TargetStepOutput; empty: none at all
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    prompt_logprobs: list[list[TokenLogprob | None] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.logprobs = self.logprobs or [None] * len(self.emitted)
        self.prompt_logprobs = self.prompt_logprobs or [None] * len(self.emitted)

    @staticmethod
    def join(parts: list[StepOutput | None], sizes: list[int]) -> StepOutput:
        """Concatenate the outputs of sub-batches of ``sizes`` sequences; a failed part (``None``)
        gives its sequences no tokens, no logprobs and no drafts."""
        out = StepOutput([], [])
        for part, n in zip(parts, sizes, strict=True):
            out.emitted += part.emitted if part is not None else [[] for _ in range(n)]
            out.proposals += part.proposals if part is not None else [None] * n
            out.logprobs += part.logprobs if part is not None else [None] * n
            out.prompt_logprobs += part.prompt_logprobs if part is not None else [None] * n
        return out


class ModelRunner(SpecShape):
    """``config``: the engine's one :class:`EngineConfig` (k, the draft tree, block size, batch size,
    draft sampling), read where it is used. ``num_blocks``, ``max_model_len`` and ``device`` are what
    ``LLM`` resolved from it (the cache sized to memory, the context fitted to the cache, the rank's
    device). ``graphs=True``: uniform decode / verify / draft steps replay CUDA graphs
    (engine/graphs.py); the KV caches then get one spare block (index ``num_blocks``) for the padding
    rows. ``max_num_seqs`` and each model's context cap (``config.max_seq_len_to_capture``, by
    default from its MLA split workspace, at most ``max_model_len`` + the draft slots) size the
    graphs' static buffers; a step past the cap runs eagerly (``max_model_len`` also caps how many
    tokens a sequence may still be proposed). ``policy`` (``num_speculative_tokens=
    "auto"``): each step proposes the k it chooses (k is then its ceiling), and uniform steps feed
    their measured times to its cost model."""

    def __init__(self, target: TargetModel, draft: DraftModel | None, config: EngineConfig, num_blocks: int, *,
                 device: torch.device | str | None = None, generator: torch.Generator | None = None,
                 graphs: bool = False, max_model_len: int = 0, capturer: Any = None,
                 policy: AdaptivePolicy | None = None) -> None:
        self.target = target
        self.draft = draft
        self.config = config
        self.device = torch.device(config.device if device is None else device)
        self.generator = generator
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.policy = policy if draft is not None else None
        block_size = config.block_size
        cache_blocks = num_blocks + 1 if graphs else num_blocks  # + the graphs' pad block
        self.target_kv = allocate_kv_cache(target.kv_cache_spec(), target.num_layers, cache_blocks,
                                           block_size, self.device)
        self.draft_kv: list[torch.Tensor] = []
        if draft is not None:
            self.draft_kv = allocate_kv_cache(draft.kv_cache_spec(), draft.num_layers, cache_blocks,
                                              block_size, self.device)
        self.aux_layer_ids = tuple(draft.aux_layer_ids) if draft is not None else None
        self.target_graphs: GraphRunner | None = None
        self.draft_graphs: GraphRunner | None = None
        # Draft trees (topk, nodes with the root; docs/trees.md): a verify of N nodes per sequence,
        # draft steps of topk frontier nodes over a region of up to (k - 1) * topk nodes. (Trees with
        # auto are refused by the config.)
        topk, nodes = self.tree if self.tree is not None else (1, 0)
        region = (self.k - 1) * topk if self.tree is not None else 0
        if graphs:
            # Longest context a step can have: max_model_len tokens plus the draft-step slots (with
            # trees, the slots a tree step writes: scheduler.slots_needed). Each graph covers contexts
            # up to its cap (graphs.context_cap: max_seq_len_to_capture, or what keeps the model's MLA
            # split workspace at the graph's query tokens within budget); longer steps run eagerly,
            # with the same bits (the attention's splits sit at fixed key positions).
            extra = 2 * self.k + 1 + (tree_kv_slots(topk, self.k, nodes) if self.tree is not None else 0)
            longest = max_model_len + extra

            def cap(model: Any) -> Callable[[int], int]:
                mla = getattr(getattr(model, "spec", None), "mla", None)
                return lambda tokens: context_cap(longest, tokens, mla, config.max_seq_len_to_capture)

            common = dict(device=self.device, block_size=block_size, pad_block=num_blocks,
                          max_num_seqs=config.max_num_seqs, capturer=capturer)
            kv, aux_ids = self.target_kv, self.aux_layer_ids
            self.target_graphs = GraphRunner(
                "target", lambda s, meta: target.forward(s["input_ids"], meta, kv, aux_ids),
                max_q_len=self.k + 1, max_tree_nodes=nodes, max_context=cap(target), **common)
            if draft is not None:
                dkv = self.draft_kv[0] if len(self.draft_kv) == 1 else self.draft_kv
                self.draft_graphs = GraphRunner(
                    "draft", lambda s, meta: draft.forward(s["input_ids"], s["hidden"], meta, dkv),
                    extra={"hidden": ((draft.hidden_size,), _hidden_dtype(draft))},
                    max_q_len=self.k + 1, max_tree_nodes=region, max_context=cap(draft), **common)
        self.proposer: EagleProposer | None = None
        if draft is not None:
            tree_drafting = TreeDrafting(config, self.forward_draft_tree) if self.tree is not None else None
            self.proposer = EagleProposer(draft, config, self.forward_draft, generator, tree_drafting)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def graph_stats(self) -> dict[str, dict[str, int]]:
        """Per model with graphs: its context cap and its forwards replayed, run eagerly, and of
        those the graph-shaped ones past the cap."""
        return {name: g.stats() for name, g in (("target", self.target_graphs), ("draft", self.draft_graphs))
                if g is not None}

    @torch.inference_mode()
    def step(self, scheduled: list[ScheduledSeq]) -> StepOutput:
        """The target forward and verification, then the proposer over what each sequence emitted."""
        res = self._timed(lambda: self.run_target(scheduled), self._uniform_target_shape(scheduled), "target")
        if self.proposer is None:
            return StepOutput(res.emitted, [None] * len(scheduled), res.logprobs, res.prompt_logprobs)
        assert res.aux is not None
        # auto: k for the next verification of this batch (0: a plain step; draft step 0 still runs
        # over the committed positions, so the draft's KV cache stays complete).
        k = self.k if self.policy is None else self.policy.choose(sum(it.samples for it in scheduled))
        items = [self._propose_item(item, emitted, res.aux, row0, k, res.tree_nodes.get(i))
                 for i, (item, emitted, row0) in enumerate(zip(scheduled, res.emitted, res.row_starts, strict=True))]
        proposer = self.proposer
        # auto: the whole proposer (forwards, logits, sampling) of a decode step is timed, per draft
        # step it ran: step 0 runs at k = 0 too, and near max_tokens a sequence drafts fewer than k
        # (dividing by k there read a short step as a cheap draft step and pulled the estimate down).
        steps = max([it.num_drafts for it in items] + [1])
        shape = (len(items), steps) if self._uniform_target_shape(scheduled) is not None else None
        proposals = self._timed(lambda: proposer.propose(items, self.target.vocab_size), shape, "draft")
        return StepOutput(res.emitted, proposals, res.logprobs, res.prompt_logprobs)

    def _propose_item(self, item: ScheduledSeq, emitted: list[int], aux: torch.Tensor, row0: int,
                      k: int, tree_nodes: list[int] | None = None) -> ProposeItem:
        """Draft step 0 runs over the positions this step commits: the chunk's real tokens and the
        accepted drafts (``emitted`` minus its last token, the next step's input). A sequence that
        samples proposes up to ``k`` tokens, but never more than it may still generate. When the
        scheduler then stops the sequence inside ``emitted`` (EOS, a stop id), the proposal is
        simply dropped."""
        seq, start = item.seq, item.start
        if not item.samples:
            return ProposeItem(seq, start, seq.token_ids[start + 1: start + item.num_tokens + 1],
                               aux[row0: row0 + item.num_tokens], 0)
        count = item.num_tokens + len(emitted) - 1
        room = seq.max_new_tokens(self.max_model_len) - len(emitted) - 1  # the bonus token takes one
        rows = aux[row0: row0 + count]
        if tree_nodes is not None:  # the accepted nodes' rows follow the root's at their node offsets
            root = row0 + item.num_tokens - 1
            rows = aux[torch.tensor(list(range(row0, root + 1)) + [root + j for j in tree_nodes], device=aux.device)]
        drafts = max(min(k, room), 0)
        if self.tree is not None and drafts < k:
            drafts = 0  # a tree has the full depth or is not drafted (near max_tokens / max_model_len)
        return ProposeItem(seq, start, seq.token_ids[start + 1: start + item.num_tokens] + emitted, rows, drafts)

    def forward_target(self, input_ids: torch.Tensor, block_tables: Seq[Seq[int]], starts: Seq[int],
                       counts: Seq[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target forward of one step: a graph replay when the step is uniform, else eager."""
        g = self.target_graphs
        if g is not None and g.supports(starts, counts):
            out = g.run(block_tables, starts, counts[0], {"input_ids": input_ids})
            if out is not None:
                return out[0], out[1]  # type: ignore[return-value]
        if g is not None:
            g.note_eager()
        return self.target.forward(input_ids, self.meta(block_tables, starts, counts), self.target_kv,
                                   self.aux_layer_ids)

    def forward_draft(self, input_ids: torch.Tensor, hidden: torch.Tensor, block_tables: Seq[Seq[int]],
                      starts: Seq[int], counts: Seq[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step (the proposer's): a graph replay when uniform, else eager."""
        assert self.draft is not None
        g = self.draft_graphs
        if g is not None and g.supports(starts, counts):
            out = g.run(block_tables, starts, counts[0], {"input_ids": input_ids, "hidden": hidden})
            if out is not None:
                return out[0], out[1]  # type: ignore[return-value]
        if g is not None:
            g.note_eager()
        kv = self.draft_kv[0] if len(self.draft_kv) == 1 else self.draft_kv
        return self.draft.forward(input_ids, hidden, self.meta(block_tables, starts, counts), kv)

    def forward_draft_tree(self, input_ids: torch.Tensor, hidden: torch.Tensor, block_tables: Seq[Seq[int]],
                           starts: Seq[int], counts: Seq[int], positions: torch.Tensor,
                           tree: TreeMask) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft-tree step (``spec.tree_proposer.TreeStepFn``): ``counts[b]`` frontier nodes per
        sequence at cache positions ``starts[b] ..``, rotated at ``positions`` (host), attending
        through ``tree``; a graph replay when every sequence has the same counts and tree size."""
        assert self.draft is not None
        g = self.draft_graphs
        n = tree.num_nodes[0] if tree.num_nodes else 0
        if g is not None and all(m == n for m in tree.num_nodes) and g.supports(starts, counts, n):
            step = TreeStep(n, tree.ancestors[:, :n, :n], positions.view(len(starts), -1))
            out = g.run(block_tables, starts, counts[0], {"input_ids": input_ids, "hidden": hidden}, step)
            if out is not None:
                return out[0], out[1]  # type: ignore[return-value]
        if g is not None:
            g.note_eager()
        meta = self.meta(block_tables, starts, counts)
        meta.positions = positions.to(meta.positions.device)
        meta.tree = tree
        kv = self.draft_kv[0] if len(self.draft_kv) == 1 else self.draft_kv
        return self.draft.forward(input_ids, hidden, meta, kv)

    # -- auto's cost model: measured step times ------------------------------------------------
    def _uniform_target_shape(self, scheduled: list[ScheduledSeq]) -> tuple[int, int] | None:
        """(batch, query length) of a pure decode / verify step with one draft count, else None."""
        if self.policy is None or not scheduled:
            return None
        q = scheduled[0].num_query_tokens
        if all(s.samples and s.num_tokens == 1 and s.num_query_tokens == q for s in scheduled):
            return len(scheduled), q
        return None

    def _timed(self, fn: Callable[[], Any], shape: tuple[int, int] | None, what: str) -> Any:
        """``fn()``; with ``shape``, its wall time goes to the policy's measured cost model."""
        cost = self.policy.cost if self.policy is not None else None
        if shape is None or not isinstance(cost, MeasuredCostModel):
            return fn()
        self._sync()
        t0 = time.perf_counter()
        out = fn()
        self._sync()
        dt = time.perf_counter() - t0
        if what == "target":
            cost.observe_target(shape[0], shape[1], dt)
        else:  # shape: (batch, draft steps run)
            cost.observe_draft(shape[0], dt / shape[1])
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def profile_costs(self, cost: MeasuredCostModel) -> None:
        """Seed ``cost`` with dummy forwards per batch bucket: the target at every query length
        1 .. k + 1 (forward + logits of every row; a query tile boundary can make one length cost
        much more than its neighbours, which interpolation would miss), one draft step. The dummy
        sequences share the first KV blocks (free at start-up; what they write is overwritten
        before it is read) and sit at a moderate context length: serving steps rescale each bucket
        to the real contexts (see MeasuredCostModel)."""
        max_num_seqs = self.config.max_num_seqs
        buckets = sorted({min(s, max_num_seqs) for s in capture_sizes(max_num_seqs)})
        cost.buckets = buckets  # serving steps rescale these rows (see MeasuredCostModel)
        bs, q_max = self.block_size, self.k + 1
        start = max(min(PROFILE_CONTEXT, self.num_blocks * bs - q_max - 1), 0)
        table = list(range(-(-(start + q_max) // bs)))
        if not table or len(table) > self.num_blocks:
            return
        dev = self.device

        def target(b: int, q: int) -> None:
            hidden, _ = self.forward_target(torch.zeros(b * q, dtype=torch.int64, device=dev), [table] * b,
                                            [start] * b, [q] * b)
            at = getattr(self.target, "compute_logits_at", None)  # tensor parallel: the workers take part
            if at is not None:
                at(hidden, torch.arange(b * q, device=hidden.device))
            else:
                self.target.compute_logits(hidden)

        def draft(b: int) -> None:
            assert self.draft is not None
            hidden = torch.zeros(b, self.draft.hidden_size, dtype=_hidden_dtype(self.draft), device=dev)
            post, _ = self.forward_draft(torch.zeros(b, dtype=torch.int64, device=dev), hidden, [table] * b,
                                         [start] * b, [1] * b)
            self.draft.compute_logits(post)

        for b in buckets:
            for q in range(1, q_max + 1):
                self._profile(lambda b=b, q=q: target(b, q), lambda dt, b=b, q=q: cost.seed_target(b, q, dt))
            self._profile(lambda b=b: draft(b), lambda dt, b=b: cost.seed_draft(b, dt))

    def _profile(self, fn: Callable[[], None], record: Callable[[float], None], runs: int = 2) -> None:
        """One untimed call (each shape's first call pays one-time costs: CUDA graph capture, Triton
        autotuning, allocator growth), then the fastest of ``runs`` timed calls (a stall of a
        shared machine lengthens single calls, never shortens them)."""
        fn()
        times = []
        for _ in range(runs):
            self._sync()
            t0 = time.perf_counter()
            fn()
            self._sync()
            times.append(time.perf_counter() - t0)
        record(min(times))

    def meta(self, block_tables: Seq[Seq[int]], starts: Seq[int], counts: Seq[int]) -> AttnMetadata:
        return build_attn_metadata(block_tables, starts, counts, self.block_size, self.device)

    @torch.inference_mode()
    def run_target(self, scheduled: list[ScheduledSeq]) -> TargetStepOutput:
        ids: list[int] = []
        row_starts: list[int] = []
        for item in scheduled:
            row_starts.append(len(ids))
            ids += item.input_ids()
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        tables, starts = [s.seq.block_table for s in scheduled], [s.start for s in scheduled]
        counts = [s.num_query_tokens for s in scheduled]
        trees = {i: t for i, s in enumerate(scheduled) if (t := _tree_of(s)) is not None}
        if trees:
            out = self._tree_graph(input_ids, scheduled, trees)
            if out is None:  # eager, with the trees' attention metadata
                if self.target_graphs is not None:
                    self.target_graphs.note_eager()
                meta = self._tree_step_meta(self.meta(tables, starts, counts), scheduled, row_starts, trees)
                out = self.target.forward(input_ids, meta, self.target_kv, self.aux_layer_ids)
            hidden, aux = out
        else:
            hidden, aux = self.forward_target(input_ids, tables, starts, counts)

        emitted: list[list[int]] = [[] for _ in scheduled]
        logprobs: list[list[TokenLogprob] | None] = [None] * len(scheduled)
        sampling = [i for i, s in enumerate(scheduled) if s.samples and i not in trees]
        if sampling:
            rows, lps = self._verify([scheduled[i] for i in sampling], [row_starts[i] for i in sampling], hidden)
            for i, toks, lp in zip(sampling, rows, lps, strict=True):
                emitted[i], logprobs[i] = toks, lp
        nodes: dict[int, list[int]] = {}
        if trees:
            for i, (toks, acc, lp) in self._verify_trees(scheduled, row_starts, trees, hidden).items():
                emitted[i], nodes[i], logprobs[i] = toks, acc, lp
        prompt: list[list[TokenLogprob | None] | None] = [None] * len(scheduled)
        if any(s.seq.params.prompt_logprobs is not None for s in scheduled):
            prompt = step_prompt_logprobs(scheduled, row_starts, lambda r: self._logits_at(hidden, r))
        return TargetStepOutput(emitted, aux, row_starts, nodes, logprobs, prompt)

    def _logits_at(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The target's float32 logits of ``rows`` of ``hidden`` (tensor parallel: with the workers)."""
        rows = rows.to(hidden.device)
        at = getattr(self.target, "compute_logits_at", None)
        return at(hidden, rows) if at is not None else self.target.compute_logits(hidden[rows])

    def _tree_graph(self, input_ids: torch.Tensor, scheduled: list[ScheduledSeq], trees: dict[int, DraftTree]
                    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A verify step of trees only, the same size each (every query token a tree node), as a
        graph replay; None when the step does not fit one (it then runs eagerly)."""
        g = self.target_graphs
        if g is None or len(trees) != len(scheduled) or any(s.num_tokens != 1 for s in scheduled):
            return None
        n = trees[0].parents.shape[1]
        counts = [s.num_query_tokens for s in scheduled]
        tables = [s.seq.block_table for s in scheduled]
        starts = [s.start for s in scheduled]  # the root: the last real token
        if any(t.parents.shape[1] != n for t in trees.values()) or not g.supports(starts, counts, n):
            return None
        ordered = [trees[i] for i in range(len(scheduled))]
        anc = torch.cat([ancestor_mask(t.parents) for t in ordered])
        pos = torch.tensor(starts, dtype=torch.int64)[:, None] + torch.cat([t.depth for t in ordered]).to(torch.int64)
        out = g.run(tables, starts, n, {"input_ids": input_ids}, TreeStep(n, anc, pos))
        return None if out is None else (out[0], out[1])  # type: ignore[return-value]

    def _tree_step_meta(self, meta: AttnMetadata, scheduled: list[ScheduledSeq], row_starts: list[int],
                        trees: dict[int, DraftTree]) -> AttnMetadata:
        """A step's metadata with the draft trees: each tree's N rows (the last real token, its
        root, then the drafted nodes) at positions root + depth, attending to their ancestors."""
        n_max = max(t.parents.shape[1] for t in trees.values())
        anc = torch.zeros(len(scheduled), n_max, n_max, dtype=torch.bool)
        num_nodes = [0] * len(scheduled)
        positions = meta.positions.clone()
        for i, tree in trees.items():
            n = tree.parents.shape[1]
            root_row = row_starts[i] + scheduled[i].num_tokens - 1
            root_pos = scheduled[i].start + scheduled[i].num_tokens - 1
            positions[root_row: root_row + n] = (root_pos + tree.depth[0]).to(positions.device)
            anc[i, :n, :n] = ancestor_mask(tree.parents)[0]
            num_nodes[i] = n
        meta.positions = positions
        meta.tree = TreeMask(num_nodes, anc.to(meta.positions.device))
        return meta

    def _verify_trees(self, scheduled: list[ScheduledSeq], row_starts: list[int], trees: dict[int, DraftTree],
                      hidden: torch.Tensor) -> dict[int, tuple[list[int], list[int], list[TokenLogprob] | None]]:
        """Tree acceptance (point-mass children) per tree, then the accepted path's KV moved to
        chain positions. Returns per tree (emitted tokens, accepted nodes, logprob entries of the
        emitted tokens: from the root's row, then the accepted nodes' rows)."""
        out: dict[int, tuple[list[int], list[int], list[TokenLogprob] | None]] = {}
        at = getattr(self.target, "compute_logits_at", None)
        for i, tree in trees.items():  # one tree at a time: trees of different sizes need no padding
            item = scheduled[i]
            root_row = row_starts[i] + item.num_tokens - 1
            rows = torch.arange(root_row, root_row + tree.parents.shape[1], device=hidden.device)
            logits = at(hidden, rows) if at is not None else self.target.compute_logits(hidden[rows])
            batch = SamplingBatch.build([item.seq.params], [item.seq.generator], device=logits.device)
            res = tree_rejection_sample(logits[None], tree, batch, None, self.generator)
            acc = res.node_ids[0, : int(res.num_accepted[0])].tolist()
            # tensor parallel: TPTarget.compact_tree_kv moves the workers' copies too
            compact = getattr(self.target, "compact_tree_kv", compact_tree_kv)
            compact(self.target_kv, item.seq.block_table, self.block_size, item.start + item.num_tokens - 1, acc)
            toks = res.rows()[0]
            out[i] = (toks, acc, emitted_logprobs(logits, [[0] + acc], [toks], [item.seq.params])[0])
        return out

    @torch.inference_mode()
    def verify_tree(self, tree: DraftTree, block_tables: Seq[Seq[int]], starts: Seq[int]
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward over ``B`` draft trees (eager: no CUDA graph, torch reference
        attention only): ``tree.tokens`` are written to the KV slots of positions ``starts[b] ..
        starts[b] + N - 1`` in node order (blocks must be allocated). Returns the target's logits
        float32 ``[B, N, V]`` (row ``i``: the prediction after node ``i``'s path, what
        ``tree_rejection_sample`` takes) and the aux states ``[B * N, n*H]`` (None without a draft).
        A standalone entry (tests, the reference driver); :meth:`step` verifies the trees of
        scheduled sequences inside its one forward (docs/trees.md)."""
        check_parents(tree.parents.cpu())
        b, n = tree.parents.shape
        meta = build_tree_attn_metadata(block_tables, starts, tree, self.block_size, self.device)
        hidden, aux = self.target.forward(tree.tokens.reshape(-1).to(self.device), meta, self.target_kv,
                                          self.aux_layer_ids)
        at = getattr(self.target, "compute_logits_at", None)  # tensor parallel: the workers need the rows
        rows = torch.arange(b * n, device=hidden.device)
        logits = at(hidden, rows) if at is not None else self.target.compute_logits(hidden)
        return logits.view(b, n, -1), aux

    def _verify(self, items: list[ScheduledSeq], row_starts: list[int], hidden: torch.Tensor
                ) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
        """Greedy / rejection-sampling verification of each sampling sequence's drafts (none for
        plain decode and the last prefill chunk: then this is ordinary sampling). Returns the
        emitted tokens and, for sequences that asked, their logprob entries (None otherwise)."""
        first = [r + it.num_tokens - 1 for r, it in zip(row_starts, items, strict=True)]
        num_drafts = [len(it.draft_ids) for it in items]
        # Row of the last real token, then one row per draft; padded to k + 1 by repeating. auto
        # pads only to this step's longest chain (static k keeps its fixed width, and its bits).
        k = self.k if self.policy is None else max(max(num_drafts), 1)
        unique = torch.tensor([f + j for f, nd in zip(first, num_drafts, strict=True) for j in range(nd + 1)],
                              dtype=torch.int64, device=hidden.device)
        at = getattr(self.target, "compute_logits_at", None)  # tensor parallel: the workers need the rows
        logits = at(hidden, unique) if at is not None else self.target.compute_logits(hidden[unique])  # fp32 [R, V]
        offsets = torch.tensor([0] + num_drafts[:-1], dtype=torch.int64).add(1).cumsum(0) - 1
        col = torch.arange(k + 1)
        pad_idx = offsets[:, None] + torch.minimum(col[None, :], torch.tensor(num_drafts)[:, None])
        target_logits = logits[pad_idx.to(logits.device)]  # [B, k+1, V]

        draft_ids, n_drafts = pad_drafts([it.draft_ids for it in items], k, logits.device)
        draft_probs = None
        if any(it.seq.draft_probs is not None and it.draft_ids for it in items):
            draft_probs = torch.zeros(len(items), k, logits.shape[-1], dtype=torch.float32, device=logits.device)
            for b, it in enumerate(items):
                if it.seq.draft_probs is not None and it.draft_ids:
                    draft_probs[b, : len(it.draft_ids)] = it.seq.draft_probs[: len(it.draft_ids)]
        batch = SamplingBatch.build([it.seq.params for it in items], [it.seq.generator for it in items],
                                    device=logits.device)
        out = rejection_sample(target_logits, draft_ids, n_drafts, batch, draft_probs, self.generator)
        emitted = out.rows()
        params = [it.seq.params for it in items]
        if all(p.logprobs is None for p in params):
            return emitted, [None] * len(items)
        # emitted token j of sequence b came from row offsets[b] + j of ``logits`` (j <= its drafts)
        rows = [[o + j for j in range(len(e))] for o, e in zip(offsets.tolist(), emitted, strict=True)]
        return emitted, emitted_logprobs(logits, rows, emitted, params)
