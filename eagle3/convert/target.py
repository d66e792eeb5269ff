"""Convert a Kimi-K2.5 / DeepSeek-V3 target: wrapper -> text stack, config hygiene, dense dequant.

* ``text_only``: the Kimi-K2.5 wrapper (``KimiK25ForConditionalGeneration``) becomes the
  DeepSeek-V3 text stack every engine serves as ``DeepseekV3ForCausalLM``: ``vision_tower.*`` and
  ``mm_projector.*`` are dropped, ``language_model.`` is stripped (``model.*``, ``lm_head.weight``),
  ``text_config`` becomes the config, its ``model_type`` stays ``kimi_k2`` unless ``model_type``
  aliases it (``deepseek_v3``: what transformers needs to fuse the experts), and the quantization_config sits at the top level only.
* Without ``text_only`` the wrapper is kept and only config hygiene is applied: the
  quantization_config moves to the top level and the nested copy is removed (ATOM's config class
  copies a nested one up over the top-level one), and
  ``tie_word_embeddings`` is written at both levels (transformers defaults the wrapper's to True).
* ``dequantize``: compressed-tensors INT4 (Moonshot, ``weight_packed``/``weight_scale``/
  ``weight_shape``) and DeepSeek FP8-block (``weight``/``weight_scale_inv``) Linears become dense
  ``weight`` tensors, one module at a time on CPU. ``bf16`` rounds exactly like the libraries'
  dequantizers; ``fp32`` keeps the exact product ``q * s`` (what Quark's file-to-file quantizer
  starts from). The quantization_config is removed afterwards.

Tokenizer, chat template and generation config are carried over; ``*.py`` remote code only with
``trust_remote_code``.
"""

from __future__ import annotations

import copy
import fnmatch
import time
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import (
    DEFAULT_SHARD_BYTES,
    CheckpointReader,
    TensorInfo,
)
from eagle3.convert.common import Item, Report, write_output
from eagle3.errors import FormatError, UsageError
from eagle3.formats import check, codecs, detect, keys

DEQUANT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODEL_TYPES = ("kimi_k2", "deepseek_v3")
TEXT_ARCHITECTURE = "DeepseekV3ForCausalLM"


@dataclass
class TargetOptions:
    engine: str | None = None  # recorded only: every engine loads the same target layout
    text_only: bool = False
    dequantize: str | None = None  # "bf16" | "fp32"
    model_type: str | None = None  # "kimi_k2" | "deepseek_v3"
    drop: list[str] = field(default_factory=list)
    trust_remote_code: bool = False
    overwrite: bool = False
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    progress: bool = True
    allow_nonfinite: bool = False  # write NaN/Inf weights (refused otherwise)


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def _target_config(cfg: dict[str, Any], family: str, opts: TargetOptions, report: Report,
                   remove_quant: bool) -> dict[str, Any]:
    qc, where = detect.quantization_config(cfg)
    wrapper = family == detect.KIMI_K25
    if wrapper and opts.text_only:
        out = copy.deepcopy(cfg["text_config"])
        for k in ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "tie_word_embeddings"):
            if k not in out and k in cfg:
                out[k] = copy.deepcopy(cfg[k])
        out["architectures"] = [TEXT_ARCHITECTURE]
        out.setdefault("tie_word_embeddings", False)
        out.pop("auto_map", None)
        report.config["from"] = "text_config of the Kimi-K2.5 wrapper"
        if "auto_map" in cfg:
            report.config["auto_map"] = "dropped (the remote-code classes describe the wrapper)"
        text = out
    else:
        out = copy.deepcopy(cfg)
        text = out["text_config"] if wrapper else out
        if wrapper:
            tie = out.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            out.setdefault("tie_word_embeddings", tie)
            text.setdefault("tie_word_embeddings", tie)
    if opts.model_type is not None:
        old = text.get("model_type")
        text["model_type"] = opts.model_type
        if old != opts.model_type:
            report.config["model_type"] = f"{old} -> {opts.model_type}"
    # quantization_config: one copy, at the top level (or none after a full dequant).
    for d in (out, out.get("text_config") if isinstance(out.get("text_config"), dict) else {}):
        d.pop("quantization_config", None)
    if qc is not None and not remove_quant:
        out["quantization_config"] = copy.deepcopy(qc)
        if where == "text_config":
            report.config["quantization_config"] = "moved from text_config to the top level"
    elif qc is not None:
        report.config["quantization_config"] = "removed (every quantized tensor was dequantized)"
    return out


