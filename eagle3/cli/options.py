"""Options and helpers shared by several commands (the serve and bench flags of the bundled runtime)."""

from __future__ import annotations

import re

import typer

from eagle3.runtime.engine.config import BACKENDS, EngineConfig

# The engine flags' defaults are EngineConfig's (declared there once; importing it loads no torch).
ENGINE = EngineConfig()

KERNEL_BACKEND_HELP = ("Kernel backend of the bundled runtime: auto (triton on a GPU where triton imports, aiter "
                        "on ROCm where aiter imports, torch otherwise), torch, triton, aiter.")
ENFORCE_EAGER_HELP = "No CUDA/HIP graphs: run every decode / verify / draft step eagerly (graphs are GPU only)."


def check_kernel_backend(name: str) -> str:
    """``--kernel-backend`` checked before anything loads (one line, exit 2, on a bad value)."""
    from eagle3.errors import UsageError

    if name not in BACKENDS:
        raise UsageError(f"--kernel-backend {name!r}: expected one of {', '.join(BACKENDS)}")
    return name


def parse_bytes(text: str, flag: str) -> int:
    """A size flag: ``"4GiB"``, ``"512MB"``, ``"5gb"``, ``"1000000"`` -> bytes (binary units with ``i``)."""
    from eagle3.errors import UsageError

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if not m:
        raise UsageError(f"{flag} {text!r}: expected a size such as 4GiB or 512MB")
    base = 1024 if m.group(3) else 1000
    n = int(float(m.group(1)) * base ** " kmgt".index(m.group(2) or " "))
    if n <= 0:
        raise UsageError(f"{flag} {text!r}: must be positive")
    return n


def exit_on_report(report: dict, lines: list[str]) -> None:
    for line in lines:
        typer.echo(line)
    if not report["passed"]:
        raise typer.Exit(1)
