"""Which files of a Hugging Face model directory are what.

Used by the checkpoint writer (side files copied next to the weights) and by ``download``
(allow-patterns per role), so both agree on what a complete checkpoint is.
"""

from __future__ import annotations

import fnmatch

INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "manifest.json"

WEIGHT_PATTERNS = ["*.safetensors", INDEX_FILE]
CONFIG_PATTERNS = ["config.json", "generation_config.json", "preprocessor_config.json"]
# Kimi ships a tiktoken vocabulary (tiktoken.model) and a Jinja chat template; other models ship
# tokenizer.json / vocab / merges. All of them are small and all are needed to serve.
TOKENIZER_PATTERNS = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tiktoken.model",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "*.jinja",
]
REMOTE_CODE_PATTERNS = ["*.py"]
DOC_PATTERNS = ["README.md", "LICENSE*", "*.md"]

# Files copied by convert/quantize next to the new weights (config.json is rewritten by the caller).
SIDE_FILE_PATTERNS = ["generation_config.json", "preprocessor_config.json", *TOKENIZER_PATTERNS]


def download_patterns(trust_remote_code: bool = False, weights: bool = True) -> list[str]:
    """Allow-patterns for ``snapshot_download``: what serving a model needs, nothing else."""
    pats = list(CONFIG_PATTERNS) + list(TOKENIZER_PATTERNS) + ["LICENSE*", "README.md"]
    if weights:
        pats += WEIGHT_PATTERNS
    if trust_remote_code:
        pats += REMOTE_CODE_PATTERNS
    return pats


def is_side_file(name: str, trust_remote_code: bool = False) -> bool:
    pats = SIDE_FILE_PATTERNS + (REMOTE_CODE_PATTERNS if trust_remote_code else [])
    return any(fnmatch.fnmatch(name, p) for p in pats)
