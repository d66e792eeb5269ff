"""Checkpoint -> runtime model, straight from the files (no convert step), one tensor at a time.

Formats read (``eagle3.formats.detect`` identifies the checkpoint; every bit decode goes through
``eagle3.formats.codecs``):

* bf16 / fp16 / fp32 weights;
* compressed-tensors ``pack-quantized`` INT4 (Moonshot Kimi routed experts, W4A16):
  ``weight_packed`` + ``weight_scale`` + ``weight_shape``;
* Quark W4A8: reorder-packed INT4 ``weight`` int32 + per-tensor ``weight_scale`` (0-d or [1]) +
  per-channel ``weight_scale_2`` [N], with dynamic per-token FP8 (default, as the config says) or
  INT8 (``act_override="int8"``) activations;
* Quark INT4 per-channel (or per-group, stored transposed) ``weight`` + ``weight_scale``;
* Quark MXFP4: uint8 E2M1 ``weight`` + uint8 E8M0 ``weight_scale``, dynamic MXFP4 activations
  when ``input_tensors`` says so;
* FP8 E4M3: DeepSeek 128x128 ``weight_scale_inv`` blocks, or per-channel / per-tensor
  ``weight_scale`` (Quark ptpc_fp8 drafts, with dynamic per-token FP8 activations when the
  config asks for them).

The Kimi-K2.5 wrapper's ``vision_tower.*`` / ``mm_projector.*`` tensors are never read.

What the runtime does with each format (first steps, documented):

* Every quantized weight stays packed in memory as it is on disk (codes + scales; Quark's
  transposed per-group INT4 is relaid out once to words along the input dim, the same bytes).
  The torch reference decodes per call, exactly as compressed-tensors / Quark do (``bf16(q * s)``
  for INT4 W4A16), into a bounded scratch; no backend keeps a dense copy
  (:func:`resident_weight_bytes` accounts for it).
* DeepSeek block-FP8 weights run weight-only with compute-dtype activations (engines quantize
  activations per 1x128 group; the reference does not).
* W4A8 runs as an integer GEMM (INT8) or an exact float64 GEMM (FP8 activations), see
  ``kernels/torch_ref.py``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle3.checkpoint import CheckpointReader
from eagle3.errors import CheckpointError, FormatError, ShapeError, UsageError
from eagle3.formats import codecs, detect, keys
from eagle3.runtime.config import DraftSpec, QuantSpec, TargetSpec
from eagle3.runtime.interfaces import default_aux_layer_ids
from eagle3.runtime.kernels import get_backend
from eagle3.runtime.kernels.base import (
    ACT_QUANTS,
    ActQuant,
    DenseWeight,
    FP8Weight,
    Int4Weight,
    LinearWeight,
    MXFP4Weight,
)
from eagle3.runtime.layers.linear import Linear, Shard
from eagle3.runtime.layers.moe import MoE
from eagle3.runtime.layers.norm import RMSNorm
from eagle3.runtime.models.deepseek_v3 import DeepseekV3Model
from eagle3.runtime.models.eagle3 import Eagle3DraftModel
from eagle3.runtime.parallel import SINGLE, TPGroup, slice_in, slice_out

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class WeightReader:
    """Reads named tensors and decodes one Linear module into a canonical weight."""

    def __init__(self, path: str | os.PathLike[str], quant: QuantSpec, dtype: torch.dtype, device: torch.device,
                 act_override: ActQuant = None, tp: TPGroup = SINGLE) -> None:
        self.reader = CheckpointReader(path)
        self.keep_bias = tp.rank == 0  # linear_part's default for input-column parts
        self.path = self.reader.path
        self.quant = quant
        self.dtype = dtype
        self.device = device
        self.act_override = act_override
        self.used: dict[str, int] = {}  # tensor -> bytes read of it (a shard's rows only, when sliced)

    def has(self, name: str) -> bool:
        return name in self.reader

    @property
    def used_bytes(self) -> int:
        """Bytes of the checkpoint tensors read so far (what the model was built from)."""
        return sum(self.used.values())

    def get(self, name: str) -> torch.Tensor:
        self.used[name] = self.reader.info(name).nbytes
        return self.reader.get(name)

    def get_part(self, name: str, rows: tuple[int, int] | None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows / columns of one tensor, reading only those bytes (a tensor-parallel shard)."""
        info = self.reader.info(name)
        r0, r1 = rows if rows is not None else (0, info.shape[0])
        c0, c1 = cols if cols is not None else (None, None)
        t = self.reader.get_rows(name, r0, r1, c0, c1)
        self.used[name] = self.used.get(name, 0) + t.numel() * t.element_size()
        return t

    def norm(self, module: RMSNorm, name: str) -> None:
        t = self.get(name)
        if tuple(t.shape) != (module.size,):
            raise ShapeError(f"{self.path}: tensor {name!r} has shape {list(t.shape)}, expected [{module.size}]")
        module.load(t.to(self.device), self.dtype)

    def linear(self, module: str) -> tuple[LinearWeight, ActQuant]:
        """Decode ``<module>.*`` (format told by the tensors present) -> (weight, activation quant)."""
        w = self._decode(module)
        bias_name = f"{module}.bias"
        if self.has(bias_name):
            w.bias = self.get(bias_name)
        if isinstance(w, DenseWeight):
            return w, None
        act = self.quant.act_for(module)
        if self.act_override is not None and act in ("int8", "fp8") and isinstance(w, Int4Weight):
            act = self.act_override
        if isinstance(w, FP8Weight) and w.block is not None:
            act = None  # weight-only emulation of DeepSeek block FP8 (module docstring)
        return w, act

    def load_linear(self, layer: Linear, module: str) -> None:
        """Load the part of ``module`` that ``layer`` holds (:attr:`Linear.shard`: whole, or a
        tensor-parallel layer's rows / columns)."""
        w, act = self.shard_part(module, layer.shard)
        with _named(self, module):
            layer.load(w, act, self.dtype, self.device)

    def shard_part(self, module: str, shard: Shard) -> tuple[LinearWeight, ActQuant]:
        """The part of ``module`` a layer's :class:`~eagle3.runtime.layers.linear.Shard` names."""
        return self.linear_part(module, shard.rows, shard.cols, shard.keep_bias)

    def linear_part(self, module: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
                    keep_bias: bool | None = None) -> tuple[LinearWeight, ActQuant]:
        """Output rows ``rows`` or input columns ``cols`` of a Linear, reading only those bytes where
        the format allows; the whole weight when neither is given. ``keep_bias`` (with ``cols``):
        whether this part carries the bias (a row-parallel bias is added once); default: as the
        reader was built (``tp``: the group's first member keeps it)."""
        if keep_bias is None:
            keep_bias = self.keep_bias
        if rows is not None or cols is not None:
            part = self._decode_part(module, rows, cols, keep_bias)
            if part is not None:
                return part
        w, act = self.linear(module)
        if rows is not None:
            w = slice_out(w, *rows)
        if cols is not None:
            w = slice_in(w, *cols, keep_bias=keep_bias)
            if isinstance(w, DenseWeight) and act is not None:
                act = None  # decoded fallback of slice_in: runs as a float weight
        return w, act

    def _decode_part(self, m: str, rows: tuple[int, int] | None,
                     cols: tuple[int, int] | None, keep_bias: bool) -> tuple[LinearWeight, ActQuant] | None:
        """Rows (output features) or input columns of module ``m``, read straight from
        the shard's bytes (:meth:`CheckpointReader.get_rows`): packed words and scale groups are
        cut on their boundaries. None when the format or the range does not allow it (then the
        caller reads the whole tensor and slices: Quark's transposed per-group INT4, zero points,
        a range across a packing boundary)."""
        n_packed, n_w, n_scale = f"{m}.{keys.CT_PACKED}", f"{m}.{keys.WEIGHT}", f"{m}.{keys.SCALE}"
        n_zp = f"{m}.{keys.ZERO_POINT}"
        # Zero points are one small tensor per module (Quark writes all-zero ones): read whole, checked.
        if self.has(n_zp) and bool(self.get(n_zp).any()):
            raise FormatError(f"{self.path}: tensor {n_zp!r}: asymmetric (zero-point) quantization is not supported")

        def ok(lo: int, hi: int, total: int, step: int) -> bool:
            return lo % step == 0 and (hi % step == 0 or hi == total)

        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        w: LinearWeight
        if self.has(n_packed):
            n, k = (int(x) for x in self.get(f"{m}.{keys.CT_SHAPE}").tolist())
            sk = self.reader.info(n_scale).shape
            if len(sk) != 2 or not sk[1] or k % sk[1]:
                return None
            g = k // sk[1]
            r, c = rows or (0, n), cols or (0, k)
            if not (ok(*c, k, 8) and c[0] % g == 0 and (c[1] - c[0]) % g == 0):
                return None
            packed = self.get_part(n_packed, r, (c[0] // 8, cdiv(c[1], 8)) if cols else None)
            scale = self.get_part(n_scale, r, (c[0] // g, c[1] // g) if cols else None)
            w = Int4Weight(packed, scale, group_size=g, packing="ct", in_features=c[1] - c[0])
        elif self.has(n_w):
            info = self.reader.info(n_w)
            if len(info.shape) != 2:
                return None
            dt = info.torch_dtype
            n = info.shape[0]
            if dt in _FLOATS:
                k = info.shape[1]
                w = DenseWeight(self.get_part(n_w, rows, cols))
            elif dt == torch.int32 and self.quant.int4_per_group:
                # Quark per-group INT4, stored transposed: weight [K, N/8], scale [K/G, N]. The part's
                # output rows are stored columns (whole words of 8), its input columns stored rows.
                k, n = info.shape[0], info.shape[1] * 8
                sk = self.reader.info(n_scale).shape
                if len(sk) != 2 or not sk[0] or k % sk[0]:
                    return None
                g = k // sk[0]
                r, c = rows or (0, n), cols or (0, k)
                if not (ok(*r, n, 8) and c[0] % g == 0 and (c[1] - c[0]) % g == 0):
                    return None
                stored = self.get_part(n_w, c, (r[0] // 8, cdiv(r[1], 8)) if rows else None)
                st_scale = self.get_part(n_scale, (c[0] // g, c[1] // g), r if rows else None)
                reorder = self.quant.pack_method == "reorder"
                codes = codecs.quark_int4_unpack(stored, reorder=reorder)[:, : r[1] - r[0]].t().contiguous()
                w = Int4Weight(codecs.quark_int4_pack(codes, reorder=reorder), st_scale.float().t().contiguous(),
                               group_size=g, packing="quark" if reorder else "quark_order", in_features=c[1] - c[0])
            elif dt == torch.int32:  # Quark INT4 per-channel / W4A8: words along the input dim
                k = info.shape[1] * 8
                c = cols or (0, k)
                if not ok(*c, k, 8):
                    return None
                words = self.get_part(n_w, rows, (c[0] // 8, cdiv(c[1], 8)) if cols else None)
                # The scales as _quark_int4 reads them (a stride-0 stand-in for the words: no memory).
                full = self._quark_int4(m, torch.zeros((), dtype=torch.int32).expand(n, info.shape[1]))
                r = rows or (0, n)
                scale = full.scale[r[0]: r[1]]
                w = Int4Weight(words, scale, None, tensor_scale=full.tensor_scale, packing=full.packing,
                               in_features=c[1] - c[0])
            elif dt == torch.uint8:  # MXFP4
                k = info.shape[1] * 2
                c = cols or (0, k)
                if not ok(*c, k, 32):
                    return None
                w = MXFP4Weight(self.get_part(n_w, rows, (c[0] // 2, c[1] // 2) if cols else None),
                                self.get_part(n_scale, rows, (c[0] // 32, c[1] // 32) if cols else None))
            elif dt in _FP8:
                k = info.shape[1]
                r, c = rows or (0, n), cols or (0, k)
                n_inv = f"{m}.{keys.SCALE_INV}"
                if self.has(n_inv):
                    bn, bk = self.quant.fp8_block or (128, 128)
                    if not (ok(*r, n, bn) and ok(*c, k, bk)):
                        return None
                    scale = self.get_part(n_inv, (r[0] // bn, cdiv(r[1], bn)),
                                          (c[0] // bk, cdiv(c[1], bk)) if cols else None).float()
                    w = FP8Weight(self.get_part(n_w, rows, cols), scale, block=(bn, bk))
                else:
                    s = self.get(n_scale).float()
                    if s.dim() >= 1 and s.shape[0] == n and n > 1:
                        s = s[r[0]: r[1]]
                    w = FP8Weight(self.get_part(n_w, rows, cols), s)
            else:
                return None
        else:
            return None
        bias_name = f"{m}.bias"
        if self.has(bias_name):
            if rows is not None:
                w.bias = self.get_part(bias_name, rows)
            elif keep_bias:  # row parallel: the bias is added once, on one rank
                w.bias = self.get(bias_name)
        if isinstance(w, DenseWeight):
            return w, None
        act = self.quant.act_for(m)
        if self.act_override is not None and act in ("int8", "fp8") and isinstance(w, Int4Weight):
            act = self.act_override
        if isinstance(w, FP8Weight) and w.block is not None:
            act = None
        return w, act

    def _decode(self, m: str) -> LinearWeight:
        n_packed, n_w = f"{m}.{keys.CT_PACKED}", f"{m}.{keys.WEIGHT}"
        n_scale = f"{m}.{keys.SCALE}"
        n_inv, n_zp = f"{m}.{keys.SCALE_INV}", f"{m}.{keys.ZERO_POINT}"
        # Quark's export writes all-zero zero points for symmetric schemes (int4-draft): those are fine.
        if self.has(n_zp) and bool(self.get(n_zp).any()):
            raise FormatError(f"{self.path}: tensor {n_zp!r}: asymmetric (zero-point) quantization is not supported")
        if self.has(n_packed):  # compressed-tensors pack-quantized INT4
            packed, scale = self.get(n_packed), self.get(n_scale)
            shape = self.get(f"{m}.{keys.CT_SHAPE}").tolist()
            n, k = int(shape[0]), int(shape[1])
            if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[0] != n or packed.shape[1] * 8 < k:
                raise ShapeError(f"{self.path}: tensor {n_packed!r} is {packed.dtype}{list(packed.shape)}, not int32 "
                                 f"[{n}, {-(-k // 8)}] for weight_shape {[n, k]}")
            if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1]:
                raise ShapeError(f"{self.path}: tensor {n_scale!r} has shape {list(scale.shape)}, not [{n}, {k}/group]")
            # kept packed as on disk; the backend decodes it (codecs.ct_int4_unpack) when it runs
            return Int4Weight(packed, scale, group_size=k // scale.shape[1], packing="ct", in_features=k)
        if not self.has(n_w):
            raise CheckpointError(f"{self.path}: missing tensor {n_w!r} (or {n_packed!r}) of module {m!r}")
        w = self.get(n_w)
        if w.dtype in _FLOATS:
            return DenseWeight(w)
        if w.dtype == torch.int32:  # Quark INT4 (reorder or natural nibble order)
            return self._quark_int4(m, w)
        if w.dtype == torch.uint8:  # Quark MXFP4
            scale = self.get(n_scale)
            if scale.dtype != torch.uint8 or scale.shape[0] != w.shape[0] or scale.shape[1] * 32 != w.shape[1] * 2:
                raise ShapeError(f"{self.path}: tensor {n_scale!r} is {scale.dtype}{list(scale.shape)}; MXFP4 weight "
                                 f"{list(w.shape)} needs uint8 [{w.shape[0]}, {w.shape[1] * 2 // 32}]")
            return MXFP4Weight(w, scale)
        if w.dtype in _FP8:
            if self.has(n_inv):
                return FP8Weight(w, self.get(n_inv).float(), block=self.quant.fp8_block or (128, 128))
            return FP8Weight(w, self.get(n_scale).float())
        raise FormatError(f"{self.path}: tensor {n_w!r} has dtype {w.dtype}, not a weight format eagle3 reads")

    def _quark_int4(self, m: str, w: torch.Tensor) -> Int4Weight:
        """Quark INT4, kept packed (int32 words along the input dim, Quark's nibble order)."""
        reorder = self.quant.pack_method == "reorder"
        packing = "quark" if reorder else "quark_order"
        scale = self.get(f"{m}.{keys.SCALE}").float()
        n_s2 = f"{m}.{keys.SCALE_2}"
        if w.dim() != 2:
            raise ShapeError(f"{self.path}: tensor {m + '.' + keys.WEIGHT!r} has shape {list(w.shape)}, not 2-D")
        if self.quant.int4_per_group:  # Quark per_group INT4 is stored transposed: [K, N/8], scale [K/G, N]
            # Relaid out once to words along the input dim (the same codes, the same bytes), so that
            # rows decode independently like every other INT4 weight.
            codes = codecs.quark_int4_unpack(w, reorder=reorder).t().contiguous()
            n, k = codes.shape
            scale = scale.t().contiguous()
            if scale.shape[0] != n or k % scale.shape[1]:
                raise ShapeError(f"{self.path}: {m}: per-group scale {list(scale.shape)} does not fit weight [{n}, {k}]")
            return Int4Weight(codecs.quark_int4_pack(codes, reorder=reorder), scale, group_size=k // scale.shape[1],
                              packing=packing, in_features=k)
        n, k = int(w.shape[0]), int(w.shape[1]) * 8
        if self.has(n_s2):  # two-stage W4A8: W = q * scale_2[n] * scale
            s2 = self.get(n_s2).float().reshape(-1)
            if s2.shape[0] != n or scale.numel() != 1:
                raise ShapeError(f"{self.path}: {m}: W4A8 weight {[n, k]} needs weight_scale_2 "
                                 f"[{n}] and a per-tensor weight_scale, got {list(s2.shape)} and "
                                 f"{list(scale.shape)}")
            return Int4Weight(w, s2, None, tensor_scale=scale.reshape(()), packing=packing, in_features=k)
        if scale.numel() == 1:
            return Int4Weight(w, scale.reshape(1).expand(n).contiguous(), packing=packing, in_features=k)
        if scale.reshape(-1).shape[0] != n:
            raise ShapeError(f"{self.path}: {m}: per-channel scale {list(scale.shape)} does not fit weight "
                             f"{[n, k]}")
        return Int4Weight(w, scale.reshape(-1), packing=packing, in_features=k)


def _device(device: str | torch.device | None) -> torch.device:
    return torch.device(device or "cpu")


def _check_act_override(act: ActQuant) -> None:
    if act is not None and act not in ("int8", "fp8"):
        raise UsageError(f"act_override must be 'int8' or 'fp8' (W4A8 activation type), got {act!r}; "
                         f"known activation types: {', '.join(ACT_QUANTS)}")


# ---------------------------------------------------------------------------------------------
# Target
# ---------------------------------------------------------------------------------------------


def target_spec(path: str | os.PathLike[str], latent_norm_eps: float | None = None) -> TargetSpec:
    """The :class:`TargetSpec` of a target checkpoint (config and headers only)."""
    summary = detect.detect(path, check_vocab_map=False)
    if summary.role != "target" or summary.target is None:
        raise FormatError(f"{summary.config_file}: this is a {summary.role} checkpoint ({summary.family}), "
                          f"not a target")
    cfg = detect.load_config(path)
    tc = detect.text_config(cfg)
    qc, _ = detect.quantization_config(cfg)
    where = f"{summary.config_file}" + (" text_config" if tc is not cfg else "")
    return TargetSpec.from_config(tc, where, prefix=summary.target.text_prefix, quant=qc,
                                  latent_norm_eps=latent_norm_eps, top=cfg)


def load_target(path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                backend: str = "torch", *, act_override: ActQuant = None,
                latent_norm_eps: float | None = None, tp: TPGroup = SINGLE) -> DeepseekV3Model:
    """Load a DeepSeek-V3 / Kimi target from any supported format.

    ``act_override``: activation type of W4A8 layers ("fp8" or "int8"; default: the config's).
    ``latent_norm_eps``: eps of q_a/kv_a layernorms; None = ``rms_norm_eps`` as vLLM/SGLang/ATOM
    (transformers uses 1e-6 there).
    ``tp``: this process's place in a tensor-parallel group: the model's parallel layers hold only
    their shard and the reader reads only that (runtime/layers/linear.py)."""
    _check_act_override(act_override)
    spec = target_spec(path, latent_norm_eps)
    dev = _device(device)
    be = get_backend(backend, dev)
    model = DeepseekV3Model(spec, be, dtype, tp)
    wr = WeightReader(path, spec.quant, dtype, dev, act_override)
    p = spec.prefix
    with torch.no_grad():
        embed = wr.get(f"{p}{keys.TARGET_EMBED}")
        if tuple(embed.shape) != (spec.vocab_size, spec.hidden_size):
            raise ShapeError(f"{wr.path}: tensor {p + keys.TARGET_EMBED!r} has shape {list(embed.shape)}, expected "
                             f"{[spec.vocab_size, spec.hidden_size]}")
        model.embed_tokens = embed.to(device=dev, dtype=dtype)
        for i, layer in enumerate(model.layers):
            _load_target_layer(wr, layer, f"{p}model.layers.{i}.")
        wr.norm(model.norm, f"{p}{keys.TARGET_NORM}")
        head = f"{p}lm_head"
        if wr.has(f"{head}.weight") or wr.has(f"{head}.{keys.CT_PACKED}"):
            wr.load_linear(model.lm_head, head)
        elif spec.tie_word_embeddings:
            model.lm_head.load(DenseWeight(model.lm_head.shard.take_rows(embed)), None, dtype, dev)
        else:
            raise FormatError(f"{wr.path}: no tensor {head + '.weight'!r} and tie_word_embeddings is false")
    model.to(dev)  # module buffers (RoPE frequencies, ...); the ops' prepared weights are there already
    model.eval()
    model.checkpoint_bytes = wr.used_bytes
    return model


def _load_target_layer(wr: WeightReader, layer: Any, p: str) -> None:
    wr.norm(layer.input_layernorm, p + "input_layernorm.weight")
    wr.norm(layer.post_attention_layernorm, p + "post_attention_layernorm.weight")
    _load_mla(wr, layer.self_attn, p + "self_attn.")
    mlp = layer.mlp
    if isinstance(mlp, MoE):
        gate_w = wr.get(p + "mlp.gate.weight")
        if tuple(gate_w.shape) != (mlp.num_experts, mlp.hidden):
            raise ShapeError(f"{wr.path}: tensor {p + 'mlp.gate.weight'!r} has shape {list(gate_w.shape)}, expected "
                             f"{[mlp.num_experts, mlp.hidden]}")
        bias_name = p + "mlp.gate.e_score_correction_bias"
        mlp.load_router(gate_w, wr.get(bias_name) if wr.has(bias_name) else None, wr.device)
        gates, ups, downs, acts = [], [], [], set()
        for e in range(*mlp.expert_range):  # expert parallel: only the experts the layer holds are read
            for proj, out in (("gate_proj", gates), ("up_proj", ups), ("down_proj", downs)):
                w, act = wr.linear(f"{p}mlp.experts.{e}.{proj}")
                out.append(w)
                acts.add(act)
        if len(acts) != 1 or len({type(w) for w in gates + ups + downs}) != 1:
            raise FormatError(f"{wr.path}: the routed experts of {p}mlp mix weight formats")
        want = {"gate": (mlp.inter, mlp.hidden), "down": (mlp.hidden, mlp.inter)}
        for name, ws in (("gate", gates), ("gate", ups), ("down", downs)):
            if any(w.shape != want[name] for w in ws):
                raise ShapeError(f"{wr.path}: {p}mlp.experts: expert weights are not all {list(want[name])}")
        mlp.load_experts(gates, ups, downs, acts.pop(), wr.dtype, wr.device)
        if mlp.shared is not None:
            _load_mlp(wr, mlp.shared, p + "mlp.shared_experts.")
    else:
        _load_mlp(wr, mlp, p + "mlp.")


def _load_mlp(wr: WeightReader, mlp: Any, p: str) -> None:
    """gate/up/down of a SwiGLU MLP: the parts the layer holds (``mlp.gate_up_shard`` of gate and of
    up, ``mlp.down.shard`` of down; whole unless the MLP is tensor parallel)."""
    (g, ag), (u, au) = (wr.shard_part(p + n, mlp.gate_up_shard) for n in ("gate_proj", "up_proj"))
    d, ad = wr.shard_part(p + "down_proj", mlp.down.shard)
    if ag != au:
        raise FormatError(f"{wr.path}: {p}gate_proj and up_proj have different activation quantization")
    with _named(wr, p + "gate_proj/up_proj"):
        mlp.load(g, u, d, ag, ad, wr.dtype, wr.device)


@contextlib.contextmanager
def _named(wr: WeightReader, what: str) -> Iterator[None]:
    """Name the checkpoint and module in shape / fusion errors raised while loading ``what``."""
    try:
        yield
    except ShapeError as e:
        raise ShapeError(f"{wr.path}: {e}") from None
    except UsageError as e:  # weights that cannot be fused (different formats)
        raise FormatError(f"{wr.path}: {what}: {e}") from None


def _load_mla(wr: WeightReader, attn: Any, p: str) -> None:
    """MLA weights, each the part the layer holds (its heads' q_b / q / kv_b rows and o_proj input
    columns under tensor parallelism; q_a / kv_a whole)."""
    if attn.spec.q_lora_rank is not None:
        (qa, act_q), (kva, act_kv) = wr.linear(p + "q_a_proj"), wr.linear(p + "kv_a_proj_with_mqa")
        with _named(wr, p + "q_a_proj/kv_a_proj_with_mqa"):
            attn.load_a(qa, act_q, kva, act_kv, wr.dtype, wr.device)
        wr.norm(attn.q_a_layernorm, p + "q_a_layernorm.weight")
        wr.load_linear(attn.q_b_proj, p + "q_b_proj")
    else:
        wr.load_linear(attn.q_proj, p + "q_proj")
        wr.load_linear(attn.kv_a_proj_with_mqa, p + "kv_a_proj_with_mqa")
    wr.norm(attn.kv_a_layernorm, p + "kv_a_layernorm.weight")
    kv_b, _ = wr.shard_part(p + "kv_b_proj", attn.kv_b_shard)
    with _named(wr, p + "kv_b_proj"):
        attn.load_kv_b(kv_b, wr.dtype, wr.device)
    wr.load_linear(attn.o_proj, p + "o_proj")


# ---------------------------------------------------------------------------------------------
# Draft
# ---------------------------------------------------------------------------------------------


def draft_spec(path: str | os.PathLike[str], latent_norm_eps: float | None = None) -> DraftSpec:
    summary = detect.detect(path, check_vocab_map=False)
    if summary.role != "draft" or summary.draft is None:
        raise FormatError(f"{summary.config_file}: this is a {summary.role} checkpoint ({summary.family}), "
                          f"not an EAGLE-3 draft")
    cfg = detect.load_config(path)
    layer_cfg = detect.text_config(cfg)
    qc, _ = detect.quantization_config(cfg)
    return DraftSpec.from_detected(cfg, layer_cfg, summary.draft, summary.family, str(summary.config_file),
                                   quant=qc, latent_norm_eps=latent_norm_eps)


def load_draft(path: str | os.PathLike[str], target: DeepseekV3Model, dtype: torch.dtype | None = None,
               device: str | torch.device | None = None, backend: str | None = None, *,
               act_override: ActQuant = None, latent_norm_eps: float | None = None,
               aux_layer_ids: tuple[int, ...] | None = None, lm_head: Linear | None = None) -> Eagle3DraftModel:
    """Load an EAGLE-3 / 3.1 draft for ``target`` (dtype, device and backend default to the
    target's). Shares the target's embedding (and lm_head) when the draft has none.
    ``aux_layer_ids`` overrides the config's ids (input-to-layer convention)."""
    _check_act_override(act_override)
    spec = draft_spec(path, latent_norm_eps)
    dtype = dtype or target.dtype
    dev = _device(device) if device is not None else target.backend.device
    be = get_backend(backend, dev) if backend is not None else target.backend
    where = Path(path)
    if spec.target_hidden_size != target.hidden_size:
        raise ShapeError(f"{where}: draft takes aux states of width {spec.target_hidden_size} but the target's "
                         f"hidden size is {target.hidden_size}")
    if spec.vocab_size != target.vocab_size:
        raise ShapeError(f"{where}: draft maps into a vocabulary of {spec.vocab_size} tokens but the target has "
                         f"{target.vocab_size}")
    ids = tuple(aux_layer_ids or spec.aux_layer_ids or default_aux_layer_ids(target.num_layers))
    if len(ids) != spec.num_aux or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] > target.num_layers:
        raise FormatError(f"{where}: aux layer ids {list(ids)} (input-to-layer) do not fit a draft with "
                          f"{spec.num_aux} aux states and a target with {target.num_layers} layers")
    if not spec.own_lm_head:
        spec = _replace(spec, draft_vocab_size=target.vocab_size)
    model = Eagle3DraftModel(spec, ids, be, dtype)
    wr = WeightReader(path, spec.quant, dtype, dev, act_override)
    lp = spec.layer_prefix
    with torch.no_grad():
        if spec.own_embedding:
            emb = wr.get(keys.DRAFT_EMBED)
            if tuple(emb.shape) != (spec.vocab_size, spec.hidden_size):
                raise ShapeError(f"{wr.path}: tensor {keys.DRAFT_EMBED!r} has shape {list(emb.shape)}, expected "
                                 f"{[spec.vocab_size, spec.hidden_size]}")
            model.embed_tokens = emb.to(device=dev, dtype=dtype)
        else:
            if spec.hidden_size != target.hidden_size:
                raise ShapeError(f"{where}: draft has no embed_tokens and its hidden size {spec.hidden_size} differs "
                                 f"from the target's {target.hidden_size}")
            model.embed_tokens = target.embed_tokens.to(dtype)  # shared, not copied (same dtype/device)
        wr.load_linear(model.fc, "fc")
        if model.input_norm is not None:
            wr.norm(model.input_norm, keys.DRAFT_INPUT_NORM)
        if model.fc_norm is not None:
            for i, norm in enumerate(model.fc_norm):
                name = keys.fc_norm_key(i)
                if not wr.has(name):
                    legacy = [n for n, j in keys.LEGACY_FC_NORM.items() if j == i]
                    name = legacy[0] if legacy and wr.has(legacy[0]) else name
                wr.norm(norm, name)
        for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            wr.norm(getattr(model, n), f"{lp}{n}.weight")
        if spec.attention == "mla":
            _load_mla(wr, model.self_attn, lp + "self_attn.")
        else:
            q, k, v, o = (wr.linear(f"{lp}self_attn.{n}_proj") for n in "qkvo")
            if len({q[1], k[1], v[1]}) != 1:
                raise FormatError(f"{wr.path}: {lp}self_attn q/k/v have different activation quantization")
            with _named(wr, lp + "self_attn.q/k/v_proj"):
                model.self_attn.load(q[0], k[0], v[0], o[0], q[1], o[1], dtype, dev)
        _load_mlp(wr, model.mlp, lp + "mlp.")
        wr.norm(model.norm, keys.DRAFT_NORM)
        if spec.own_lm_head:
            wr.load_linear(model.lm_head, "lm_head")
        elif lm_head is not None:  # the target's, whole (its own lm_head is split over tensor-parallel ranks)
            model.lm_head = lm_head
        elif target.lm_head.out_features != target.vocab_size:  # the target's holds part of the vocabulary
            raise UsageError(f"{where}: the draft shares the target's lm_head, which is split over the "
                             f"tensor-parallel ranks; pass the whole one (lm_head=load_lm_head(target_dir))")
        else:
            model.lm_head = target.lm_head
        if wr.has(keys.D2T) and spec.draft_vocab_size != spec.vocab_size:
            d2t = wr.get(keys.D2T).to(torch.int64)
            if d2t.shape != (spec.draft_vocab_size,):
                raise ShapeError(f"{wr.path}: tensor 'd2t' has shape {list(d2t.shape)}, expected "
                                 f"[{spec.draft_vocab_size}]")
            tgt = d2t + torch.arange(d2t.shape[0])
            if int(tgt.min()) < 0 or int(tgt.max()) >= spec.vocab_size:
                raise FormatError(f"{wr.path}: tensor 'd2t' maps draft ids outside the target vocabulary "
                                  f"[0, {spec.vocab_size})")
            model.d2t = d2t.to(dev)
        elif spec.draft_vocab_size != spec.vocab_size:
            raise FormatError(f"{wr.path}: the draft vocabulary has {spec.draft_vocab_size} tokens, the target "
                              f"{spec.vocab_size}, and there is no 'd2t' map")
    model.to(dev)
    model.eval()
    model.checkpoint_bytes = wr.used_bytes
    return model


def load_lm_head(path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu", backend: str = "torch") -> Linear:
    """The target's whole ``lm_head`` (or its tied embedding) as a Linear: for a draft that shares
    it when the target's own is split over tensor-parallel ranks (the draft runs on rank 0)."""
    spec = target_spec(path)
    dev = _device(device)
    wr = WeightReader(path, spec.quant, dtype, dev)
    head = Linear(spec.hidden_size, spec.vocab_size, get_backend(backend, dev), f"{spec.prefix}lm_head")
    name = f"{spec.prefix}lm_head"
    with torch.no_grad():
        if wr.has(f"{name}.weight") or wr.has(f"{name}.{keys.CT_PACKED}"):
            wr.load_linear(head, name)
        elif spec.tie_word_embeddings:
            head.load(DenseWeight(wr.get(f"{spec.prefix}{keys.TARGET_EMBED}")), None, dtype, dev)
        else:
            raise FormatError(f"{wr.path}: no tensor {name + '.weight'!r} and tie_word_embeddings is false")
    return head


def _replace(spec: DraftSpec, **kw: Any) -> DraftSpec:
    import dataclasses

    return dataclasses.replace(spec, **kw)


# ---------------------------------------------------------------------------------------------
# Resident memory of a loaded model
# ---------------------------------------------------------------------------------------------

# Roles of resident tensors: quantized codes, their scales, float weights (embeddings, norms, dense
# linears, biases, router), other checkpoint tensors (d2t), and runtime buffers that no checkpoint
# holds (RoPE frequencies). The first four are weights; "buffers" are accounted separately.
WEIGHT_ROLES = ("packed", "scales", "dense", "other")


@dataclass
class ResidentBytes:
    """Bytes of the tensors a loaded model keeps, per module (its own tensors, not its children's)
    and role, each tensor counted once; ``checkpoint_bytes``: the checkpoint tensors it was built
    from (None for a model the loader did not build)."""

    per_module: dict[str, dict[str, int]] = field(default_factory=dict)
    checkpoint_bytes: int | None = None

    @property
    def totals(self) -> dict[str, int]:
        out = dict.fromkeys((*WEIGHT_ROLES, "buffers"), 0)
        for roles in self.per_module.values():
            for role, n in roles.items():
                out[role] += n
        return out

    @property
    def weights(self) -> int:
        """Resident weight bytes: packed codes + scales + dense + other checkpoint tensors."""
        t = self.totals
        return sum(t[r] for r in WEIGHT_ROLES)

    @property
    def buffers(self) -> int:
        return self.totals["buffers"]


def module_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(role, tensor) of what ``module`` itself keeps: its registered parameters and buffers plus
    the tensors its kernel ops hold (``resident()``: packed codes, scales, dense weights)."""
    out: list[tuple[str, torch.Tensor]] = []
    non_persistent = getattr(module, "_non_persistent_buffers_set", set())
    for name, b in module.named_buffers(recurse=False):
        if b is not None:
            role = "buffers" if name in non_persistent else "dense" if b.is_floating_point() else "other"
            out.append((role, b))
    out.extend(("dense", p) for p in module.parameters(recurse=False))
    resident = getattr(module, "resident", None)
    if callable(resident):
        out.extend(resident())
    return out


def resident_weight_bytes(model: nn.Module, exclude: nn.Module | None = None) -> ResidentBytes:
    """What a loaded model holds in memory, per module and role (see :data:`WEIGHT_ROLES`), each
    tensor once (tied / shared weights are not counted twice). ``exclude``: a model whose tensors
    are not counted (a draft's view of the target's shared embedding and lm_head)."""

    def key(t: torch.Tensor) -> tuple[str, int, int]:
        return str(t.device), t.data_ptr(), t.nbytes

    seen: set[tuple[str, int, int]] = set()
    if exclude is not None:
        seen = {key(t) for m in exclude.modules() for _, t in module_tensors(m)}
    rb = ResidentBytes(checkpoint_bytes=getattr(model, "checkpoint_bytes", None))
    for name, m in model.named_modules():
        roles: dict[str, int] = {}
        for role, t in module_tensors(m):
            k = key(t)
            if k in seen or t.nbytes == 0:
                continue
            seen.add(k)
            roles[role] = roles.get(role, 0) + t.nbytes
        if roles:
            rb.per_module[name or "."] = roles
    return rb
