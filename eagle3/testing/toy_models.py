"""Toy target and draft models that implement the runtime's model interface exactly, with a
real paged KV cache, for testing the engine (scheduler, block tables, rollback, preemption,
speculation, sampling) independently of the real models and in milliseconds.

The toy target is a deterministic function of the token sequence *as read back from its paged
cache*: the logits at position ``p`` depend on every cached token ``0..p`` (a position-weighted
sum, modulo a prime) and on the token at ``p``. Integer arithmetic makes it exactly batch
invariant, so any difference from :func:`toy_reference_greedy` (computed from plain token lists)
is an engine bug: a wrong slot, a stale block, a missed rollback.

The toy draft stores its inputs in its own paged cache at draft positions (token ``p + 1`` at
position ``p``, the EAGLE pairing) and reconstructs the target's state from that cache and the
first token carried in the hidden state. In ``"oracle"`` mode it therefore predicts the target's
distribution exactly *if and only if* the engine keeps the draft cache right, so full acceptance
tests the draft-side KV bookkeeping too. ``"wrong"`` always proposes a token the target does not
pick greedily; ``"noisy"`` is the oracle corrupted on about a third of the positions.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from eagle3.runtime.context import AttnMetadata
from eagle3.runtime.interfaces import KVCacheSpec

_PRIME = 1_000_003
_ROWS = 997


def _weight(pos: torch.Tensor) -> torch.Tensor:
    return (pos * 7919 + 13) % 101 + 1


def _table(vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(_ROWS, vocab_size, generator=g) * 3.0


def _logits_from_state(table: torch.Tensor, state: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    return table[(state * 31 + last) % _ROWS].clone()


def _read(cache: torch.Tensor, meta: AttnMetadata, b: int) -> torch.Tensor:
    """Tokens at positions ``0 .. context_lens[b] - 1`` of sequence ``b``, through its block table."""
    ctx = int(meta.context_lens[b])
    pos = torch.arange(ctx)
    blocks = meta.block_tables[b, pos // meta.block_size].to(torch.int64)
    assert bool((blocks >= 0).all()), "read through an unallocated block"
    stored = cache.view(-1)[blocks * meta.block_size + pos % meta.block_size]
    assert bool((stored > 0).all()), "read a KV slot that was never written"
    return stored - 1


def _check_meta(meta: AttnMetadata) -> None:
    """The AttnMetadata contract: each sequence's queries are its last positions, contiguous."""
    cu = meta.cu_seqlens_q.tolist()
    for b in range(meta.num_seqs):
        pos = meta.positions[cu[b]: cu[b + 1]]
        ctx = int(meta.context_lens[b])
        expect = torch.arange(ctx - len(pos), ctx)
        assert torch.equal(pos.cpu(), expect), f"positions {pos.tolist()} do not end at context_len {ctx}"


class ToyTarget:
    """Target with hidden rows ``[state, last_token, position, first_token]`` (float64, exact)."""

    hidden_size = 4

    def __init__(self, vocab_size: int = 64, seed: int = 0, num_layers: int = 2, eos_token_id: int | None = None,
                 max_position_embeddings: int = 4096) -> None:
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.table = _table(vocab_size, seed)
        self.spec = SimpleNamespace(eos_token_id=eos_token_id, max_position_embeddings=max_position_embeddings)
        self.num_forwards = 0

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec((1,), torch.int64)

    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata, kv_caches: list[torch.Tensor],
                aux_layer_ids: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.num_forwards += 1
        _check_meta(meta)
        for cache in kv_caches:
            cache.view(-1)[meta.slot_mapping] = input_ids + 1
        cu = meta.cu_seqlens_q.tolist()
        rows = []
        for b in range(meta.num_seqs):
            toks = _read(kv_caches[-1], meta, b)
            pos = torch.arange(len(toks))
            state = torch.cumsum((toks + 1) * _weight(pos), 0) % _PRIME
            qpos = meta.positions[cu[b]: cu[b + 1]].cpu()
            rows.append(torch.stack([state[qpos], toks[qpos], qpos, toks[0].expand(len(qpos))], 1))
        hidden = torch.cat(rows).to(torch.float64)
        aux = None if aux_layer_ids is None else hidden.repeat(1, len(aux_layer_ids))
        return hidden, aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.to(torch.int64)
        return _logits_from_state(self.table, h[:, 0], h[:, 1])


