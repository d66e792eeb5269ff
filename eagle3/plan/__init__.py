"""The memory plan (``eagle3 plan``, ``serve --plan``): weight bytes per rank, KV-cache capacity and
whether a deployment fits, from config files alone (:mod:`.memory`; docs/scale.md).

It reads checkpoints through :mod:`eagle3.formats` and projects ``quantize --recipe`` outputs
through :mod:`eagle3.quantize`; the KV bytes per token are the runtime's formula
(:func:`eagle3.runtime.kv_cache.cache_bytes`). :mod:`.floor` turns the same per-rank bytes into the
byte floor of a decode step (``eagle3 plan --decode-floor``). Nothing below it imports it.
"""

from eagle3.plan.floor import DecodeFloor, decode_floor, expected_distinct_experts, floor_lines, gpu_hbm_tbps
from eagle3.plan.memory import (
    CATEGORIES,
    DEFAULT_RESERVE,
    GPUS,
    KV_DTYPE_BYTES,
    MemoryPlan,
    Model,
    check_options,
    classify,
    gpu_for_device_name,
    kv_bytes_per_token,
    load_model,
    plan,
    project_config,
    rank_bytes,
    summary_lines,
)

__all__ = ["DecodeFloor", "decode_floor", "expected_distinct_experts", "floor_lines", "gpu_hbm_tbps", "CATEGORIES", "DEFAULT_RESERVE", "GPUS", "KV_DTYPE_BYTES", "MemoryPlan", "Model", "check_options",
           "classify", "gpu_for_device_name", "kv_bytes_per_token", "load_model", "plan", "project_config", "rank_bytes", "summary_lines"]
