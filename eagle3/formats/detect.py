"""What is this checkpoint? Role, family, quantization, EAGLE flags, aux-layer convention, tensors.

:func:`detect` reads ``config.json`` and the safetensors headers only (plus, optionally, the tiny
``d2t``/``t2d`` vocabulary maps of a draft, at most a few hundred KB) and returns a
:class:`CheckpointSummary`, the typed object model that convert, quantize and the runtime loader
build on. ``eagle3 inspect --json`` prints :meth:`CheckpointSummary.to_json`; every key is
documented in docs/inspect_json.md, and keys only ever get added (``schema_version`` bumps on a
breaking change).

What is an error and what is a warning:

* :class:`~eagle3.errors.FormatError` (one line, naming the file and the field or tensor) when the
  checkpoint cannot be identified or contradicts itself in a way every loader would trip on:
  unknown architecture, missing required fields, a quantization scheme eagle3 does not read,
  quantized tensors that do not match ``quantization_config`` (or have none), draft layer tensors
  under both ``midlayer.`` and ``layers.0.``.
* ``warnings`` (listed in the summary) for what engines treat differently or silently get wrong:
  a missing ``draft_vocab_size`` (SGLang then swaps in the target's lm_head), EAGLE-3.1 flags
  without their tensors, a d2t map out of range, a stale nested ``quantization_config``, ...

The tensor layouts of every format: :mod:`eagle3.formats.sizing`; the per-family schema the
checkpoint is checked against: :mod:`eagle3.formats.schema`; docs/inspect_json.md for the output.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from eagle3.checkpoint import CheckpointReader, TensorInfo, read_json
from eagle3.errors import CheckpointError, FormatError, ShapeError
from eagle3.formats import keys
from eagle3.formats.files import INDEX_FILE
from eagle3.units import human_bytes

SCHEMA_VERSION = 1
CONFIG_FILE = "config.json"

Role = Literal["target", "draft"]
Convention = Literal["input", "output", "default"]

# ---------------------------------------------------------------------------------------------
# Families and the architectures that name them
# ---------------------------------------------------------------------------------------------

KIMI_K25 = "kimi-k25"  # KimiK25ForConditionalGeneration: DeepSeek-V3 text stack + vision, language_model.*
DEEPSEEK_V3 = "deepseek-v3"  # text-only DeepseekV3ForCausalLM (model_type kimi_k2 for K2 / K2-Thinking)
EAGLE3_LLAMA = "eagle3-llama"  # Llama-style (MHA) EAGLE-3/3.1 draft, midlayer.* or layers.0.*
EAGLE3_MLA = "eagle3-mla"  # Eagle3DeepseekV2ForCausalLM: MLA EAGLE-3/3.1 draft (lightseek K2.6)
SPECULATORS = "speculators-eagle3"  # vllm-project/speculators Eagle3Speculator format

TARGET_ARCHITECTURES: dict[str, str] = {
    "KimiK25ForConditionalGeneration": KIMI_K25,  # Moonshot remote code
    "Kimi_K25ForConditionalGeneration": KIMI_K25,  # transformers >= 5 native spelling
    "DeepseekV3ForCausalLM": DEEPSEEK_V3,
}
DRAFT_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLMEagle3": EAGLE3_LLAMA,  # TorchSpec / SpecForge / SGLang
    "Eagle3LlamaForCausalLM": EAGLE3_LLAMA,  # vLLM
    "Eagle3DeepseekV2ForCausalLM": EAGLE3_MLA,
    "Eagle3DeepseekV3ForCausalLM": EAGLE3_MLA,  # vLLM alias
    "Eagle3Speculator": SPECULATORS,
    "Eagle3DraftModel": SPECULATORS,
}

# ---------------------------------------------------------------------------------------------
# Quantization schemes (config side) and tensor layouts (file side)
# ---------------------------------------------------------------------------------------------

CT_INT4 = "ct-int4"  # compressed-tensors pack-quantized INT4 (Moonshot Kimi, W4A16)
CT_FP8 = "ct-fp8"  # compressed-tensors float-quantized FP8
FP8_BLOCK = "fp8-block"  # DeepSeek / Kimi-K2 quant_method fp8, 128x128 weight_scale_inv
QUARK_W4A8 = "quark-w4a8"  # Quark progressive FP8 -> INT4 per-channel weight (amd/Kimi-K2.5-W4A8)
QUARK_INT4 = "quark-int4"  # Quark single-stage INT4 weight (weight-only or with INT8/FP8 activations)
QUARK_MXFP4 = "quark-mxfp4"  # Quark OCP MXFP4 (E2M1 + E8M0 per 32)
QUARK_FP8 = "quark-fp8"  # Quark FP8 E4M3 weights (e.g. ptpc_fp8 drafts)
QUANT_SCHEMES = (CT_INT4, CT_FP8, FP8_BLOCK, QUARK_W4A8, QUARK_INT4, QUARK_MXFP4, QUARK_FP8)

# Tensor layout of one quantized Linear -> the schemes that write it.
_LAYOUT_SCHEMES: dict[str, frozenset[str]] = {
    "int4_ct": frozenset({CT_INT4}),
    "int4": frozenset({QUARK_INT4}),
    "int4_2stage": frozenset({QUARK_W4A8}),
    "fp4": frozenset({QUARK_MXFP4}),
    "fp8_block": frozenset({FP8_BLOCK}),
    "fp8": frozenset({CT_FP8, QUARK_FP8}),
}
_LAYOUT_TEXT = {
    "int4_ct": "compressed-tensors INT4 (int32 weight_packed + weight_scale)",
    "int4": "Quark INT4 (int32 weight + weight_scale)",
    "int4_2stage": "Quark W4A8 (int32 weight + weight_scale + weight_scale_2)",
    "fp4": "MXFP4 (uint8 weight + uint8 weight_scale)",
    "fp8_block": "FP8 block (float8 weight + weight_scale_inv)",
    "fp8": "FP8 (float8 weight + weight_scale)",
}
_FLOAT_NAMES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}
_FP8_TAGS = {"F8_E4M3", "F8_E5M2"}


# ---------------------------------------------------------------------------------------------
# Object model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardStats:
    file: str  # file name relative to the checkpoint directory
    tensors: int
    bytes: int


@dataclass(frozen=True)
class TensorStats:
    count: int
    total_bytes: int
    dtypes: dict[str, int]  # safetensors dtype tag -> number of tensors
    dtype_bytes: dict[str, int]  # safetensors dtype tag -> bytes
    shards: list[ShardStats]
    indexed: bool  # a model.safetensors.index.json names the shards


@dataclass(frozen=True)
class QuantInfo:
    """How the weights are stored. ``scheme`` is one of :data:`QUANT_SCHEMES` or, unquantized,
    the dominant float dtype of the Linear weights (``bf16``/``fp16``/``fp32``)."""

    scheme: str
    method: str | None  # quantization_config.quant_method: compressed-tensors | fp8 | quark | None
    config_location: str | None  # "top-level" | "text_config" | None
    schemes: list[str]  # every scheme the config declares (Quark layer configs can mix)
    weights: str | None  # e.g. "int4 group g32 sym", "fp8_e4m3 per_tensor -> int4 per_channel"
    activations: str | None  # e.g. "fp8_e4m3 per_tensor dynamic"; None = not quantized (W-only)
    group_size: int | None
    pack_method: str | None  # Quark export.pack_method ("reorder" | "order")
    exclude: int | None  # number of ignore/exclude entries in the config
    modules: dict[str, int]  # scheme (or float dtype for unquantized Linears) -> module count

    @property
    def quantized(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class ModelDims:
    """Transformer dimensions from the text (or draft-layer) config; None where the field is absent."""

    hidden_size: int
    num_layers: int
    vocab_size: int | None
    num_attention_heads: int | None
    num_key_value_heads: int | None
    head_dim: int | None
    intermediate_size: int | None
    attention: str  # "mla" | "mha"
    q_lora_rank: int | None
    kv_lora_rank: int | None
    qk_nope_head_dim: int | None
    qk_rope_head_dim: int | None
    v_head_dim: int | None
    rms_norm_eps: float | None
    rope_theta: float | None
    rope_type: str  # "default" when the config has no rope scaling
    max_position_embeddings: int | None


@dataclass(frozen=True)
class TargetInfo:
    text_prefix: str  # "language_model." (K2.5 wrapper) or "" (text-only)
    has_vision: bool
    vision_tensors: int
    projector_tensors: int
    n_routed_experts: int | None
    num_experts_per_tok: int | None
    n_shared_experts: int | None
    first_k_dense_replace: int | None
    moe_intermediate_size: int | None
    mtp_layers: int  # num_nextn_predict_layers
    layers_in_files: int  # distinct decoder-layer indices among the tensor names
    default_aux_layer_ids: list[int]  # (2, N//2, N-3), "input" convention


@dataclass(frozen=True)
class AuxLayers:
    """The target layers whose hidden states feed the draft's ``fc``.

    ``convention`` says what an id k means: "input" = the input of decoder layer k (HF
    ``hidden_states[k]``; vLLM, ATOM, speculators), "output" = the output of layer k (SpecForge,
    TorchSpec), "default" = no ids in the config, every engine uses its default (2, N//2, N-3)
    in the input convention. ``input_ids`` are the ids rewritten to the input convention."""

    count: int
    ids: list[int] | None
    convention: Convention
    input_ids: list[int] | None
    source: str | None  # "top-level" | "eagle_config" | "both" | None
    rule: str  # why this convention (see aux_convention)
    use_aux_hidden_state: bool


@dataclass(frozen=True)
class VocabMapCheck:
    """Header facts of d2t/t2d plus, when read, the value checks."""

    d2t_length: int | None
    t2d_length: int | None
    values_checked: bool  # False: headers only
    d2t_length_ok: bool | None  # len(d2t) == draft vocab size
    d2t_in_range: bool | None  # every draft id maps into [0, vocab_size)
    d2t_increasing: bool | None  # targets strictly increasing (sorted used-token list)
    t2d_consistent: bool | None  # t2d marks exactly the d2t targets


@dataclass(frozen=True)
class DraftInfo:
    eagle_version: str  # "3" | "3.1"
    layer_prefix: str  # "midlayer" | "layers.0"
    attention: str  # "mha" | "mla"
    num_layers: int
    fc_norm: bool
    fc_norm_tensors: int
    norm_output: bool
    norm_before_fc: bool
    input_norm_tensor: bool
    norm_before_residual: bool
    defaulted: list[str]  # flags absent from the config, reported with the format's default
    aux_layers: AuxLayers
    hidden_size: int
    target_hidden_size: int
    vocab_size: int | None  # the target vocabulary the draft maps into
    draft_vocab_size: int | None  # rows of lm_head (what the head really predicts)
    config_draft_vocab_size: int | None  # the config field, None when absent
    d2t: bool
    t2d: bool
    vocab_map: VocabMapCheck
    own_embedding: bool
    own_lm_head: bool
    speculators: dict[str, Any] | None  # speculators_config facts for the speculators format


@dataclass(frozen=True)
class CheckpointSummary:
    path: Path
    config_file: Path
    role: Role
    family: str
    architecture: str
    model_type: str | None
    text_model_type: str | None
    dims: ModelDims
    quant: QuantInfo
    target: TargetInfo | None
    draft: DraftInfo | None
    tensors: TensorStats
    warnings: list[str] = field(default_factory=list)
    text_config: dict[str, Any] = field(default_factory=dict, repr=False)  # not in the JSON form

    def to_json(self) -> dict[str, Any]:
        """The stable JSON form (docs/inspect_json.md)."""
        d = asdict(self)
        d.pop("text_config")
        d["path"] = str(self.path)
        d["config_file"] = str(self.config_file)
        return {"schema_version": SCHEMA_VERSION, **d}


# ---------------------------------------------------------------------------------------------
# Config helpers
# ---------------------------------------------------------------------------------------------


def checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """The directory of a checkpoint given as a directory or as one of its ``.safetensors`` files."""
    p = Path(path)
    return p if p.is_dir() else p.parent


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory (or of the directory holding a ``.safetensors`` file)."""
    f = checkpoint_dir(path) / CONFIG_FILE
    # Only a missing config is "no such file"; a FIFO or directory there is refused by read_json
    # (before it is opened) as what it is.
    if not os.path.lexists(f):
        raise FormatError(f"{f}: no such file (a checkpoint directory needs its config.json)")
    return read_json(f)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config of the transformer stack: ``text_config`` of a K2.5 wrapper,
    ``transformer_layer_config`` of a speculators draft, else the top level."""
    for k in ("text_config", "transformer_layer_config"):
        sub = cfg.get(k)
        if isinstance(sub, dict):
            return sub
    return cfg


def _text_config_field(cfg: dict[str, Any]) -> str:
    for k in ("text_config", "transformer_layer_config"):
        if isinstance(cfg.get(k), dict):
            return k + "."
    return ""


def quantization_config(cfg: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """(quantization_config, where): the top-level one wins, as every engine reads it after
    Moonshot's and ATOM's config classes copy ``text_config.quantization_config`` up."""
    top = cfg.get("quantization_config")
    if isinstance(top, dict):
        return top, "top-level"
    tc = cfg.get("text_config")
    if isinstance(tc, dict) and isinstance(tc.get("quantization_config"), dict):
        return tc["quantization_config"], "text_config"
    return None, None


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The engines' default aux layers for a target of ``num_layers`` decoder layers, in the
    "input" convention (vLLM/ATOM/SGLang/SafeAILab): (2, N//2, N-3); (2, 30, 58) for Kimi's 61."""
    if num_layers < 4:
        raise ValueError(f"a target needs at least 4 layers for the default aux ids, got {num_layers}")
    return (2, num_layers // 2, num_layers - 3)


def to_input_convention(ids: list[int] | tuple[int, ...] | None, convention: str) -> list[int] | None:
    """Rewrite aux ids to the "input to layer k" convention (output of layer k == input of k+1)."""
    if ids is None:
        return None
    if convention == "input":
        return list(ids)
    if convention == "output":
        return [i + 1 for i in ids]
    raise ValueError(f"unknown aux-id convention {convention!r} (expected 'input' or 'output')")


def to_output_convention(ids: list[int] | tuple[int, ...] | None, convention: str) -> list[int] | None:
    """Rewrite aux ids to the "output of layer k" convention (SpecForge / TorchSpec native)."""
    if ids is None:
        return None
    if convention == "output":
        return list(ids)
    if convention == "input":
        if any(i < 1 for i in ids):
            raise ValueError(f"aux id 0 (the embeddings) has no 'output of layer k' form: {list(ids)}")
        return [i - 1 for i in ids]
    raise ValueError(f"unknown aux-id convention {convention!r} (expected 'input' or 'output')")


def aux_convention(ids: list[int] | None, speculators_format: bool) -> tuple[Convention, str]:
    """Decide which convention a draft's aux ids follow; returns (convention, rule).

    Nothing in a config states the convention, so the rule is the one the engines themselves
    apply: no ids -> "default" (each engine's (2, N//2, N-3)); the speculators format -> "input"
    (speculators trains and vLLM serves with input-to-layer ids, and nothing shifts them);
    otherwise SGLang's heuristic (sglang PR #25454): first id 1 -> "output" (SpecForge/TorchSpec
    default [1, N//2-1, N-4]), any other first id -> "input" (TorchSpec's ``--vllm`` export and
    the lightseek drafts write 2, ...). An id list starting at 1 meant as "input" cannot be told
    apart; convert lets the user override the convention."""
    if not ids:
        return "default", "no ids in the config: engine default (2, N//2, N-3), input convention"
    if speculators_format:
        return "input", "speculators format: ids are input-to-layer (vLLM convention)"
    if ids[0] == 1:
        return "output", "first id is 1: output-of-layer (SGLang heuristic, SpecForge/TorchSpec default)"
    return "input", "first id is not 1: input-to-layer (SGLang heuristic, vLLM/ATOM convention)"


# ---------------------------------------------------------------------------------------------
# Detection
# ---------------------------------------------------------------------------------------------


def detect(path: str | os.PathLike[str], check_vocab_map: bool = True,
           reader: CheckpointReader | None = None) -> CheckpointSummary:
    """Identify the checkpoint at ``path`` (a directory or a ``.safetensors`` file beside its config).

    Reads headers and config only; with ``check_vocab_map`` a draft's ``d2t``/``t2d`` (tiny
    int64/bool vectors) are read to check that draft ids map into the target vocabulary.
    Raises CheckpointError for unreadable files and FormatError for unknown or inconsistent formats.
    ``reader`` may be a header-only view (``CheckpointReader.from_headers``) of a remote checkpoint
    whose config sits in ``path``."""
    p = Path(path)
    if p.is_file() and p.suffix != ".safetensors":
        raise FormatError(f"{p}: not a checkpoint (give its directory or one of its .safetensors files)")
    if reader is None:
        reader = CheckpointReader(p)
    else:
        check_vocab_map = False  # no tensor data in a header-only view
    if not reader.files:
        raise CheckpointError(f"{reader.path}: no .safetensors files (nothing to inspect)")
    cfg_file = reader.path / CONFIG_FILE
    cfg = load_config(reader.path)
    warnings: list[str] = []
    arch, family, role = _classify(cfg, cfg_file)
    tc = text_config(cfg)
    tc_field = _text_config_field(cfg)
    if family == KIMI_K25 and tc is cfg:
        raise FormatError(f"{cfg_file}: field 'text_config' is missing (a {arch} config nests the text stack there)")

    infos = {i.name: i for i in reader.infos()}
    quant = _detect_quant(cfg, cfg_file, infos, warnings)
    dims = _dims(tc, tc_field, cfg_file, infos, role)
    target = _target_info(family, tc, dims, infos, warnings) if role == "target" else None
    draft = (_draft_info(cfg, tc, tc_field, family, dims, reader, cfg_file, check_vocab_map, warnings)
             if role == "draft" else None)
    return CheckpointSummary(
        path=reader.path,
        config_file=cfg_file,
        role=role,
        family=family,
        architecture=arch,
        model_type=cfg.get("model_type"),
        text_model_type=tc.get("model_type") if tc is not cfg else None,
        dims=dims,
        quant=quant,
        target=target,
        draft=draft,
        # The reader follows the index only when given the directory (a single file is read alone).
        tensors=_tensor_stats(reader, p.is_dir() and (reader.path / INDEX_FILE).is_file()),
        warnings=warnings,
        text_config=tc,
    )


def _classify(cfg: dict[str, Any], cfg_file: Path) -> tuple[str, str, Role]:
    """(architecture, family, role) from ``architectures`` (``speculators_model_type`` first)."""
    archs = cfg.get("architectures")
    if "speculators_model_type" in cfg:
        smt = cfg["speculators_model_type"]
        if smt != "eagle3":
            raise FormatError(f"{cfg_file}: field 'speculators_model_type' is {smt!r}; eagle3 reads 'eagle3'")
        arch = archs[0] if isinstance(archs, list) and archs else "Eagle3Speculator"
        return str(arch), SPECULATORS, "draft"
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise FormatError(f"{cfg_file}: field 'architectures' is missing or not a list of names "
                          f"(got {archs!r})")
    for a in archs:
        if a in DRAFT_ARCHITECTURES:
            return a, DRAFT_ARCHITECTURES[a], "draft"
        if a in TARGET_ARCHITECTURES:
            return a, TARGET_ARCHITECTURES[a], "target"
    known = sorted(TARGET_ARCHITECTURES) + sorted(DRAFT_ARCHITECTURES)
    raise FormatError(f"{cfg_file}: field 'architectures' is {archs}, not an architecture eagle3 knows "
                      f"(targets and EAGLE-3 drafts: {', '.join(known)})")


def _int(d: dict[str, Any], key: str, cfg_file: Path, prefix: str, required: bool = False) -> int | None:
    v = d.get(key)
    if v is None:
        if required:
            raise FormatError(f"{cfg_file}: field '{prefix}{key}' is missing")
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise FormatError(f"{cfg_file}: field '{prefix}{key}' is {v!r}, expected a non-negative integer")
    return v


def _flag(d: dict[str, Any], key: str, cfg_file: Path, prefix: str = "") -> bool | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise FormatError(f"{cfg_file}: field '{prefix}{key}' is {v!r}, expected true or false")
    return v


def _rope_type(tc: dict[str, Any]) -> str:
    for k in ("rope_scaling", "rope_parameters"):
        r = tc.get(k)
        if isinstance(r, dict):
            t = r.get("rope_type") or r.get("type")
            if t:
                return str(t)
    return "default"


def _dims(tc: dict[str, Any], prefix: str, cfg_file: Path, infos: dict[str, TensorInfo], role: Role) -> ModelDims:
    kv_lora = _int(tc, "kv_lora_rank", cfg_file, prefix)
    mla_tensors = any(keys.MLA_MARKER in n for n in infos)
    # kv_lora_rank signals MLA in a config (ATOM docs); the tensors decide when the config is silent.
    attention = "mla" if (kv_lora is not None or mla_tensors) else "mha"
    theta = tc.get("rope_theta")
    if theta is None and isinstance(tc.get("rope_parameters"), dict):
        theta = tc["rope_parameters"].get("rope_theta")
    eps = tc.get("rms_norm_eps")
    return ModelDims(
        hidden_size=_int(tc, "hidden_size", cfg_file, prefix, required=True) or 0,
        num_layers=_int(tc, "num_hidden_layers", cfg_file, prefix, required=role == "target") or 1,
        vocab_size=_int(tc, "vocab_size", cfg_file, prefix),
        num_attention_heads=_int(tc, "num_attention_heads", cfg_file, prefix),
        num_key_value_heads=_int(tc, "num_key_value_heads", cfg_file, prefix),
        head_dim=_int(tc, "head_dim", cfg_file, prefix),
        intermediate_size=_int(tc, "intermediate_size", cfg_file, prefix),
        attention=attention,
        q_lora_rank=_int(tc, "q_lora_rank", cfg_file, prefix),
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=_int(tc, "qk_nope_head_dim", cfg_file, prefix),
        qk_rope_head_dim=_int(tc, "qk_rope_head_dim", cfg_file, prefix),
        v_head_dim=_int(tc, "v_head_dim", cfg_file, prefix),
        rms_norm_eps=float(eps) if isinstance(eps, (int, float)) else None,
        rope_theta=float(theta) if isinstance(theta, (int, float)) else None,
        rope_type=_rope_type(tc),
        max_position_embeddings=_int(tc, "max_position_embeddings", cfg_file, prefix),
    )


def _tensor_stats(reader: CheckpointReader, indexed: bool) -> TensorStats:
    dtypes: Counter[str] = Counter()
    dbytes: Counter[str] = Counter()
    for i in reader.infos():
        dtypes[i.dtype] += 1
        dbytes[i.dtype] += i.nbytes
    shards = [ShardStats(f.name, len(names), sum(reader.info(n).nbytes for n in names))
              for f, names in reader.shards().items()]
    return TensorStats(
        count=len(reader),
        total_bytes=reader.total_bytes,
        dtypes=dict(sorted(dtypes.items())),
        dtype_bytes=dict(sorted(dbytes.items())),
        shards=shards,
        indexed=indexed,
    )


# -- quantization -------------------------------------------------------------------------------


def _spec_text(spec: dict[str, Any]) -> str:
    """Short text of one Quark QTensorConfig: "int4 per_channel sym", "fp4 per_group g32 e8m0"."""
    parts = [str(spec.get("dtype")), str(spec.get("qscheme"))]
    if spec.get("group_size"):
        parts.append(f"g{spec['group_size']}")
    if spec.get("scale_format"):
        parts.append(str(spec["scale_format"]))
    if spec.get("symmetric") is True:
        parts.append("sym")
    return " ".join(parts)


def _quark_scheme(weight: Any, cfg_file: Path, where: str) -> str:
    if isinstance(weight, list):
        dts = [str(s.get("dtype")) if isinstance(s, dict) else None for s in weight]
        if len(dts) == 2 and dts[0] and dts[0].startswith("fp8_e4m3") and dts[1] == "int4":
            return QUARK_W4A8
        raise FormatError(f"{cfg_file}: field '{where}' is a {len(weight)}-stage weight spec {dts}; "
                          f"eagle3 reads the two-stage [fp8_e4m3, int4] (W4A8) only")
    if not isinstance(weight, dict):
        raise FormatError(f"{cfg_file}: field '{where}' is {weight!r}, expected a Quark QTensorConfig object")
    dt = str(weight.get("dtype"))
    if dt in ("int4", "uint4"):
        return QUARK_INT4
    if dt == "fp4":
        return QUARK_MXFP4
    if dt.startswith("fp8_e4m3"):
        return QUARK_FP8
    raise FormatError(f"{cfg_file}: field '{where}.dtype' is {dt!r}; eagle3 reads Quark int4, fp4 (MXFP4), "
                      f"fp8_e4m3 and the [fp8_e4m3, int4] W4A8 weight")


def _config_schemes(qc: dict[str, Any], cfg_file: Path, qfield: str) -> dict[str, Any]:
    """Parse a quantization_config into the QuantInfo fields that come from the config."""
    method = qc.get("quant_method")
    out: dict[str, Any] = {"method": method, "activations": None, "group_size": None, "pack_method": None,
                           "exclude": None}
    if method == "compressed-tensors":
        fmt = qc.get("format")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise FormatError(f"{cfg_file}: field '{qfield}.config_groups' is missing or empty")
        schemes: list[str] = []
        for gname, g in groups.items():
            w = g.get("weights") if isinstance(g, dict) else None
            if not isinstance(w, dict):
                raise FormatError(f"{cfg_file}: field '{qfield}.config_groups.{gname}.weights' is missing")
            bits, typ = w.get("num_bits"), w.get("type")
            if bits == 4 and typ == "int" and fmt == "pack-quantized":
                s = CT_INT4
                out["weights"] = (f"int4 {w.get('strategy')} g{w.get('group_size')} "
                                  f"{'sym' if w.get('symmetric', True) else 'asym'}")
                out["group_size"] = w.get("group_size")
            elif bits == 8 and typ == "float":
                s = CT_FP8
                out["weights"] = f"fp8_e4m3 {w.get('strategy')}"
            else:
                raise FormatError(f"{cfg_file}: field '{qfield}.config_groups.{gname}.weights' is {bits}-bit "
                                  f"{typ} ({fmt}); eagle3 reads pack-quantized int4 and float-quantized fp8")
            acts = g.get("input_activations")
            if isinstance(acts, dict):
                out["activations"] = (f"{acts.get('type')}{acts.get('num_bits')} {acts.get('strategy')} "
                                      f"{'dynamic' if acts.get('dynamic') else 'static'}")
            if s not in schemes:
                schemes.append(s)
        out["schemes"] = schemes
        out["exclude"] = len(qc.get("ignore") or [])
    elif method == "fp8":
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2):
            raise FormatError(f"{cfg_file}: field '{qfield}.weight_block_size' is {block!r}, "
                              f"expected [128, 128] for a DeepSeek-style FP8 checkpoint")
        out["schemes"] = [FP8_BLOCK]
        out["weights"] = f"fp8_e4m3 block {block[0]}x{block[1]}"
        out["activations"] = f"fp8_e4m3 {qc.get('activation_scheme', 'dynamic')}"
        out["exclude"] = len(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or [])
    elif method == "quark":
        g = qc.get("global_quant_config")
        if not isinstance(g, dict):
            raise FormatError(f"{cfg_file}: field '{qfield}.global_quant_config' is missing")
        specs: list[tuple[str, dict[str, Any]]] = []
        if g.get("weight") is not None:
            specs.append((f"{qfield}.global_quant_config.weight", g))
        for k in ("layer_quant_config", "layer_type_quant_config"):
            sub = qc.get(k) or {}
            if not isinstance(sub, dict):
                raise FormatError(f"{cfg_file}: field '{qfield}.{k}' is {type(sub).__name__}, expected an object")
            for pat, lc in sub.items():
                if isinstance(lc, dict) and lc.get("weight") is not None:
                    specs.append((f"{qfield}.{k}.{pat}.weight", lc))
        if not specs:
            raise FormatError(f"{cfg_file}: field '{qfield}.global_quant_config.weight' is null and no layer "
                              f"config quantizes weights")
        schemes = []
        for where, lc in specs:
            s = _quark_scheme(lc["weight"], cfg_file, where)
            if s not in schemes:
                schemes.append(s)
        first = specs[0][1]
        w = first["weight"]
        out["weights"] = " -> ".join(_spec_text(x) for x in w) if isinstance(w, list) else _spec_text(w)
        stages = w if isinstance(w, list) else [w]
        out["group_size"] = next((s.get("group_size") for s in stages if s.get("group_size")), None)
        a = first.get("input_tensors")
        if isinstance(a, dict):
            out["activations"] = f"{_spec_text(a)} {'dynamic' if a.get('is_dynamic') else 'static'}"
        exp = qc.get("export")
        out["pack_method"] = exp.get("pack_method") if isinstance(exp, dict) else None
        out["exclude"] = len(qc.get("exclude") or [])
        out["schemes"] = schemes
    else:
        raise FormatError(f"{cfg_file}: field '{qfield}.quant_method' is {method!r}; eagle3 reads "
                          f"compressed-tensors, fp8 and quark")
    return out


def _module_layout(mod: str, params: dict[str, TensorInfo]) -> str | None:
    """Tensor layout of one module: a key of _LAYOUT_SCHEMES, "dense:<dtype>" for an
    unquantized Linear-like weight, or None for what is not a Linear (norms, embeddings, biases)."""
    if keys.CT_PACKED in params:
        w = params[keys.CT_PACKED]
        if w.dtype != "I32":
            raise FormatError(f"{w.file}: tensor {w.name!r} is {w.dtype}; compressed-tensors packs INT4 into I32")
        if keys.SCALE not in params:
            raise FormatError(f"{w.file}: tensor {w.name!r} has no {mod}.{keys.SCALE} beside it")
        return "int4_ct"
    w = params.get(keys.WEIGHT)
    if w is None:
        return None
    scale = params.get(keys.SCALE)
    if w.dtype in ("I32", "U32"):
        if scale is None:
            raise FormatError(f"{w.file}: tensor {w.name!r} is packed INT4 ({w.dtype}) but has no "
                              f"{mod}.{keys.SCALE} beside it")
        return "int4_2stage" if keys.SCALE_2 in params else "int4"
    if w.dtype == "U8":
        if scale is None or scale.dtype != "U8":
            got = "no weight_scale" if scale is None else f"weight_scale {scale.dtype}"
            raise FormatError(f"{w.file}: tensor {w.name!r} is uint8 (packed FP4) but has {got}; "
                              f"MXFP4 needs a uint8 E8M0 weight_scale")
        return "fp4"
    if w.dtype in _FP8_TAGS:
        if keys.SCALE_INV in params:
            return "fp8_block"
        if scale is not None:
            return "fp8"
        raise FormatError(f"{w.file}: tensor {w.name!r} is {w.dtype} but has neither {keys.SCALE_INV} "
                          f"nor {keys.SCALE} beside it")
    if w.dtype in _FLOAT_NAMES:
        # Embeddings and convolutions (vision patch_embed) are not Linears; 1-D weights are norms.
        if len(w.shape) != 2 or "embed" in mod:
            return None
        return "dense:" + _FLOAT_NAMES[w.dtype]
    if w.dtype in ("I8", "U16", "I16"):
        raise FormatError(f"{w.file}: tensor {w.name!r} is {w.dtype}, a quantized weight layout eagle3 "
                          f"does not read")
    return None


def _detect_quant(cfg: dict[str, Any], cfg_file: Path, infos: dict[str, TensorInfo],
                  warnings: list[str]) -> QuantInfo:
    qc, where = quantization_config(cfg)
    qfield = "quantization_config" if where != "text_config" else "text_config.quantization_config"
    parsed = _config_schemes(qc, cfg_file, qfield) if qc is not None else None
    tc = cfg.get("text_config")
    if where == "top-level" and isinstance(tc, dict) and isinstance(tc.get("quantization_config"), dict):
        if tc["quantization_config"] != qc:
            warnings.append("text_config.quantization_config differs from the top-level one (ATOM copies the "
                            "nested one up; remove it, as Quark's export does)")

    modules: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
    for name, info in infos.items():
        mod, param = keys.split_param(name)
        if param in keys.QUANT_PARAMS:
            modules[mod][param] = info
    allowed = set(parsed["schemes"]) if parsed else set()
    counts: Counter[str] = Counter()
    for mod, params in modules.items():
        layout = _module_layout(mod, params)
        if layout is None:
            continue
        if layout.startswith("dense:"):
            counts[layout[len("dense:"):]] += 1
            continue
        fits = _LAYOUT_SCHEMES[layout] & allowed
        t = params.get(keys.CT_PACKED) or params[keys.WEIGHT]
        if not parsed:
            raise FormatError(f"{t.file}: tensor {t.name!r} is {_LAYOUT_TEXT[layout]} but {cfg_file} has no "
                              f"quantization_config")
        if not fits:
            raise FormatError(f"{cfg_file}: field '{qfield}' declares {', '.join(parsed['schemes'])} but tensor "
                              f"{t.name!r} in {t.file.name} is {_LAYOUT_TEXT[layout]}")
        # A layout that two declared schemes share (fp8) is counted under the first declared one.
        counts[next(s for s in parsed["schemes"] if s in fits)] += 1

    dense = {k: v for k, v in counts.items() if k not in QUANT_SCHEMES}
    if parsed:
        scheme = parsed["schemes"][0]
        if not any(counts.get(s) for s in parsed["schemes"]):
            warnings.append(f"{qfield} declares {scheme} but no tensor is quantized (everything excluded?)")
    elif dense:
        scheme = max(dense.items(), key=lambda kv: kv[1])[0]
    else:
        floats = Counter({_FLOAT_NAMES[i.dtype]: i.nbytes for i in infos.values() if i.dtype in _FLOAT_NAMES})
        scheme = floats.most_common(1)[0][0] if floats else "unknown"
    ordered = {s: counts[s] for s in QUANT_SCHEMES if counts.get(s)}
    ordered.update(sorted(dense.items()))
    return QuantInfo(
        scheme=scheme,
        method=parsed["method"] if parsed else None,
        config_location=where,
        schemes=list(parsed["schemes"]) if parsed else [],
        weights=parsed.get("weights") if parsed else None,
        activations=parsed["activations"] if parsed else None,
        group_size=parsed["group_size"] if parsed else None,
        pack_method=parsed["pack_method"] if parsed else None,
        exclude=parsed["exclude"] if parsed else None,
        modules=ordered,
    )


# -- target -------------------------------------------------------------------------------------


def _target_info(family: str, tc: dict[str, Any], dims: ModelDims, infos: dict[str, TensorInfo],
                 warnings: list[str]) -> TargetInfo:
    wrapped = sum(1 for n in infos if n.startswith(keys.LM_PREFIX))
    vision = sum(1 for n in infos if n.startswith(keys.VISION_PREFIX))
    proj = sum(1 for n in infos if n.startswith(keys.PROJECTOR_PREFIX))
    prefix = keys.LM_PREFIX if wrapped else ""
    if family == KIMI_K25 and not wrapped:
        warnings.append("a KimiK25ForConditionalGeneration config, but no tensor is named language_model.*")
    if family == DEEPSEEK_V3 and wrapped:
        warnings.append("a text-only DeepseekV3ForCausalLM config, but tensors are named language_model.* "
                        "(a K2.5 wrapper's weights?)")
    _check_target_vocab(prefix, dims, infos)
    layers = {i for n in infos if (i := keys.target_layer_index(n)) is not None}
    mtp = tc.get("num_nextn_predict_layers") or 0
    if layers and len(layers) not in (dims.num_layers, dims.num_layers + mtp):
        warnings.append(f"config says {dims.num_layers} decoder layers but the tensors hold {len(layers)} "
                        f"(indices {min(layers)}..{max(layers)})")
    return TargetInfo(
        text_prefix=prefix,
        has_vision=bool(vision or proj),
        vision_tensors=vision,
        projector_tensors=proj,
        n_routed_experts=tc.get("n_routed_experts"),
        num_experts_per_tok=tc.get("num_experts_per_tok"),
        n_shared_experts=tc.get("n_shared_experts"),
        first_k_dense_replace=tc.get("first_k_dense_replace"),
        moe_intermediate_size=tc.get("moe_intermediate_size"),
        mtp_layers=int(mtp),
        layers_in_files=len(layers),
        default_aux_layer_ids=list(default_aux_layer_ids(dims.num_layers)) if dims.num_layers >= 4 else [],
    )


def _check_target_vocab(prefix: str, dims: ModelDims, infos: dict[str, TensorInfo]) -> None:
    """The embedding (and a dense lm_head) must be [vocab_size, hidden_size] as the config says: a
    model whose config disagrees with its tensors loads nowhere, so every command refuses it."""
    for name in (keys.TARGET_EMBED, keys.TARGET_LM_HEAD):
        info = infos.get(prefix + name)
        if info is None or info.dtype not in ("BF16", "F16", "F32") or len(info.shape) != 2:
            continue  # absent (tied), or a quantized head whose packed shape says nothing here
        rows, cols = info.shape
        if cols != dims.hidden_size or (dims.vocab_size is not None and rows != dims.vocab_size):
            raise ShapeError(f"{info.file}: tensor {info.name!r} has shape {list(info.shape)} but the config says "
                             f"vocab_size {dims.vocab_size} x hidden_size {dims.hidden_size}")


# -- draft --------------------------------------------------------------------------------------


def _aux_ids(cfg: dict[str, Any], cfg_file: Path, warnings: list[str]) -> tuple[list[int] | None, str | None]:
    """Aux ids from the top level (vLLM / speculators) and ``eagle_config`` (SGLang / SpecForge)."""
    found: dict[str, list[int]] = {}
    ec = cfg.get("eagle_config")
    for where, d in (("top-level", cfg), ("eagle_config", ec if isinstance(ec, dict) else {})):
        v = d.get("eagle_aux_hidden_state_layer_ids")
        if v is None:
            continue
        fld = "eagle_aux_hidden_state_layer_ids" if where == "top-level" else \
            "eagle_config.eagle_aux_hidden_state_layer_ids"
        if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v):
            raise FormatError(f"{cfg_file}: field '{fld}' is {v!r}, expected a list of non-negative layer ids")
        found[where] = list(v)
    if not found:
        return None, None
    if len(found) == 2:
        if found["top-level"] != found["eagle_config"]:
            warnings.append(f"aux ids differ: top-level {found['top-level']} (read by vLLM) vs eagle_config "
                            f"{found['eagle_config']} (read by SGLang/ATOM); reporting the top-level ones")
        return found["top-level"], "both"
    (where, ids), = found.items()
    return ids, where


