"""The KV cache's element format (``kv_cache_dtype``): names, storage dtypes, per-tensor scales, and
the one definition of the fp8 numbers every backend implements (docs/kernels.md, "fp8 KV cache").

Names (vLLM's): ``auto`` (the model dtype; the torch reference on a CPU keeps a bf16 model's cache in
fp32 holding the same bf16 values), ``bf16`` (a bf16 model's cache, the same as auto), ``fp8`` (=
``fp8_e4m3``), ``fp8_e4m3`` and ``fp8_e5m2``. An fp8 cache stores one byte per value: the target's
MLA latent (``kv_lora_rank + qk_rope_head_dim`` per token and layer) and the draft's cache (the
Llama draft's paged K and V, or the MLA draft's latent) alike.

Scales: one per tensor, static (never computed from the batch, so a token's cached bits do not
depend on what shares its step and speculative greedy stays equal to plain greedy). A layer's
scales come from the checkpoint's kv-cache scheme when it has one (``formats.keys.kv_scale_names``:
compressed-tensors ``k_scale`` / ``v_scale``, Quark's ``output_scale`` on the projections its
``kv_cache_quant_config`` names), else 1.0, as vLLM does. The MLA latent is one tensor holding
what both keys and values are computed from: it takes the largest of the layer's kv scales, so that
no calibrated quantity saturates. On an ``fnuz`` fp8 (MI300-class GPUs, max 240 instead of 448) a
checkpoint scale is doubled, as vLLM does, so the calibrated range still fits.

The numbers (:func:`quantize`, :func:`dequantize`):

* write (the cache update): ``code = fp8(clamp(float32(x) / scale, -max, max))``: the value ``x``
  in the model dtype (the layers round it there first, as for a bf16 cache), divided by the scale
  in fp32, saturated to the fp8 format's largest finite value, rounded to nearest-even;
* read (attention): the keys are ``k_scale * code`` and the values ``v_scale * code``. Both scales
  are folded out of the inner products, which then run over the codes (exact in fp32 and bf16):
  scores ``= (q . code_k) * (softmax_scale * k_scale)`` and ``out = (sum_j p_j code_v_j / sum_j p_j)
  * v_scale``, in fp32. The torch reference multiplies ``q`` by ``softmax_scale * k_scale`` before
  its score GEMM (as it scales by ``softmax_scale`` for any cache); the Triton kernels multiply the
  score tile after the dot; both multiply the normalised output by ``v_scale``. At scale 1.0 (and
  for a float cache, whose scales are 1.0) nothing changes: the bits are the float cache's path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eagle3.errors import FormatError, UsageError

if TYPE_CHECKING:  # pragma: no cover - typing only (this module is imported by the torch-free config)
    import torch

# What users may ask for (--kv-cache-dtype, LLM(kv_cache_dtype=...)); "fp8" means e4m3, as in vLLM.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_KINDS: tuple[str, ...] = ("fp8_e4m3", "fp8_e5m2")
_ALIASES = {"fp8": "fp8_e4m3"}


# Bytes per cached value, by name: the engine's cache dtypes and the float widths the memory plan also
# takes (``eagle3 plan --kv-cache-dtype fp16|fp32``). fp8 of any kind is one byte: twice bf16's tokens.
ELEMENT_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def cache_bytes(values_per_layer: int, num_layers: int, element_bytes: int, tokens: int = 1) -> int:
    """Bytes ``tokens`` tokens take in a KV cache of ``num_layers`` layers of ``values_per_layer``
    values each: the one formula of the engine's block size (``engine/model_runner.kv_bytes_per_block``)
    and of the memory plan (:mod:`eagle3.plan`, which takes the values from the config)."""
    return values_per_layer * num_layers * element_bytes * tokens


def canonical(name: str) -> str:
    """``name`` as one of ``auto``, ``bf16``, ``fp8_e4m3``, ``fp8_e5m2``; one line when unknown."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise UsageError(f"kv_cache_dtype (--kv-cache-dtype) must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {name!r}")
    return _ALIASES.get(name, name)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache stored in ``dtype`` holds fp8 codes (any of torch's float8 types)."""
    return str(dtype).startswith("torch.float8_")


def fnuz_device(device: torch.device) -> bool:
    """Whether ``device`` computes fp8 in the ``fnuz`` encodings (MI300-class GPUs, gfx94x)."""
    import torch

    if device.type != "cuda" or not getattr(torch.version, "hip", None):
        return False
    arch = str(getattr(torch.cuda.get_device_properties(device), "gcnArchName", ""))
    return arch.startswith("gfx94")


def fp8_dtype(kind: str, device: torch.device) -> torch.dtype:
    """The torch dtype an fp8 cache of ``kind`` (:data:`FP8_KINDS`) is stored in on ``device``: the
    OCP formats, or their ``fnuz`` variants on MI300-class GPUs (what their kernels compute in)."""
    import torch

    if kind not in FP8_KINDS:
        raise UsageError(f"not an fp8 KV cache dtype: {kind!r}")
    if fnuz_device(device):
        return torch.float8_e4m3fnuz if kind == "fp8_e4m3" else torch.float8_e5m2fnuz
    return torch.float8_e4m3fn if kind == "fp8_e4m3" else torch.float8_e5m2


@dataclass(frozen=True)
class KVFormat:
    """How a model's KV cache is stored: the canonical name asked for and the storage dtype
    (:meth:`KernelBackend.kv_storage` decides it)."""

    name: str  # auto | bf16 | fp8_e4m3 | fp8_e5m2
    dtype: Any  # torch.dtype

    @property
    def fp8(self) -> bool:
        return is_fp8(self.dtype)


def quantize(values: torch.Tensor, dtype: torch.dtype, scale: float | torch.Tensor) -> torch.Tensor:
    """fp8 codes of ``values``: ``fp8(clamp(float32(values) / scale, -max, max))`` (round to nearest
    even: torch's cast). The clamp is explicit: torch's casts saturate e4m3fn but give inf / NaN for
    e5m2 and the fnuz types."""
    import torch

    top = torch.finfo(dtype).max
    return (values.float() / scale).clamp_(-top, top).to(dtype)


def dequantize(codes: torch.Tensor, scale: float | torch.Tensor, dtype: Any = None) -> torch.Tensor:
    """``float32(codes) * scale`` (in ``dtype`` when given): what an fp8 cache stands for."""
    out = codes.float() * scale
    return out if dtype is None else out.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as same-width integers, for moving cache rows (index_copy / index_put have no
    float8 kernels on the CPU); any other dtype is returned as it is."""
    import torch

    if not is_fp8(t.dtype):
        return t
    return t.view(torch.uint8)


def storage_scale(scale: float, dtype: torch.dtype) -> float:
    """The scale a checkpoint's kv scale becomes for a cache stored in ``dtype``: doubled on the
    fnuz fp8 types (their largest value is about half the OCP one), as vLLM does."""
    return scale * 2.0 if str(dtype).endswith("fnuz") else scale


def check_scale(value: Any, where: str) -> float:
    """A kv scale read from a checkpoint as a float; one line when it is not one finite positive number."""
    import math

    import torch

    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if t.numel() != 1 or t.dim() > 1:
        raise FormatError(f"{where}: a KV cache scale must be a single number (shape [] or [1]), "
                         f"got shape {list(t.shape)}")
    v = float(t.reshape(()).float())
    if not math.isfinite(v) or v <= 0.0:
        raise FormatError(f"{where}: a KV cache scale must be finite and > 0, got {v}")
    return v


__all__ = ["KV_CACHE_DTYPES", "FP8_KINDS", "ELEMENT_BYTES", "cache_bytes", "KVFormat", "canonical", "is_fp8", "fp8_dtype", "quantize",
           "dequantize", "bits", "storage_scale", "check_scale", "fnuz_device"]
