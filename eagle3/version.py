"""The package version, in a module of its own: ``checkpoint/`` and ``quantize/`` record it in what
they write, and importing it from ``eagle3`` itself would make them depend on the package facade,
which names the runtime's API (``eagle3/__init__.py``)."""

__version__ = "0.1.0"
