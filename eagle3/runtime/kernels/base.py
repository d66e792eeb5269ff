"""The kernel interface: canonical weights, the ops a model calls, and backend selection.

Design (docs/kernels.md):

* The loader turns every on-disk format into one of a few *canonical* weights
  (:class:`DenseWeight`, :class:`Int4Weight`, :class:`MXFP4Weight`, :class:`FP8Weight`) that keep
  the packed codes and scales as on disk; the bits are
  decoded through ``eagle3.formats.codecs`` (:func:`dequantize`, :meth:`Int4Weight.unpack`). A
  backend never sees a file layout.
* Each weighted op is an object with ``prepare(...)`` (once, at load: relayout, pre-transpose;
  whatever the backend wants, but never a dense copy of a quantized weight) and ``__call__`` (per
  step). Weightless ops (norm, RoPE, attention) are backend methods. ``resident()`` lists the
  tensors an op keeps (memory accounting, ``loader.resident_weight_bytes``).
* ``torch`` (:mod:`eagle3.runtime.kernels.torch_ref`) is the exact reference on any device.
  Triton (Hopper) and aiter (MI3xx) backends plug in with the same interface later; a backend may
  refuse a case and return the reference op instead.

Batch invariance is part of the contract: for every op, the result for one token (row) must not
depend on which other tokens share the call. The reference achieves it by construction (see
``torch_ref``); a backend that cannot keep it (aiter, whose split-KV count follows the batch) says
so in its module docstring: the engine then cannot promise that speculative greedy output equals
plain greedy output.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from eagle3.errors import ShapeError, UsageError
from eagle3.formats import codecs
from eagle3.formats.quant_detect import ActQuant

if TYPE_CHECKING:  # pragma: no cover
    from eagle3.runtime.context import AttnMetadata

# Dynamic activation quantization applied in front of a quantized Linear (``ActQuant``, read from
# quantization_config by formats/quant_detect.QuantSpec): per token, or per 32-element block of a
# token row for MXFP4. None = activations stay in the compute dtype.
ACT_QUANTS: tuple[str, ...] = ("int8", "fp8", "mxfp4")
PER_TOKEN_QUANTS: tuple[str, ...] = ("int8", "fp8")  # the ones a fused norm can hand over (QuantizedRows)


@dataclass(frozen=True)
class QuantizedRows:
    """The per-token quantization of a GEMM's input rows, made ahead of the GEMM by the op that
    produced the rows (a fused RMSNorm, :meth:`KernelBackend.add_rms_norm_quant`): ``kind`` int8
    (codes int8) or fp8 (float8_e4m3fn), ``codes [T, K]`` and fp32 ``scales [T]``, the numbers the
    op would compute from the rows itself (``act_quant``). An op whose activation quantization is
    ``kind`` may read them instead of quantizing; any other op ignores them."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor


# ---------------------------------------------------------------------------------------------
# Canonical weights (what the loader produces)
# ---------------------------------------------------------------------------------------------


