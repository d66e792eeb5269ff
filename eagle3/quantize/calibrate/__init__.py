"""Calibrated quantization methods for the W4A8 and MXFP4 recipes: the same export tensors as the
native engine (names, dtypes, shapes), better values in them.

Two ways in:

* one weight at a time, for a caller that has the weight and its inputs' statistics::

      from eagle3.quantize.calibrate import solve, grid_for
      tensors = solve(w_fp32, H, grid_for("mxfp4", w_fp32))   # {"weight": ..., "weight_scale": ...}

  ``H`` [in, in] is the inputs' second-moment matrix ``X^T X`` (None: round to nearest);

* a whole source checkpoint, streamed layer by layer (:class:`.driver.Calibrator`): calibration
  prompts run through the source with the runtime's own layers, every in-scope MLP solved from
  the tokens that reach it, results written per layer to a :class:`.store.TensorStore` that the
  quantizer reads instead of computing those modules itself::

      from eagle3.quantize.calibrate import calibrate
      result = calibrate("kimi-k2.5", "calib-store", "mxfp4", method="gptq", calibration="gsm8k")

Modules: :mod:`.grids` (the formats' values with fixed scales), :mod:`.gptq` (round to nearest,
GPTQ, the GPTAQ target), :mod:`.smooth` (per-expert up <-> down smoothing), :mod:`.mlp` (one MLP
solved), :mod:`.capture` (the source one layer at a time), :mod:`.prompts` (calibration tokens),
:mod:`.methods` (names and settings), :mod:`.driver` (the pass), :mod:`.store` (its output).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from eagle3.quantize.calibrate import gptq as _solvers
from eagle3.quantize.calibrate.driver import CalibrationResult, Calibrator
from eagle3.quantize.calibrate.grids import Grid, MXFP4Grid, W4A8Grid, grid_for, mxfp4_grid, w4a8_grid
from eagle3.quantize.calibrate.methods import METHODS, CalibConfig
from eagle3.quantize.calibrate.prompts import DEFAULT_MAX_TOKENS, DEFAULT_SAMPLES, load_calibration
from eagle3.quantize.calibrate.store import TensorStore


def solve(w: torch.Tensor, h: torch.Tensor | None, grid: Grid, damp: float = _solvers.DEFAULT_DAMP,
          act_order: bool = True, block: int = _solvers.DEFAULT_BLOCK) -> dict[str, torch.Tensor]:
    """One weight ``w`` [out, in] (fp32 source values) on ``grid``: GPTQ with the inputs' Hessian
    ``h`` [in, in], or round to nearest when ``h`` is None. Returns the native engine's export
    tensors for the grid's format (``weight``, ``weight_scale`` (, ``weight_scale_2``))."""
    if h is None:
        sol = _solvers.rtn(w, grid)
    else:
        sol = _solvers.gptq(w, _solvers.factor(h, damp, act_order), grid, block)
    return grid.native(sol.codes)


def calibrate(src: str | os.PathLike[str], store: str | os.PathLike[str], recipe: str = "mxfp4",
              scope: str | None = None, method: str = "gptq", calibration: str = "gsm8k",
              samples: int = DEFAULT_SAMPLES, max_tokens: int = DEFAULT_MAX_TOKENS,
              config: CalibConfig | None = None, dtype: torch.dtype = torch.bfloat16) -> CalibrationResult:
    """Run the calibration pass of ``src`` for ``recipe``'s weights with ``method`` and write the
    solved export tensors to ``store`` (a directory). ``calibration``: "gsm8k" or a JSONL file."""
    from eagle3.quantize.recipes import load_recipe
    from eagle3.runtime.tokenizer import load_tokenizer

    rec = load_recipe(recipe)
    cfg = config or CalibConfig(method=method)
    calib = load_calibration(calibration, load_tokenizer(Path(src)), samples, max_tokens)
    return Calibrator(src, rec, rec.scope(scope), cfg, calib, TensorStore(store), dtype).run()


__all__ = ["METHODS", "CalibConfig", "CalibrationResult", "Calibrator", "Grid", "MXFP4Grid", "TensorStore",
           "W4A8Grid", "calibrate", "grid_for", "load_calibration", "mxfp4_grid", "solve", "w4a8_grid"]