# ---------------------------------------------------------------------------------------------
# Dequantization (one module at a time)
# ---------------------------------------------------------------------------------------------


def _ct_int4_check(qc: dict[str, Any], cfg_file: Path) -> None:
    for gname, g in (qc.get("config_groups") or {}).items():
        w = g.get("weights") or {}
        if w.get("symmetric") is False or w.get("actorder") not in (None, False) or w.get("strategy") not in (
                "group", "channel"):
            raise FormatError(f"{cfg_file}: field 'quantization_config.config_groups.{gname}.weights' is "
                              f"{w.get('strategy')} symmetric={w.get('symmetric')} actorder={w.get('actorder')}; "
                              f"--dequantize reads symmetric group/channel INT4 without activation ordering")


def _dequant_ct(reader: CheckpointReader, mod: str, dtype: torch.dtype) -> torch.Tensor:
    packed = reader.get(f"{mod}.{keys.CT_PACKED}")
    scale = reader.get(f"{mod}.{keys.SCALE}")
    if f"{mod}.{keys.CT_SHAPE}" in reader:
        shape: Any = reader.get(f"{mod}.{keys.CT_SHAPE}")
    else:  # weight_shape is optional when K is a multiple of 8
        shape = (packed.shape[0], packed.shape[-1] * 8)
    if scale.dim() == 1:  # per-channel: one scale per row = one group spanning the row
        scale = scale.reshape(-1, 1)
    # bf16: product in the scale's dtype, cast -- compressed-tensors' rounding; fp32: exact q * s.
    return codecs.ct_int4_dequantize(packed, scale, shape, dtype=dtype)


