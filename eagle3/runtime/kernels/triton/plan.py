"""Per-forward attention indices shared by every attention layer (the backend's ``plan``).

Query tokens are cut into *chunks*: up to ``qt`` consecutive query tokens of one sequence (a
verify window of k+1 tokens, or a run of a prefill chunk), so that one attention program reads
the sequence's keys once for all of them. ``qt`` is a per-model constant (it follows from the
head layout, never from the batch). A token's output does not depend on its chunk-mates: each
row is masked by its own position, and key tiles past it contribute exact zeros (see the
attention kernels).
"""

from __future__ import annotations

import torch

from eagle3.errors import UsageError
from eagle3.runtime.context import AttnMetadata, pack_tree_paths

TREE_MAX_NODES = 64  # tree nodes per sequence at most (the width of a tree query's ancestor path)
ORDINARY = 2**31 - 1  # ``lo`` of a query token that is not a tree node: no key of it is remapped


class TritonAttnPlan:
    """Per query token its absolute position, the block tables (int32, on the device), and
    lazily per chunk height ``qt`` the chunk list ``(first token, tokens, sequence)``."""

    def __init__(self, meta: AttnMetadata) -> None:
        dev = meta.positions.device
        self.device = dev
        self.positions = meta.positions.to(dev, torch.int32).contiguous()
        self.block_tables = meta.block_tables.to(dev, torch.int32).contiguous()
        self.block_size = int(meta.block_size)
        # The host copy when the builder kept one: no device sync, which a CUDA-graph capture forbids.
        self.cu = list(meta.host_cu) if meta.host_cu is not None else meta.cu_seqlens_q.to("cpu", torch.int64).tolist()
        # Chunk lists depend only on cu (fixed for a graph's batch bucket): a metadata that carries a
        # cache (engine/graphs.py) keeps them across warm-up, capture and replay, so that the capture
        # never copies from the host. positions / block_tables above are converted per forward by
        # device ops (no copy when already int32), which a graph records and replays.
        self._chunks: dict[object, torch.Tensor] = meta.cache if meta.cache is not None else {}
        # Draft trees (AttnMetadata.tree): a tree query masks by its virtual position (start +
        # depth) and reads its virtual keys start, start+1, .. at its ancestors' cache positions
        # (``tree_arrays``). A chunk shares one key map, so a tree chunk holds one root-to-node
        # path (``pack_tree_paths``), the deepest query's map serving it; its tokens need not be
        # consecutive, so chunks index ``order(qt)``, the query tokens in chunk order. A graph's
        # metadata gives each tree query a chunk of its own instead: grouping needs the tree's
        # shape on the host, which changes per replay (a row's bits never depend on its chunk-mates).
        self.tree: tuple[torch.Tensor, torch.Tensor] | None = None
        self._tree_paths: dict[int, list[int]] = {}  # tree query token -> its path (host)
        if meta.tree is not None:
            tokens = _tree_tokens(meta, self.cu)
            self.positions, lo, paths = tree_arrays(meta, tokens, self._chunks)
            self.tree = (lo, paths)
            if meta.cache is None:
                self._tree_paths = _host_paths(meta, tokens, self.positions, lo, paths)
            else:  # a graph's metadata: the tree changes per replay, so no chunk may depend on its shape
                self._tree_paths = {t: [t] for t, *_ in tokens}

    def chunks(self, qt: int) -> torch.Tensor:
        """int32 ``[C, 3]``: (first row, number of rows <= qt, sequence index). A row is a query
        token; with draft trees an entry of :meth:`order`."""
        key = ("triton_chunks", qt)
        if key not in self._chunks:
            if self.tree is None:
                rows = [(t, min(qt, t1 - t), b)
                        for b, (t0, t1) in enumerate(zip(self.cu[:-1], self.cu[1:], strict=True))
                        for t in range(t0, t1, qt)]
            else:
                rows, order = self._tree_chunks(qt)
                self._chunks[("triton_order", qt)] = torch.tensor(order or [0], dtype=torch.int32).to(self.device)
            self._chunks[key] = torch.tensor(rows or [(0, 0, 0)], dtype=torch.int32).reshape(-1, 3).to(self.device)
        return self._chunks[key]

    def _tree_chunks(self, qt: int) -> tuple[list[tuple[int, int, int]], list[int]]:
        """Chunk rows and the token order they index: a sequence's ordinary query tokens in runs
        of ``qt``, then its tree queries grouped along root-to-node paths."""
        rows: list[tuple[int, int, int]] = []
        order: list[int] = []
        for b, (t0, t1) in enumerate(zip(self.cu[:-1], self.cu[1:], strict=True)):
            tree0 = next((t for t in range(t0, t1) if t in self._tree_paths), t1)
            for t in range(t0, tree0, qt):
                rows.append((len(order), min(qt, tree0 - t), b))
                order += range(t, min(t + qt, tree0))
            for group in pack_tree_paths([self._tree_paths[t] for t in range(tree0, t1)], qt):
                rows.append((len(order), len(group), b))
                order += [tree0 + i for i in group]
        return rows, order

    def order(self, qt: int) -> torch.Tensor | None:
        """Draft trees: int32 ``[T]``, the query tokens in the chunk order of :meth:`chunks`
        (None without trees: the rows are the tokens)."""
        if self.tree is None:
            return None
        self.chunks(qt)
        return self._chunks[("triton_order", qt)]


