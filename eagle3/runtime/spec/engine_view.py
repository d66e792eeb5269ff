"""What ``spec/`` reads of the engine's objects, as protocols: the engine's ``EngineConfig`` and
``Sequence`` satisfy them, and ``spec/`` names no engine type, not even for annotations, so the
engine depends on ``spec/`` and never the other way (tests/test_architecture.py counts typing-only
imports in its cycle check)."""

from __future__ import annotations

from typing import Protocol

from eagle3.runtime.sampling import SamplingParams


class DraftingConfig(Protocol):
    """The engine's one config as the proposer and tree drafting read it."""

    @property
    def draft_sampling(self) -> str:
        """"sample": drafts drawn from the draft's distribution; "greedy": its argmax."""
        ...

    @property
    def max_k(self) -> int:
        """The most drafts a step may verify (the tree's depth when drafting trees)."""
        ...

    @property
    def tree(self) -> tuple[int, int] | None:
        """(topk, tree nodes with the root) when drafting trees, else None."""
        ...


class DraftingSeq(Protocol):
    """A running sequence as the proposer reads it: where its KV lives and how it samples."""

    @property
    def block_table(self) -> list[int]: ...

    @property
    def params(self) -> SamplingParams: ...
