"""Acceptance statistics of speculative decoding, per request and per engine.

Counters are vLLM's (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``) so the server can export them
as they are; the derived numbers follow the vLLM / SGLang convention that the mean acceptance
length counts the bonus token (``1 + accepted / drafts``, range ``[1, k + 1]``). :meth:`line`
prints them the way ATOM logs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters over verification steps. A "draft" is one verification of >= 1 draft token."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i
    accepted_hist: list[int] = field(default_factory=list)  # [k+1]: drafts with 0..k accepted tokens

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * k
        if not self.accepted_hist:
            self.accepted_hist = [0] * (k + 1)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Record one verification of ``num_draft_tokens`` drafts of which the first
        ``num_accepted`` were accepted. Steps without drafts (prefill) are not drafts."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        self.accepted_hist[num_accepted] += 1

    def copy(self) -> SpecStats:
        return SpecStats(self.num_speculative_tokens, self.num_drafts, self.num_draft_tokens,
                         self.num_accepted_tokens, list(self.accepted_per_pos), list(self.accepted_hist))

    def merge(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, n in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += n
        for i, n in enumerate(other.accepted_hist):
            self.accepted_hist[i] += n

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per target forward in decode, bonus included (vLLM / SGLang / ATOM
        "avg toks/fwd")."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of drafts whose token at position ``i`` was accepted."""
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.accepted_per_pos]

    @property
    def accepted_distribution(self) -> list[float]:
        """Fraction of drafts that had exactly ``0..k`` tokens accepted."""
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.accepted_hist]

    def line(self) -> str:
        """``acceptance: 67.85%  avg toks/fwd: 3.04  dist 0/1/2/3: 10.00/12.00/20.00/58.00%``."""
        k = self.num_speculative_tokens
        dist = "/".join(f"{100 * f:.2f}" for f in self.accepted_distribution)
        return (f"acceptance: {100 * self.acceptance_rate:.2f}%  avg toks/fwd: {self.mean_acceptance_length:.2f}"
                f"  dist {'/'.join(str(i) for i in range(k + 1))}: {dist}%")

    def depth_line(self) -> str:
        """``depth>=1/2/3: 91.00/86.00/77.00%``: the share of verifies whose accepted path reached
        each depth. With draft trees ``accepted_per_pos[i]`` counts exactly that (the accepted
        path is a chain of i + 1 nodes, one per depth), so the chain's per-position counter is
        the tree's per-depth counter."""
        k = self.num_speculative_tokens
        rates = "/".join(f"{100 * f:.2f}" for f in self.per_position_acceptance)
        return f"depth>={'/'.join(str(d) for d in range(1, k + 1))}: {rates}%"

    def as_dict(self) -> dict[str, object]:
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "accepted_hist": list(self.accepted_hist),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
        }