def _tree_tokens(meta: AttnMetadata, cu: list[int]) -> list[tuple[int, int, int, int]]:
    """The query tokens that are tree nodes as (token, sequence, node index, the sequence's node
    count): host values that follow from ``cu`` and ``num_nodes`` alone, constant for a graph."""
    assert meta.tree is not None
    out: list[tuple[int, int, int, int]] = []
    for b, n in enumerate(meta.tree.num_nodes):
        if n <= 0:
            continue
        if n > TREE_MAX_NODES or n > meta.tree.ancestors.shape[-1]:
            raise UsageError(f"the triton tree mask holds up to {TREE_MAX_NODES} tree nodes per sequence "
                             f"(sequence {b}: {n}, ancestor mask width {meta.tree.ancestors.shape[-1]})")
        t1 = cu[b + 1]
        m = min(n, t1 - cu[b])  # the query tokens are the last m nodes
        out += [(t1 - m + i, b, n - m + i, n) for i in range(m)]
    return out


def tree_arrays(meta: AttnMetadata, tokens: list[tuple[int, int, int, int]],
                cache: dict[object, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query token (on the metadata's device): ``reach`` int32 (its last virtual key
    position: a tree node's start + depth, else its position), ``lo`` int32 (the first tree
    position; :data:`ORDINARY` for other tokens) and ``paths`` int32 ``[T, TREE_MAX_NODES]``
    (the cache positions of a tree node's ancestors and itself in depth order), so that virtual
    key ``k`` of a tree query lives at cache position ``paths[t, k - lo]`` when ``k >= lo``, else
    at ``k``. Nodes are topological, so a node's ancestors in node order are in depth order.

    Device ops over the ancestor mask only (no value comes back to the host): a CUDA graph
    records them, and each replay computes the arrays of the tree in its static buffers. The
    tree tokens' index (``tokens``, :func:`_tree_tokens`: it depends on ``cu`` and ``num_nodes``
    only) goes to the device once and is kept in ``cache`` (a graph's warm-up fills it, as the
    chunk lists)."""
    assert meta.tree is not None
    dev = meta.positions.device
    key = ("triton_tree_index",)
    if key not in cache:
        cache[key] = torch.tensor(tokens, dtype=torch.int64).t().contiguous().to(dev) if tokens else None
    reach = meta.positions.to(torch.int32).clone()
    lo = torch.full_like(reach, ORDINARY)
    paths = torch.zeros(reach.shape[0], TREE_MAX_NODES, dtype=torch.int32, device=dev)
    if cache[key] is None:
        return reach, lo, paths
    tok, seq, node, count = cache[key]
    anc = meta.tree.ancestors
    cols = torch.arange(anc.shape[-1], device=dev)
    mine = anc[seq, node] & (cols[None, :] <= node[:, None])  # [M, N]: its ancestors and itself
    start = meta.context_lens.to(torch.int64)[seq] - count
    reach[tok] = (start + mine.sum(-1) - 1).to(torch.int32)
    lo[tok] = start.to(torch.int32)
    # Path column of ancestor j: the number of ancestors before it; non-ancestors go to a spare
    # column, dropped.
    col = torch.where(mine, mine.cumsum(-1) - 1, TREE_MAX_NODES)
    wide = torch.zeros(tok.shape[0], TREE_MAX_NODES + 1, dtype=torch.int64, device=dev)
    wide.scatter_(1, col, start[:, None] + cols[None, :])
    paths[tok] = wide[:, :TREE_MAX_NODES].to(torch.int32)
    return reach, lo, paths


def _host_paths(meta: AttnMetadata, tokens: list[tuple[int, int, int, int]], reach: torch.Tensor, lo: torch.Tensor,
                paths: torch.Tensor) -> dict[int, list[int]]:
    """Per tree query token its path on the host (an eager step's chunks group tree queries along
    root-to-node paths), after checking that every node sees itself."""
    assert meta.tree is not None
    anc = meta.tree.ancestors.to("cpu", torch.bool)
    host_reach, host_lo, host_paths = reach.cpu(), lo.cpu(), paths.cpu()
    out: dict[int, list[int]] = {}
    for t, b, i, _ in tokens:
        if not bool(anc[b, i, i]):
            raise UsageError(f"tree node {i} of sequence {b} does not see itself in the ancestor mask")
        out[t] = host_paths[t, : int(host_reach[t] - host_lo[t]) + 1].tolist()
    return out


def plan_attention(meta: AttnMetadata) -> TritonAttnPlan:
    return TritonAttnPlan(meta)
