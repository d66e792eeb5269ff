"""The source side of ``eagle3 quantize``: which Linear modules a checkpoint has, and the exact
tensor each one is quantized from.

A module is addressed by name through the index, never by shard: a compressed-tensors module
whose ``weight_packed`` and ``weight_scale`` lie in different shards (the index format allows it;
Quark 0.13 fails on it with ``KeyError: 'weight_packed'``) reads each tensor from wherever it is.

What a quantizer sees, matching Quark's file-to-file path (docs/recipes.md), so that the native and Quark engines and AMD's artifacts agree bit for bit:

* bf16 / fp16 / fp32 weights: the stored tensor, in its stored dtype;
* compressed-tensors INT4 (Moonshot Kimi): ``q * scale`` computed in **fp32** (no bf16 rounding of
  the product), produced a row chunk at a time and never written anywhere;
* DeepSeek/Kimi-K2 FP8 blocks: ``fp8 * weight_scale_inv`` in fp32.

A module the recipe does *not* quantize but which is stored quantized (an INT4 or FP8 module
outside the scope) is written dense in bf16, the rounding compressed-tensors itself applies, since
the exported config no longer describes the source format.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import CheckpointReader, TensorInfo
from eagle3.checkpoint.files import INDEX_FILE
from eagle3.errors import CheckpointError, FormatError, ShapeError
from eagle3.formats import codecs, detect, keys

DENSE = "dense"
CT_INT4 = "ct-int4"
FP8_BLOCK = "fp8-block"
_FLOAT_TAGS = {"BF16", "F16", "F32", "F64"}
FP8_BLOCK_ROWS = 128


@dataclass(frozen=True)
class Module:
    """One Linear-like weight of the source (what Quark's file-to-file path would consider)."""

    name: str  # module name, checkpoint naming (tensor name without the parameter)
    kind: str  # DENSE | CT_INT4 | FP8_BLOCK
    shape: tuple[int, int]  # logical [N, K] = [out, in]
    primary: str  # tensor whose shard receives the module's output (weight or weight_packed)
    consumed: tuple[str, ...]  # every source tensor that this module replaces

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass(frozen=True)
class SourceInfo:
    path: Path
    kind: str  # the source weight format: "bf16"/"fp16"/"fp32" or CT_INT4 / FP8_BLOCK
    role: str | None  # "target" | "draft" | None (an architecture eagle3 does not classify)
    family: str | None
    config: dict[str, Any]
    indexed: bool
    shard_files: tuple[str, ...]  # file names in order
    fp8_block: tuple[int, int] | None = None


def _is_linear_name(module: str) -> bool:
    # Quark's file-to-file heuristic (_is_linear_weight_tensor): not a norm, not an embedding.
    return not module.endswith("norm") and "embed" not in module


def inspect_source(path: Path, any_architecture: bool = False) -> tuple[SourceInfo, CheckpointReader]:
    """Classify the source and refuse what cannot be quantized from (one-line errors). An
    architecture eagle3 does not know is refused as ``inspect``, ``convert`` and ``serve`` refuse
    it, unless ``any_architecture``: then it is quantized file to file (Quark's own approach)."""
    reader = CheckpointReader(path)
    cfg = detect.load_config(reader.path)
    role = family = None
    archs = cfg.get("architectures") or []
    known = "speculators_model_type" in cfg or any(
        a in detect.TARGET_ARCHITECTURES or a in detect.DRAFT_ARCHITECTURES for a in archs)
    qc, where = detect.quantization_config(cfg)
    if not known and not any_architecture:
        try:
            detect.detect(reader.path, check_vocab_map=False)  # raises the architecture error inspect shows
        except FormatError as e:
            raise FormatError(f"{e} (pass --any-architecture to quantize it file to file anyway)") from None
        raise FormatError(f"{reader.path / detect.CONFIG_FILE}: field 'architectures' is {archs!r}, not an "
                          f"architecture eagle3 knows (pass --any-architecture to quantize it file to file anyway)")
    if known:
        summary = detect.detect(reader.path, check_vocab_map=False)
        role, family = summary.role, summary.family
        scheme = summary.quant.scheme
        method = summary.quant.method
    else:
        # An architecture eagle3 does not classify (a plain Llama, say): still quantizable file to
        # file; the config alone says whether it is quantized.
        method = qc.get("quant_method") if qc else None
        scheme = {"compressed-tensors": detect.CT_INT4, "fp8": detect.FP8_BLOCK}.get(method or "", "bf16")
    cfg_file = reader.path / detect.CONFIG_FILE
    if method == "quark":
        raise FormatError(f"{cfg_file}: field 'quantization_config.quant_method' is 'quark': the checkpoint is "
                          f"already Quark-quantized; quantize the original (unquantized or Moonshot INT4) checkpoint")
    if method not in (None, "compressed-tensors", "fp8"):
        raise FormatError(f"{cfg_file}: field 'quantization_config.quant_method' is {method!r}; eagle3 quantizes "
                          f"from bf16/fp16/fp32, compressed-tensors INT4 and FP8-block sources")
    if method == "compressed-tensors" and scheme != detect.CT_INT4:
        raise FormatError(f"{cfg_file}: compressed-tensors source scheme {scheme!r}; eagle3 quantizes from "
                          f"pack-quantized INT4 (Moonshot) only")
    block = None
    if method == "fp8":
        b = (qc or {}).get("weight_block_size")
        if not (isinstance(b, list) and len(b) == 2 and b[0] == b[1] == FP8_BLOCK_ROWS):
            raise FormatError(f"{cfg_file}: field '{where}.weight_block_size' is {b!r}; eagle3 reads 128x128 FP8 blocks")
        block = (FP8_BLOCK_ROWS, FP8_BLOCK_ROWS)
    kind = {"compressed-tensors": CT_INT4, "fp8": FP8_BLOCK}.get(method or "", None)
    if kind is None:
        tags = {i.dtype for i in reader.infos() if i.dtype in _FLOAT_TAGS and len(i.shape) == 2}
        kind = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(next(iter(tags)) if len(tags) == 1 else "", "mixed")
    indexed = (reader.path / INDEX_FILE).is_file()
    info = SourceInfo(path=reader.path, kind=kind, role=role, family=family, config=cfg, indexed=indexed,
                      shard_files=tuple(f.name for f in reader.files), fp8_block=block)
    return info, reader


def find_modules(reader: CheckpointReader, source: SourceInfo) -> dict[str, Module]:
    """Every Linear-like weight, from the headers only (shapes, dtypes, which tensors it consumes)."""
    params: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
    for info in reader.infos():
        mod, p = keys.split_param(info.name)
        if p in keys.QUANT_PARAMS and mod:
            params[mod][p] = info
    out: dict[str, Module] = {}
    for mod, ps in params.items():
        if not _is_linear_name(mod):
            continue
        packed = ps.get(keys.CT_PACKED)
        w = ps.get(keys.WEIGHT)
        if packed is not None:
            scale = ps.get(keys.SCALE)
            if scale is None or len(scale.shape) != 2 or len(packed.shape) != 2:
                raise FormatError(f"{packed.file}: tensor {packed.name!r} needs a 2-D {mod}.{keys.SCALE} beside it "
                                  f"(compressed-tensors INT4)")
            n, k = packed.shape[0], packed.shape[1] * 8
            if scale.shape[0] != n or k % scale.shape[1]:
                raise ShapeError(f"{scale.file}: tensor {scale.name!r} has shape {list(scale.shape)}, which does not "
                                 f"fit weight_packed {list(packed.shape)}")
            consumed = tuple(ps[p].name for p in (keys.CT_PACKED, keys.SCALE, keys.CT_SHAPE, keys.ZERO_POINT,
                                                    keys.G_IDX) if p in ps)
            out[mod] = Module(mod, CT_INT4, (n, k), packed.name, consumed)
        elif w is not None and len(w.shape) == 2:
            if w.dtype in ("F8_E4M3",) and keys.SCALE_INV in ps:
                out[mod] = Module(mod, FP8_BLOCK, (w.shape[0], w.shape[1]), w.name, (w.name, ps[keys.SCALE_INV].name))
            elif w.dtype in _FLOAT_TAGS:
                out[mod] = Module(mod, DENSE, (w.shape[0], w.shape[1]), w.name, (w.name,))
    return out


# ---------------------------------------------------------------------------------------------
# Row sources: the quantizer input of one module, a chunk of output rows at a time
# ---------------------------------------------------------------------------------------------


class RowSource:
    """A [N, K] weight that yields row ranges. Chunks keep the working set in cache and the peak
    memory at a few MB per tensor; every quantizer eagle3 chunks is row-separable, so the result is
    bit-identical to the whole-tensor computation."""

    shape: tuple[int, int]
    dtype: torch.dtype
    row_align: int = 1  # chunk boundaries must be multiples of this

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        raise NotImplementedError

    def full(self) -> torch.Tensor:
        return self.rows(0, self.shape[0])


class DenseRows(RowSource):
    def __init__(self, w: torch.Tensor) -> None:
        self._w = w
        self.shape = (w.shape[0], w.shape[1])
        self.dtype = w.dtype

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        return self._w[r0:r1]

    def full(self) -> torch.Tensor:
        return self._w


class CtInt4Rows(RowSource):
    """Moonshot INT4 -> fp32 ``q * scale`` (Quark upcasts the scale before multiplying)."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int]) -> None:
        self._packed, self._scale = packed, scale
        self.shape = shape
        self.dtype = torch.float32

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        return codecs.ct_int4_dequantize(self._packed[r0:r1], self._scale[r0:r1], (r1 - r0, self.shape[1]),
                                         dtype=torch.float32)


class Fp8BlockRows(RowSource):
    row_align = FP8_BLOCK_ROWS

    def __init__(self, w: torch.Tensor, scale_inv: torch.Tensor) -> None:
        self._w, self._s = w, scale_inv
        self.shape = (w.shape[0], w.shape[1])
        self.dtype = torch.float32

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        b = FP8_BLOCK_ROWS
        if r0 % b:
            raise ValueError(f"FP8 block rows must start on a multiple of {b}, got {r0}")
        return codecs.fp8_block_dequantize(self._w[r0:r1], self._s[r0 // b: math.ceil(r1 / b)], (b, b),
                                           dtype=torch.float32)


def open_rows(reader: CheckpointReader, m: Module) -> RowSource:
    """Read the module's tensors (by name, from any shard) and wrap them as a RowSource."""
    if m.kind == DENSE:
        return DenseRows(reader.get(m.primary))
    mod = m.name
    if m.kind == CT_INT4:
        packed = reader.get(f"{mod}.{keys.CT_PACKED}")
        scale = reader.get(f"{mod}.{keys.SCALE}")
        shape_name = f"{mod}.{keys.CT_SHAPE}"
        n, k = m.shape
        if shape_name in reader:
            n2, k2 = (int(x) for x in reader.get(shape_name).tolist())
            if n2 != n or k2 > k or k2 <= k - 8:
                raise ShapeError(f"{reader.info(shape_name).file}: tensor {shape_name!r} says ({n2}, {k2}) but "
                                 f"weight_packed is {list(packed.shape)}")
            k = k2
        return CtInt4Rows(packed, scale, (n, k))
    if m.kind == FP8_BLOCK:
        return Fp8BlockRows(reader.get(m.primary), reader.get(f"{mod}.{keys.SCALE_INV}"))
    raise CheckpointError(f"unknown module kind {m.kind!r}")


def dense_passthrough(reader: CheckpointReader, m: Module) -> torch.Tensor:
    """An excluded module as a plain weight: as stored when dense, bf16 when stored quantized."""
    if m.kind == DENSE:
        return reader.get(m.primary)
    if m.kind == CT_INT4:
        rs = open_rows(reader, m)
        assert isinstance(rs, CtInt4Rows)
        # compressed-tensors' own dequantize: product in the scale dtype (bf16 for Kimi).
        return codecs.ct_int4_dequantize(rs._packed, rs._scale, rs.shape, dtype=None).to(torch.bfloat16)
    return codecs.fp8_block_dequantize(reader.get(m.primary), reader.get(f"{m.name}.{keys.SCALE_INV}"),
                                       dtype=torch.bfloat16)


def index_weight_map(path: Path) -> dict[str, str] | None:
    f = Path(path) / INDEX_FILE
    if not f.is_file():
        return None
    return json.loads(f.read_text()).get("weight_map")
