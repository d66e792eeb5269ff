"""Checkpoint -> runtime model, straight from the files (no convert step), one tensor at a time:
:func:`load_target` (DeepSeek-V3 / Kimi), :func:`load_draft` (EAGLE-3 / 3.1), :func:`load_lm_head`,
and what a loaded model keeps in memory (:func:`resident_weight_bytes`).

Each checkpoint format is decoded into a canonical weight by :class:`eagle3.runtime.weights.WeightReader`
(which formats, and what the runtime does with each, is described there). Over a tensor-parallel
group the model's parallel layers say which part of each weight they hold (``layers/linear.py``);
this module passes those parts to the reader and never computes a range itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle3.errors import FormatError, ShapeError, UsageError
from eagle3.formats import detect, keys
from eagle3.formats.model_config import require_config
from eagle3.runtime import kv_cache
from eagle3.runtime.config import DraftSpec, TargetSpec
from eagle3.runtime.interfaces import default_aux_layer_ids
from eagle3.runtime.kernels import get_backend
from eagle3.runtime.kernels.base import (
    ACT_QUANTS,
    DenseWeight,
)
from eagle3.runtime.layers.linear import Linear
from eagle3.runtime.layers.moe import MoE
from eagle3.runtime.models.deepseek_v3 import DeepseekV3Model
from eagle3.runtime.models.eagle3 import Eagle3DraftModel
from eagle3.runtime.parallel import SINGLE, TPGroup
from eagle3.runtime.weights import WEIGHT_ONLY, ActOverride, WeightReader, named_errors


def _device(device: str | torch.device | None) -> torch.device:
    return torch.device(device or "cpu")


def _check_act_override(act: ActOverride) -> None:
    if act is not None and act not in ("int8", "fp8", WEIGHT_ONLY):
        raise UsageError(f"act_override must be 'int8' or 'fp8' (W4A8 activation type) or {WEIGHT_ONLY!r} (no "
                         f"activation quantization at all), got {act!r}; known activation types: "
                         f"{', '.join(ACT_QUANTS)}")


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
    require_config(cfg, summary.config_file)  # every field typed and in range, one line if not
    tc = detect.text_config(cfg)
    qc, _ = detect.quantization_config(cfg)
    where = f"{summary.config_file}" + (" text_config" if tc is not cfg else "")
    return TargetSpec.from_config(tc, where, prefix=summary.target.text_prefix, quant=qc,
                                  latent_norm_eps=latent_norm_eps, top=cfg)


def load_target(path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                backend: str = "torch", *, act_override: ActOverride = None,
                latent_norm_eps: float | None = None, tp: TPGroup = SINGLE,
                kv_cache_dtype: str = "auto") -> DeepseekV3Model:
    """Load a DeepSeek-V3 / Kimi target from any supported format.

    ``act_override``: activation type of W4A8 layers ("fp8" or "int8"; default: the config's), or
    "none": no quantized Linear quantizes its activations (weight-only emulation).
    ``latent_norm_eps``: eps of q_a/kv_a layernorms; None = ``rms_norm_eps`` as vLLM/SGLang/ATOM
    (transformers uses 1e-6 there).
    ``tp``: this process's place in a tensor-parallel group: the model's parallel layers hold only
    their shard and the reader reads only that (runtime/layers/linear.py).
    ``kv_cache_dtype``: what the latent cache is stored in (runtime/kv_cache.py); fp8 takes each
    layer's scale from the checkpoint's kv-cache scheme (1.0 without one)."""
    _check_act_override(act_override)
    spec = target_spec(path, latent_norm_eps)
    dev = _device(device)
    be = get_backend(backend, dev)
    model = DeepseekV3Model(spec, be, dtype, tp, kv_cache_dtype)
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
            if model.kv_format.fp8:
                layer.self_attn.kv_scale = _kv_scales(wr, f"{p}model.layers.{i}.self_attn", model.kv_format.dtype)[2]
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
    with named_errors(wr, p + "gate_proj/up_proj"):
        mlp.load(g, u, d, ag, ad, wr.dtype, wr.device)


def _load_mla(wr: WeightReader, attn: Any, p: str) -> None:
    """MLA weights, each the part the layer holds (its heads' q_b / q / kv_b rows and o_proj input
    columns under tensor parallelism; q_a / kv_a whole)."""
    if attn.spec.q_lora_rank is not None:
        (qa, act_q), (kva, act_kv) = wr.linear(p + "q_a_proj"), wr.linear(p + "kv_a_proj_with_mqa")
        with named_errors(wr, p + "q_a_proj/kv_a_proj_with_mqa"):
            attn.load_a(qa, act_q, kva, act_kv, wr.dtype, wr.device)
        wr.norm(attn.q_a_layernorm, p + "q_a_layernorm.weight")
        wr.load_linear(attn.q_b_proj, p + "q_b_proj")
    else:
        wr.load_linear(attn.q_proj, p + "q_proj")
        wr.load_linear(attn.kv_a_proj_with_mqa, p + "kv_a_proj_with_mqa")
    wr.norm(attn.kv_a_layernorm, p + "kv_a_layernorm.weight")
    kv_b, _ = wr.shard_part(p + "kv_b_proj", attn.kv_b_shard)
    with named_errors(wr, p + "kv_b_proj"):
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
    require_config(cfg, summary.config_file)
    layer_cfg = detect.text_config(cfg)
    qc, _ = detect.quantization_config(cfg)
    return DraftSpec.from_detected(cfg, layer_cfg, summary.draft, summary.family, str(summary.config_file),
                                   quant=qc, latent_norm_eps=latent_norm_eps)


def load_draft(path: str | os.PathLike[str], target: DeepseekV3Model, dtype: torch.dtype | None = None,
               device: str | torch.device | None = None, backend: str | None = None, *,
               act_override: ActOverride = None, latent_norm_eps: float | None = None,
               aux_layer_ids: tuple[int, ...] | None = None, lm_head: Linear | None = None,
               kv_cache_dtype: str | None = None) -> Eagle3DraftModel:
    """Load an EAGLE-3 / 3.1 draft for ``target`` (dtype, device, backend and ``kv_cache_dtype``
    default to the target's). Shares the target's embedding (and lm_head) when the draft has none.
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
    kv_name = kv_cache_dtype or getattr(getattr(target, "kv_format", None), "name", "auto")
    model = Eagle3DraftModel(spec, ids, be, dtype, kv_name)
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
            with named_errors(wr, lp + "self_attn.q/k/v_proj"):
                model.self_attn.load(q[0], k[0], v[0], o[0], q[1], o[1], dtype, dev)
        _load_mlp(wr, model.mlp, lp + "mlp.")
        if model.kv_format.fp8:
            k, v, latent = _kv_scales(wr, lp + "self_attn", model.kv_format.dtype)
            if spec.attention == "mla":
                model.self_attn.kv_scale = latent
            else:
                model.self_attn.kv_scales = (k, v)
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


def _kv_scales(wr: WeightReader, attn: str, dtype: torch.dtype) -> tuple[float, float, float]:
    """(key scale, value scale, latent scale) of an fp8 cache for attention module ``attn``: the
    largest of the checkpoint's key / value scales (``formats.keys.kv_scale_names``), and for an MLA
    latent (one tensor that keys and values are both computed from) the largest of all of them;
    1.0 where the checkpoint has none (vLLM's rule). As the cache stored in ``dtype`` uses them
    (``kv_cache.storage_scale``: fnuz doubles)."""
    found: list[list[float]] = []
    for names in keys.kv_scale_names(attn):
        found.append([kv_cache.check_scale(wr.get(n), f"{wr.path}: tensor {n!r}") for n in names if wr.has(n)])

    def pick(vals: list[float]) -> float:
        return kv_cache.storage_scale(max(vals), dtype) if vals else 1.0

    return pick(found[0]), pick(found[1]), pick(found[0] + found[1])


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
