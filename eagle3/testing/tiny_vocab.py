"""The tiny vocabulary: 1024 ids, 0..767 byte-level BPE and 768..1023 Kimi's 256 reserved special
tokens at Kimi's offsets (``tiny id = kimi id - 163584 + 768``); see :mod:`eagle3.testing.tiny`."""

from __future__ import annotations

VOCAB_SIZE = 1024
BPE_VOCAB_SIZE = 768  # ids below this are byte-level BPE tokens
NUM_RESERVED_SPECIAL = VOCAB_SIZE - BPE_VOCAB_SIZE  # 256, like Kimi
KIMI_FIRST_SPECIAL = 163584


def kimi_to_tiny_id(kimi_id: int) -> int:
    """Kimi special-token id -> the tiny vocabulary's id (same offset inside the reserved block)."""
    tiny = kimi_id - KIMI_FIRST_SPECIAL + BPE_VOCAB_SIZE
    if not BPE_VOCAB_SIZE <= tiny < VOCAB_SIZE:
        raise ValueError(f"Kimi id {kimi_id} is not a reserved special token")
    return tiny


# Kimi-K2 / K2.5 named special tokens (tokenizer_config.json of the Kimi repos).
_KIMI_SPECIALS: dict[int, str] = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|im_end|>",
    163587: "<|im_user|>",
    163588: "<|im_assistant|>",
    163590: "<|start_header_id|>",
    163591: "<|end_header_id|>",
    163593: "[EOT]",
    163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>",
    163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>",
    163599: "<|tool_call_end|>",
    163601: "<|im_middle|>",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163606: "<think>",
    163607: "</think>",
    163838: "[UNK]",
    163839: "[PAD]",
}
VIDEO_PLACEHOLDER = "<|kimi_k25_video_placeholder|>"
VIDEO_PLACEHOLDER_ID = 792  # our choice: Kimi has no such token id (see the module docstring)

SPECIAL_TOKENS: dict[int, str] = {kimi_to_tiny_id(k): v for k, v in _KIMI_SPECIALS.items()}
SPECIAL_TOKENS[VIDEO_PLACEHOLDER_ID] = VIDEO_PLACEHOLDER
TOKEN_IDS: dict[str, int] = {v: k for k, v in SPECIAL_TOKENS.items()}

BOS_ID = TOKEN_IDS["[BOS]"]  # 768
EOS_ID = TOKEN_IDS["[EOS]"]  # 769
IM_END_ID = TOKEN_IDS["<|im_end|>"]  # 770
EOT_ID = TOKEN_IDS["[EOT]"]  # 777
PAD_ID = TOKEN_IDS["[PAD]"]  # 1023
UNK_ID = TOKEN_IDS["[UNK]"]  # 1022
MEDIA_PAD_ID = TOKEN_IDS["<|media_pad|>"]  # 789
MEDIA_BEGIN_ID = TOKEN_IDS["<|media_begin|>"]  # 786
MEDIA_END_ID = TOKEN_IDS["<|media_end|>"]  # 788
STOP_IDS = (EOS_ID, IM_END_ID, EOT_ID)  # what runtimes stop on for Kimi: {[EOS], <|im_end|>, [EOT]}


def special_token_name(tiny_id: int) -> str:
    """Name of reserved id ``tiny_id``: Kimi's name, else ``<|reserved_token_{id}|>`` as Kimi does."""
    return SPECIAL_TOKENS.get(tiny_id, f"<|reserved_token_{tiny_id}|>")