class ToyDraft:
    """EAGLE-style draft over the toy target; ``mode`` is "oracle", "wrong" or "noisy"."""

    hidden_size = 4
    num_layers = 1

    def __init__(self, target: ToyTarget, mode: str = "oracle", aux_layer_ids: tuple[int, ...] = (2, 3, 4)) -> None:
        assert mode in ("oracle", "wrong", "noisy")
        self.target = target
        self.mode = mode
        self.vocab_size = target.vocab_size
        self.aux_layer_ids = aux_layer_ids
        self.spec = SimpleNamespace()
        self.num_forwards = 0

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec((1,), torch.int64)

    def combine_aux(self, aux: torch.Tensor) -> torch.Tensor:
        assert aux.shape[-1] == 4 * len(self.aux_layer_ids)
        return aux[:, :4]

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: AttnMetadata,
                kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.num_forwards += 1
        _check_meta(meta)
        kv_cache.view(-1)[meta.slot_mapping] = input_ids + 1
        cu = meta.cu_seqlens_q.tolist()
        first = hidden[:, 3].to(torch.int64)
        rows = []
        for b in range(meta.num_seqs):
            c = _read(kv_cache, meta, b)  # c[i] = token i + 1
            t0 = first[cu[b]]
            state = ((t0 + 1) * _weight(torch.tensor(0)) +
                     torch.cumsum((c + 1) * _weight(torch.arange(1, len(c) + 1)), 0)) % _PRIME
            qpos = meta.positions[cu[b]: cu[b + 1]].cpu()
            rows.append(torch.stack([state[qpos], c[qpos], qpos + 1, t0.expand(len(qpos))], 1))
        out = torch.cat(rows).to(torch.float64)
        return out, out

    def compute_logits(self, post_norm: torch.Tensor) -> torch.Tensor:
        h = post_norm.to(torch.int64)
        logits = _logits_from_state(self.target.table, h[:, 0], h[:, 1])
        if self.mode == "oracle":
            return logits
        wrong = logits.roll(1, dims=-1)
        if self.mode == "wrong":
            return wrong
        return torch.where((h[:, 0] % 3 == 0)[:, None], wrong, logits)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids


def toy_reference_greedy(target: ToyTarget, prompt: list[int], max_tokens: int,
                         stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """The toy target's greedy continuation computed directly from token lists (no cache)."""
    toks = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        t = torch.tensor(toks)
        state = int(torch.sum((t + 1) * _weight(torch.arange(len(t)))) % _PRIME)
        nxt = int(_logits_from_state(target.table, torch.tensor([state]), torch.tensor([toks[-1]])).argmax())
        toks.append(nxt)
        out.append(nxt)
        if nxt in stop_ids:
            break
    return out


class ReplayDraft:
    """A draft for any target that proposes from known continuations (e.g. the target's own
    greedy outputs, computed beforehand): a perfect draft for a real model, or an imperfect one
    with ``corrupt_every=n`` (every ``n``-th draft position proposes a wrong token).

    Like :class:`ToyDraft` it keeps its inputs in its own paged cache and looks the context up
    from there (tokens ``1 .. p + 1`` at draft position ``p``), so it proposes right only while the
    engine keeps the draft cache right."""

    hidden_size = 1
    num_layers = 1

    def __init__(self, sequences: list[list[int]], vocab_size: int, aux_layer_ids: tuple[int, ...],
                 corrupt_every: int = 0) -> None:
        self.vocab_size = vocab_size
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.corrupt_every = corrupt_every
        self.spec = SimpleNamespace()
        self.next: dict[tuple[int, ...], int] = {}
        for s in sequences:
            for i in range(1, len(s) - 1):
                self.next[tuple(s[1: i + 1])] = s[i + 1]

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec((1,), torch.int64)

    def combine_aux(self, aux: torch.Tensor) -> torch.Tensor:
        return aux.new_zeros(aux.shape[0], 1)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: AttnMetadata,
                kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _check_meta(meta)
        kv_cache.view(-1)[meta.slot_mapping.cpu()] = input_ids.cpu() + 1
        cu = meta.cu_seqlens_q.tolist()
        out = []
        for b in range(meta.num_seqs):
            c = _read(kv_cache, meta, b).tolist()
            for p in meta.positions[cu[b]: cu[b + 1]].tolist():
                tok = self.next.get(tuple(c[: p + 1]), 0)
                if self.corrupt_every and p % self.corrupt_every == 0:
                    tok = (tok + 1) % self.vocab_size
                out.append(tok)
        t = torch.tensor(out, dtype=torch.float64, device=hidden.device)[:, None]
        return t, t

    def compute_logits(self, post_norm: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(post_norm.shape[0], self.vocab_size, device=post_norm.device)
        logits[torch.arange(post_norm.shape[0]), post_norm[:, 0].long()] = 10.0
        return logits

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids
