"""Batch-invariant paged attention: fixed-shape tile GEMMs, two schedules with the same bits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.errors import UsageError
from eagle3.runtime.context import AttnMetadata, pack_tree_paths
from eagle3.runtime.kernels.torch_ref.gemm import split_tiles, stack_sizes, tile_gemm

KEY_TILE = 64  # keys per attention tile

#
# The numbers. Query rows are tiled per sequence: ``query_tile_tokens(G)`` consecutive tokens x G
# heads = R rows (a model constant), zero padded. Every score is a row of a fixed-shape
# ``[R, D] x [D, KEY_TILE]`` GEMM; every per-tile softmax numerator a row of a fixed-shape
# ``[R, KEY_TILE] x [KEY_TILE, Dv]`` GEMM and every denominator a row sum of fixed length
# KEY_TILE. A token's softmax is two-pass: the max over all its keys (exact in any order),
# ``exp(s - max)`` element by element on the scalar path, then the per-tile partials added in
# key-tile order starting from zero, in fp32. Tiles past a token's own position hold probability
# exactly 0 and add exact zeros, so computing them or skipping them changes nothing.
#
# Two schedules compute exactly these numbers:
#
# * gathered units (decode, verify, short chunks): every (row tile, key tile) pair of a group as
#   one batched GEMM, the keys gathered per pair (``index_select``: one copy per pair);
# * per sequence (prefill chunks of >= SEQ_PATH_MIN_TOKENS tokens): the sequence's keys gathered
#   once, then per key tile one batched GEMM over the row tiles that see it with the key tile
#   broadcast (stride 0, no copy); the row tiles that cannot see a key tile are skipped (causal
#   skipping halves a prefill's work). The 1,600-token prefill of the tiny target went from
#   ~11 s (every token gathering its own padded context) to ~1 s.
#
# Memory is bounded by ATTN_CHUNK_FLOATS per group of row tiles, never ``T x J``.
#
# Draft trees (``AttnMetadata.tree``): a tree node's keys sit at node-order cache positions, but
# its query reduces over *virtual* key positions, exactly the chain's: the context positions
# ``0 .. start-1``, then its ancestors in depth order at ``start, start+1, ..``, itself at
# ``start + depth`` (its RoPE position). Tree queries get query tiles of their own, each holding
# queries on one root-to-node path (``_tree_tiles``), whose slot map sends virtual position
# ``start + d`` to the cache slot of the depth-``d`` node of that path; keys past a query's
# virtual position are masked like the causal mask. So a node runs the very GEMMs, key-tile
# grouping and sums of the same token in a chain (its root-to-node path decoded or verified
# causally): its output is that chain's bit for bit, and its non-ancestors are never gathered.
# Tree sequences always take the gathered units (their positions are not ascending).
#
# Both schedules rely on the property the row-tiled linears rely on: a row of a fixed-shape
# batched GEMM does not depend on its position in the tile, on the other rows or on the batch
# size (measured here for MKL with R = 4..128, D = 16..576, N = 17..65, contiguous, transposed
# and stride-0 operands, 1 and 2 threads; below 4 rows MKL takes other kernels, hence
# ATTN_MIN_ROWS), and that a fixed-length row sum does not depend on the number of rows. Both
# are re-checked by tests/runtime/test_kernels_torch_ref.py on every run.
#
# Row tiles that read the same key tile are stacked into one GEMM where the probe of
# ``gemm.stack_sizes`` saw this BLAS keep the tile bits (both products, their exact operand
# layouts): the per-sequence schedule multiplies a key tile with all the row tiles that see it
# (about 1.4x faster prefill attention here), and the gathered units gather a key tile once for
# all the query tiles of a sequence that read it (verify and draft-tree tiles share their context:
# 1.7x faster for a batch-16 verify of 4 tokens). Elsewhere they stay R-row tile GEMMs.

ATTN_MIN_ROWS = 4  # rows of a query tile at least (MKL's bmm rows differ below 4 rows, measured)
SEQ_PATH_MIN_TOKENS = 32  # query tokens of one sequence from which the per-sequence schedule runs
ATTN_CHUNK_FLOATS = 1 << 23  # fp32 elements of scores / gathered keys one attention chunk holds


def query_tile_tokens(group: int) -> int:
    """Query tokens per row tile for ``group`` query heads per kv head: the fewest giving at
    least :data:`ATTN_MIN_ROWS` rows (a model constant, never a batch one)."""
    return max(1, -(-ATTN_MIN_ROWS // group))


@dataclass
class _Blocks:
    """Query rows that read one identical key tile (a sequence's query tiles over its shared
    context), packed densely into row tiles, the padding token slots of their tiles left out: a
    block's rows are one GEMM against its keys, gathered once. Packed row ``m`` of block ``b`` is
    row ``row[b, m]`` of row tile ``tile[b, m]``; ``dst[b, m]`` is the key tile its result belongs
    to (``jidx[b]``), or one past the last key tile for the rows that pad the last packed tile
    (computed, then dropped)."""

    jidx: torch.Tensor  # [nb] key tile of each block
    tile: torch.Tensor  # [nb, M] the row tile (index into the group's tiles) of each packed row
    row: torch.Tensor  # [nb, M] its row within that tile
    dst: torch.Tensor  # [nb, M] key tile of its result (nk: a padding row)
    slots: torch.Tensor  # [nb * KEY_TILE] cache slots of each block's keys


@dataclass
class _Units:
    """Gathered-units schedule for a group of row tiles (short sequences)."""

    tok: torch.Tensor | None  # [nqt, qt] query row per tile slot (T: the zero pad row); None: row = tile
    slots: torch.Tensor  # [nk, nqt, KEY_TILE] cache slot of each key (0 where there is none)
    masked: torch.Tensor  # [nk, nqt, qt, KEY_TILE] key NOT visible to the tile slot's token
    dst: torch.Tensor | None  # query rows of the real tile slots (None: all rows, in order)
    src: torch.Tensor | None  # flat tile-slot index of each of them
    blocks: list[_Blocks] | None = None  # shared key tiles, by block size (None: every pair its own)


@dataclass
class _SeqChunk:
    """Per-sequence schedule for one long query chunk with ascending positions."""

    t0: int  # query rows t0 .. t1-1
    t1: int
    num_tiles: int  # row tiles (the last one zero padded)
    num_key_tiles: int
    key_slots: torch.Tensor  # [num_key_tiles * KEY_TILE] cache slot of key position j (0: none)
    first: list[int]  # first[j]: first row tile whose last token sees key tile j (ascending in j)
    masks: list[tuple[int, torch.Tensor]]  # per j: (lo, masked [n, qt, KEY_TILE]) for tiles lo..lo+n-1,
    #                                        the tiles that see key tile j only in part
    groups: list[tuple[int, int]]  # row-tile ranges whose scores are held at once


@dataclass
class _Schedule:
    units: list[_Units]
    seqs: list[_SeqChunk]


class AttnPlan:
    """Per-forward attention work, shared by every attention layer of a model. Built lazily per
    query-tile height and memory footprint (they depend on the model's head layout)."""

    def __init__(self, meta: AttnMetadata) -> None:
        self.device = meta.positions.device
        self.num_tokens = int(meta.positions.shape[0])
        self.positions = meta.positions.to("cpu", torch.int64)
        self.cu = meta.cu_seqlens_q.to("cpu", torch.int64).tolist()
        self.tables = meta.block_tables.to("cpu", torch.int64)
        self.block_size = int(meta.block_size)
        self._schedules: dict[tuple[int, int, int, tuple[int, ...], int], _Schedule] = {}
        # The last (virtual) key position each query sees: its position; a tree node's start + depth.
        self.reach = self.positions.clone()
        self.tree_seqs: set[int] = set()
        # tree query token -> (first tree position, cache positions of its ancestors and itself in
        # depth order): the keys of its virtual positions start, start+1, ...
        self.tree_keys: dict[int, tuple[int, torch.Tensor]] = {}
        if meta.tree is not None:
            self._tree_setup(meta)

    def _tree_setup(self, meta: AttnMetadata) -> None:
        """Virtual reach and ancestor key positions of every tree query. Nodes are topological
        (a parent before its children), so a node's ancestors in node order are in depth order."""
        assert meta.tree is not None
        ctx = meta.context_lens.to("cpu", torch.int64).tolist()
        anc = meta.tree.ancestors.to("cpu", torch.bool)
        for b, n in enumerate(meta.tree.num_nodes):
            if n <= 0:
                continue
            t0, t1 = self.cu[b], self.cu[b + 1]
            if n > anc.shape[-1]:
                raise UsageError(f"tree of {n} nodes for sequence {b} with an ancestor mask of width {anc.shape[-1]}")
            start = ctx[b] - n
            self.tree_seqs.add(b)
            for i in range(n - min(n, t1 - t0), n):  # the query tokens are the last nodes
                t = t1 - n + i
                path = torch.nonzero(anc[b, i, : i + 1]).reshape(-1)
                if path.numel() == 0 or int(path[-1]) != i:
                    raise UsageError(f"tree node {i} of sequence {b} does not see itself in the ancestor mask")
                self.reach[t] = start + path.numel() - 1
                self.tree_keys[t] = (start, start + path)

    def schedule(self, qt: int, unit_floats: int, tile_floats: int, stack: tuple[int, ...] = (1,),
                 key_floats: int = 0, group: int = 1) -> _Schedule:
        """``stack``: the row-tile counts one GEMM may stack (``gemm.stack_sizes``; (1,): none);
        ``key_floats``: the part of ``unit_floats`` that is a unit's gathered keys; ``group``: query
        heads per kv head (a row tile is ``qt`` tokens x ``group`` heads)."""
        key = (qt, unit_floats, tile_floats, stack, key_floats, group)
        if key not in self._schedules:
            self._schedules[key] = self._build(qt, unit_floats, tile_floats, stack, key_floats, group)
        return self._schedules[key]

    # -- building --------------------------------------------------------------------------
    def _key_slots(self, tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache slot, present) of key positions ``0 .. length-1`` through block table rows
        ``tables [..., W]``; absent keys get slot 0 (finite data, never visible)."""
        kpos = torch.arange(length)
        bi = (kpos // self.block_size).clamp(max=tables.shape[-1] - 1)
        return self._slots(tables[..., bi], kpos, tables.shape[-1])

    def _row_slots(self, tables: torch.Tensor, kpos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache slot, present) of key position ``kpos[m]`` through block table row ``tables[m]``."""
        bi = (kpos // self.block_size).clamp(max=tables.shape[-1] - 1)
        return self._slots(tables.gather(1, bi[:, None])[:, 0], kpos, tables.shape[-1])

    def _slots(self, blocks: torch.Tensor, kpos: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache slot, present) of key positions ``kpos`` in table entries ``blocks`` (read at the
        clamped block index) of tables ``width`` blocks wide."""
        bs = self.block_size
        ok = (kpos // bs < width) & (blocks >= 0)
        return torch.where(ok, blocks * bs + kpos % bs, 0), ok

    def _build(self, qt: int, unit_floats: int, tile_floats: int, stack: tuple[int, ...],
               key_floats: int, group: int) -> _Schedule:
        seqs: list[_SeqChunk] = []
        short: list[int] = []
        for b in range(len(self.cu) - 1):
            t0, t1 = self.cu[b], self.cu[b + 1]
            if t1 == t0:
                continue
            pos = self.positions[t0:t1]
            chunk = None
            if t1 - t0 >= SEQ_PATH_MIN_TOKENS and b not in self.tree_seqs and bool((pos[1:] > pos[:-1]).all()):
                chunk = self._seq_chunk(b, t0, t1, pos, qt, tile_floats)
            if chunk is None:
                short.append(b)
            else:
                seqs.append(chunk)
        return _Schedule(self._unit_groups(short, qt, unit_floats, key_floats, stack, group), seqs)

    def _seq_chunk(self, b: int, t0: int, t1: int, pos: torch.Tensor, qt: int, tile_floats: int) -> _SeqChunk | None:
        n = t1 - t0
        nq = -(-n // qt)
        last = int(pos[-1])
        nk = last // KEY_TILE + 1
        slots, ok = self._key_slots(self.tables[b], nk * KEY_TILE)
        if not bool(ok[: last + 1].all()):
            return None  # a visible key without a block: let the gathered schedule mask it
        big = torch.iinfo(torch.int64).max
        tpos = torch.full((nq * qt,), big, dtype=torch.int64)
        tpos[:n] = pos
        tpos = tpos.view(nq, qt)  # zero-padded rows: no mask (their query is zero, result dropped)
        tile_last = pos[torch.clamp(torch.arange(1, nq + 1) * qt, max=n) - 1]
        tile_first = pos[torch.arange(nq) * qt]
        starts = torch.arange(nk) * KEY_TILE
        first = torch.searchsorted(tile_last, starts).tolist()  # tiles whose last token reaches tile j
        full = torch.searchsorted(tile_first, starts + KEY_TILE - 1).tolist()  # ... whose first sees all of it
        kpos = torch.arange(nk * KEY_TILE).view(nk, KEY_TILE)
        masks = []
        for j in range(nk):
            lo, hi = first[j], max(first[j], full[j])
            masks.append((lo, (kpos[j][None, None, :] > tpos[lo:hi, :, None]).to(self.device)))
        cost = ((tile_last // KEY_TILE) + 1).tolist()
        groups, lo, acc = [], 0, 0
        for i, c in enumerate(cost):
            if i > lo and (acc + c) * tile_floats > ATTN_CHUNK_FLOATS:
                groups.append((lo, i))
                lo, acc = i, 0
            acc += c
        groups.append((lo, nq))
        return _SeqChunk(t0, t1, nq, nk, slots.to(self.device), first, masks, groups)

    def _unit_groups(self, seqs: list[int], qt: int, unit_floats: int, key_floats: int,
                     stack: tuple[int, ...], group: int) -> list[_Units]:
        if not seqs:
            return []
        t = self.num_tokens
        toks: list[list[int]] = []
        tpos: list[list[int]] = []
        tseq: list[int] = []
        for b in seqs:
            t0, t1 = self.cu[b], self.cu[b + 1]
            p = self.reach[t0:t1].tolist()
            tree0 = next((i for i in range(t0, t1) if i in self.tree_keys), t1) if b in self.tree_seqs else t1
            top = max(p)  # pad slots see the sequence's keys: finite scores, result dropped
            for i in range(t0, tree0, qt):
                k = min(qt, tree0 - i)
                toks.append(list(range(i, i + k)) + [t] * (qt - k))
                tpos.append(p[i - t0: i - t0 + k] + [top] * (qt - k))
                tseq.append(b)
            for tile in self._tree_tiles(tree0, t1, qt):
                reach = [p[i - t0] for i in tile]
                toks.append(tile + [t] * (qt - len(tile)))
                tpos.append(reach + [reach[-1]] * (qt - len(tile)))
                tseq.append(b)
        tok_all = torch.tensor(toks, dtype=torch.int64)
        pos_all = torch.tensor(tpos, dtype=torch.int64)
        seq_all = torch.tensor(tseq, dtype=torch.int64)
        nk_all = int(pos_all.max()) // KEY_TILE + 1
        # a tree tile's virtual positions span at most two key tiles of its own (depth < KEY_TILE)
        private = [2 if any(x in self.tree_keys for x in tile) else 0 for tile in toks]
        bounds = self._group_bounds(tseq, private, nk_all, unit_floats, key_floats, max(stack))
        identity = len(seqs) == len(self.cu) - 1 and qt == 1 and len(bounds) == 1
        groups = []
        for lo, hi in bounds:
            tok, tp = tok_all[lo:hi], pos_all[lo:hi]
            nqt = tok.shape[0]
            nk = int(tp.max()) // KEY_TILE + 1
            tables = self.tables[seq_all[lo:hi]]
            slots, ok = self._key_slots(tables, nk * KEY_TILE)  # [nqt, J]
            if self.tree_keys:
                self._map_tree_keys(tok, tables, slots, ok)
            kpos = torch.arange(nk * KEY_TILE)
            masked = ~ok[:, None, :] | (kpos[None, None, :] > tp[:, :, None])  # [nqt, qt, J]
            slots = slots.view(nqt, nk, KEY_TILE).transpose(0, 1).contiguous()
            masked = masked.view(nqt, qt, nk, KEY_TILE).permute(2, 0, 1, 3).contiguous()
            dev = self.device
            blocks = self._shared_blocks(slots, tseq[lo:hi], stack, tok, group) if len(stack) > 1 else None
            if identity:
                groups.append(_Units(None, slots.to(dev), masked.to(dev), None, None, blocks))
            else:
                flat = tok.reshape(-1)
                src = torch.nonzero(flat < t).reshape(-1)
                groups.append(_Units(tok.to(dev), slots.to(dev), masked.to(dev), flat[src].to(dev), src.to(dev),
                                     blocks))
        return groups

    @staticmethod
    def _group_bounds(tseq: list[int], private: list[int], nk: int, unit_floats: int, key_floats: int,
                      run: int) -> list[tuple[int, int]]:
        """Row-tile ranges of at most ATTN_CHUNK_FLOATS working floats each (at least one tile).
        ``key_floats`` of a tile's ``unit_floats`` are one key tile's gathered keys. With stacking
        (``run`` > 1 tiles a GEMM), a sequence's tiles after the first of each run of ``run`` read
        that tile's keys, except for their ``private[i]`` own key tiles (a tree tile's virtual
        positions), and cost the rest only."""
        bounds, lo, acc, streak = [], 0, 0, 0
        for i, b in enumerate(tseq):
            streak = streak + 1 if i > lo and tseq[i - 1] == b else 0
            shared = nk - min(nk, private[i]) if run > 1 and streak % run else 0
            cost = nk * unit_floats - shared * key_floats
            if i > lo and acc + cost > ATTN_CHUNK_FLOATS:
                bounds.append((lo, i))
                lo, acc, streak = i, nk * unit_floats, 0
            else:
                acc += cost
        bounds.append((lo, len(tseq)))
        return bounds

    def _shared_blocks(self, slots: torch.Tensor, tseq: list[int], stack: tuple[int, ...], tok: torch.Tensor,
                       group: int) -> list[_Blocks] | None:
        """Blocks of the (key tile, row tile) pairs of ``slots [nk, nqt, KEY_TILE]``: per key tile
        and sequence, the real rows (those of the token slots of ``tok [nqt, qt]`` that hold a
        query, ``group`` heads each) of the row tiles whose keys are its first tile's (a verify's or
        a tree's shared context), packed into row tiles in blocks of ``stack`` sizes; the others
        alone. None when no pair shares (decode: one row tile per sequence), so the plain pairs run.

        Packing leaves out the padding token slots, which a tree's one-path tiles have many of (16
        tree nodes in 11 tiles of 2); a row's bits do not depend on the tile it is computed in, on
        its place there or on the other rows (what the probe of ``stack_sizes`` checks)."""
        nk, nqt, kt = slots.shape
        first: dict[int, int] = {}
        lead = [first.setdefault(b, i) for i, b in enumerate(tseq)]
        if len(first) == nqt:
            return None  # one row tile per sequence: nothing to share
        r = tok.shape[1] * group  # a row tile: its token slots in order, each slot's heads in order
        rows = [[x * group + h for x, tk in enumerate(tile) if tk < self.num_tokens for h in range(group)]
                for tile in tok.tolist()]
        same = (slots == slots[:, lead]).all(-1).tolist()  # [nk][nqt]: reads its first tile's keys
        by_size: dict[int, tuple[list[int], list[list[tuple[int, int, int]]]]] = {}
        for j in range(nk):
            members: dict[int, list[int]] = {}
            for i in range(nqt):
                members.setdefault(lead[i] if same[j][i] else -1 - i, []).append(i)
            for tiles in members.values():
                packed = [(i, x, j) for i in tiles for x in rows[i]]
                a = 0
                for c in split_tiles(-(-len(packed) // r), stack):
                    part = packed[a: a + c * r]
                    part += [(tiles[0], 0, nk)] * (c * r - len(part))  # pad rows: dropped (key tile nk)
                    js, ps = by_size.setdefault(c, ([], []))
                    js.append(j)
                    ps.append(part)
                    a += c * r
        out = []
        for js, ps in by_size.values():
            jidx, packed_t = torch.tensor(js), torch.tensor(ps)  # [nb], [nb, M, 3]
            tiles = packed_t[:, 0, 0]  # a block's first packed row is a real one
            out.append(_Blocks(jidx.to(self.device), packed_t[..., 0].to(self.device), packed_t[..., 1].to(self.device),
                               packed_t[..., 2].to(self.device), slots[jidx, tiles].reshape(-1).to(self.device)))
        return out

    def _tree_tiles(self, t0: int, t1: int, qt: int) -> list[list[int]]:
        """The tree queries ``t0 .. t1-1`` packed into query tiles that each hold one
        root-to-node path (``pack_tree_paths``): the deepest token's slot map then serves the
        whole tile, as chain tokens sharing a tile see one key map."""
        paths = [self.tree_keys[t][1].tolist() for t in range(t0, t1)]
        return [[t0 + i for i in tile] for tile in pack_tree_paths(paths, qt)]

    def _map_tree_keys(self, tok: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor,
                       ok: torch.Tensor) -> None:
        """Point the virtual key positions ``start ..`` of each tree query tile at the cache slots
        of its deepest node's ancestors and itself, in depth order (see :meth:`_tree_tiles`)."""
        rows: list[int] = []
        cols: list[int] = []
        cache_pos: list[torch.Tensor] = []
        for row, tile in enumerate(tok.tolist()):
            hit = self.tree_keys.get(max(x for x in tile if x < self.num_tokens))
            if hit is not None:
                start, path = hit
                rows += [row] * path.numel()
                cols += range(start, start + path.numel())
                cache_pos.append(path)
        if rows:  # one gather for every tree tile of the group
            r, c = torch.tensor(rows), torch.tensor(cols)
            slots[r, c], ok[r, c] = self._row_slots(tables[r], torch.cat(cache_pos))


