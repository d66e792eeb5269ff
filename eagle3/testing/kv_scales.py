"""Checkpoints with static FP8 KV-cache scales, as the two schemes that write them store them
(tests of the fp8 KV cache; ``eagle3.runtime.kv_cache``):

* ``compressed-tensors`` (llm-compressor's kv-cache scheme): ``quantization_config.kv_cache_scheme``
  (8-bit float, per tensor, static) and ``<layer>.self_attn.k_scale`` / ``v_scale``, fp32 ``[1]``;
* ``quark`` (AMD Quark's FP8 KV export): ``kv_cache_quant_config`` and ``export.kv_cache_group``
  naming the projections whose output is cached, FP8 E4M3 per-tensor static ``output_tensors`` on
  them in ``layer_quant_config``, and ``<projection>.output_scale``, a bf16 scalar: ``kv_b_proj`` of
  an MLA layer, ``k_proj`` / ``v_proj`` of a Llama layer (added to a Quark checkpoint's config).

:func:`with_kv_scales` copies a checkpoint (tensors rewritten shard by shard, side files copied) and
adds them; ``scale(module, which)`` gives each value, ``extra`` overrides or adds raw tensors (a bad
scale, for the refusal tests).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import CheckpointReader, CheckpointWriter
from eagle3.errors import UsageError
from eagle3.formats import keys

STYLES = ("compressed-tensors", "quark")
_CT_KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
                 "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
                 "observer_kwargs": {}}
_QUARK_FP8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": True,
              "observer_cls": "PerTensorMinMaxObserver", "round_method": "half_even", "scale_type": None,
              "ch_axis": None, "group_size": None}


def _quant_holder(cfg: dict[str, Any]) -> dict[str, Any]:
    """The dict holding ``quantization_config`` (the Kimi-K2.5 wrapper keeps it in ``text_config``)."""
    tc = cfg.get("text_config")
    if isinstance(tc, dict) and "quantization_config" in tc:
        return tc
    return cfg


def _attention_modules(names: list[str]) -> list[str]:
    tag = ".self_attn."
    return sorted({n[: n.index(tag) + len(tag) - 1] for n in names if tag in n})


def with_kv_scales(src: str | Path, out: str | Path, style: str,
                   scale: Callable[[str, str], float | None] = lambda module, which: 0.05,
                   extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Copy checkpoint ``src`` to ``out`` with ``style``'s kv scales on every attention layer.
    ``scale(attention_module, "k" | "v")`` (compressed-tensors; None leaves that one out) or
    ``scale(projection, "out")`` (Quark) gives each value."""
    if style not in STYLES:
        raise UsageError(f"kv scale style must be one of {', '.join(STYLES)}, got {style!r}")
    src, out = Path(src), Path(out)
    cfg = json.loads((src / "config.json").read_text())
    reader = CheckpointReader(src)
    names = list(reader.names())
    mla = any(n.endswith(".kv_b_proj.weight") or ".kv_b_proj." in n for n in names)
    holder = _quant_holder(cfg)
    qc = holder.get("quantization_config")
    added: dict[str, torch.Tensor] = {}
    if style == "compressed-tensors":
        if not qc or qc.get("quant_method") != "compressed-tensors":
            raise UsageError(f"{src}: a compressed-tensors kv-cache scheme goes into a compressed-tensors checkpoint")
        qc["kv_cache_scheme"] = dict(_CT_KV_SCHEME)
        for attn in _attention_modules(names):
            for which, param in (("k", keys.K_SCALE), ("v", keys.V_SCALE)):
                value = scale(attn, which)
                if value is not None:  # None: this scale left out
                    added[f"{attn}.{param}"] = torch.tensor([value], dtype=torch.float32)
    else:
        if not qc or qc.get("quant_method") != "quark":
            raise UsageError(f"{src}: Quark kv scales go into a Quark checkpoint (its weights quantized by Quark)")
        pats = ["*kv_b_proj"] if mla else ["*k_proj", "*v_proj"]
        glob = qc.get("global_quant_config") or {}
        for p in pats:  # the layer keeps the global weight / input scheme and gains the cached output's
            layer = {**json.loads(json.dumps(glob)), "output_tensors": dict(_QUARK_FP8)}
            qc.setdefault("layer_quant_config", {})[p] = layer
            qc.setdefault("kv_cache_quant_config", {})[p] = layer
        qc.setdefault("export", {})["kv_cache_group"] = pats
        projections = ("kv_b_proj",) if mla else ("k_proj", "v_proj")
        for attn in _attention_modules(names):
            for proj in projections:
                m = f"{attn}.{proj}"
                added[f"{m}.{keys.OUTPUT_SCALE}"] = torch.tensor(scale(m, "out"), dtype=torch.bfloat16)
    added.update(extra or {})
    out.mkdir(parents=True)
    with CheckpointWriter(out) as w:
        for n in names:
            if n not in added:
                w.add(n, reader.get(n))
        for n, t in added.items():
            w.add(n, t)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("model.safetensors.index.json",
                                                                                   "config.json"):
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return out


__all__ = ["STYLES", "with_kv_scales"]
