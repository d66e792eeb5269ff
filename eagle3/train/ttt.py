"""Training-time test (EAGLE-3): K unrolled draft steps, each fed the draft's own hidden state.

For a sequence of tokens ``x_0..x_{L-1}`` with target aux states ``a_t`` and target next-token
distributions ``p_t`` (row ``t`` predicts ``x_{t+1}``), step ``i`` (0-based) of the chain that
starts at index ``t``:

* input token ``x_{t+1+i}`` (teacher forcing), at draft position ``t + i``;
* hidden: ``fc(a_t)`` for step 0, else the previous step's ``next_hidden`` at index ``t`` (pre-norm
  for EAGLE-3, post-norm for EAGLE-3.1 ``norm_output``: the module decides, like the runtime);
* attention: step-0 keys of positions ``<= t`` plus this chain's keys of steps ``1..i``
  (:func:`eagle3.train.draft_module.chain_attention`), which is what the runtime proposer's
  chained steps see;
* label: the target's distribution ``p_{t+1+i}`` of token ``x_{t+2+i}``; valid while ``t+1+i <= L-1``.

Loss: soft cross-entropy ``-sum_v p(v) log q(v)`` averaged over valid positions, weighted
``decay**i`` (0.8 in EAGLE-3 / SpecForge) and summed over steps. With a reduced draft vocabulary
the target logits are restricted to the draft's tokens and renormalised, and positions whose
target argmax lies outside the draft vocabulary are left out (SafeAILab ``cnets.py``).

Which chains carry loss: a sequence's ``loss_start`` ``s`` (the first token whose prediction is
trained; 0 = all) makes the chains start at ``t >= s - 2`` (step 0 of chain ``t`` predicts token
``t + 2``). The earlier positions are context only: step 0 computes their keys and values but no
query (:class:`eagle3.train.draft_module.KVChain`), and the target's logits are only computed where
a label is read, which is what keeps a few-shot prompt of thousands of tokens affordable.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from eagle3.train.draft_module import KVChain, TrainableDraft
from eagle3.train.teacher import Teacher


@dataclass
class VocabMap:
    """The reduced draft vocabulary: ``used[d]`` is the target id of draft id ``d`` (ascending)."""

    used: torch.Tensor  # int64 [V_d]

    @property
    def size(self) -> int:
        return int(self.used.shape[0])

    @property
    def d2t(self) -> torch.Tensor:
        """Offsets, as every engine stores them: ``target = draft + d2t[draft]``."""
        return self.used - torch.arange(self.size, dtype=torch.int64)

    def t2d(self, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.used] = True
        return mask

    @staticmethod
    def from_d2t(d2t: torch.Tensor) -> VocabMap:
        d2t = d2t.to(torch.int64)
        return VocabMap(d2t + torch.arange(d2t.shape[0], dtype=torch.int64))

    @staticmethod
    def from_frequencies(seqs: Iterable[Sequence[int]], vocab_size: int, size: int,
                         always: Iterable[int] = ()) -> VocabMap:
        """The ``size`` most frequent tokens of ``seqs`` (ties: lower id first) plus ``always`` (stop
        tokens: a draft that cannot propose EOS loses every sequence end), filled up with the
        lowest unused ids when the data has fewer distinct tokens (SpecForge's frequency scan)."""
        keep = {int(t) for t in always if 0 <= int(t) < vocab_size}
        counts = Counter(t for s in seqs for t in s)
        for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            if len(keep) >= size:
                break
            keep.add(int(tok))
        i = 0
        while len(keep) < size:
            if i not in keep:
                keep.add(i)
            i += 1
        return VocabMap(torch.tensor(sorted(keep)[:size], dtype=torch.int64))


@dataclass
class Batch:
    """Right-padded training batch; chain rows and label rows are gathered by :func:`chain_rows`."""

    input_ids: torch.Tensor  # int64 [B, T] (padding: 0)
    lengths: torch.Tensor  # int64 [B]
    aux: torch.Tensor  # [B, T, n*H_t]
    first: torch.Tensor  # int64 [B]: the first chain's row a_b (max(loss_start - 2, 0))
    label_hidden: torch.Tensor  # [B, Tq + K - 1, H_t]: target post-norm hidden at rows a_b + 1 + j


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar, differentiable
    step_loss: list[float]  # per unrolled step (unweighted)
    step_acc: list[float]  # per step: draft top-1 == target top-1 over valid positions


def _shift(x: torch.Tensor, n: int, fill: float = 0) -> torch.Tensor:
    """``x[:, t + n]`` at ``t`` (dim 1), ``fill`` past the end."""
    if n == 0:
        return x
    tail = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], tail], dim=1)


