"""Loading a model directory's tokenizer: the one place the runtime, the server and the benchmark
get theirs from."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eagle3.errors import UsageError

logger = logging.getLogger("eagle3.runtime")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")


def _refuse_special_files(target: Path) -> None:
    """transformers opens whichever tokenizer files it finds by name: a FIFO named tokenizer.json
    would block it forever. Anything in the directory that is neither a directory nor a regular
    file is refused before it loads (one line, like every other bad input)."""
    from eagle3.checkpoint import check_regular_file

    for entry in sorted(target.iterdir()):
        if not entry.is_dir():
            check_regular_file(entry)


def load_tokenizer(target: str | Path, trust_remote_code: bool = False) -> Any | None:
    """The tokenizer of a model directory, or None when it has none (token-id prompts only).

    AutoTokenizer first (it also reads config.json, whose ``kimi_k2`` model type transformers 5
    does not know: its warnings about that are silenced here); ``PreTrainedTokenizerFast`` on
    ``tokenizer.json`` when AutoTokenizer cannot map the config (Kimi-K2-Thinking's config with
    transformers 5). Code shipped with the model (Kimi's tiktoken tokenizer) only runs with
    ``trust_remote_code``."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    target = Path(target)
    if not target.is_dir():
        return None
    _refuse_special_files(target)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    except Exception as err:
        if (target / "tokenizer.json").is_file():
            try:
                return PreTrainedTokenizerFast.from_pretrained(str(target))
            except Exception:  # fall through to the explanation below
                pass
        cfg = target / "tokenizer_config.json"
        if not trust_remote_code and cfg.is_file() and "auto_map" in cfg.read_text():
            raise UsageError(f"{target}: the tokenizer is defined by code shipped with the model; pass "
                             f"--trust-remote-code to run it") from err
        if any((target / n).exists() for n in _TOKENIZER_FILES):
            raise UsageError(f"{target}: cannot load the tokenizer: {type(err).__name__}: {err}") from err
        logger.warning("%s has no tokenizer; token-id prompts only", target)
        return None
    finally:
        hf_logging.set_verbosity(level)
