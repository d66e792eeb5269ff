"""Verification of chain drafts against the target: greedy and exact rejection sampling.

Semantics are vLLM's ``RejectionSampler`` (Leviathan et al., arXiv:2211.17192), written out the
way gpt-fast writes it. Notation: ``p`` is the target distribution, ``q`` the draft's, both after
temperature, top-k and top-p (``sampling.logits_to_probs``); draft token ``x`` was drawn from ``q``.

* accept ``x`` with probability ``min(1, p(x) / q(x))``: if ``q(x) <= p(x)`` always, otherwise
  with probability ``p(x) / q(x)``;
* at the first rejection emit a *recovered* token from ``norm(max(p - q, 0))`` and stop;
* if every draft is accepted emit a *bonus* token from ``p`` of the position after the last draft.

The emitted tokens are then distributed exactly as if sampled from ``p`` one by one. Greedy rows
accept the longest prefix where ``x == argmax p`` and emit the argmax at the first mismatch (or
as the bonus). A draft that is a point mass (argmax drafting, ``draft_probs=None``) is the special
case ``q = one_hot(x)``: accept with probability ``p(x)``, recover from ``p`` with ``x`` removed.

Output contract (vLLM): ``[B, K + 1]`` int64 rows of accepted drafts then the recovered or bonus
token, padded with ``-1``; ``num_accepted = emitted - 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eagle3.runtime.sampling import SamplingBatch, draw_uniform, logits_to_probs, sample_from_weights

PLACEHOLDER = -1


@dataclass
class VerifyOutput:
    token_ids: torch.Tensor  # int64 [B, K+1], -1 padded
    num_accepted: torch.Tensor  # int64 [B], accepted drafts (0..num_drafts[b])

    def rows(self) -> list[list[int]]:
        """Emitted tokens per request (accepted drafts + one recovered/bonus token)."""
        ids = self.token_ids.tolist()
        return [r[: int(a) + 1] for r, a in zip(ids, self.num_accepted.tolist(), strict=True)]


def _first_rejection(accepted: torch.Tensor) -> torch.Tensor:
    """``accepted`` bool [B, K] -> number of leading Trues per row."""
    return accepted.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalised distribution to recover from after rejecting a draft: ``max(p - q, 0)``."""
    return (p - q).clamp_min(0.0)


