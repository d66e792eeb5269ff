"""The byte floor of a decode step: the fewest bytes one rank must read from HBM per plain decode
step at batch ``b``, and so the shortest time the step can take at the card's memory bandwidth
(``eagle3 plan TARGET --decode-floor 1,16,64``; docs/kernels.md "Byte floors").

From the memory plan's per-rank bytes (:mod:`.memory`, the same sharding), per step:

* every weight a step uses is read once: attention (split by heads, and the replicated q_a / kv_a),
  shared experts, the dense MLP, router, norms, the rank's ``lm_head`` shard;
* the embedding only by rows: ``b`` rows of the table (a vocab-split table: its share of them);
* routed experts: the distinct experts the batch touches. Under uniform routing each token picks
  ``top_k`` distinct experts of ``E``, so a given expert is missed by one token with probability
  ``1 - top_k / E`` and by the whole batch with ``(1 - top_k / E) ** b``: the expected fraction of a
  rank's experts read is ``1 - (1 - top_k / E) ** b`` (8 of 384 at b = 1, ~110 at b = 16, ~284 at
  b = 64), the same on every rank under expert parallelism;
* the KV cache: every sequence's ``context`` tokens of every layer read (the MLA latent is per token,
  not per head, so every rank reads all of it), and one token per sequence written.

Activations between kernels are left out (a fused step need not write them; they are ~b x hidden
per layer), and so is the draft: this is the target's plain step. A real router is not uniform (hot
experts make the touched set smaller), so measured against a real trace the floor is an estimate;
at b = 1 it is exact (top_k experts).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from eagle3.errors import UsageError
from eagle3.formats.detect import text_config
from eagle3.plan.memory import GPUS, Model, kv_bytes_per_token


def expected_distinct_experts(experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts ``batch`` tokens touch when each picks ``top_k`` of ``experts``
    uniformly (without repeats): ``experts * (1 - (1 - top_k / experts) ** batch)``."""
    if experts <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - min(top_k, experts) / experts) ** batch)


@dataclass
class DecodeFloor:
    target: str
    gpus: int
    batch: int
    context: int  # tokens per sequence already in the KV cache
    kv_cache_dtype: str
    experts: int  # routed experts of the model (0: dense)
    top_k: int
    experts_per_rank: int
    experts_touched_per_rank: float  # expected distinct experts read per MoE layer, on one rank
    weight_bytes: dict[str, float]  # by memory-plan category, read per step on the fullest rank
    kv_read_bytes: int
    kv_write_bytes: int
    total_bytes: float
    hbm_tbps: float | None  # the card's HBM peak (TB/s = 1e12 B/s), when known
    floor_seconds: float | None  # total_bytes at that peak

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def decode_floor(model: Model, *, gpus: int = 1, batch: int = 1, context: int = 4096, kv_cache_dtype: str = "bf16",
                 embedding: str = "replicated", hbm_tbps: float | None = None) -> DecodeFloor:
    """The byte floor of one plain decode step of ``model`` at ``batch`` sequences of ``context``
    tokens, on the fullest of ``gpus`` ranks (the memory plan's sharding)."""
    if batch < 1 or context < 0 or gpus < 1:
        raise UsageError(f"decode floor: batch {batch} and gpus {gpus} must be >= 1, context {context} >= 0")
    tc = text_config(model.config)
    experts = int(tc.get("n_routed_experts") or 0)
    top_k = int(tc.get("num_experts_per_tok") or 0)
    per, _ = model.rank_bytes(gpus, experts, embedding)
    rank = max(per, key=lambda r: sum(r.values()))
    rank.pop("draft", None)  # the target's step alone
    weights: dict[str, float] = {k: float(v) for k, v in rank.items() if v}
    per_rank_experts = -(-experts // gpus) if experts else 0
    fraction = expected_distinct_experts(experts, top_k, batch) / experts if experts else 0.0
    if "routed_experts" in weights:
        weights["routed_experts"] *= fraction
    if "embedding" in weights:
        weights["embedding"] = float(min(batch, _vocab_rows(model)) * _embedding_row_bytes(model))
        if embedding == "vocab-split":
            weights["embedding"] /= gpus
    kv_token = kv_bytes_per_token(model.config, model.path, kv_cache_dtype)
    kv_read, kv_write = batch * context * kv_token, batch * kv_token
    total = sum(weights.values()) + kv_read + kv_write
    return DecodeFloor(target=model.path, gpus=gpus, batch=batch, context=context, kv_cache_dtype=kv_cache_dtype,
                       experts=experts, top_k=top_k, experts_per_rank=per_rank_experts,
                       experts_touched_per_rank=per_rank_experts * fraction, weight_bytes=weights,
                       kv_read_bytes=kv_read, kv_write_bytes=kv_write, total_bytes=total, hbm_tbps=hbm_tbps,
                       floor_seconds=None if not hbm_tbps else total / (hbm_tbps * 1e12))


def _embedding(model: Model) -> Any:
    for t in model.tensors:
        if t.name.endswith("embed_tokens.weight") and len(t.shape) == 2:
            return t
    return None


def _vocab_rows(model: Model) -> int:
    t = _embedding(model)
    return t.shape[0] if t is not None else 0


def _embedding_row_bytes(model: Model) -> int:
    t = _embedding(model)
    return t.nbytes // t.shape[0] if t is not None else 0


def gpu_hbm_tbps(gpu: str | None) -> float | None:
    """The HBM peak of a ``--gpu`` name (TB/s), None without one."""
    if gpu is None:
        return None
    key = gpu.lower()
    if key not in GPUS:
        raise UsageError(f"--gpu {gpu!r}: choose from {', '.join(GPUS)}")
    return GPUS[key].hbm_tbps


def floor_lines(floors: list[DecodeFloor]) -> list[str]:
    """The human-readable floors, one line per batch (GB = 1e9 bytes)."""
    if not floors:
        return []
    f0 = floors[0]
    peak = f"{f0.hbm_tbps:g} TB/s" if f0.hbm_tbps else "no --gpu: bytes only"
    lines = [f"decode floor (plain step, bytes read per rank of {f0.gpus}; context {f0.context}, KV {f0.kv_cache_dtype}, "
             f"HBM {peak}):",
             f"  {'batch':>5s} {'experts/rank':>14s} {'routed':>9s} {'other w.':>9s} {'KV':>9s} {'total':>9s} "
             f"{'floor':>9s}"]
    for f in floors:
        routed = f.weight_bytes.get("routed_experts", 0.0)
        other = sum(v for k, v in f.weight_bytes.items() if k != "routed_experts")
        touched = f"{f.experts_touched_per_rank:.1f} of {f.experts_per_rank}" if f.experts else "-"
        floor = f"{1e3 * f.floor_seconds:.3f} ms" if f.floor_seconds is not None else "-"
        lines.append(f"  {f.batch:>5d} {touched:>14s} {routed / 1e9:>6.2f} GB {other / 1e9:>6.2f} GB "
                     f"{(f.kv_read_bytes + f.kv_write_bytes) / 1e9:>6.2f} GB {f.total_bytes / 1e9:>6.2f} GB {floor:>9s}")
    return lines


__all__ = ["DecodeFloor", "decode_floor", "expected_distinct_experts", "floor_lines", "gpu_hbm_tbps"]