def plan_attention(meta: AttnMetadata) -> AttnPlan:
    return AttnPlan(meta)


def _exp_shifted(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``exp(s - m)`` with every element on the scalar path (see :func:`pointwise`); the
    subtraction writes straight into the strided buffer."""
    if s.device.type != "cpu":
        return torch.exp(s - m)
    buf = s.new_empty(*s.shape, 2)
    torch.sub(s, m, out=buf[..., 0])
    return torch.exp(buf[..., 0])


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache[slots]`` in fp32. ``index_select`` copies whole rows (~10x faster than advanced
    indexing here); the fp32 copy is the GEMM operand."""
    return torch.index_select(cache, 0, slots).float()


def _gather_keys(k_cache: torch.Tensor, v_cache: torch.Tensor | None, slots: torch.Tensor, hkv: int, kt: int,
                 d: int, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[n * hkv, kt, d]`` and values ``[n * hkv, kt, dv]`` of ``n`` key tiles (flat ``slots``);
    MLA (``v_cache`` None): the values are a strided view of the keys, read in place."""
    n = slots.numel() // kt
    k = _gather(k_cache, slots).view(n, kt, hkv, d)
    kb = (k.transpose(1, 2) if hkv > 1 else k).reshape(n * hkv, kt, d)
    if v_cache is None:
        return kb, kb[..., :dv]
    v = _gather(v_cache, slots).view(n, kt, hkv, dv)
    return kb, (v.transpose(1, 2) if hkv > 1 else v).reshape(n * hkv, kt, dv)


def _block_scores(qtile: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, u: _Units,
                  dv: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Scores ``[nk, nqt, hkv, r, kt]`` of every (key tile, row tile) pair from ``qtile [nqt, hkv,
    r, d]``, a block's packed rows as one GEMM against its keys (gathered once); also each
    block size's values for :func:`_block_values`. The padding token slots' rows are not computed:
    they hold score 0, as a zero query row's scores are."""
    nqt, hkv, r, d = qtile.shape
    nk, _, kt = u.slots.shape
    assert u.blocks is not None
    s = qtile.new_zeros(nk + 1, nqt, hkv, r, kt)  # key tile nk: where padding rows' results go
    heads = torch.arange(hkv, device=qtile.device)[None, :, None]
    vals = []
    for blk in u.blocks:
        nb, m = blk.tile.shape
        kb, v = _gather_keys(k_cache, v_cache, blk.slots, hkv, kt, d, dv)
        tile, row = blk.tile[:, None, :], blk.row[:, None, :]
        qb = qtile[tile, heads, row].reshape(nb * hkv, m, d)
        s[blk.dst[:, None, :], tile, heads, row] = torch.bmm(qb, kb.transpose(1, 2)).view(nb, hkv, m, kt)
        vals.append(v)
    return s[:nk], vals


def _block_values(p: torch.Tensor, blocks: list[_Blocks], vals: list[torch.Tensor]) -> torch.Tensor:
    """Per-pair numerators ``[nk, nqt, hkv, r, dv]`` from probabilities ``p [nk, nqt, hkv, r, kt]``,
    a block's packed rows as one GEMM against its values (padding token slots' rows: 0)."""
    nk, nqt, hkv, r, kt = p.shape
    dv = vals[0].shape[-1]
    num = p.new_zeros(nk + 1, nqt, hkv, r, dv)
    heads = torch.arange(hkv, device=p.device)[None, :, None]
    for blk, v in zip(blocks, vals, strict=True):
        nb, m = blk.tile.shape
        tile, row = blk.tile[:, None, :], blk.row[:, None, :]
        pb = p[blk.jidx[:, None, None], tile, heads, row].reshape(nb * hkv, m, kt)
        num[blk.dst[:, None, :], tile, heads, row] = torch.bmm(pb, v).view(nb, hkv, m, dv)
    return num[:nk]


def _attend_units(qs: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, u: _Units,
                  out: torch.Tensor) -> None:
    """Gathered units: ``qs [T, hkv, g, d]`` (fp32, scaled) -> rows of ``out [T, hkv, g, dv]``.
    ``v_cache`` None: the values are the first ``dv`` dims of the keys (MLA latent)."""
    t, hkv, g, d = qs.shape
    dv = out.shape[-1]
    nk, nqt, kt = u.slots.shape
    qt = u.masked.shape[2]
    r = qt * g
    b = nk * nqt * hkv
    if u.tok is None:
        qtile = qs.view(1, nqt, hkv, r, d)
    else:
        qpad = torch.cat([qs, qs.new_zeros(1, hkv, g, d)])
        qtile = qpad[u.tok].transpose(1, 2).reshape(1, nqt, hkv, r, d)
    if u.blocks is None:
        qb = qtile.expand(nk, nqt, hkv, r, d).reshape(b, r, d)
        kb, v = _gather_keys(k_cache, v_cache, u.slots.view(-1), hkv, kt, d, dv)
        s = torch.bmm(qb, kb.transpose(1, 2)).view(nk, nqt, hkv, qt, g, kt)
    else:
        s, vals = _block_scores(qtile[0], k_cache, v_cache, u, dv)
        s = s.view(nk, nqt, hkv, qt, g, kt)
    s.masked_fill_(u.masked.view(nk, nqt, 1, qt, 1, kt), float("-inf"))
    m = s.amax(dim=(0, 5), keepdim=True)
    p = _exp_shifted(s, m).view(b, r, kt)  # masked keys: exp(-inf) = 0 exactly
    # Per key tile the softmax partial sums: numerator (fixed-shape GEMM rows) and denominator (a
    # row sum of fixed length kt), added in key-tile order from zero (0 + x, as the per-sequence
    # schedule starts from zeros). Kept apart, not concatenated: the same sums without the copy.
    if u.blocks is None:
        num = torch.bmm(p, v).view(nk, nqt, hkv, r, dv)
    else:
        num = _block_values(p.view(nk, nqt, hkv, r, kt), u.blocks, vals)
    den = p.sum(-1).view(nk, nqt, hkv, r)
    acc, acc_den = num[0] + 0.0, den[0] + 0.0
    for j in range(1, nk):
        acc += num[j]
        acc_den += den[j]
    o = (acc / acc_den[..., None]).view(nqt, hkv, qt, g, dv).transpose(1, 2).reshape(nqt * qt, hkv, g, dv)
    if u.dst is None:
        out.copy_(o)
    else:
        out.index_copy_(0, u.dst, o[u.src])


def _attend_seq(qs: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, c: _SeqChunk,
                qt: int, out: torch.Tensor, stack: tuple[int, ...]) -> None:
    """Per-sequence schedule for the rows ``c.t0 .. c.t1-1`` of ``qs`` (see :func:`_attend_units`)."""
    _, hkv, g, d = qs.shape
    dv = out.shape[-1]
    kt, nk, nq = KEY_TILE, c.num_key_tiles, c.num_tiles
    n = c.t1 - c.t0
    r = qt * g
    keys = _gather(k_cache, c.key_slots).view(nk, kt, hkv, d).permute(2, 0, 1, 3).contiguous()  # [hkv, nk, kt, d]
    if v_cache is None:
        vals = keys[..., :dv]
    else:
        vals = _gather(v_cache, c.key_slots).view(nk, kt, hkv, dv).permute(2, 0, 1, 3).contiguous()
    q = qs.new_zeros(nq * qt, hkv, g, d)
    q[:n] = qs[c.t0: c.t1]
    q = q.view(nq, qt, hkv, g, d).permute(2, 0, 1, 3, 4).reshape(hkv, nq, r, d)
    o = qs.new_empty(hkv, nq, r, dv)
    for lo, hi in c.groups:
        for h in range(hkv):
            m = qs.new_full((hi - lo, r), float("-inf"))
            scores = []
            for j in range(nk):
                a = max(lo, c.first[j])
                if a >= hi:
                    break
                s = tile_gemm(q[h, a:hi].reshape(-1, d), keys[h, j].t(), r, stack).view(hi - a, r, kt)
                mlo, masked = c.masks[j]
                s0, s1 = max(a, mlo), min(hi, mlo + masked.shape[0])
                if s1 > s0:
                    s[s0 - a: s1 - a].view(s1 - s0, qt, g, kt).masked_fill_(masked[s0 - mlo: s1 - mlo, :, None, :],
                                                                         float("-inf"))
                mm = m[a - lo:]
                torch.maximum(mm, s.amax(-1), out=mm)
                scores.append((a, s))
            num = qs.new_zeros(hi - lo, r, dv)
            den = qs.new_zeros(hi - lo, r)
            for j, (a, s) in enumerate(scores):  # the same fp32 sums as the gathered units' acc
                p = _exp_shifted(s, m[a - lo:, :, None])
                num[a - lo:] += tile_gemm(p.reshape(-1, kt), vals[h, j], r, stack).view(hi - a, r, dv)
                den[a - lo:] += p.sum(-1)
            o[h, lo:hi] = num / den[..., None]
    out[c.t0: c.t1] = o.view(hkv, nq, qt, g, dv).permute(1, 2, 0, 3, 4).reshape(nq * qt, hkv, g, dv)[:n]


def _stack_sizes(device: torch.device, r: int, d: int, dv: int, v_row: int) -> tuple[int, ...]:
    """Row-tile counts both attention products may stack (``gemm.stack_sizes``): scores against
    a key tile read as a transposed view, numerators against values whose rows are ``v_row``
    apart (MLA: a prefix of the gathered keys)."""
    if device.type != "cpu":
        return (1,)
    threads = torch.get_num_threads()
    keys = stack_sizes(r, d, KEY_TILE, (1, d), torch.float32, threads)
    vals = stack_sizes(r, KEY_TILE, dv, (v_row, 1), torch.float32, threads)
    return keys if len(keys) <= len(vals) else vals


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttnPlan,
                    scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """fp32 causal attention over the paged cache with batch-invariant numerics (see above). An fp8
    cache is read as its codes widened to fp32 (exact); ``k_scale`` joins the query's softmax scale
    and ``v_scale`` multiplies the normalised output (runtime/kv_cache.py: the fp8 numbers)."""
    t, hkv, g, d = q.shape
    dv = v_cache.shape[-1]
    out = q.new_empty(t, hkv, g, dv, dtype=torch.float32)
    if t == 0:
        return out.to(q.dtype)
    shared = v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride() and dv <= d
    vc = None if shared else v_cache  # MLA: the values are the first kv_lora dims of the cached latent
    qt = query_tile_tokens(g)
    r = qt * g
    key_floats = hkv * KEY_TILE * (d + dv)
    unit_floats = key_floats + hkv * r * (d + 4 * KEY_TILE + dv + 1)
    stack = _stack_sizes(q.device, r, d, dv, k_cache.shape[-1] if vc is None else dv)
    sched = plan.schedule(qt, unit_floats, 2 * r * KEY_TILE, stack, key_floats, g)
    qs = q.float() * (scale * k_scale)  # k_scale 1.0 (a float cache): the same number as scale
    for u in sched.units:
        _attend_units(qs, k_cache, vc, u, out)
    for c in sched.seqs:
        _attend_seq(qs, k_cache, vc, c, qt, out, stack)
    if v_scale != 1.0:
        out.mul_(v_scale)
    return out.to(q.dtype)