def _draft_info(cfg: dict[str, Any], tc: dict[str, Any], tc_field: str, family: str, dims: ModelDims,
                reader: CheckpointReader, cfg_file: Path, check_vocab_map: bool,
                warnings: list[str]) -> DraftInfo:
    names = reader.names()
    spec = family == SPECULATORS
    prefixes = keys.draft_layer_prefixes(names)
    if len(prefixes) == 2:
        a = next(n for n in names if n.startswith(keys.MIDLAYER))
        b = next(n for n in names if n.startswith(keys.LAYERS0))
        raise FormatError(f"{reader.path}: draft has layer tensors under both 'midlayer.' and 'layers.0.' "
                          f"(e.g. {a!r} and {b!r})")
    if not prefixes:
        raise FormatError(f"{reader.path}: no draft decoder-layer tensors (expected 'midlayer.*' or 'layers.0.*')")
    prefix = prefixes.pop()
    has = set(names)

    # Attention: the tensors decide; a disagreeing family or config is worth a warning.
    mla_t = any(n.startswith(prefix + keys.MLA_MARKER) for n in names)
    mha_t = any(n.startswith(prefix + keys.MHA_MARKER) for n in names)
    attention = "mla" if mla_t else "mha" if mha_t else dims.attention
    if (family == EAGLE3_MLA) != (attention == "mla"):
        warnings.append(f"architecture {cfg.get('architectures')} but the layer tensors are {attention.upper()}")
    if (dims.kv_lora_rank is not None) != (attention == "mla"):
        warnings.append(f"config {'has' if dims.kv_lora_rank is not None else 'lacks'} kv_lora_rank but the "
                        f"layer tensors are {attention.upper()}")

    defaulted: list[str] = []
    if cfg.get("eagle_config") is not None and not isinstance(cfg["eagle_config"], dict):
        raise FormatError(f"{cfg_file}: field 'eagle_config' must be an object, got "
                          f"{type(cfg['eagle_config']).__name__}")
    ec = cfg.get("eagle_config") or {}

    def flag(name: str, default: bool, *dicts: tuple[dict[str, Any], str]) -> bool:
        for d, pre in dicts:
            v = _flag(d, name, cfg_file, pre)
            if v is not None:
                return v
        defaulted.append(name)
        return default

    fc_norm = flag("fc_norm", False, (cfg, ""))
    if "fc_norm" in defaulted and cfg.get("use_aux_norm") is True:  # SGLang's legacy spelling
        fc_norm = True
        defaulted.remove("fc_norm")
    norm_output = flag("norm_output", False, (cfg, ""))
    norm_before_fc = flag("norm_before_fc", False, (ec, "eagle_config."), (cfg, ""))
    # vLLM's update_eagle3 defaults norm_before_residual to True for speculators configs only.
    norm_before_residual = flag("norm_before_residual", spec, (cfg, ""))

    fc_norm_idx = sorted({i for n in names if (i := keys.fc_norm_index(n)) is not None})
    input_norm = keys.DRAFT_INPUT_NORM in has
    eagle_version = "3.1" if (fc_norm or norm_output or fc_norm_idx) else "3"

    # Widths: fc is [H, n_aux * H_t].
    hidden = dims.hidden_size
    top_th = _int(cfg, "target_hidden_size", cfg_file, "")
    target_hidden = top_th or hidden
    if top_th is None:
        defaulted.append("target_hidden_size")
    fc = reader.info(keys.DRAFT_FC) if keys.DRAFT_FC in has else None
    fc_in = fc.shape[1] if fc is not None and len(fc.shape) == 2 and fc.dtype in _FLOAT_NAMES else None
    if fc is not None and len(fc.shape) == 2 and fc.shape[0] != hidden and fc.dtype in _FLOAT_NAMES:
        warnings.append(f"fc.weight has {fc.shape[0]} rows but hidden_size is {hidden}")

    ids, source = _aux_ids(cfg, cfg_file, warnings)
    use_aux = _flag(ec, "use_aux_hidden_state", cfg_file, "eagle_config.")
    if cfg.get("eagle_config") is not None and use_aux is None:
        warnings.append("eagle_config has no use_aux_hidden_state: ATOM then turns aux hidden states off "
                        "(convert writes it explicitly)")
    use_aux = True if use_aux is None else use_aux
    n_aux = _int(cfg, "num_aux_hidden_states", cfg_file, "")
    if n_aux is None:
        if ids:
            n_aux = len(ids)
        elif fc_in is not None and target_hidden and fc_in % target_hidden == 0:
            n_aux = fc_in // target_hidden
        else:
            n_aux = 3
    if ids and len(ids) != n_aux:
        warnings.append(f"{len(ids)} aux layer ids but num_aux_hidden_states is {n_aux}")
    if fc_in is not None and fc_in != n_aux * target_hidden:
        warnings.append(f"fc.weight takes {fc_in} inputs but {n_aux} aux states of width {target_hidden} "
                        f"need {n_aux * target_hidden}")
    if use_aux and fc is None:
        warnings.append("no fc.weight although aux hidden states are in use")
    conv, rule = aux_convention(ids, spec)
    marked = (cfg.get("eagle3_canonical") or {}).get("aux_layer_ids_convention") if isinstance(
        cfg.get("eagle3_canonical"), dict) else None
    if ids and marked in ("input", "output"):  # written by `eagle3 convert --engine eagle3`: no guessing
        conv, rule = marked, f"eagle3_canonical.aux_layer_ids_convention says {marked!r}"
    aux = AuxLayers(count=n_aux, ids=ids, convention=conv, input_ids=to_input_convention(ids, conv) if ids else None,
                    source=source, rule=rule, use_aux_hidden_state=use_aux)

    # EAGLE-3.1 norms: flags and tensors must agree (engines build fc_norm only from the flag).
    if fc_norm and not fc_norm_idx:
        warnings.append("config sets fc_norm but there are no fc_norm.{i}.weight tensors")
    if fc_norm_idx and not fc_norm:
        warnings.append(f"{len(fc_norm_idx)} fc_norm tensors but the config does not set fc_norm: engines "
                        f"would ignore them")
    if fc_norm_idx and fc_norm_idx != list(range(n_aux)):
        warnings.append(f"fc_norm tensors for slots {fc_norm_idx} but there are {n_aux} aux states")
    if norm_before_fc != input_norm:
        warnings.append(f"norm_before_fc is {str(norm_before_fc).lower()} but input_norm.weight is "
                        f"{'present' if input_norm else 'absent'}")
    if fc_norm and norm_before_fc:
        warnings.append("both fc_norm and norm_before_fc are set (mutually exclusive in speculators)")

    # Vocabulary: lm_head rows are what the head predicts; d2t maps them into the target vocab.
    lm_head = next((reader.info(n) for n in (keys.DRAFT_LM_HEAD, "lm_head.weight_packed") if n in has), None)
    vocab = dims.vocab_size
    cfg_dv = _int(cfg, "draft_vocab_size", cfg_file, "")
    draft_vocab = lm_head.shape[0] if lm_head is not None else cfg_dv
    if lm_head is None:
        warnings.append("no lm_head.weight: the draft would need the target's lm_head")
    if cfg_dv is None:
        warnings.append("config has no draft_vocab_size: SGLang then replaces the draft's lm_head with the "
                        "target's (convert writes it explicitly)")
    elif lm_head is not None and cfg_dv != lm_head.shape[0]:
        warnings.append(f"draft_vocab_size is {cfg_dv} but lm_head has {lm_head.shape[0]} rows")
    vmap = _vocab_map(reader, draft_vocab, vocab, check_vocab_map, warnings)
    if draft_vocab is not None and vocab is not None and draft_vocab != vocab and keys.D2T not in has:
        warnings.append(f"draft vocab {draft_vocab} < target vocab {vocab} but no d2t: draft ids cannot be "
                        f"mapped to target ids")

    speculators = None
    if spec:
        sc = cfg.get("speculators_config") if isinstance(cfg.get("speculators_config"), dict) else {}
        ver = sc.get("verifier") if isinstance(sc.get("verifier"), dict) else {}
        pms = sc.get("proposal_methods") if isinstance(sc.get("proposal_methods"), list) else []
        pm = pms[0] if pms and isinstance(pms[0], dict) else {}
        speculators = {
            "version": cfg.get("speculators_version"),
            "algorithm": sc.get("algorithm"),
            "verifier": ver.get("name_or_path"),
            "verifier_architectures": ver.get("architectures"),
            "speculative_tokens": pm.get("speculative_tokens"),
        }
        if not ver.get("name_or_path"):
            warnings.append("speculators_config.verifier.name_or_path is missing (vLLM requires it)")

    return DraftInfo(
        eagle_version=eagle_version,
        layer_prefix=prefix.rstrip("."),
        attention=attention,
        num_layers=dims.num_layers,
        fc_norm=fc_norm,
        fc_norm_tensors=len(fc_norm_idx),
        norm_output=norm_output,
        norm_before_fc=norm_before_fc,
        input_norm_tensor=input_norm,
        norm_before_residual=norm_before_residual,
        defaulted=defaulted,
        aux_layers=aux,
        hidden_size=hidden,
        target_hidden_size=target_hidden,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        config_draft_vocab_size=cfg_dv,
        d2t=keys.D2T in has,
        t2d=keys.T2D in has,
        vocab_map=vmap,
        own_embedding=keys.DRAFT_EMBED in has,
        own_lm_head=lm_head is not None,
        speculators=speculators,
    )


