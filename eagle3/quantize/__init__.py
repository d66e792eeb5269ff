"""Quantize a target or draft checkpoint, file to file, into AMD Quark's export format.

Public API::

    from eagle3.quantize import quantize, load_recipe
    result = quantize("moonshotai/Kimi-K2.5", "kimi-k2.5-w4a8", "w4a8", workers=2)

Modules: :mod:`.recipes` (YAML -> Recipe), :mod:`.sources` (modules and exact quantizer inputs of
a source checkpoint), :mod:`.native` (eagle3 codecs engine), :mod:`.quark` (Quark primitives
engine), :mod:`.compat` (the exported config), :mod:`.report` (verification report),
:mod:`.pipeline` (the streaming, parallel, resumable driver).
"""

from eagle3.quantize.pipeline import QuantizeResult, quantize
from eagle3.quantize.recipes import Recipe, builtin_names, load_recipe, parse_recipe

__all__ = ["QuantizeResult", "Recipe", "builtin_names", "load_recipe", "parse_recipe", "quantize"]
