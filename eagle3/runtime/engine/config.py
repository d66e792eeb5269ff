"""Engine settings (scheduling, KV cache, speculation): one small dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from eagle3.errors import UsageError

MAX_SPECULATIVE_TOKENS = 8


@dataclass
class EngineConfig:
    num_speculative_tokens: int = 3  # k draft tokens per target step (ignored without a draft)
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks; None: sized from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for target + draft caches; None: a default
    max_num_seqs: int = 64  # running sequences per step
    # Query tokens per target forward (drafts included). 2048 holds a whole 5-shot GSM8K prompt
    # (~1,600 tokens); measured on the tiny target + draft (8 such prompts, CPU): 512 -> 4.3 s,
    # 1024 -> 3.6 s, 2048 -> 3.4 s, 8192 -> 3.3 s, so larger chunks only lengthen the steps that
    # decoding sequences share with a prefill.
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the target's max_position_embeddings
    draft_sampling: str = "sample"  # "sample": drafts drawn from q; "greedy": argmax drafts
    seed: int = 0  # engine generator, used by requests without their own seed
    log_stats: bool = False  # print the acceptance line after generate()

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise UsageError(f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.block_size < 1:
            raise UsageError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise UsageError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_num_seqs < 1:
            raise UsageError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise UsageError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.draft_sampling not in ("sample", "greedy"):
            raise UsageError(f"draft_sampling must be 'sample' or 'greedy', got {self.draft_sampling!r}")