_MAX_VOCAB_MAP_BYTES = 64 * 1024 * 1024  # a real d2t is V_d * 8 bytes (~256 KB); refuse anything absurd


def _vocab_map(reader: CheckpointReader, draft_vocab: int | None, vocab: int | None, read_values: bool,
               warnings: list[str]) -> VocabMapCheck:
    d2t = reader.info(keys.D2T) if keys.D2T in reader else None
    t2d = reader.info(keys.T2D) if keys.T2D in reader else None
    d2t_len = d2t.shape[0] if d2t is not None and len(d2t.shape) == 1 else None
    t2d_len = t2d.shape[0] if t2d is not None and len(t2d.shape) == 1 else None
    if d2t is not None and (d2t_len is None or d2t.dtype != "I64"):
        warnings.append(f"d2t is {d2t.dtype}{list(d2t.shape)}, expected a 1-D int64 offset vector")
    if t2d is not None and vocab is not None and t2d_len != vocab:
        warnings.append(f"t2d has shape {list(t2d.shape)} but the target vocab is {vocab}")
    length_ok = None if d2t_len is None or draft_vocab is None else d2t_len == draft_vocab
    if length_ok is False:
        warnings.append(f"d2t has {d2t_len} entries but the draft vocab (lm_head rows) is {draft_vocab}")
    in_range = increasing = t2d_ok = None
    checked = False
    small = d2t is not None and d2t.nbytes <= _MAX_VOCAB_MAP_BYTES and (t2d is None or t2d.nbytes <= _MAX_VOCAB_MAP_BYTES)
    if read_values and d2t_len is not None and d2t.dtype == "I64" and small:
        import torch

        checked = True
        targets = reader.get(keys.D2T) + torch.arange(d2t_len, dtype=torch.int64)
        if vocab is not None and d2t_len:
            in_range = bool(targets.min() >= 0) and bool(targets.max() < vocab)
            if not in_range:
                warnings.append(f"d2t maps draft ids to target ids {int(targets.min())}..{int(targets.max())}, "
                                f"outside the target vocab [0, {vocab})")
        increasing = bool((targets[1:] > targets[:-1]).all()) if d2t_len > 1 else True
        if not increasing:
            warnings.append("d2t targets are not strictly increasing (d2t must be the offsets of a sorted "
                            "used-token list)")
        if t2d is not None and t2d_len == vocab and t2d.dtype == "BOOL" and in_range:
            mask = reader.get(keys.T2D)
            t2d_ok = bool(mask[targets].all()) and int(mask.sum()) == d2t_len
            if not t2d_ok:
                warnings.append("t2d does not mark exactly the d2t target ids (absolute ids stored as d2t?)")
    return VocabMapCheck(d2t_length=d2t_len, t2d_length=t2d_len, values_checked=checked, d2t_length_ok=length_ok,
                         d2t_in_range=in_range, d2t_increasing=increasing, t2d_consistent=t2d_ok)


