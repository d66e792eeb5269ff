"""The calibrated methods by name, their settings, and the activation quantization they model.

Methods (``--method``): ``gptq`` (error feedback with the source model's inputs), ``gptaq`` (error
feedback fitted to the quantized model's inputs, :func:`.gptq.asymmetric_target`), ``smooth``
(per-expert up <-> down smoothing, then round to nearest), and ``smooth+gptq`` / ``smooth+gptaq``
(smoothing, then the solver on the smoothed weights). ``rtn`` is round to nearest on the same
grids (the data-free values an uncovered expert keeps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from eagle3.errors import UsageError
from eagle3.quantize.calibrate import gptq as solvers
from eagle3.runtime.kernels.torch_ref.act_quant import (
    mxfp4_qdq,
    quantize_fp8_per_token,
    quantize_int8_per_token,
)

SOLVERS = ("rtn", "gptq", "gptaq")
METHODS = ("gptq", "gptaq", "smooth", "smooth+gptq", "smooth+gptaq", "rtn")
# An expert (or MLP) is calibrated only when at least MIN_TOKENS_PER_INPUT * in_features calibration
# tokens reach it: below that its inputs' second-moment matrix H has rank < in_features, and the
# error feedback moves rounding error into exactly the input directions calibration never took (the
# "expert distortion" of calibrated PTQ); it keeps its data-free values instead.
MIN_TOKENS_PER_INPUT = 1.0


@dataclass(frozen=True)
class CalibConfig:
    """How a calibrated method solves each weight (defaults: GPTQ's and Quark's)."""

    method: str = "gptq"
    damp: float = solvers.DEFAULT_DAMP
    block: int = solvers.DEFAULT_BLOCK
    act_order: bool = True
    alpha: float = 0.25  # gptaq: share of the correction towards the quantized inputs (Quark's default)
    scales: str | None = None  # grid scales: None = the format's default (grids.grid_for)
    smooth_pow2: bool = False  # smoothing scales rounded to powers of two (the smoothed source: same bits)
    min_tokens_per_input: float = MIN_TOKENS_PER_INPUT
    hessian_dtype: torch.dtype = torch.float32  # X^T X accumulation
    factor_dtype: torch.dtype = torch.float32  # the Cholesky factorisation (gptq.factor)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UsageError(f"--method {self.method!r}: calibrated methods are {', '.join(METHODS)}")
        if not 0 <= self.damp < 1:
            raise UsageError(f"damping {self.damp}: must be in [0, 1)")
        if self.block < 1:
            raise UsageError(f"GPTQ block {self.block}: must be >= 1")

    @property
    def smooth(self) -> bool:
        return self.method.startswith("smooth")

    @property
    def solver(self) -> str:
        """rtn | gptq | gptaq (what runs after the optional smoothing)."""
        tail = self.method.split("+")[-1]
        return "rtn" if tail == "smooth" else tail

    @property
    def needs_quantized_inputs(self) -> bool:
        return self.solver == "gptaq"


ActQdq = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _fp8_qdq(x: torch.Tensor) -> torch.Tensor:
    q, s = quantize_fp8_per_token(x)
    return (q.float() * s[:, None]).to(x.dtype)


def _int8_qdq(x: torch.Tensor) -> torch.Tensor:
    q, s = quantize_int8_per_token(x)
    return (q.float() * s[:, None]).to(x.dtype)


def act_qdq(fmt: str | None) -> ActQdq:
    """The dynamic activation quantization a served quantized Linear applies to its input (the
    runtime's torch reference), as a fake-quantize function: recipe activation format
    ``none`` / ``fp8`` / ``int8`` (per token) / ``mxfp4`` (per 32-block)."""
    if fmt in (None, "none"):
        return _identity
    if fmt == "fp8":
        return _fp8_qdq
    if fmt == "int8":
        return _int8_qdq
    if fmt == "mxfp4":
        return mxfp4_qdq
    raise UsageError(f"activation format {fmt!r}: calibrated methods model none, fp8, int8 or mxfp4")
