"""eagle3: EAGLE-3 speculative decoding for Kimi-K2.5.

Download, convert, quantize (AMD Quark formats) and serve-and-validate a Kimi-K2.5 target with an
EAGLE-3 / EAGLE-3.1 draft. The CLI lives in :mod:`eagle3.cli`; on-disk format knowledge lives in
:mod:`eagle3.formats` only.
"""

__version__ = "0.1.0"