# ---------------------------------------------------------------------------------------------
# Human-readable output
# ---------------------------------------------------------------------------------------------


def summary_rows(s: CheckpointSummary) -> list[tuple[str, str, str]]:
    """(section, key, value) rows of the human-readable summary (also handy in logs)."""
    rows: list[tuple[str, str, str]] = []

    def add(sec: str, k: str, v: Any) -> None:
        rows.append((sec, k, "-" if v is None else str(v)))

    add("model", "path", s.path)
    add("model", "role", s.role)
    add("model", "family", s.family)
    add("model", "architecture", s.architecture)
    mt = s.model_type if s.text_model_type is None else f"{s.model_type} (text: {s.text_model_type})"
    add("model", "model_type", mt)
    d = s.dims
    add("model", "dims", f"hidden {d.hidden_size}, layers {d.num_layers}, vocab {d.vocab_size}, "
                         f"heads {d.num_attention_heads}/{d.num_key_value_heads}, attention {d.attention}")
    if d.attention == "mla":
        add("model", "mla", f"q_lora {d.q_lora_rank}, kv_lora {d.kv_lora_rank}, nope/rope/v "
                            f"{d.qk_nope_head_dim}/{d.qk_rope_head_dim}/{d.v_head_dim}")
    add("model", "rope", f"{d.rope_type}, theta {d.rope_theta}, max_pos {d.max_position_embeddings}")
    q = s.quant
    add("quant", "scheme", q.scheme if not q.method else f"{q.scheme} ({q.method}, config {q.config_location})")
    if q.method:
        add("quant", "weights", q.weights)
        add("quant", "activations", q.activations or "not quantized (weight-only)")
        if q.pack_method:
            add("quant", "pack_method", q.pack_method)
        add("quant", "exclude entries", q.exclude)
    add("quant", "modules", ", ".join(f"{k} {v}" for k, v in q.modules.items()) or "none")
    if s.target:
        t = s.target
        add("target", "text prefix", repr(t.text_prefix))
        add("target", "vision", f"{t.vision_tensors} vision + {t.projector_tensors} projector tensors"
            if t.has_vision else "none")
        add("target", "experts", f"{t.n_routed_experts} routed (top {t.num_experts_per_tok}), "
                                 f"{t.n_shared_experts} shared, first {t.first_k_dense_replace} dense")
        add("target", "layers in files", t.layers_in_files)
        add("target", "default aux ids", t.default_aux_layer_ids)
    if s.draft:
        r = s.draft
        a = r.aux_layers
        add("draft", "eagle version", r.eagle_version)
        add("draft", "layer prefix", r.layer_prefix)
        add("draft", "attention", r.attention)
        add("draft", "flags", f"fc_norm {r.fc_norm} ({r.fc_norm_tensors} tensors), norm_output {r.norm_output}, "
                              f"norm_before_fc {r.norm_before_fc}, norm_before_residual {r.norm_before_residual}")
        if r.defaulted:
            add("draft", "defaulted", ", ".join(r.defaulted))
        ids = "engine default" if a.ids is None else f"{a.ids} ({a.convention}; input form {a.input_ids})"
        add("draft", "aux layers", f"{a.count}: {ids}")
        add("draft", "aux rule", a.rule)
        add("draft", "hidden", f"{r.hidden_size} (target hidden {r.target_hidden_size})")
        add("draft", "vocab", f"draft {r.draft_vocab_size} -> target {r.vocab_size} "
                              f"(config draft_vocab_size {r.config_draft_vocab_size})")
        vm = r.vocab_map
        add("draft", "d2t / t2d", f"{'yes' if r.d2t else 'no'} / {'yes' if r.t2d else 'no'}"
            + (f" (in range {vm.d2t_in_range}, length ok {vm.d2t_length_ok})" if r.d2t else ""))
        add("draft", "own embedding", r.own_embedding)
        if r.speculators:
            add("draft", "speculators", ", ".join(f"{k} {v}" for k, v in r.speculators.items()))
    ts = s.tensors
    add("tensors", "count", ts.count)
    add("tensors", "total", human_bytes(ts.total_bytes))
    add("tensors", "dtypes", ", ".join(f"{k} {v}" for k, v in ts.dtypes.items()))
    add("tensors", "shards", f"{len(ts.shards)}{' (indexed)' if ts.indexed else ''}")
    for w in s.warnings:
        add("warnings", "!", w)
    return rows


def print_summary(s: CheckpointSummary) -> None:
    """Print the summary as a rich table (``eagle3 inspect`` without ``--json``)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{s.family} {s.role}", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold cyan")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    last = None
    for sec, k, v in summary_rows(s):
        style = "yellow" if sec == "warnings" else None
        table.add_row(sec if sec != last else "", k, v, style=style)
        last = sec
    Console().print(table)