def _dequant_fp8_block(reader: CheckpointReader, mod: str, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return codecs.fp8_block_dequantize(reader.get(f"{mod}.{keys.WEIGHT}"), reader.get(f"{mod}.{keys.SCALE_INV}"),
                                       block, dtype)


def _module_params(infos: list[TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    mods: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
    for i in infos:
        mod, param = keys.split_param(i.name)
        if param in keys.QUANT_PARAMS:
            mods[mod][param] = i
    return mods


# ---------------------------------------------------------------------------------------------
# The converter
# ---------------------------------------------------------------------------------------------


def plan_target(src: Path, opts: TargetOptions, summary: detect.CheckpointSummary | None = None
                ) -> tuple[dict[str, Any], list[Item], Report, CheckpointReader]:
    summary = summary or detect.detect(src, check_vocab_map=False)
    if summary.role != "target" or summary.target is None:
        raise UsageError(f"{src}: is a {summary.family} draft, not a target model")
    if opts.dequantize is not None and opts.dequantize not in DEQUANT_DTYPES:
        raise UsageError(f"--dequantize {opts.dequantize}: expected bf16 or fp32")
    if opts.model_type is not None and opts.model_type not in MODEL_TYPES:
        raise UsageError(f"--model-type {opts.model_type}: expected one of {', '.join(MODEL_TYPES)}")
    cfg = detect.load_config(src)
    reader = CheckpointReader(summary.path)
    report = Report(kind="target", source=str(src), output="", engine=opts.engine)
    report.source_warnings = list(summary.warnings)
    wrapper = summary.family == detect.KIMI_K25
    report.source_format = {"family": summary.family, "architecture": summary.architecture,
                            "text_prefix": summary.target.text_prefix, "quant": summary.quant.scheme}
    if opts.text_only and not wrapper:
        report.warn(f"--text-only: {src} is already a text-only {summary.architecture} checkpoint")

    qc, _ = detect.quantization_config(cfg)
    dq_dtype = DEQUANT_DTYPES[opts.dequantize] if opts.dequantize else None
    method = summary.quant.method
    if dq_dtype is not None:
        if qc is None:
            raise UsageError(f"--dequantize {opts.dequantize}: {src} is not quantized (no quantization_config)")
        schemes = set(summary.quant.schemes)
        if not schemes <= {detect.CT_INT4, detect.FP8_BLOCK}:
            raise FormatError(f"{summary.config_file}: --dequantize reads compressed-tensors INT4 and FP8-block "
                              f"(weight_scale_inv) weights; this checkpoint is {', '.join(sorted(schemes))}")
        if detect.CT_INT4 in schemes:
            _ct_int4_check(qc, summary.config_file)
    block = tuple(qc.get("weight_block_size") or (128, 128)) if qc and method == "fp8" else (128, 128)

    infos = reader.infos()
    mods = _module_params(infos)
    dense_of: dict[str, str] = {}  # quantized module -> "ct" | "fp8"
    if dq_dtype is not None:
        for mod, params in mods.items():
            if keys.CT_PACKED in params:
                extra = set(params) - {keys.CT_PACKED, keys.SCALE, keys.CT_SHAPE}
                if extra:
                    raise FormatError(f"{params[keys.CT_PACKED].file}: module {mod!r} has {sorted(extra)}; "
                                      f"--dequantize reads symmetric INT4 (weight_packed, weight_scale, weight_shape)")
                dense_of[mod] = "ct"
            elif keys.SCALE_INV in params and keys.WEIGHT in params:
                extra = set(params) - {keys.WEIGHT, keys.SCALE_INV}
                if extra:
                    raise FormatError(f"{params[keys.WEIGHT].file}: module {mod!r} has {sorted(extra)} beside its "
                                      f"FP8 weight_scale_inv")
                dense_of[mod] = "fp8"
            elif set(params) - {keys.WEIGHT}:
                p = next(iter(params.values()))
                raise FormatError(f"{p.file}: module {mod!r} has quantization parameters {sorted(params)} that "
                                  f"--dequantize does not read")
        if not dense_of:
            raise UsageError(f"--dequantize {opts.dequantize}: {src} declares {method} but holds no quantized tensor")

    drops = set()
    for pat in opts.drop:
        hit = {i.name for i in infos if fnmatch.fnmatchcase(i.name, pat)}
        if not hit:
            raise UsageError(f"--drop {pat}: matches no tensor of the source")
        drops |= hit

    out_cfg = _target_config(cfg, summary.family, opts, report, remove_quant=dq_dtype is not None)

    def rename(n: str) -> str:
        return keys.strip_lm_prefix(n) if wrapper and opts.text_only else n

    items: list[Item] = []
    done_mods: set[str] = set()
    n_mm = 0
    for f, fnames in sorted(reader.shards().items(), key=lambda kv: kv[0].name):
        for s in fnames:
            ti = reader.info(s)
            report.tensors_in += 1
            report.bytes_in += ti.nbytes
            if s in drops:
                report.drop(s, "--drop")
                continue
            if wrapper and opts.text_only and keys.is_multimodal(s):
                n_mm += 1
                continue
            mod, _param = keys.split_param(s)
            kind = dense_of.get(mod)
            if kind is not None:
                if mod in done_mods:
                    continue
                done_mods.add(mod)
                out = rename(f"{mod}.{keys.WEIGHT}")
                if kind == "ct":
                    numel = mods[mod][keys.CT_PACKED].numel * 8  # K rounded up to 8: progress only
                    make = partial(_dequant_ct, reader, mod, dq_dtype)
                    how = f"compressed-tensors INT4 -> {opts.dequantize}"
                else:
                    numel = mods[mod][keys.WEIGHT].numel
                    make = partial(_dequant_fp8_block, reader, mod, block, dq_dtype)
                    how = f"FP8 block {block[0]}x{block[1]} -> {opts.dequantize}"
                report.transformed.append({"name": out, "how": how})
                items.append(Item(out, str(f), numel * dq_dtype.itemsize, make=make))
                continue
            out = rename(s)
            if out != s:
                report.renames.append({"from": s, "to": out})
            items.append(Item(out, str(f), ti.nbytes, raw=ti))  # bytes unchanged: copied file to file
    if n_mm:
        report.drop("vision_tower.* / mm_projector.*", f"--text-only: {n_mm} vision tower and projector tensors")
    report.output_format = {
        "architecture": out_cfg.get("architectures", [None])[0],
        "model_type": (out_cfg.get("text_config") or out_cfg).get("model_type"),
        "text_prefix": "" if (opts.text_only or not wrapper) else keys.LM_PREFIX,
        "dequantized": opts.dequantize,
    }
    return out_cfg, items, report, reader


def convert_target(src: str | Path, out: str | Path, opts: TargetOptions,
                   summary: detect.CheckpointSummary | None = None) -> Report:
    """Convert the target at ``src`` into ``out``; returns the report (also in ``out/convert_report.json``)."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    out_cfg, items, report, reader = plan_target(src, opts, summary)
    # The model against its schema, after the plan's own (more specific) checks and before any
    # weight is written; tensors the user drops with --drop are not held against it.
    check.require_valid(src, ignore=frozenset(d["name"] for d in report.drops if d["reason"] == "--drop"))
    return write_output(Path(out), out_cfg, items, report, reader.path, opts, t0)
