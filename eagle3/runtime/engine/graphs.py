"""CUDA / HIP graphs for the uniform steps: the target's decode and verify forwards and the draft's
steps, captured per (query tokens per sequence, batch-size bucket) and replayed with padding.

A *uniform* step gives every sequence the same number of query tokens ``n``: plain decode (1), EAGLE
verify (last token + k drafts = k+1), draft steps 1..k-1 (1) and a draft step 0 whose sequences all
committed the same count. Its batch of ``B`` sequences is padded to the bucket ``B' >= B`` (1, 2, 4, 8,
... up to ``max_num_seqs``, as vLLM and nano-vllm do) and run through a graph captured for
``(n, B')`` over *static* buffers: ``input_ids``, ``positions``, ``slot_mapping`` ``[B' n]``,
``block_tables`` ``[B', width]``, ``context_lens`` ``[B']`` and the model's extra inputs (the draft's
hidden states). Each step copies its inputs in (:func:`pad_uniform_step` builds the padded host
tensors, :meth:`StaticBuffers.copy_in` writes them), replays, and copies the first ``B n`` rows of
the outputs out (:func:`copy_out`). Mixed steps (prefill chunks, sequences with fewer drafts) run
eagerly, and so do steps whose longest context is past their graph's cap (:func:`context_cap`: the
graph's table width, so its MLA split grid and workspace, follow the cap, not ``max_model_len``).

Draft-tree steps (:class:`TreeStep`) are uniform too: a verify of ``N`` nodes per sequence, a draft
step of ``K`` frontier nodes over a region of ``W`` tree nodes. Their graphs are keyed by
``(n, B', W)`` and their static buffers add the ancestor mask ``[B', W, W]``; the positions buffer
holds the RoPE positions (root + depth), the slots follow the cache positions. The kernels derive
everything else about the tree from the mask by device ops (docs/trees.md, "CUDA graphs").

Padding rows are sequences of ``n`` tokens at position 0 whose block table names one spare *pad
block* past the engine's blocks (the KV caches get one extra block; the block manager never hands it
out): they write their latents there and attend only to it, so they never touch a real sequence's
cache. Their outputs are dropped. Because every kernel is batch invariant (a row's bits do not
depend on the other rows of the call), the real rows of a padded replay equal an eager run of the
real rows alone, bit for bit (tests/runtime/test_graphs.py checks this through ``LLM`` on the CPU
with :class:`EagerCapturer`, which runs the same static-buffer path without a graph).

Metadata under capture: nothing may copy between host and device or read a device value while a
graph is being captured, and a replay re-runs exactly the recorded kernels on the recorded
addresses. So the per-forward metadata of a graph is built once per ``(n, B')`` from host values that
are constant for that key (``cu_seqlens_q`` = ``arange(B'+1) * n``, kept on the host in
``AttnMetadata.host_cu``) plus views of the static buffers; the Triton attention plan keeps its
chunk list (a function of ``cu`` only) in ``AttnMetadata.cache``, filled by the eager warm-up run
and reused by the capture, and converts positions / block tables by device ops that the graph
records. A graph keeps no references to what it reads, so the runner keeps each graph's metadata
(and the capturer the captured function) for as long as the graph: the chunk lists are made by the
warm-up, outside the graph's memory pool, and were freed after the first GPU run's capture
(replays then read reused memory). Constant tables a kernel reads (codecs' lookup tables) are
copied to the device once per device and kept (``codecs.on_device``), never per call: a copy from
pageable host memory is not allowed under capture. A backend whose ops sync with the host (the torch reference's MoE and attention schedule;
not the Triton backend, whose fused MoE sizes its buffers by an upper bound) fails to capture: the runner then logs why once and runs
that model eagerly from then on. On an H200 the Triton backend's target and draft graphs (chain and
tree) capture and replay with the eager tokens; HIP graphs are unverified (docs/kernels.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eagle3.runtime import split_kv
from eagle3.runtime.context import AttnMetadata, TreeMask

logger = logging.getLogger("eagle3.runtime")

Outputs = tuple[torch.Tensor | None, ...]
ForwardFn = Callable[[dict[str, torch.Tensor], AttnMetadata], Outputs]


def available(device: torch.device) -> bool:
    """Graphs exist on CUDA / ROCm devices only; on the CPU every step is eager."""
    return device.type == "cuda" and torch.cuda.is_available()


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch buckets: powers of two from 1 up to the first one >= ``max_num_seqs``."""
    sizes = [1]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] * 2)
    return sizes


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` sequences (None: larger than every bucket)."""
    for s in sizes:
        if s >= num_seqs:
            return s
    return None


def context_cap(longest: int, tokens: int, mla: Any = None, explicit: int | None = None) -> int:
    """The context cap of a graph of ``tokens`` query tokens (bucket x query tokens per sequence):
    ``explicit`` (``max_seq_len_to_capture``, one cap for every graph) when given; else, for an MLA
    model (``mla``: its ``MLASpec``), the longest context whose split workspace at ``tokens`` fits
    ``split_kv.GRAPH_WORKSPACE_BUDGET`` (so a small batch's graphs cover longer contexts than a
    full batch's); else (no split workspace: the Llama draft) ``longest``, the longest context a
    step can have, which bounds every cap."""
    if explicit is not None:
        cap = explicit
    elif mla is not None:
        cap = split_kv.graph_context_cap(tokens, mla.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim)
    else:
        cap = longest
    return max(1, min(cap, longest))


@dataclass
class PaddedStep:
    """Host tensors of a uniform step padded to its bucket (see :func:`pad_uniform_step`)."""

    positions: torch.Tensor  # int64 [B' n]
    slot_mapping: torch.Tensor  # int64 [B' n]
    block_tables: torch.Tensor  # int32 [B', width], -1 padded
    context_lens: torch.Tensor  # int32 [B']
    ancestors: torch.Tensor | None = None  # bool [B', W, W]: a tree step's mask (TreeStep), padded, on its device


@dataclass
class TreeStep:
    """What makes a uniform step a draft-tree step (``AttnMetadata.tree``): every sequence's last
    ``num_nodes`` cache positions hold tree nodes, its ``n`` query tokens are the last ``n`` of them,
    rotated at ``positions`` (root position + depth, not their cache positions)."""

    num_nodes: int
    ancestors: torch.Tensor  # bool [B, num_nodes, num_nodes] (on any device: no host round trip)
    positions: torch.Tensor  # int64 [B, n] RoPE positions of the query tokens (host)


def pad_uniform_step(block_tables: Sequence[Sequence[int]], starts: Sequence[int], q_len: int, bucket: int,
                     width: int, block_size: int, pad_block: int, tree: TreeStep | None = None) -> PaddedStep:
    """Sequence ``b < B`` queries cache positions ``starts[b] .. starts[b] + q_len - 1`` through the
    first ``width`` blocks of its table (every context must fit them: the graph's cap); sequences
    ``B .. bucket-1`` are padding: ``q_len`` tokens at position 0 in ``pad_block`` (every column of
    their tables). A tree step's padding sequences query positions
    ``num_nodes - q_len ..`` instead: their context holds a whole tree, a chain (each node seeing
    the ones before it)."""
    b = len(starts)
    if not 0 < b <= bucket:
        raise ValueError(f"{b} sequences do not fit a bucket of {bucket}")
    if max(starts) + q_len > width * block_size:
        raise ValueError(f"a context of {max(starts) + q_len} positions is past the static {width} blocks")
    # A table's blocks past the step's context (allocated ahead for drafts) are never read: cut there.
    tables = torch.full((bucket, width), -1, dtype=torch.int32)
    for i, t in enumerate(block_tables):
        if t:
            t = list(t[:width])
            tables[i, : len(t)] = torch.as_tensor(t, dtype=torch.int32)
    tables[b:] = pad_block
    offs = torch.arange(q_len)
    pos = torch.zeros(bucket, q_len, dtype=torch.int64)
    pos[:b] = torch.as_tensor(list(starts), dtype=torch.int64)[:, None] + offs[None, :]
    if tree is not None:
        pos[b:] = max(tree.num_nodes - q_len, 0) + offs[None, :]
    blk = tables[:, :].to(torch.int64).gather(1, (pos // block_size).clamp(max=width - 1))
    if bool((blk[:b] < 0).any()):
        raise ValueError("a query position has no KV block allocated")
    slots = blk * block_size + pos % block_size
    slots[b:] = pad_block * block_size  # every padding token writes the pad block's first slot
    ctx = (pos[:, -1] + 1).to(torch.int32)
    anc = None
    if tree is not None:
        n = tree.num_nodes
        anc = torch.ones(n, n, dtype=torch.bool, device=tree.ancestors.device).tril().repeat(bucket, 1, 1)
        anc[:b] = tree.ancestors
        pos[:b] = tree.positions
    return PaddedStep(pos.reshape(-1), slots.reshape(-1), tables, ctx, anc)


class StaticBuffers:
    """The fixed-address inputs every graph of one model reads (sized for the largest bucket; the
    draft-tree ancestor masks per tree size, made when a tree step first needs one). The block
    tables are one flat buffer of ``max_seqs x width`` entries: a graph whose context cap spans
    ``w <= width`` blocks reads its first ``B' w`` as a contiguous ``[B', w]`` table."""

    def __init__(self, max_tokens: int, max_seqs: int, width: int, device: torch.device,
                 extra: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        z = dict(device=device)
        self.max_tokens, self.max_seqs, self.width = max_tokens, max_seqs, width
        self.tensors: dict[str, torch.Tensor] = {
            "input_ids": torch.zeros(max_tokens, dtype=torch.int64, **z),
            "positions": torch.zeros(max_tokens, dtype=torch.int64, **z),
            "slot_mapping": torch.zeros(max_tokens, dtype=torch.int64, **z),
            "block_tables": torch.full((max_seqs * width,), -1, dtype=torch.int32, **z),
            "context_lens": torch.ones(max_seqs, dtype=torch.int32, **z),
        }
        # One buffer per tree size (a graph reads its mask contiguous, as an eager step's is).
        self.ancestors: dict[int, torch.Tensor] = {}
        for name, (shape, dtype) in extra.items():
            self.tensors[name] = torch.zeros(max_tokens, *shape, dtype=dtype, **z)

    def copy_in(self, step: PaddedStep, inputs: dict[str, torch.Tensor], num_tokens: int) -> None:
        """Write a step's padded metadata and its per-token inputs (rows ``0 .. num_tokens-1``;
        the padding rows up to the bucket get zeros) into the static buffers."""
        tp = step.positions.shape[0]
        bp = step.block_tables.shape[0]
        s = self.tensors
        s["positions"][:tp].copy_(step.positions, non_blocking=True)
        s["slot_mapping"][:tp].copy_(step.slot_mapping, non_blocking=True)
        s["block_tables"][: step.block_tables.numel()].copy_(step.block_tables.reshape(-1), non_blocking=True)
        s["context_lens"][:bp].copy_(step.context_lens, non_blocking=True)
        if step.ancestors is not None:
            self._ancestors(step.ancestors.shape[-1])[:bp].copy_(step.ancestors, non_blocking=True)
        for name, x in inputs.items():
            buf = s[name]
            buf[:num_tokens].copy_(x)
            if tp > num_tokens:
                buf[num_tokens:tp].zero_()

    def _ancestors(self, n: int) -> torch.Tensor:
        if n not in self.ancestors:
            self.ancestors[n] = torch.zeros(self.max_seqs, n, n, dtype=torch.bool,
                                            device=self.tensors["positions"].device)
        return self.ancestors[n]

    def meta(self, q_len: int, bucket: int, block_size: int, tree_nodes: int = 0,
             width: int | None = None) -> AttnMetadata:
        """The metadata a graph for ``(q_len, bucket)`` is captured with: views of the static buffers
        (block tables ``width`` blocks wide: the graph's cap; default all) plus the constant
        ``cu_seqlens_q`` (host and device copies) and a device-tensor cache; with ``tree_nodes``, the
        tree mask of a draft-tree step (its node count is part of the graph's key)."""
        tp = q_len * bucket
        w = self.width if width is None else width
        s = self.tensors
        cu = [i * q_len for i in range(bucket + 1)]
        dev = s["positions"].device
        tree = TreeMask([tree_nodes] * bucket, self._ancestors(tree_nodes)[:bucket]) if tree_nodes else None
        return AttnMetadata(positions=s["positions"][:tp], cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
                            context_lens=s["context_lens"][:bucket], slot_mapping=s["slot_mapping"][:tp],
                            block_tables=s["block_tables"][: bucket * w].view(bucket, w), block_size=block_size, host_cu=cu, cache={},
                            tree=tree)


def copy_out(outputs: Outputs, num_tokens: int) -> Outputs:
    """The real rows of a replay's outputs, as new tensors (the next replay overwrites the static ones)."""
    return tuple(None if o is None else o[:num_tokens].clone() for o in outputs)


class CudaGraphCapturer:
    """``torch.cuda.CUDAGraph`` capture (also HIP graphs on ROCm builds of torch), one memory pool
    shared by every graph of the runner (only one replays at a time)."""

    def __init__(self) -> None:
        self.pool: Any = None

    def capture(self, fn: Callable[[], Outputs]) -> Callable[[], Outputs]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy inits, autotuning, the plan cache
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return CapturedGraph(graph, out, fn)


@dataclass
class CapturedGraph:
    """A captured graph and its outputs; calling it replays. A graph holds raw addresses, no
    references: the tensors it reads that were made outside its pool (the metadata ``forward``
    closes over, the plan's chunk lists the warm-up put in ``AttnMetadata.cache``) must live as
    long as the graph, so the captured function is kept with it. (Dropped after the capture, they
    were freed and a replay read whatever the allocator put there next: an illegal memory access,
    or silently wrong rows.)"""

    graph: Any
    out: Outputs
    forward: Callable[[], Outputs]  # kept alive: see the class doc

    def __call__(self) -> Outputs:
        self.graph.replay()
        return self.out


class EagerCapturer:
    """No graph: "replay" runs the forward again over the static buffers. Takes the whole padded,
    static-buffer path on any device (the CPU tests use it to check padding and copy-in / out).

    No warm-up run: the CUDA capturer's warm-up exists so that lazy state (the plan cache) is
    filled outside the graph; here the first replay fills it and later replays reuse it, so a
    warm-up would only repeat one forward per captured key (a quarter of an interpreted Triton
    graph test's time)."""

    def capture(self, fn: Callable[[], Outputs]) -> Callable[[], Outputs]:
        return fn


def default_capturer() -> Any:
    return CudaGraphCapturer()


class GraphRunner:
    """Captured forwards of one model, keyed by (query tokens per sequence, bucket), and for
    draft-tree steps by (query tokens per sequence, bucket, tree nodes per sequence).

    ``forward(static, meta)`` runs the model on views of the static buffers (``static[name][:B' n]``)
    and returns its outputs (tensors or None); it must read nothing else that changes per step."""

    def __init__(self, name: str, forward: ForwardFn, *, device: torch.device, block_size: int,
                 max_context: int | Callable[[int], int], pad_block: int, max_num_seqs: int, max_q_len: int,
                 extra: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
                 capturer: Any = None, max_tree_nodes: int = 0) -> None:
        self.name = name
        self.forward = forward
        self.block_size = block_size
        self.pad_block = pad_block
        self.sizes = capture_sizes(max_num_seqs)
        self.max_q_len = max_q_len  # query tokens per sequence of a chain / decode step
        self.max_tree_nodes = max_tree_nodes  # 0: tree steps run eagerly
        # The context cap of a graph of T query tokens (:func:`context_cap`; a number: the same for
        # every graph): its block tables hold the cap's blocks, so its MLA split grid and workspace
        # follow the cap; a step with a longer context runs eagerly. Caps shrink as T grows, so the
        # smallest graph's (one token) is the longest, and the static tables are that wide.
        self._cap = max_context if callable(max_context) else (lambda tokens, c=max_context: c)
        self._caps: dict[int, int] = {}
        self.max_context = self.context_cap(1)
        rows = max(max_q_len, max_tree_nodes)  # a tree step queries at most its nodes
        self.static = StaticBuffers(self.sizes[-1] * rows, self.sizes[-1], self.width(1), device, extra or {})
        self.capturer = capturer if capturer is not None else default_capturer()
        self.graphs: dict[tuple[int, ...], Callable[[], Outputs]] = {}
        # The metadata each graph was captured with: its cache holds device tensors (the plan's
        # chunk lists) that the graph reads on every replay, so it lives as long as the graph.
        self.metas: dict[tuple[int, ...], AttnMetadata] = {}
        self.failed: str | None = None  # why capture failed (the model then runs eagerly)
        # why a tree step's capture failed (tree steps then run eagerly; chain and decode graphs stay)
        self.tree_failed: str | None = None
        self.replays = 0
        self.eager = 0  # forwards of this model that ran eagerly (the runner counts them: ``note_eager``)
        self.over_cap = 0  # of which graph-shaped ones with a context past their graph's cap

    def context_cap(self, tokens: int) -> int:
        """The longest context (positions, the step's queries included) a graph of ``tokens`` query
        tokens covers."""
        if tokens not in self._caps:
            self._caps[tokens] = max(1, int(self._cap(tokens)))
        return self._caps[tokens]

    def width(self, tokens: int) -> int:
        """Block-table width of a graph of ``tokens`` query tokens: its cap's blocks."""
        return -(-self.context_cap(tokens) // self.block_size)

    def supports(self, starts: Sequence[int], counts: Sequence[int], tree_nodes: int = 0) -> bool:
        """Whether a step can replay a graph: uniform, small enough (a tree step: at most
        ``max_tree_nodes`` nodes per sequence, querying at most all of them; any other step at most
        ``max_q_len`` tokens per sequence) and every context ``starts[b] + counts[b]`` (a tree
        step's padding rows: ``tree_nodes``) within the cap of its graph, ``bucket x counts[b]``
        query tokens (a step that fails only that is counted in ``over_cap``)."""
        if self.failed is not None or not counts:
            return False
        if tree_nodes and (self.tree_failed is not None or tree_nodes > self.max_tree_nodes):
            return False
        n = counts[0]
        bucket = bucket_for(len(counts), self.sizes)
        if not (all(c == n for c in counts) and 1 <= n <= (tree_nodes or self.max_q_len) and bucket is not None):
            return False
        if max(max(starts) + n, tree_nodes) > self.context_cap(bucket * n):
            self.over_cap += 1
            return False
        return True

    def note_eager(self) -> None:
        self.eager += 1

    def stats(self) -> dict[str, int]:
        """This model's context caps (of its smallest graph, one token, and of its largest decode /
        verify graph, the largest bucket x ``max_q_len``) and its forwards: replayed, run eagerly,
        and of those the graph-shaped ones past their graph's cap."""
        return {"max_context": self.max_context,
                "max_context_full_batch": self.context_cap(self.sizes[-1] * self.max_q_len),
                "replays": self.replays, "eager": self.eager, "eager_over_cap": self.over_cap}

    def run(self, block_tables: Sequence[Sequence[int]], starts: Sequence[int], q_len: int,
            inputs: dict[str, torch.Tensor], tree: TreeStep | None = None) -> Outputs | None:
        """The step's outputs (real rows only), or None when the graph could not be captured (the
        caller then runs the step eagerly; the static copy-in has no effect on anything else)."""
        b = len(starts)
        bucket = bucket_for(b, self.sizes)
        assert bucket is not None
        width = self.width(bucket * q_len)
        step = pad_uniform_step(block_tables, starts, q_len, bucket, width, self.block_size, self.pad_block, tree)
        self.static.copy_in(step, inputs, b * q_len)
        nodes = 0 if tree is None else tree.num_nodes
        key = (q_len, bucket) if tree is None else (q_len, bucket, nodes)
        replay = self.graphs.get(key)
        if replay is None:
            meta = self.static.meta(q_len, bucket, self.block_size, nodes, width)
            views = {k: v[: q_len * bucket] for k, v in self.static.tensors.items()
                     if k not in ("block_tables", "context_lens")}
            try:
                replay = self.capturer.capture(lambda: self.forward(views, meta))
            except Exception as err:  # noqa: BLE001 - any capture failure means "run eagerly"
                why = f"{type(err).__name__}: {err}".splitlines()[0]
                if tree is None:
                    self.failed = why
                else:  # e.g. memory for a large tree's graph: the chain / decode graphs stay
                    self.tree_failed = why
                logger.warning("%s: CUDA graph capture failed, running %s eagerly from now on (%s)", self.name,
                               "every step" if tree is None else "tree steps", why)
                _reset_capture_state()
                return None
            self.graphs[key] = replay
            self.metas[key] = meta
        self.replays += 1
        return copy_out(replay(), b * q_len)


def _reset_capture_state() -> None:
    """After a failed capture: make sure no stream is left capturing (torch ends the capture when the
    ``torch.cuda.graph`` context exits with an error; this only waits for the device)."""
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - best effort; the eager step that follows reports real errors
            pass
