"""The part of AMD Quark's import that cannot change its result, skipped (tests only: speed; what
Quark registers is unchanged).

Importing ``quark.torch`` (0.13) runs ``quark_experts``' scan of transformers: it ``ast.parse``s
every ``transformers/models/*/modeling_*.py`` (538 files with transformers 5) to find the classes
decorated ``@use_experts_implementation``, imports the modules that have one and registers those
classes. A decorator of that name cannot appear in a file that does not contain the name, so a
file without it parses to nothing the scan keeps: here such a file's parse returns an empty module
at once. Files that contain the name are parsed and imported as before, so the registry is the
same. That was 6.3 of the ~20 CPU-s the import costs, once in every test process that imports
Quark (directly, or through ``eagle3.quantize.quark`` for ``--engine quark``). There is no switch
in Quark for it; a test (test_quark_speed.py) checks the registry equals the full scan's on a
sample of files.
"""

from __future__ import annotations

import ast
import sys
from typing import Any

SCANNER = "quark.torch.utils.llm.module_replacement.quark_experts"
MARKER = "use_experts_implementation"

_parse = ast.parse


def _parse_unless_unmarked(source: Any, *args: Any, **kwargs: Any) -> Any:
    # Only the scanner's own calls (its module-level loop) are filtered: every other caller, pytest's
    # assertion rewriting included, gets ast.parse untouched.
    if (isinstance(source, str) and MARKER not in source
            and sys._getframe(1).f_globals.get("__name__") == SCANNER):
        return ast.Module(body=[], type_ignores=[])
    return _parse(source, *args, **kwargs)


def install() -> None:
    """Filter the scan's parses for the rest of this process (before Quark is first imported)."""
    ast.parse = _parse_unless_unmarked
