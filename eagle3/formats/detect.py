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
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.checkpoint import CheckpointReader, TensorInfo, read_json
from eagle3.checkpoint.files import INDEX_FILE
from eagle3.errors import CheckpointError, FormatError, ShapeError
from eagle3.formats import keys
from eagle3.formats.quant_detect import (  # noqa: F401 (re-exported: detect is the public entry)
    _FLOAT_NAMES,
    CT_FP8,
    CT_INT4,
    FP8_BLOCK,
    QUANT_SCHEMES,
    QUARK_FP8,
    QUARK_INT4,
    QUARK_MXFP4,
    QUARK_W4A8,
    _detect_quant,
    quantization_config,
)
from eagle3.formats.summary import (  # noqa: F401 (re-exported)
    SCHEMA_VERSION,
    AuxLayers,
    CheckpointSummary,
    Convention,
    DraftInfo,
    ModelDims,
    QuantInfo,
    Role,
    ShardStats,
    TargetInfo,
    TensorStats,
    VocabMapCheck,
    print_summary,
    summary_rows,
)

CONFIG_FILE = "config.json"


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
# Config helpers
# ---------------------------------------------------------------------------------------------


def checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """The directory of a checkpoint given as a directory or as one of its ``.safetensors`` files."""
    p = Path(path)
    return p if p.is_dir() else p.parent


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory (or of the directory holding a ``.safetensors`` file),
    or a ``.json`` config file given itself."""
    p = Path(path)
    f = p if p.suffix == ".json" and not p.is_dir() else checkpoint_dir(p) / CONFIG_FILE
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


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The engines' default aux layers for a target of ``num_layers`` decoder layers, in the
    "input" convention (vLLM/ATOM/SGLang/SafeAILab): (2, N//2, N-3); (2, 30, 58) for Kimi's 61."""
    if num_layers < 4:
        raise ValueError(f"a target needs at least 4 layers for the default aux ids, got {num_layers}")
    return (2, num_layers // 2, num_layers - 3)


def new_draft_aux_layer_ids(num_layers: int) -> tuple[tuple[int, int, int], str]:
    """Aux layers for a new draft of a target of ``num_layers`` decoder layers ("input" convention),
    and the rule that chose them. Always three distinct ascending ids: SpecForge and SafeAILab
    drafts take exactly three aux states, and every engine's capture reaches them.

    * 7 layers and more: the engines' default (2, N//2, N-3) (:func:`default_aux_layer_ids`);
    * 4 to 6 layers, where that default repeats ids or runs backwards ((2, 2, 1) for 4 layers):
      (1, N//2, N-1), the second, middle and last layers' inputs ((1, 2, 3) for 4 layers, the ids of
      the trained tiny target's shipped drafts);
    * 2 and 3 layers: (0, 1, 2), the embeddings and the next two layer boundaries (for 2 layers id 2
      is the last layer's output, before the final norm);
    * 1 layer: a ValueError (no three distinct states to take).
    """
    if num_layers >= 7:
        return default_aux_layer_ids(num_layers), f"(2, N//2, N-3), the engines' default, for {num_layers} layers"
    if num_layers >= 4:
        return ((1, num_layers // 2, num_layers - 1),
                f"(1, N//2, N-1) for {num_layers} layers: the engines' (2, N//2, N-3) would be "
                f"{list(default_aux_layer_ids(num_layers))}, not three ascending ids")
    if num_layers >= 2:
        return (0, 1, 2), f"(0, 1, 2) for {num_layers} layers: too few for (2, N//2, N-3)"
    raise ValueError(f"a draft takes three distinct aux states; a {num_layers}-layer target has only "
                     f"{num_layers + 1} (input-to-layer ids 0..{num_layers})")


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


def _draft_prefix(reader: CheckpointReader, names: list[str]) -> str:
    """The decoder layer's prefix: ``midlayer.`` or ``layers.0.``, never both."""
    prefixes = keys.draft_layer_prefixes(names)
    if len(prefixes) == 2:
        a = next(n for n in names if n.startswith(keys.MIDLAYER))
        b = next(n for n in names if n.startswith(keys.LAYERS0))
        raise FormatError(f"{reader.path}: draft has layer tensors under both 'midlayer.' and 'layers.0.' "
                          f"(e.g. {a!r} and {b!r})")
    if not prefixes:
        raise FormatError(f"{reader.path}: no draft decoder-layer tensors (expected 'midlayer.*' or 'layers.0.*')")
    return prefixes.pop()


def _draft_attention(cfg: dict[str, Any], family: str, dims: ModelDims, prefix: str, names: list[str],
                     warnings: list[str]) -> str:
    """MLA or MHA: the tensors decide; a disagreeing family or config is worth a warning."""
    mla_t = any(n.startswith(prefix + keys.MLA_MARKER) for n in names)
    mha_t = any(n.startswith(prefix + keys.MHA_MARKER) for n in names)
    attention = "mla" if mla_t else "mha" if mha_t else dims.attention
    if (family == EAGLE3_MLA) != (attention == "mla"):
        warnings.append(f"architecture {cfg.get('architectures')} but the layer tensors are {attention.upper()}")
    if (dims.kv_lora_rank is not None) != (attention == "mla"):
        warnings.append(f"config {'has' if dims.kv_lora_rank is not None else 'lacks'} kv_lora_rank but the "
                        f"layer tensors are {attention.upper()}")
    return attention


@dataclass
class _Flags:
    fc_norm: bool
    norm_output: bool
    norm_before_fc: bool
    norm_before_residual: bool
    defaulted: list[str]


def _draft_flags(cfg: dict[str, Any], cfg_file: Path, spec: bool) -> _Flags:
    """The EAGLE-3.1 flags, and which of them the config leaves to their defaults."""
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
    return _Flags(fc_norm, norm_output, norm_before_fc, norm_before_residual, defaulted)


def _draft_aux(cfg: dict[str, Any], cfg_file: Path, reader: CheckpointReader, hidden: int, target_hidden: int,
               spec: bool, warnings: list[str]) -> AuxLayers:
    """The aux hidden states: ids, count and convention, against fc [H, n_aux * H_t]."""
    has = set(reader.names())
    ec = cfg.get("eagle_config") or {}
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
    return AuxLayers(count=n_aux, ids=ids, convention=conv, input_ids=to_input_convention(ids, conv) if ids else None,
                     source=source, rule=rule, use_aux_hidden_state=use_aux)


def _check_eagle31_norms(f: _Flags, fc_norm_idx: list[int], n_aux: int, input_norm: bool,
                         warnings: list[str]) -> None:
    """EAGLE-3.1 norms: flags and tensors must agree (engines build fc_norm only from the flag)."""
    if f.fc_norm and not fc_norm_idx:
        warnings.append("config sets fc_norm but there are no fc_norm.{i}.weight tensors")
    if fc_norm_idx and not f.fc_norm:
        warnings.append(f"{len(fc_norm_idx)} fc_norm tensors but the config does not set fc_norm: engines "
                        f"would ignore them")
    if fc_norm_idx and fc_norm_idx != list(range(n_aux)):
        warnings.append(f"fc_norm tensors for slots {fc_norm_idx} but there are {n_aux} aux states")
    if f.norm_before_fc != input_norm:
        warnings.append(f"norm_before_fc is {str(f.norm_before_fc).lower()} but input_norm.weight is "
                        f"{'present' if input_norm else 'absent'}")
    if f.fc_norm and f.norm_before_fc:
        warnings.append("both fc_norm and norm_before_fc are set (mutually exclusive in speculators)")


def _draft_vocab(cfg: dict[str, Any], cfg_file: Path, reader: CheckpointReader, vocab: int | None,
                 check_vocab_map: bool, warnings: list[str]) -> tuple[TensorInfo | None, int | None, int | None,
                                                                      VocabMapCheck]:
    """(lm_head, draft vocab, config's draft_vocab_size, d2t/t2d check): lm_head rows are what the
    head predicts; d2t maps them into the target vocab."""
    has = set(reader.names())
    lm_head = next((reader.info(n) for n in (keys.DRAFT_LM_HEAD, "lm_head.weight_packed") if n in has), None)
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
    return lm_head, draft_vocab, cfg_dv, vmap


def _speculators_info(cfg: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    sc = cfg.get("speculators_config") if isinstance(cfg.get("speculators_config"), dict) else {}
    ver = sc.get("verifier") if isinstance(sc.get("verifier"), dict) else {}
    pms = sc.get("proposal_methods") if isinstance(sc.get("proposal_methods"), list) else []
    pm = pms[0] if pms and isinstance(pms[0], dict) else {}
    if not ver.get("name_or_path"):
        warnings.append("speculators_config.verifier.name_or_path is missing (vLLM requires it)")
    return {
        "version": cfg.get("speculators_version"),
        "algorithm": sc.get("algorithm"),
        "verifier": ver.get("name_or_path"),
        "verifier_architectures": ver.get("architectures"),
        "speculative_tokens": pm.get("speculative_tokens"),
    }


def _draft_info(cfg: dict[str, Any], tc: dict[str, Any], tc_field: str, family: str, dims: ModelDims,
                reader: CheckpointReader, cfg_file: Path, check_vocab_map: bool,
                warnings: list[str]) -> DraftInfo:
    names = reader.names()
    spec = family == SPECULATORS
    prefix = _draft_prefix(reader, names)
    has = set(names)
    attention = _draft_attention(cfg, family, dims, prefix, names, warnings)
    flags = _draft_flags(cfg, cfg_file, spec)
    fc_norm_idx = sorted({i for n in names if (i := keys.fc_norm_index(n)) is not None})
    input_norm = keys.DRAFT_INPUT_NORM in has
    eagle_version = "3.1" if (flags.fc_norm or flags.norm_output or fc_norm_idx) else "3"

    hidden = dims.hidden_size
    top_th = _int(cfg, "target_hidden_size", cfg_file, "")
    target_hidden = top_th or hidden
    if top_th is None:
        flags.defaulted.append("target_hidden_size")
    aux = _draft_aux(cfg, cfg_file, reader, hidden, target_hidden, spec, warnings)
    _check_eagle31_norms(flags, fc_norm_idx, aux.count, input_norm, warnings)
    vocab = dims.vocab_size
    lm_head, draft_vocab, cfg_dv, vmap = _draft_vocab(cfg, cfg_file, reader, vocab, check_vocab_map, warnings)
    speculators = _speculators_info(cfg, warnings) if spec else None

    return DraftInfo(
        eagle_version=eagle_version,
        layer_prefix=prefix.rstrip("."),
        attention=attention,
        num_layers=dims.num_layers,
        fc_norm=flags.fc_norm,
        fc_norm_tensors=len(fc_norm_idx),
        norm_output=flags.norm_output,
        norm_before_fc=flags.norm_before_fc,
        input_norm_tensor=input_norm,
        norm_before_residual=flags.norm_before_residual,
        defaulted=flags.defaulted,
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

