"""The exact, batch-invariant torch reference backend (CPU, CUDA, ROCm).

Batch invariance by construction. A token's result must be bit-identical whether it is decoded
alone, verified with k drafts, or prefilled with 500 others. BLAS kernels pick different code
paths (and K-reduction orders) for different matrix shapes: measured on the CPU here, fp32
``x[:M] @ W.T`` differs from ``(x @ W.T)[:M]`` for M < 12 except 4 and 8 (two threads; M < 4
with one). So every floating-point reduction below runs with a shape that depends only on the
model, never on the batch:

* GEMMs (:func:`mm_rows`, :func:`bmm_rows`) run on tiles of exactly ``ROW_TILE`` rows (zero
  padded) as one ``bmm`` over the tiles; every tile is the same-shaped GEMM, whose row results
  depend only on that row (checked by ``tests/runtime/test_kernels_torch_ref.py`` on each run).
* Integer GEMMs (W4A8 with int8 activations) accumulate exactly in int32 (``torch._int_mm``); the
  FP8-activation variant accumulates FP8 x INT4/FP8 products in float64, which is exact too
  (every product is a multiple of 2^-18 of magnitude below 2^18, so any K < 2^17 sums exactly).
  Exact sums need no tiling at all.
* Attention computes every score as a row of a fixed-shape ``[R, D] x [D, KEY_TILE]`` tile GEMM
  (R query rows of one sequence, fixed per model) and every softmax partial sum per key tile as
  a fixed-shape GEMM / fixed-length row sum; the partial sums over key tiles are added in tile
  order (an outer, sequential reduction). Keys past a token's position get probability exactly
  0, so tiles past its own context add exact zeros: decode (a token alone, keys gathered per
  token) and long prefill chunks (keys gathered once per sequence, each key tile broadcast over
  the query tiles that see it, causally skipped tiles never computed) give the same bits. Where
  a start-up probe (:func:`gemm.stack_sizes`) sees this BLAS give each row of a stacked
  ``[m*R, D] x [D, KEY_TILE]`` GEMM its tile's bits, the row tiles that read one key tile (a
  prefill chunk's, a verify's or a draft tree's) run as one GEMM against keys gathered once;
  elsewhere they stay tiles. See the Attention section.
* Norms, RoPE, routing and the top-k combine are row-wise elementwise ops or inner reductions of
  model-fixed length.
* Transcendental pointwise ops (sigmoid, SiLU, exp, cos, sin) are NOT shape-invariant on CPU as
  such: TensorIterator runs the SIMD kernel on whole vectors and a scalar libm path on the tail,
  and the two differ by an ulp (measured: fp32 sigmoid/silu of row ``t`` change with the number
  of rows). :func:`pointwise` feeds them a strided view, which sends every element down the
  scalar path, so an element's result depends on its value only.

On a GPU the tiles keep their shapes, but cuBLAS picks its kernels by the batch count of the
tile ``bmm`` as well, and the first GPU run (H200, fp32) saw a token's hidden state change with the
batch composition: the bitwise promise holds on the CPU; on GPUs it is the Triton backend's, whose
router and MLA absorption products run its own fixed-tile kernel there (``triton/dense_gemm.py``;
``tests/runtime/test_models_gpu.py`` checks this reference on a GPU within rounding).

On CPU, bf16/fp16 models keep their GEMM operands in fp32 (:func:`compute_dtype`): the products
of bf16 values are exact in fp32, so this is a bf16 GEMM with fp32 accumulation, ~10x faster on
CPUs without AVX512-BF16; outputs are rounded back to the model dtype.

Numerics follow transformers' DeepseekV3 implementation where it defines them (RMSNorm weight
multiply in the activation dtype, cos/sin cast to the activation dtype, router in fp32, top-k
combine in fp32); attention runs in fp32 with one softmax over the whole context.

The package, by op family: ``elementwise`` (scalar-path transcendental ops), ``gemm`` (row-tiled
float GEMMs), ``act_quant`` (dynamic activation quantization), ``packed`` (packed weights decoded
per call into a reused scratch), ``exact_gemm`` (integer / float64 GEMMs), ``linear``, ``moe``,
``attention`` (paged attention and its plan), ``backend`` (the ``torch`` KernelBackend).
"""

from eagle3.runtime.kernels.base import int4_channel_scale, unpack_int4
from eagle3.runtime.kernels.torch_ref import (
    act_quant,
    attention,
    backend,
    elementwise,
    exact_gemm,
    gemm,
    linear,
    moe,
    packed,
)
from eagle3.runtime.kernels.torch_ref.act_quant import (
    INT8_MAX,
    _check_act,
    mxfp4_qdq,
    quantize_fp8_per_token,
    quantize_int8_per_token,
)
from eagle3.runtime.kernels.torch_ref.attention import (
    ATTN_CHUNK_FLOATS,
    ATTN_MIN_ROWS,
    KEY_TILE,
    SEQ_PATH_MIN_TOKENS,
    AttnPlan,
    paged_attention,
    plan_attention,
    query_tile_tokens,
)
from eagle3.runtime.kernels.torch_ref.backend import TorchBackend
from eagle3.runtime.kernels.torch_ref.elementwise import pointwise, silu
from eagle3.runtime.kernels.torch_ref.exact_gemm import (
    FP8_DIGITS_MAX_K,
    fp8_digits,
    fp8_digits_gemm,
    fp8_int4_linear,
    fp8_linear,
    int8_gemm,
    int8_linear,
)
from eagle3.runtime.kernels.torch_ref.gemm import ROW_TILE, _bmm, _pad_rows, bmm_rows, compute_dtype, mm_rows
from eagle3.runtime.kernels.torch_ref.linear import TorchLinear
from eagle3.runtime.kernels.torch_ref.moe import TorchMoE
from eagle3.runtime.kernels.torch_ref.packed import (
    DECODE_PASS_ELEMS,
    LINEAR_SCRATCH_BYTES,
    MOE_SCRATCH_BYTES,
    _Bank,
    _bank_gemm,
    _row_tiles,
    _scratch_ok,
    scratch,
)

# Tunables (LINEAR_SCRATCH_BYTES, REUSE_SCRATCH, _scratch_ok, ...) are read from their own module at
# call time: set or monkeypatch them there (``torch_ref.packed.REUSE_SCRATCH = False``), not here.
__all__ = [
    "ATTN_CHUNK_FLOATS", "ATTN_MIN_ROWS", "DECODE_PASS_ELEMS", "FP8_DIGITS_MAX_K", "INT8_MAX", "KEY_TILE",
    "LINEAR_SCRATCH_BYTES", "MOE_SCRATCH_BYTES", "ROW_TILE", "SEQ_PATH_MIN_TOKENS", "AttnPlan", "TorchBackend",
    "TorchLinear", "TorchMoE", "_Bank", "_bank_gemm", "_bmm", "_check_act", "_pad_rows", "_row_tiles",
    "_scratch_ok", "act_quant", "attention", "backend", "bmm_rows", "compute_dtype", "exact_gemm",
    "fp8_digits", "fp8_digits_gemm", "fp8_int4_linear", "fp8_linear", "gemm", "int4_channel_scale",
    "int8_gemm", "int8_linear", "linear", "mm_rows", "moe", "mxfp4_qdq", "packed", "paged_attention",
    "plan_attention", "elementwise", "pointwise", "quantize_fp8_per_token", "quantize_int8_per_token", "query_tile_tokens",
    "scratch", "silu", "unpack_int4",
]
