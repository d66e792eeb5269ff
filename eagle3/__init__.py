"""eagle3: EAGLE-3 speculative decoding for Kimi-K2.5.

Download, convert, quantize (AMD Quark formats) and serve-and-validate a Kimi-K2.5 target with an
EAGLE-3 / EAGLE-3.1 draft. The CLI lives in :mod:`eagle3.cli`; on-disk format knowledge lives in
:mod:`eagle3.formats` only.

``from eagle3 import LLM, SamplingParams`` (vLLM's convention) gives the runtime's Python API. The
names are resolved on first use (PEP 562 module ``__getattr__``): ``import eagle3`` stays cheap for
the CLI and never imports torch by itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eagle3.version import __version__

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from eagle3.runtime.engine.llm import LLM, RequestOutput
    from eagle3.runtime.sampling import SamplingParams

_LAZY = {"LLM": "eagle3.runtime.engine.llm", "RequestOutput": "eagle3.runtime.engine.llm",
         "SamplingParams": "eagle3.runtime.sampling"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'eagle3' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
