"""How a quantized weight's numbers are chosen inside its recipe's format: ``eagle3 quantize --method``.

The format is the recipe's (tensor names, dtypes, shapes, ``quantization_config``); a method only
chooses the numbers in it. The interface every method implements, data-free or calibrated:

* input: a block of whole rows of one weight, ``x`` [R, K], as the quantizer reads them (bf16 /
  fp16 / fp32 as stored; the fp32 dequant of a Moonshot INT4 or DeepSeek FP8 source), and a
  :class:`RowsContext`: the weight's format and shape, the per-tensor FP8-stage scale of a two-stage
  W4A8 weight (chosen by the engine over the whole weight before any row), and :class:`InputStats`,
  what is known about the weight's inputs (a per-input-channel importance, or a Hessian
  ``E[x x^T]`` from calibration tokens);
* output: those rows' part of each export tensor (:func:`row_tensors` names them per format), in
  the layout :class:`eagle3.quantize.native.NativeEngine` writes and
  :func:`eagle3.quantize.native.decode` reads.

Why blocks of whole rows: every format's scales are per output row or finer (W4A8's per-tensor
stage comes in through the context), and error feedback (GPTQ and its kin) runs along one row's
inputs with the same Hessian for every row, so a row block is the unit every method works on,
streaming, with memory bounded by the block.

Methods here (data-free):

* ``rtn``: Quark 0.13's round to nearest with max-based scales, bit for bit (``--engine quark``
  computes the same bits with Quark's own primitives).
* ``mse``: a scale search against the source values, round to nearest within the chosen scales
  (:mod:`eagle3.quantize.scale_search`): INT4 per channel (``fp8_int4``, ``int4`` per_channel) picks
  each row's step among clip ratios of its max by the (importance-weighted) squared error, then
  refines it by least squares; MXFP4 picks each block's exponent among Quark's ``even`` exponent
  and its two neighbours by the block's squared error. W4A8's routed experts' ``down_proj`` is then
  rounded within that step with error feedback for a data-free model of its inputs
  (:mod:`eagle3.quantize.expert_inputs`, through ``InputStats.moments``).

Calibrated methods (``gptq``, ``gptaq``, ``smooth``, ``smooth+gptq``, ``smooth+gptaq``;
:class:`Calibrated`, solved by :mod:`eagle3.quantize.calibrate` before the file-to-file pass): the
weights the calibration pass solved arrive whole as ``ctx.inputs.solved``; every other weight of the
run (an expert too few calibration tokens reach, a module outside the MLPs) gets the recipe format's
data-free default through :meth:`Calibrated.rows`. :func:`register` adds a method to :data:`METHODS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from eagle3.errors import UsageError
from eagle3.formats import codecs, keys
from eagle3.quantize.recipes import WeightSpec


@dataclass(frozen=True)
class InputStats:
    """What is known about a weight's inputs (its K input channels), for the methods that use it.

    ``importance`` [K] fp32 > 0: how much each input channel's error counts (a diagonal Hessian,
    up to scale), e.g. ``E[x_k^2]`` over calibration tokens. No data-free method sets it: the RMSNorm
    weight feeding a Linear was measured no better than none (docs/recipes.md, "Importance").
    ``hessian`` [K, K] fp32: ``E[x x^T]`` over calibration tokens (calibrated methods only).
    ``moments``: :class:`eagle3.quantize.expert_inputs.InputMoments`, ``E[x]`` and ``E[x^2]`` per input
    channel of a data-free model (a routed expert's ``down_proj``, from its own gate / up projections):
    ``mse`` then rounds W4A8's INT4 codes with error feedback for them.
    ``solved``: the weight's whole export tensors, already chosen by a calibrated method's pass over
    the model (error feedback needs a layer's inputs, which exist only while the source runs layer by
    layer, so the calibrated numbers are solved before the file-to-file pass and handed in here; the
    engine checks and writes them instead of calling :meth:`Method.rows`).
    ``source`` says where they came from, for the report."""

    importance: torch.Tensor | None = None
    hessian: torch.Tensor | None = None
    solved: dict[str, torch.Tensor] | None = None
    moments: Any = None  # eagle3.quantize.expert_inputs.InputMoments: E[x], E[x^2] of a data-free model
    source: str = "none"


NO_STATS = InputStats()


@dataclass(frozen=True)
class RowsContext:
    """Everything about the weight a method may use beside the rows themselves."""

    spec: WeightSpec
    shape: tuple[int, int]  # the whole weight's [N, K]
    s1: torch.Tensor | None = None  # fp8_int4: the FP8 stage's per-tensor scale (fp32, 0-d)
    inputs: InputStats = field(default=NO_STATS)


class Method(Protocol):
    """A way of choosing a weight's numbers in its recipe's format (module docstring)."""

    name: str
    description: str

    def supports(self, spec: WeightSpec) -> bool:
        """Whether this method can write weights in ``spec``'s format."""
        ...

    def rows(self, x: torch.Tensor, ctx: RowsContext) -> dict[str, torch.Tensor]:
        """Rows ``x`` [R, K] -> their part of each export tensor (:func:`row_tensors`)."""
        ...


def row_tensors(spec: WeightSpec) -> tuple[str, ...]:
    """The export tensors a method returns for a block of rows, by format (their row dimension
    first, except per-group INT4's transposed ``weight`` [K, R/8] and ``weight_scale`` [K/g, R]):

    * ``fp8_int4``: ``weight`` int32 [R, K/8] (reorder-packed INT4), ``weight_scale_2`` f32 [R]
      (the per-tensor ``weight_scale`` is the context's ``s1``, written by the engine);
    * ``int4``: ``weight`` int32, ``weight_scale`` f32 ([R] per channel);
    * ``mxfp4``: ``weight`` uint8 [R, K/2], ``weight_scale`` uint8 E8M0 [R, K/32];
    * ``fp8``: ``weight`` float8_e4m3fn [R, K], per channel also ``weight_scale`` f32 [R]."""
    if spec.format == "fp8_int4":
        return keys.WEIGHT, keys.SCALE_2
    if spec.format == "fp8" and spec.qscheme == "per_tensor":
        return (keys.WEIGHT,)
    return keys.WEIGHT, keys.SCALE


class RoundToNearest:
    """Quark 0.13's numbers: max-based scales, round half to even (eagle3's codecs, bit for bit)."""

    name = "rtn"
    description = "round to nearest with max-based scales (Quark 0.13's numbers, bit for bit)"

    def supports(self, spec: WeightSpec) -> bool:
        return True

    def rows(self, x: torch.Tensor, ctx: RowsContext) -> dict[str, torch.Tensor]:
        spec, f32 = ctx.spec, torch.float32
        if spec.format == "fp8_int4":
            assert ctx.s1 is not None
            w, _, s2 = codecs.w4a8_quantize(x, True, f32, ctx.s1)
            return {keys.WEIGHT: w, keys.SCALE_2: s2}
        if spec.format == "mxfp4":
            w, s = codecs.mxfp4_quantize(x)
            return {keys.WEIGHT: w, keys.SCALE: s}
        if spec.format == "fp8" and spec.qscheme == "per_tensor":
            assert ctx.s1 is not None
            return {keys.WEIGHT: codecs.fp8_per_tensor_quantize(x, f32, ctx.s1)[0]}
        if spec.format == "fp8":
            w, s = codecs.fp8_per_channel_quantize(x, f32)
            return {keys.WEIGHT: w, keys.SCALE: s}
        if spec.qscheme == "per_channel":
            w, s = codecs.quark_int4_per_channel_quantize(x, True, f32)
            return {keys.WEIGHT: w, keys.SCALE: s}
        w, s = codecs.quark_int4_per_group_quantize(x, int(spec.group_size or 0), True, f32)
        return {keys.WEIGHT: w, keys.SCALE: s}


class ScaleSearch:
    """Data-free: scales chosen by the squared error against the source values, elements rounded to
    nearest within them (:mod:`eagle3.quantize.scale_search`)."""

    name = "mse"
    description = ("data-free scale search: INT4 per-channel steps by clip ratio + least squares, MXFP4 block "
                   "exponents among the even rule's and its neighbours, by the importance-weighted squared error "
                   "against the source; round to nearest within them (W4A8's routed-expert down_proj: with error "
                   "feedback for its modelled mean input)")

    def supports(self, spec: WeightSpec) -> bool:
        return spec.format in ("fp8_int4", "mxfp4") or (spec.format == "int4" and spec.qscheme == "per_channel")

    def rows(self, x: torch.Tensor, ctx: RowsContext) -> dict[str, torch.Tensor]:
        from eagle3.quantize import scale_search

        imp = ctx.inputs.importance
        if ctx.spec.format == "mxfp4":
            e = scale_search.mxfp4_exponents(x, imp)
            w, s = codecs.mxfp4_quantize(x, exponents=e)
            return {keys.WEIGHT: w, keys.SCALE: s}
        s1 = ctx.s1 if ctx.spec.format == "fp8_int4" else None
        codes, scale = scale_search.int4_per_channel(x, imp, s1)
        if ctx.inputs.moments is not None and s1 is not None:  # a routed expert's down_proj
            mo = ctx.inputs.moments
            codes = scale_search.int4_mean_feedback(x, mo.mean, mo.square, s1, scale)
        return {keys.WEIGHT: codecs.quark_int4_pack(codes, True),
                (keys.SCALE_2 if s1 is not None else keys.SCALE): scale}


class Calibrated:
    """A calibrated method (module docstring): its numbers come solved through ``ctx.inputs.solved``;
    :meth:`rows` is the data-free default of the format for the weights the calibration left alone
    (W4A8: the scale search, the w4a8 recipes' default; MXFP4: round to nearest, the mxfp4 recipe's)."""

    calibrated = True

    def __init__(self, name: str, description: str) -> None:
        self.name, self.description = name, description

    def supports(self, spec: WeightSpec) -> bool:
        return spec.format in ("fp8_int4", "mxfp4")

    def fallback(self, spec: WeightSpec) -> Method:
        return METHODS["mse"] if spec.format == "fp8_int4" else RTN

    def rows(self, x: torch.Tensor, ctx: RowsContext) -> dict[str, torch.Tensor]:
        return self.fallback(ctx.spec).rows(x, ctx)


CALIBRATED = {
    "gptq": "calibrated: GPTQ error feedback with the source model's inputs on calibration prompts",
    "gptaq": "calibrated: GPTAQ error feedback fitted to the quantized model's inputs on calibration prompts",
    "smooth": "calibrated: per-expert up <-> down smoothing scored on calibration prompts, then round to nearest",
    "smooth+gptq": "calibrated: per-expert up <-> down smoothing, then GPTQ error feedback",
    "smooth+gptaq": "calibrated: per-expert up <-> down smoothing, then GPTAQ error feedback",
}
METHODS: dict[str, Method] = {m.name: m for m in (RoundToNearest(), ScaleSearch(),
                                                   *(Calibrated(n, d) for n, d in CALIBRATED.items()))}
RTN = METHODS["rtn"]


def is_calibrated(method: Method | str) -> bool:
    """Whether ``method`` needs calibration prompts (``--calibrate``)."""
    m = METHODS.get(method) if isinstance(method, str) else method
    return bool(getattr(m, "calibrated", False))


def register(method: Method) -> None:
    """Make ``method`` a ``--method`` choice (calibrated methods register themselves on import)."""
    METHODS[method.name] = method


def get_method(name: str, spec: WeightSpec | None = None, recipe: str = "") -> Method:
    """The method of ``--method NAME``; one line when it is unknown or cannot write ``spec``."""
    m = METHODS.get(name)
    if m is None:
        raise UsageError(f"--method {name!r}: choose one of {', '.join(METHODS)}")
    if spec is not None and not m.supports(spec):
        ok = ", ".join(n for n, x in METHODS.items() if x.supports(spec))
        raise UsageError(f"--method {name}: recipe {recipe or '?'!r} writes {spec.describe()} weights, which {name} "
                         f"does not cover (methods for it: {ok})")
    return m
