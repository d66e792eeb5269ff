"""``backend="aiter"``: an optional adapter over ROCm's aiter for the two ops that matter most on
MI300-class GPUs, the routed-expert MoE (``aiter.fused_moe.fused_moe``) and MLA decode / verify
attention (``aiter.mla.mla_decode_fwd``). Every other op, and every case the adapter does not take
(below), runs on the base backend: triton on a GPU where triton imports, else the torch reference.

Written against aiter's documented API (checked against ROCm/aiter's ``aiter/mla.py``), always with
keyword arguments (the positional order changed between releases). **Unverified on real ROCm**: CI runs it against a fake ``aiter`` module
(tests/runtime/fake_aiter/) that checks the argument contracts (names, shapes, dtypes, shuffled
weights, head counts) and computes with the torch reference; no MI300 was available to this project.

MoE (``AiterMoE``), weights preshuffled once in ``prepare`` with ``aiter.ops.shuffle.shuffle_weight``
(layout (16, 16)):

* dense bf16 / fp16 experts -> ``QuantType.No``; w1 ``[E, 2I, H]`` (gate rows, then up), w2 ``[E, H, I]``;
* INT4 group-32 experts with bf16 activations (Moonshot's W4A16, Kimi-K2.5's own checkpoint) ->
  ``QuantType.per_1x32`` with two signed INT4 codes per byte (even k in the low nibble) and bf16 group
  scales ``[E, K/32, N]`` (aiter's a16w4 path, recent aiter with FlyDSL only);
* anything else (INT4 x int8 activations: aiter has no such MoE kernel; MXFP4, FP8, fp32 models,
  shapes that do not tile by 16 x 32) -> the base backend's MoE, logged once.

MLA (``attention``): the absorbed latent form, bf16 / fp16, page size 1 (``kv_buffer`` is the flat
latent cache viewed ``[slots, 1, 1, 576]``, ``kv_indices`` the slots of positions ``0 .. ctx-1``),
CSR ``qo_indptr`` / ``kv_indptr``. aiter's kernels take 16 or 128 query heads per KV head: 16 / 128
go as they are, a multiple of 16 (Kimi's 64 at TP=1) is folded into groups of 16 heads that become
pseudo-sequences sharing the KV pages, and 1 / 2 / 4 / 8 heads (TP=8..64 shards) are repeated up to 16
and every r-th output head taken. Query windows (verify: last token + k drafts) rely on aiter's
bottom-right causal convention: the sequence's queries are its last ``n`` positions. Anything else
(MHA drafts, fp32 models, queries that are not the last positions) runs on the base backend.

fp8 KV cache (``kv_cache_dtype="fp8"``): the latent is stored as ``aiter.dtypes.fp8`` (e4m3fnuz on
gfx942, e4m3fn on gfx950; e5m2 is refused: aiter's MLA kernels read e4m3 only) and read by aiter's
a8w8 MLA decode (``mla_a8w8_qh16_qseqlen{1,2,4}``: fp8 queries with a per-call dynamic ``q_scale``,
the layer's ``kv_scale``), which takes up to 4 queries per sequence: longer query windows, and the
Llama draft's fp8 cache, run on the base backend over the same fp8 codes.

Batch invariance is aiter's business: its split-KV count depends on the batch (``get_meta_param``
picks ``num_kv_splits`` from the CU count and the batch size), so the backend is not batch invariant
and speculative greedy output may differ from plain greedy output in the last bits on real hardware.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from eagle3.errors import UsageError
from eagle3.runtime import kv_cache
from eagle3.runtime.context import AttnMetadata
from eagle3.runtime.kernels.base import (
    ActQuant,
    DenseWeight,
    Int4Weight,
    KernelBackend,
    LinearOp,
    LinearWeight,
    MoEOp,
    QuantizedRows,
    get_backend,
    register_backend,
)
from eagle3.runtime.kernels.torch_ref import TorchBackend

logger = logging.getLogger("eagle3.runtime")

AITER_HEADS = (16, 128)  # query heads per KV head aiter's MLA kernels take (0.1.7 asm_mla.cu)
FP8_MAX_QLEN = 4  # aiter's fp8 MLA decode: "only support fp8 mla decoding for qo_len <= 4"
SHUFFLE_ROWS, SHUFFLE_COLS = 16, 32  # shuffle_weight(layout=(16, 16)) tiles N by 16 and K by 2 * 16
INT4_GROUP = 32


def import_aiter() -> Any:
    """The ``aiter`` package, or one line saying why not. Any exception counts: without ROCm ``import
    aiter`` raises RuntimeError ("ROCm version file not found"), not ImportError."""
    try:
        import aiter
    except Exception as exc:  # noqa: BLE001 - the reason is the message
        why = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise UsageError(f"kernel backend 'aiter' needs ROCm's aiter package (import aiter failed: {why})") from exc
    return aiter


def _warn_once(seen: set[str], key: str, msg: str) -> None:
    if key not in seen:
        seen.add(key)
        logger.warning(msg)


_WARNED: set[str] = set()


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------


def pack_int4_pairs(codes: torch.Tensor) -> torch.Tensor:
    """Signed INT4 codes ``[..., K]`` (int8 in [-8, 7]) -> uint8 ``[..., K/2]``, two's-complement
    nibbles, even k in the low nibble (aiter's i4x2)."""
    u = (codes.to(torch.int16) & 0xF).to(torch.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


class AiterMoE(MoEOp):
    def __init__(self, aiter: Any, fallback: MoEOp) -> None:
        self.aiter = aiter
        self.fallback = fallback
        self.mode = "fallback"

    def _why_not(self, gate: list[LinearWeight], act: ActQuant, dtype: torch.dtype) -> str | None:
        first = gate[0]
        n, k = first.shape
        if dtype not in (torch.bfloat16, torch.float16):
            return f"model dtype {dtype} (aiter's MoE runs bf16 / fp16)"
        if act is not None:
            return f"{act} activations (no aiter MoE for this weight x activation pair)"
        if (2 * n) % SHUFFLE_ROWS or k % SHUFFLE_COLS or n % SHUFFLE_COLS or k % SHUFFLE_ROWS:
            return f"expert shape [{n}, {k}] does not tile by {SHUFFLE_ROWS} x {SHUFFLE_COLS}"
        if isinstance(first, DenseWeight):
            return None
        if isinstance(first, Int4Weight):
            if first.group_size != INT4_GROUP or first.tensor_scale is not None:
                return f"INT4 group {first.group_size} / a stage scale (aiter's a16w4 MoE is group 32)"
            return None
        return f"{type(first).__name__} experts"

    def prepare(self, gate: list[LinearWeight], up: list[LinearWeight], down: list[LinearWeight],
                act: ActQuant, dtype: torch.dtype, device: torch.device) -> None:
        why = self._why_not(gate, act, dtype)
        if why is not None:
            _warn_once(_WARNED, f"moe:{why}", f"aiter MoE not used ({why}): the base backend's MoE runs")
            self.fallback.prepare(gate, up, down, act, dtype, device)
            return
        a = self.aiter
        shuffle = a.ops.shuffle.shuffle_weight
        self.dtype = dtype
        self.w1_scale = self.w2_scale = None
        if isinstance(gate[0], DenseWeight):
            self.mode = "bf16"
            self.quant_type = a.QuantType.No
            w1 = torch.stack([torch.cat([g.weight, u.weight]) for g, u in zip(gate, up, strict=True)])  # type: ignore[union-attr]
            w2 = torch.stack([d.weight for d in down])  # type: ignore[union-attr]
            self.w1 = shuffle(w1.to(device=device, dtype=dtype).contiguous(), layout=(16, 16))
            self.w2 = shuffle(w2.to(device=device, dtype=dtype).contiguous(), layout=(16, 16))
        else:
            self.mode = "int4_w4a16"
            self.quant_type = a.QuantType.per_1x32
            ws: list[list[Int4Weight]] = [[g, u] for g, u in zip(gate, up, strict=True)]  # type: ignore[misc]
            c1 = torch.stack([torch.cat([w.unpack() for w in pair]) for pair in ws])  # int8 [E, 2I, H]
            s1 = torch.stack([torch.cat([w.scale for w in pair]) for pair in ws])  # [E, 2I, H/32]
            c2 = torch.stack([d.unpack() for d in down])  # type: ignore[union-attr]
            s2 = torch.stack([d.scale for d in down])  # type: ignore[union-attr]
            self.w1 = shuffle(pack_int4_pairs(c1).to(device), layout=(16, 16), use_int4=True)
            self.w2 = shuffle(pack_int4_pairs(c2).to(device), layout=(16, 16), use_int4=True)
            # group scales [E, K/32, N] in bf16 (aiter's a16w4 layout)
            self.w1_scale = s1.transpose(1, 2).to(device=device, dtype=torch.bfloat16).contiguous()
            self.w2_scale = s2.transpose(1, 2).to(device=device, dtype=torch.bfloat16).contiguous()

    def resident(self) -> list[tuple[str, torch.Tensor]]:
        if self.mode == "fallback":
            return self.fallback.resident()
        out = [("packed" if self.mode != "bf16" else "dense", self.w1),
               ("packed" if self.mode != "bf16" else "dense", self.w2)]
        return out + [("scales", s) for s in (self.w1_scale, self.w2_scale) if s is not None]

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 xq: QuantizedRows | None = None) -> torch.Tensor:
        if self.mode == "fallback":
            return self.fallback(x, topk_ids, topk_weights, xq)
        a = self.aiter
        return a.fused_moe.fused_moe(
            hidden_states=x.to(self.dtype).contiguous(), w1=self.w1, w2=self.w2,
            topk_weight=topk_weights.to(torch.float32).contiguous(), topk_ids=topk_ids.to(torch.int32).contiguous(),
            activation=a.ActivationType.Silu, quant_type=self.quant_type, w1_scale=self.w1_scale,
            w2_scale=self.w2_scale, dtype=self.dtype)


# ---------------------------------------------------------------------------------------------
# MLA
# ---------------------------------------------------------------------------------------------


def head_layout(heads: int) -> tuple[int, int] | None:
    """``(groups, repeat)`` to present ``heads`` query heads to aiter as 16 / 128 per call: fold into
    ``groups`` pseudo-sequences of 16 heads, or repeat every head ``repeat`` times up to 16; None:
    no layout (run the base backend)."""
    if heads in AITER_HEADS:
        return 1, 1
    if heads % 16 == 0:
        return heads // 16, 1
    if 16 % heads == 0:
        return 1, 16 // heads
    return None


class AiterMLAPlan:
    """CSR indices of one forward for aiter's MLA call (built on the host, once per forward and fold
    factor, shared by every layer), or ``ok=False`` when the forward does not fit its conventions."""

    def __init__(self, meta: AttnMetadata) -> None:
        self._folded: dict[int, dict[str, Any]] = {}
        cu = list(meta.host_cu) if meta.host_cu is not None else meta.cu_seqlens_q.to("cpu").tolist()
        pos = meta.positions.to("cpu", torch.int64)
        tables = meta.block_tables.to("cpu", torch.int64)
        bs = int(meta.block_size)
        self.ok = True
        self.cu, self.q_lens, self.ctx, self.slots = cu, [], [], []
        for b in range(len(cu) - 1):
            p = pos[cu[b]: cu[b + 1]]
            n = int(p.numel())
            if n == 0:
                self.q_lens.append(0)
                self.ctx.append(0)
                self.slots.append(torch.zeros(0, dtype=torch.int64))
                continue
            ctx = int(p[-1]) + 1
            # aiter's causal convention: a sequence's queries are its last n positions, in order
            if not torch.equal(p, torch.arange(ctx - n, ctx)):
                self.ok = False
                return
            kpos = torch.arange(ctx)
            blocks = tables[b, kpos // bs]
            if bool((blocks < 0).any()):
                self.ok = False
                return
            self.q_lens.append(n)
            self.ctx.append(ctx)
            self.slots.append(blocks * bs + kpos % bs)

    def folded(self, groups: int, device: torch.device) -> dict[str, Any]:
        """The CSR arguments with every sequence repeated ``groups`` times (pseudo-sequence
        ``(b, g)`` = sequence b's queries for head group g), and the query-row gather indices."""
        if groups not in self._folded:
            qo, kv, idx, rows, grp = [0], [0], [], [], []
            for b, (n, ctx, slots) in enumerate(zip(self.q_lens, self.ctx, self.slots, strict=True)):
                for g in range(groups):
                    qo.append(qo[-1] + n)
                    kv.append(kv[-1] + ctx)
                    idx.append(slots)
                    rows += range(self.cu[b], self.cu[b] + n)
                    grp += [g] * n
            i32 = dict(dtype=torch.int32, device=device)
            self._folded[groups] = {
                "qo_indptr": torch.tensor(qo, **i32), "kv_indptr": torch.tensor(kv, **i32),
                "kv_indices": (torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)).to(**i32),
                "kv_last_page_lens": torch.ones(len(qo) - 1, **i32),  # page size 1: every page is full
                "max_seqlen_q": max(self.q_lens, default=1) or 1,
                "rows": torch.tensor(rows, dtype=torch.int64, device=device),
                "groups": torch.tensor(grp, dtype=torch.int64, device=device),
            }
        return self._folded[groups]


# ---------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------


class AiterBackend(TorchBackend):
    """aiter's MoE and MLA over a base backend that runs everything else (see the module doc)."""

    name = "aiter"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self.aiter = import_aiter()
        base_name = "torch"
        if self.device.type == "cuda":
            from eagle3.runtime.kernels.base import _importable

            base_name = "triton" if _importable("triton") else "torch"
        self.base: KernelBackend = get_backend(base_name, self.device)
        self.absorb_at_load = self.base.absorb_at_load  # the base computes the absorption
        params = inspect.signature(self.aiter.mla.mla_decode_fwd).parameters
        # page_size / nhead_kv exist in newer aiter releases only; pass them when taken
        self._mla_extra = {k: 1 for k in ("page_size", "nhead_kv") if k in params}
        self.calls = {"mla": 0, "mla_fallback": 0}

    # -- delegated to the base backend ------------------------------------------------------
    def linear(self) -> LinearOp:
        return self.base.linear()

    def moe(self) -> MoEOp:
        return AiterMoE(self.aiter, self.base.moe())

    def matmul(self, x: torch.Tensor, w_t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.base.matmul(x, w_t, dtype)

    def bmm(self, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.base.bmm(x, w, dtype)

    def matrix(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.base.matrix(w, dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.base.rms_norm(x, weight, eps)

    def add_rms_norm_quant(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                           quant: str | None = None) -> tuple[torch.Tensor, torch.Tensor, QuantizedRows | None]:
        return self.base.add_rms_norm_quant(x, residual, weight, eps, quant)

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype  # aiter's MLA decode reads the cache in the query's dtype

    def kv_storage(self, name: str, dtype: torch.dtype) -> torch.dtype:
        if name == "fp8_e5m2":
            raise UsageError("kv_cache_dtype 'fp8_e5m2': kernel backend 'aiter' cannot hold it (its MLA kernels read "
                             "e4m3 only, aiter.dtypes.fp8); use fp8 / fp8_e4m3, or --kernel-backend triton")
        if name == "fp8_e4m3":
            return self.aiter.dtypes.fp8  # e4m3fnuz on gfx942 (MI300X / MI325X), e4m3fn on gfx950
        return super().kv_storage(name, dtype)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        return self.base.rope(x, cos, sin, interleaved)

    def plan_attention(self, meta: AttnMetadata) -> Any:
        return _LazyPlan(meta, self.base)

    # -- aiter MLA ----------------------------------------------------------------------------
    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
                  scale: float, plan: Any = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        lazy = plan if isinstance(plan, _LazyPlan) else _LazyPlan(meta, self.base)
        t, hkv, heads, d = q.shape
        dv = v_cache.shape[-1]
        latent = (hkv == 1 and v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride()
                  and dv <= d)
        layout = head_layout(heads)
        fp8 = kv_cache.is_fp8(k_cache.dtype)

        def on_base() -> torch.Tensor:
            self.calls["mla_fallback"] += 1
            return self.base.attention(q, k_cache, v_cache, meta, scale, lazy.base(), k_scale, v_scale)

        if (not latent or layout is None or q.dtype not in ((torch.bfloat16,) if fp8 else (torch.bfloat16, torch.float16))
                or t == 0 or meta.tree is not None):
            return on_base()  # MHA (the Llama draft), fp32 models, head counts aiter cannot take, draft trees
        p = lazy.aiter()
        groups, rep = layout
        f = p.folded(groups, q.device) if p.ok else None
        if f is None or (fp8 and f["max_seqlen_q"] > FP8_MAX_QLEN):  # aiter's fp8 MLA: qo_len <= 4
            return on_base()
        q3 = q.view(t, heads, d)
        if rep > 1:
            q3 = q3.repeat_interleave(rep, dim=1)  # [t, 16, d]: head h at 16 // heads slots
        qf = q3.view(t, groups, -1, d)[f["rows"], f["groups"]].contiguous()  # [t * groups, 16 | 128, d]
        o = torch.empty(qf.shape[0], qf.shape[1], dv, dtype=q.dtype, device=q.device)
        kv = k_cache.reshape(k_cache.shape[0], d).view(-1, 1, 1, d)  # page size 1
        scales: dict[str, Any] = {}
        if fp8:  # aiter's a8w8 MLA: fp8 queries (one dynamic scale for the call) over the fp8 latent
            qf, scales["q_scale"] = self._fp8_queries(qf, k_cache.dtype)
            scales["kv_scale"] = torch.full((1,), float(k_scale), dtype=torch.float32, device=q.device)
        self.aiter.mla.mla_decode_fwd(
            q=qf, kv_buffer=kv, o=o, qo_indptr=f["qo_indptr"], kv_indptr=f["kv_indptr"],
            kv_indices=f["kv_indices"], kv_last_page_lens=f["kv_last_page_lens"], max_seqlen_q=f["max_seqlen_q"],
            sm_scale=float(scale), **scales, **self._mla_extra)
        self.calls["mla"] += 1
        out = torch.empty(t, groups, o.shape[1], dv, dtype=q.dtype, device=q.device)
        out[f["rows"], f["groups"]] = o
        out = out.view(t, -1, dv)
        if rep > 1:
            out = out[:, ::rep]
        return out.reshape(t, 1, heads, dv)

    @staticmethod
    def _fp8_queries(q: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` as fp8 codes with one dequantization scale (fp32 ``[1]``, on the device: no host sync):
        the largest |q| of the call maps to the format's largest value (SGLang's per-tensor
        ``scaled_fp8_quant``). The scale follows the batch: this path is not batch invariant."""
        top = torch.finfo(dtype).max
        q_scale = (q.abs().amax().float() / top).clamp_(min=torch.finfo(torch.float32).tiny).reshape(1)
        return kv_cache.quantize(q, dtype, q_scale), q_scale


class _LazyPlan:
    """Both plans of a forward, each built on first use (MHA drafts never need aiter's)."""

    def __init__(self, meta: AttnMetadata, base: KernelBackend) -> None:
        self.meta = meta
        self._base_backend = base
        self._base: Any = None
        self._aiter: AiterMLAPlan | None = None

    def base(self) -> Any:
        if self._base is None:
            self._base = self._base_backend.plan_attention(self.meta)
        return self._base

    def aiter(self) -> AiterMLAPlan:
        if self._aiter is None:
            self._aiter = AiterMLAPlan(self.meta)
        return self._aiter


register_backend("aiter", AiterBackend)
