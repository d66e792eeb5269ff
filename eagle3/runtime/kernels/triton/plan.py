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
        # consecutive, so chunks index ``order(qt)``, the query tokens in chunk order.
        self.tree: tuple[torch.Tensor, torch.Tensor] | None = None
        self._tree_paths: dict[int, list[int]] = {}  # tree query token -> its path (host)
        if meta.tree is not None:
            self.positions, lo, paths, self._tree_paths = tree_arrays(meta, self.cu)
            self.tree = (lo, paths)

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


def tree_arrays(meta: AttnMetadata,
                cu: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, list[int]]]:
    """Per query token (on the metadata's device): ``reach`` int32 (its last virtual key
    position: a tree node's start + depth, else its position), ``lo`` int32 (the first tree
    position; :data:`ORDINARY` for other tokens) and ``paths`` int32 ``[T, TREE_MAX_NODES]``
    (the cache positions of a tree node's ancestors and itself in depth order), so that virtual
    key ``k`` of a tree query lives at cache position ``paths[t, k - lo]`` when ``k >= lo``, else
    at ``k``. Also per tree query token its path on the host. Nodes are topological, so a node's
    ancestors in node order are in depth order. Built on the host: tree steps run eagerly, never
    under a CUDA graph."""
    assert meta.tree is not None
    dev = meta.positions.device
    reach = meta.positions.to("cpu", torch.int64).clone()
    lo = torch.full_like(reach, ORDINARY)
    paths = torch.zeros(reach.shape[0], TREE_MAX_NODES, dtype=torch.int64)
    host: dict[int, list[int]] = {}
    ctx = meta.context_lens.to("cpu", torch.int64).tolist()
    anc = meta.tree.ancestors.to("cpu", torch.bool)
    for b, n in enumerate(meta.tree.num_nodes):
        if n <= 0:
            continue
        if n > TREE_MAX_NODES or n > anc.shape[-1]:
            raise UsageError(f"the triton tree mask holds up to {TREE_MAX_NODES} tree nodes per sequence "
                             f"(sequence {b}: {n}, ancestor mask width {anc.shape[-1]})")
        t0, t1 = cu[b], cu[b + 1]
        start = ctx[b] - n
        for i in range(n - min(n, t1 - t0), n):  # the query tokens are the last nodes
            t = t1 - n + i
            path = torch.nonzero(anc[b, i, : i + 1]).reshape(-1)
            if path.numel() == 0 or int(path[-1]) != i:
                raise UsageError(f"tree node {i} of sequence {b} does not see itself in the ancestor mask")
            reach[t], lo[t] = start + path.numel() - 1, start
            paths[t, : path.numel()] = start + path
            host[t] = (start + path).tolist()
    return reach.to(dev, torch.int32), lo.to(dev, torch.int32), paths.to(dev, torch.int32), host


def plan_attention(meta: AttnMetadata) -> TritonAttnPlan:
    return TritonAttnPlan(meta)