@dataclass
class DenseWeight:
    """A float weight ``[N, K]`` (+ optional bias ``[N]``)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.weight.shape[0]), int(self.weight.shape[1])


# How the codes of an :class:`Int4Weight` are stored (``None``: unpacked int8 codes ``[N, K]``).
# Packed forms are int32 words ``[N, ceil(K/8)]`` along the input dim, decoded by eagle3.formats.codecs:
# "ct" = compressed-tensors pack-quantized (nibble = q + 8, natural order); "quark" = Quark's
# two's-complement nibbles in its "reorder" slot order; "quark_order" = the same in natural order.
INT4_PACKINGS: tuple[str, ...] = ("ct", "quark", "quark_order")


@dataclass
class Int4Weight:
    """Signed INT4 codes in [-8, 7]: unpacked int8 ``codes [N, K]`` (``packing=None``), or the
    packed int32 words ``[N, ceil(K/8)]`` as on disk (``packing`` in :data:`INT4_PACKINGS`,
    ``in_features=K``); :meth:`unpack` gives the int8 codes of any row range.

    ``W[n, k] = codes[n, k] * scale[n, k // group_size]`` (group scales ``[N, K/G]``) or
    ``codes[n, k] * scale[n]`` (per-channel, ``group_size=None``), times ``tensor_scale`` when
    set (Quark's two-stage W4A8: per-tensor FP8 stage scale). The product is formed in
    ``scale.dtype`` - compressed-tensors' rule (bf16 for Kimi)."""

    codes: torch.Tensor
    scale: torch.Tensor
    group_size: int | None = None
    tensor_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    packing: str | None = None
    in_features: int | None = None

    def __post_init__(self) -> None:
        if self.packing is not None and (self.packing not in INT4_PACKINGS or self.in_features is None):
            raise UsageError(f"Int4Weight: packing {self.packing!r} needs in_features and one of {INT4_PACKINGS}")

    @property
    def shape(self) -> tuple[int, int]:
        k = self.in_features if self.packing is not None else self.codes.shape[1]
        return int(self.codes.shape[0]), int(k)  # type: ignore[arg-type]

    def unpack(self, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """int8 codes of rows ``r0 .. r1-1`` (all rows by default), ``[r1 - r0, K]``."""
        return unpack_int4(self.codes[r0:r1], self.packing, self.shape[1])


def unpack_int4(words: torch.Tensor, packing: str | None, k: int) -> torch.Tensor:
    """int8 codes ``[..., K]`` of INT4 ``words`` stored as ``packing`` (see :data:`INT4_PACKINGS`);
    unpacked codes (``packing=None``) are returned as they are. Any leading dims (experts, rows)."""
    if packing is None:
        return words
    if packing == "ct":
        return codecs.ct_int4_unpack(words, k)
    return codecs.quark_int4_unpack(words, reorder=packing == "quark", k=k)


@dataclass
class MXFP4Weight:
    """OCP MXFP4: ``packed`` uint8 ``[N, K/2]`` (E2M1, even element in the low nibble) and
    ``scale`` uint8 ``[N, K/32]`` (E8M0)."""

    packed: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.packed.shape[0]), int(self.packed.shape[1]) * 2


@dataclass
class FP8Weight:
    """FP8 E4M3 ``weight [N, K]`` with ``scale``: ``[ceil(N/bn), ceil(K/bk)]`` when ``block`` is
    set (DeepSeek ``weight_scale_inv``), ``[N]`` / ``[N, 1]`` per channel, or 0-d / ``[1]`` per
    tensor. ``W = float(weight) * scale``."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.weight.shape[0]), int(self.weight.shape[1])


LinearWeight = DenseWeight | Int4Weight | MXFP4Weight | FP8Weight


# ---------------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------------


class LinearOp(ABC):
    """``y = act_quant(x) @ W.T (+ bias)`` in the compute dtype."""

    in_features: int
    out_features: int

    @abstractmethod
    def prepare(self, weight: LinearWeight, act: ActQuant, dtype: torch.dtype, device: torch.device) -> None:
        """Once, at load. May keep or relayout ``weight`` (it owns it afterwards), but a quantized
        weight stays quantized: no backend keeps a dense copy of it; dense values are made per call in a bounded scratch."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, xq: QuantizedRows | None = None) -> torch.Tensor:
        """``x [T, K]`` -> ``[T, N]`` (compute dtype). ``xq``: ``x``'s per-token quantization when the
        caller made it already (an op may use it for its own activation quantization or ignore it)."""

    def resident(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor the op keeps between calls, with its role (see :func:`weight_tensors`)."""
        return []


class MoEOp(ABC):
    """Routed experts: ``y[t] = sum_j w[t, j] * down_e(silu(gate_e(x)) * up_e(x))``, ``e = ids[t, j]``.

    The sum over the top-k slots runs in fp32 in slot order, then casts to the compute dtype
    (transformers' default ``grouped_mm`` path does the same)."""

    @abstractmethod
    def prepare(self, gate: list[LinearWeight], up: list[LinearWeight], down: list[LinearWeight],
                act: ActQuant, dtype: torch.dtype, device: torch.device) -> None:
        """Per-expert weights (index = expert id); kept packed, as :meth:`LinearOp.prepare`."""

    def resident(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor the op keeps between calls, with its role (see :func:`weight_tensors`)."""
        return []

    @staticmethod
    def check_experts(gate: list[LinearWeight], up: list[LinearWeight], down: list[LinearWeight]) -> int:
        """The number of experts; one line when the three lists disagree or are empty."""
        if not (len(gate) == len(up) == len(down)) or not gate:
            raise ShapeError(f"MoE needs the same number of gate/up/down experts, got {len(gate)}/{len(up)}/{len(down)}")
        return len(gate)

    @abstractmethod
    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 xq: QuantizedRows | None = None) -> torch.Tensor:
        """``x [T, H]``, ``topk_ids`` int64 ``[T, k]``, ``topk_weights`` fp32 ``[T, k]`` -> ``[T, H]``;
        ``xq`` as in :meth:`LinearOp.__call__` (for the first GEMM)."""


class KernelBackend(ABC):
    """Factory for the weighted ops plus the weightless ones."""

    name: str = "?"
    # MLA with a quantized kv_b_proj: decode its two absorbed matrices once at load (True: the
    # decode step reads them as they are, at the cost of their model-dtype bytes over the packed
    # ones) or per call from the packed weight, which alone stays resident (False: the reference).
    absorb_at_load: bool = False

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    @abstractmethod
    def linear(self) -> LinearOp: ...

    @abstractmethod
    def moe(self) -> MoEOp: ...

    @abstractmethod
    def matmul(self, x: torch.Tensor, w_t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [M, K] @ w_t [K, N]`` (router, small unquantized products), computed and returned in
        ``dtype``: by default the wider of the two operands' dtypes (a narrower operand is widened,
        which is exact; the router passes bf16 activations and weight with ``torch.float32``)."""

    @abstractmethod
    def bmm(self, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [B, M, K] @ w [B, K, N]`` with row results independent of ``M`` (MLA absorption);
        ``dtype`` as in :meth:`matmul`."""

    def matrix(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A dense operand for :meth:`matmul` / :meth:`bmm`, rounded to the model ``dtype`` and laid
        out as the backend computes with it (prepared once, at load; a backend that computes in a
        wider dtype widens it per call, so the resident copy stays the size of the model dtype)."""
        return w.to(dtype).contiguous()

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm_quant(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                           quant: str | None = None) -> tuple[torch.Tensor, torch.Tensor, QuantizedRows | None]:
        """``(rms_norm(x + residual), x + residual, xq)`` (``residual`` None: ``x`` itself is normed and
        returned). ``quant`` (``int8`` | ``fp8`` | None): the per-token quantization the GEMMs that
        read the normed rows apply; a backend that fuses it returns it as ``xq`` (None otherwise: the
        GEMMs quantize the rows themselves). Numbers are those of the separate ops: this default
        computes them so, a backend may fuse them into fewer launches."""
        summed = x if residual is None else x + residual
        return self.rms_norm(summed, weight, eps), summed, None

    @abstractmethod
    def silu(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def sigmoid(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def cos_sin(self, angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """Rotate ``x [T, heads, d]`` with ``cos/sin [T, d/2]``. ``interleaved``: pairs
        ``(x[2i], x[2i+1])`` (DeepSeek / GPT-J), output in rotate-half order; else NeoX halves."""

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache of a model in ``dtype`` is stored in. The layers write values
        already rounded to ``dtype``, so a wider store holds the same numbers; a backend that
        computes attention in a wider dtype stores them so to save a conversion per read."""
        return dtype

    def kv_storage(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype a KV cache asked for as ``name`` (``runtime.kv_cache.canonical``) is stored in, for
        a model in ``dtype``; a dtype this backend (or device) cannot hold is one line, never a
        silent fallback to another dtype."""
        from eagle3.runtime import kv_cache

        if name == "auto":
            return self.kv_cache_dtype(dtype)
        if name == "bf16":  # stored as bf16 even where auto would widen it (the torch reference on a CPU)
            if dtype != torch.bfloat16:
                raise UsageError(f"kv_cache_dtype 'bf16' needs the bfloat16 model dtype (the cache holds the model's "
                                 f"values), got {dtype}; use auto (the model dtype) or fp8")
            return torch.bfloat16
        fp8 = kv_cache.fp8_dtype(name, self.device)
        why = self.fp8_kv_unsupported(name, fp8)
        if why is not None:
            raise UsageError(f"kv_cache_dtype {name!r}: kernel backend {self.name!r} cannot hold it ({why})")
        return fp8

    def fp8_kv_unsupported(self, name: str, dtype: torch.dtype) -> str | None:
        """Why this backend cannot keep an fp8 KV cache ``name`` stored as ``dtype`` here (None: it can)."""
        return None

    @abstractmethod
    def write_cache(self, cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor,
                    scale: float | tuple[float, float] = 1.0) -> None:
        """``cache [S, ...]`` (flat slots) ``[slot_mapping[t]] = values[t]``; slot -1 is skipped. An fp8
        ``cache`` stores ``runtime.kv_cache.quantize(values, cache.dtype, scale)``; a pair of scales
        applies to ``values[:, 0]`` and ``values[:, 1]`` (a Llama layer's K and V). A float cache
        ignores ``scale`` (it is 1.0 there)."""

    def plan_attention(self, meta: AttnMetadata) -> Any:
        """Per-forward precomputation shared by every attention layer (gather indices, masks);
        the model calls it once per forward and passes the result as ``plan``."""
        return None

    @abstractmethod
    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
                  scale: float, plan: Any = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """Paged causal attention by position. ``q [T, Hkv, G, D]``, ``k_cache [S, Hkv, D]``,
        ``v_cache [S, Hkv, Dv]`` (flat slots; MLA: ``Hkv = 1``, ``v`` a prefix view of ``k``).
        Query ``t`` of sequence ``b`` at position ``p`` attends slots of positions ``0..p``
        through ``meta.block_tables[b]``; with ``meta.tree`` a draft tree's nodes see the context
        and their ancestors only (``context.TreeMask``). Returns ``[T, Hkv, G, Dv]`` in ``q.dtype``.
        An fp8 cache holds codes: the keys are ``k_scale * code``, the values ``v_scale * code``
        (the scales folded out of the products as ``runtime.kv_cache`` defines)."""


_BACKENDS: dict[str, type[KernelBackend]] = {}


def register_backend(name: str, cls: type[KernelBackend]) -> None:
    _BACKENDS[name] = cls


ENV_BACKEND = "EAGLE3_KERNEL_BACKEND"
# What users may ask for (``--kernel-backend``, ``LLM(backend=...)``); "auto" picks one per device.
BACKEND_CHOICES: tuple[str, ...] = ("auto", "torch", "triton", "aiter")


def _importable(module: str) -> bool:
    """True when ``import module`` succeeds. Any exception counts as "no": ``import aiter`` raises a
    RuntimeError (not an ImportError) on a machine without ROCm."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - whatever the package raises, it is not usable here
        return False
    return True


def resolve_backend_name(name: str | None, device: torch.device | str = "cpu") -> str:
    """The backend ``name`` stands for on ``device``. ``None`` / ``"auto"``: ``$EAGLE3_KERNEL_BACKEND``
    when set, else ``aiter`` on a ROCm GPU where ``import aiter`` succeeds, ``triton`` on a GPU where
    triton imports, ``torch`` otherwise (CPU: always ``torch``; the Triton interpreter is for tests)."""
    if name in (None, "", "auto"):
        env = os.environ.get(ENV_BACKEND)
        if env and env != "auto":
            return resolve_backend_name(env, device)
        dev = torch.device(device)
        if dev.type != "cuda":
            return "torch"
        if getattr(torch.version, "hip", None) and _importable("aiter"):
            return "aiter"
        return "triton" if _importable("triton") else "torch"
    if name not in BACKEND_CHOICES and name not in _BACKENDS:
        raise UsageError(f"unknown kernel backend {name!r} (expected one of {', '.join(BACKEND_CHOICES)})")
    return name


def get_backend(name: str | None = None, device: torch.device | str = "cpu") -> KernelBackend:
    """The backend called ``name`` on ``device``; ``None`` / ``"auto"``: see :func:`resolve_backend_name`."""
    name = resolve_backend_name(name, device)
    if name not in _BACKENDS:
        # Import on demand so that optional backends (triton, aiter) register themselves.
        import importlib

        try:
            importlib.import_module(f"eagle3.runtime.kernels.{name}")
        except ImportError:
            pass
    if name not in _BACKENDS:
        raise UsageError(f"unknown kernel backend {name!r} (available: {', '.join(sorted(_BACKENDS))})")
    return _BACKENDS[name](device)


def concat_out_features(weights: list[LinearWeight]) -> LinearWeight:
    """Stack Linear weights of one kind along the output dim (gate + up -> one GEMM).

    Per-tensor scales of INT4 / FP8 weights are folded into per-channel scales first, so that
    every row keeps exactly its own scale."""
    first = weights[0]
    if any(type(w) is not type(first) for w in weights):
        raise UsageError("cannot fuse Linear weights of different formats: "
                         + ", ".join(type(w).__name__ for w in weights))
    if any(w.bias is not None for w in weights):
        biases = [w.bias if w.bias is not None else torch.zeros(w.shape[0], dtype=torch.float32) for w in weights]
        bias: torch.Tensor | None = torch.cat([b.float() for b in biases])
    else:
        bias = None
    if isinstance(first, DenseWeight):
        return DenseWeight(torch.cat([w.weight for w in weights]), bias)  # type: ignore[union-attr]
    if isinstance(first, MXFP4Weight):
        return MXFP4Weight(torch.cat([w.packed for w in weights]),  # type: ignore[union-attr]
                           torch.cat([w.scale for w in weights]), bias)  # type: ignore[union-attr]
    if isinstance(first, Int4Weight):
        ws: list[Int4Weight] = weights  # type: ignore[assignment]
        packing, k = first.packing, first.shape[1]
        if any(w.packing != packing or w.shape[1] != k for w in ws):
            raise UsageError("cannot fuse INT4 weights stored in different packings or of different widths")
        kw = {"packing": packing, "in_features": k if packing is not None else None}
        if first.group_size is not None:
            if any(w.group_size != first.group_size or w.tensor_scale is not None for w in ws):
                raise UsageError("cannot fuse INT4 weights with different group sizes or tensor scales")
            return Int4Weight(torch.cat([w.codes for w in ws]), torch.cat([w.scale for w in ws]),
                              first.group_size, None, bias, **kw)

        def chan(w: Int4Weight) -> torch.Tensor:
            s = w.scale.float().reshape(-1)
            return s * w.tensor_scale.float().reshape(()) if w.tensor_scale is not None else s

        return Int4Weight(torch.cat([w.codes for w in ws]), torch.cat([chan(w) for w in ws]), None, None, bias, **kw)
    if isinstance(first, FP8Weight):
        fs: list[FP8Weight] = weights  # type: ignore[assignment]
        if first.block is not None:
            bn = first.block[0]
            if any(w.block != first.block for w in fs) or any(w.shape[0] % bn for w in fs[:-1]):
                raise UsageError("cannot fuse FP8 block weights whose rows do not align to the block")
            return FP8Weight(torch.cat([w.weight for w in fs]), torch.cat([w.scale for w in fs]), first.block, bias)

        def fchan(w: FP8Weight) -> torch.Tensor:
            s = w.scale.float().reshape(-1)
            return s.expand(w.shape[0]) if s.numel() == 1 else s

        return FP8Weight(torch.cat([w.weight for w in fs]), torch.cat([fchan(w) for w in fs]), None, bias)
    raise TypeError(f"not a canonical weight: {type(first).__name__}")


# ---------------------------------------------------------------------------------------------
# Exact dequantization of canonical weights (weight-only paths, MLA absorption)
# ---------------------------------------------------------------------------------------------


def int4_channel_scale(w: Int4Weight) -> torch.Tensor:
    """Per-output-channel fp32 scale of a per-channel INT4 weight, stage scales merged
    (``weight_scale_2 * weight_scale`` for Quark W4A8, as vLLM merges them)."""
    if w.group_size is not None:
        raise UsageError("int8/fp8 activations need a per-channel INT4 weight, got group scales "
                         f"(group {w.group_size})")
    s = w.scale.float().reshape(-1)
    if w.tensor_scale is not None:
        s = s * w.tensor_scale.float().reshape(())
    return s


def dequantize(w: LinearWeight, dtype: torch.dtype, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Dense ``[N, K]`` weight in ``dtype`` (exact decode, one rounding to ``dtype``), or only its rows
    ``rows[0] .. rows[1]-1`` (a row tile: the same values as those rows of the whole; FP8 block
    weights need tiles aligned to the block). Element by element, so the bits never depend on the tile."""
    n, k = w.shape
    r0, r1 = rows if rows is not None else (0, n)
    if isinstance(w, DenseWeight):
        return w.weight[r0:r1].to(dtype)
    if isinstance(w, Int4Weight):
        codes = w.unpack(r0, r1)
        if w.group_size is not None:
            if w.scale.shape != (n, k // w.group_size):
                raise ShapeError(f"INT4 group scale has shape {list(w.scale.shape)}, expected {[n, k // w.group_size]}")
            # compressed-tensors forms q * scale in the scale's dtype (bf16(q*s) for Kimi).
            sd = w.scale.dtype
            out = codes.to(sd) * w.scale[r0:r1].repeat_interleave(w.group_size, dim=1)
            if w.tensor_scale is not None:
                out = out.float() * w.tensor_scale.float().reshape(())
            return out.to(dtype)
        return (codes.float() * int4_channel_scale(w)[r0:r1, None]).to(dtype)
    if isinstance(w, MXFP4Weight):
        return codecs.mxfp4_dequantize(w.packed[r0:r1], w.scale[r0:r1], dtype=dtype)
    if isinstance(w, FP8Weight):
        if w.block is not None:
            bn = w.block[0]
            if r0 % bn or (r1 % bn and r1 != n):
                raise UsageError(f"FP8 block rows {r0}..{r1} do not align to the {bn}-row block")
            return codecs.fp8_block_dequantize(w.weight[r0:r1], w.scale[r0 // bn: -(-r1 // bn)], block=w.block,
                                               dtype=dtype)
        s = w.scale.float()
        s = s.reshape(()) if s.numel() == 1 else s.reshape(-1, 1)[r0:r1]
        return (w.weight[r0:r1].float() * s).to(dtype)
    raise TypeError(f"not a canonical weight: {type(w).__name__}")


def weight_to(w: LinearWeight, device: torch.device) -> LinearWeight:
    """The same canonical weight with its tensors on ``device`` (no copy when they are there)."""
    import dataclasses

    moved = {f.name: getattr(w, f.name).to(device) for f in dataclasses.fields(w)
             if isinstance(getattr(w, f.name), torch.Tensor)}
    return dataclasses.replace(w, **moved)


def weight_tensors(w: LinearWeight) -> list[tuple[str, torch.Tensor]]:
    """The tensors a canonical weight holds, each with its role for memory accounting:
    ``packed`` (quantized codes), ``scales`` (their scales) or ``dense`` (float weights, biases)."""
    if isinstance(w, DenseWeight):
        out = [("dense", w.weight)]
    elif isinstance(w, Int4Weight):
        out = [("packed", w.codes), ("scales", w.scale)]
        if w.tensor_scale is not None:
            out.append(("scales", w.tensor_scale))
    elif isinstance(w, MXFP4Weight):
        out = [("packed", w.packed), ("scales", w.scale)]
    elif isinstance(w, FP8Weight):
        out = [("packed", w.weight), ("scales", w.scale)]
    else:
        raise TypeError(f"not a canonical weight: {type(w).__name__}")
    if w.bias is not None:
        out.append(("dense", w.bias))
    return out