def chain_rows(first: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain rows ``[B, Tq]`` (``first[b] + j``, clamped to the sequence) and their count per row
    (``lengths - 1 - first``: the last chain starts at ``L - 2``)."""
    n = (lengths - 1 - first).clamp(min=0)
    tq = max(int(n.max()), 1)
    j = torch.arange(tq, device=first.device)
    return torch.minimum(first[:, None] + j[None], (lengths - 1).clamp(min=0)[:, None]), n


def chain_steps(model: TrainableDraft, ids: torch.Tensor, aux: torch.Tensor, query: torch.Tensor,
                steps: int) -> Iterator[torch.Tensor]:
    """The draft's post-norm output ``[B, Tq, H]`` at each unrolled step over the chains ``query``
    (:func:`chain_rows`), every step fed the text's own next token (teacher forcing)."""
    b, t = ids.shape
    positions = torch.arange(t, device=ids.device)[None, :].expand(b, t)
    chain = KVChain(query=query)
    post, hidden = model.step(_shift(ids, 1), model.combine_aux(aux), positions, chain)
    for i in range(steps):
        if i:
            tok = torch.gather(ids, 1, (query + 1 + i).clamp(max=t - 1))
            post, hidden = model.step(tok, hidden, query + i, chain)
        yield post


def ttt_loss(model: TrainableDraft, teacher: Teacher, batch: Batch, steps: int, decay: float = 0.8,
             vocab: VocabMap | None = None) -> TTTResult:
    dev = model.fc.weight.device
    ids = batch.input_ids.to(dev)
    b = ids.shape[0]
    lengths, first = batch.lengths.to(dev), batch.first.to(dev)
    query, nq = chain_rows(first, lengths)
    tq = query.shape[1]
    with torch.no_grad():
        tlogits = teacher.logits(batch.label_hidden[:, : tq + steps - 1]).to(dev)  # [B, Tq+K-1, V] float32
        in_vocab = torch.ones(tlogits.shape[:2], dtype=torch.bool, device=dev)
        if vocab is not None:
            used = vocab.used.to(dev)
            in_vocab = vocab.t2d(tlogits.shape[-1]).to(dev)[tlogits.argmax(-1)]
            tlogits = tlogits[..., used]
        probs = torch.softmax(tlogits, dim=-1)
        if probs.shape[1] < tq + steps - 1:  # fewer label rows than chains need: pad (masked below)
            pad = tq + steps - 1 - probs.shape[1]
            probs = torch.cat([probs, probs.new_zeros(b, pad, probs.shape[-1])], dim=1)
            in_vocab = torch.cat([in_vocab, in_vocab.new_zeros(b, pad)], dim=1)
    j = torch.arange(tq, device=dev)
    total = torch.zeros((), device=dev)
    step_loss, step_acc = [], []
    for i, post in enumerate(chain_steps(model, ids, batch.aux.to(dev), query, steps)):
        # chain j of row b (start a_b + j) at step i: label row a_b + 1 + i + j <= L - 1
        mask = (j[None] < nq[:, None]) & (first[:, None] + 1 + i + j[None] <= lengths[:, None] - 1)
        mask = mask & in_vocab[:, i: i + tq]
        if not bool(mask.any()):
            break
        logp = torch.log_softmax(model.compute_logits(post), dim=-1)
        p = probs[:, i: i + tq]
        ce = -(p * logp).sum(-1)
        m = mask.float()
        n = m.sum()
        loss_i = (ce * m).sum() / n
        total = total + decay**i * loss_i
        step_loss.append(float(loss_i.detach()))
        step_acc.append(float(((logp.argmax(-1) == p.argmax(-1)).float() * m).sum() / n))
    return TTTResult(total, step_loss, step_acc)