def rejection_sample(target_logits: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                     batch: SamplingBatch, draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> VerifyOutput:
    """Verify ``K``-padded chain drafts for ``B`` requests.

    Args:
      target_logits: float32 ``[B, K+1, V]``; row ``i`` is the target's prediction for the token
        after draft ``i`` (row 0: after the last committed token). Rows past ``num_drafts[b]`` are
        ignored.
      draft_ids: int64 ``[B, K]`` target-vocabulary draft tokens (padding: any value).
      num_drafts: int64 ``[B]``, ``0 <= num_drafts[b] <= K``.
      batch: one sampling row per request.
      draft_probs: float32 ``[B, K, V]`` distribution each draft was sampled from (target vocab),
        or None for point-mass (argmax) drafts. Only used on non-greedy rows.
      generator: the engine's generator for rows without their own.

    Random numbers are drawn ``K`` uniforms and ``V`` exponentials per non-greedy request, however
    many drafts it has, so a seeded request consumes its generator the same way in any batch
    (``K`` is the engine's configured number of speculative tokens).
    """
    b, k1, v = target_logits.shape
    k = k1 - 1
    device = target_logits.device
    pos = torch.arange(k, device=device)
    valid = pos[None, :] < num_drafts[:, None]  # [B, K]
    safe_ids = draft_ids.clamp(0, v - 1)

    # Greedy: target argmax at every position; the emitted token at the stop position is the argmax.
    argmax = target_logits.argmax(dim=-1)  # [B, K+1]
    greedy_acc = (safe_ids == argmax[:, :k]) & valid
    num_acc = _first_rejection(greedy_acc)
    final = argmax.gather(1, num_acc[:, None]).squeeze(1)

    stochastic = ~batch.greedy
    if bool(stochastic.any()):
        idx = stochastic.nonzero().squeeze(1)
        n_acc_s, final_s = _verify_stochastic(
            target_logits[idx], safe_ids[idx], valid[idx], num_drafts[idx],
            _select(batch, idx), None if draft_probs is None else draft_probs[idx], generator)
        num_acc = num_acc.clone()
        num_acc[idx] = n_acc_s
        final = final.clone()
        final[idx] = final_s

    out = torch.full((b, k1), PLACEHOLDER, dtype=torch.int64, device=device)
    out[:, :k] = torch.where(pos[None, :] < num_acc[:, None], safe_ids, PLACEHOLDER)
    out.scatter_(1, num_acc[:, None], final[:, None])
    return VerifyOutput(out, num_acc)


def _select(batch: SamplingBatch, idx: torch.Tensor) -> SamplingBatch:
    rows = idx.tolist()
    return SamplingBatch(batch.temperature[idx], batch.top_k[idx], batch.top_p[idx], batch.greedy[idx],
                         [batch.generators[i] for i in rows])


def _verify_stochastic(logits: torch.Tensor, draft_ids: torch.Tensor, valid: torch.Tensor,
                       num_drafts: torch.Tensor, batch: SamplingBatch, draft_probs: torch.Tensor | None,
                       generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    b, k1, v = logits.shape
    k = k1 - 1
    rows = SamplingBatch(batch.temperature.repeat_interleave(k1), batch.top_k.repeat_interleave(k1),
                         batch.top_p.repeat_interleave(k1), batch.greedy.repeat_interleave(k1), [])
    p = logits_to_probs(logits.reshape(b * k1, v), rows).view(b, k1, v)  # [B, K+1, V]
    p_x = p[:, :k].gather(2, draft_ids[..., None]).squeeze(2)  # [B, K]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(2, draft_ids[..., None]).squeeze(2)
    u = draw_uniform(k, batch.generators, generator, logits.device)  # [B, K]
    # p/q >= u written without a division; q(x) == 0 can only happen for a broken draft: reject.
    accepted = (q_x > 0) & (p_x >= u * q_x) & valid
    num_acc = _first_rejection(accepted)

    p_stop = p.gather(1, num_acc[:, None, None].expand(b, 1, v)).squeeze(1)  # [B, V]
    rejected = num_acc < num_drafts  # else: every draft accepted -> bonus from p_stop
    if bool(rejected.any()):
        stop = num_acc.clamp_max(k - 1)
        if draft_probs is None:
            x = draft_ids.gather(1, stop[:, None])
            q_stop = torch.zeros_like(p_stop).scatter_(1, x, 1.0)
        else:
            q_stop = draft_probs.gather(1, stop[:, None, None].expand(b, 1, v)).squeeze(1)
        resid = _residual(p_stop, q_stop)
        # p == q on the support makes the residual vanish; then rejection had probability 0 and
        # any choice is exact, so fall back to p instead of sampling from all-zero weights.
        degenerate = resid.sum(dim=-1) <= 0
        resid = torch.where(degenerate[:, None], p_stop, resid)
        weights = torch.where(rejected[:, None], resid, p_stop)
    else:
        weights = p_stop
    final = sample_from_weights(weights, batch.generators, generator)
    return num_acc, final


def pad_drafts(drafts: Sequence[Sequence[int]], k: int, device: torch.device | str = "cpu"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged draft lists -> (int64 ``[B, k]`` padded with -1, int64 ``[B]`` lengths)."""
    out = torch.full((len(drafts), k), PLACEHOLDER, dtype=torch.int64)
    for i, d in enumerate(drafts):
        if d:
            out[i, : len(d)] = torch.as_tensor(list(d), dtype=torch.int64)
    lens = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
    return out.to(device), lens.to(device)
