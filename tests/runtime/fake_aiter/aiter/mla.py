"""aiter.mla (fake): ``mla_decode_fwd`` with the signature of recent aiter (``page_size`` and
``nhead_kv`` after ``max_seqlen_q``), keyword-only, computed by eagle3's torch reference attention."""

from __future__ import annotations

from typing import Any

import torch

from aiter import CALLS, contract


def _i32(name: str, t: torch.Tensor, n: int | None = None) -> None:
    contract(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1,
             f"{name} must be a 1-D int32 tensor, got {getattr(t, 'dtype', type(t))}")
    contract(n is None or t.shape[0] == n, f"{name} has {t.shape[0]} entries, expected {n}")


def mla_decode_fwd(*, q: torch.Tensor, kv_buffer: torch.Tensor, o: torch.Tensor, qo_indptr: torch.Tensor,
                   kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_lens: torch.Tensor,
                   max_seqlen_q: int, page_size: int = 1, nhead_kv: int = 1, sm_scale: float | None = None,
                   logit_cap: float = 0.0, num_kv_splits: Any = None, q_scale: Any = None,
                   kv_scale: Any = None, **persistent: Any) -> tuple[torch.Tensor, torch.Tensor]:
    contract(q.dim() == 3 and q.is_contiguous(), f"q must be a contiguous [total_q, heads, d], got {list(q.shape)}")
    total_q, heads, d = q.shape
    contract(heads in (16, 128), f"query heads per KV head must be 16 or 128 (asm_mla.cu), got {heads}")
    contract(kv_buffer.dim() == 4 and kv_buffer.shape[2] == 1 and kv_buffer.shape[3] == d,
             f"kv_buffer must be [pages, page_size, 1, {d}], got {list(kv_buffer.shape)}")
    contract(kv_buffer.shape[1] == page_size == 1, "this fake checks page size 1 (vLLM's ROCM_AITER_MLA)")
    contract(nhead_kv == 1, "MLA has one KV head")
    contract(q.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fnuz, torch.float8_e4m3fn),
             f"q dtype {q.dtype}")
    contract(kv_buffer.dtype == q.dtype or (q.dtype.itemsize == 1 and kv_buffer.dtype in (q.dtype, torch.bfloat16)),
             f"kv dtype {kv_buffer.dtype} vs q {q.dtype} (bf16 q over an fp8 cache is persistent mode only)")
    fp8_q, fp8_kv = q.dtype.itemsize == 1, kv_buffer.dtype.itemsize == 1
    for name, t, need in (("q_scale", q_scale, fp8_q), ("kv_scale", kv_scale, fp8_kv)):
        contract(not need or (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() == 1
                              and t.device == q.device), f"an fp8 {name[:-6]} needs {name}: an fp32 [1] tensor")
    from aiter import dtypes

    contract(not fp8_kv or kv_buffer.dtype == dtypes.fp8, f"an fp8 kv_buffer must be aiter.dtypes.fp8, got {kv_buffer.dtype}")
    contract(o.dim() == 3 and o.shape[:2] == q.shape[:2] and o.shape[2] < d and o.dtype in (torch.bfloat16, q.dtype),
             f"o must be [total_q, heads, d_v] in the model dtype, got {o.dtype} {list(o.shape)}")
    b = qo_indptr.shape[0] - 1
    _i32("qo_indptr", qo_indptr)
    _i32("kv_indptr", kv_indptr, b + 1)
    _i32("kv_last_page_lens", kv_last_page_lens, b)
    _i32("kv_indices", kv_indices, int(kv_indptr[-1]))
    q_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
    kv_lens = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
    contract(int(qo_indptr[-1]) == total_q, "qo_indptr[-1] must be the number of query rows")
    contract(max_seqlen_q == max(q_lens), f"max_seqlen_q={max_seqlen_q}, longest query {max(q_lens)}")
    contract(q.dtype.itemsize != 1 or max_seqlen_q <= 4, "fp8 MLA decode supports qo_len <= 4 only")
    contract(all(n <= k for n, k in zip(q_lens, kv_lens, strict=True)), "a sequence has more queries than keys")
    contract(sm_scale is not None and isinstance(sm_scale, float), "pass sm_scale (a float)")
    contract(logit_cap <= 0, "logit_cap is not supported")
    CALLS.append(("mla_decode_fwd", {"heads": heads, "max_seqlen_q": max_seqlen_q, "batch": b,
                                     **({"fp8": True} if fp8_kv else {})}))

    # The torch reference over the same keys: pseudo-sequence b is a sequence whose block table is
    # its kv_indices (block size 1); its queries are its last q_len positions (bottom-right causal).
    from eagle3.runtime.context import AttnMetadata
    from eagle3.runtime.kernels import torch_ref

    width = max(kv_lens) or 1
    tables = torch.full((b, width), -1, dtype=torch.int32)
    pos = []
    for i in range(b):
        lo = int(kv_indptr[i])
        tables[i, : kv_lens[i]] = kv_indices[lo: lo + kv_lens[i]].cpu()
        pos += range(kv_lens[i] - q_lens[i], kv_lens[i])
    dev = q.device
    meta = AttnMetadata(positions=torch.tensor(pos, dtype=torch.int64, device=dev), cu_seqlens_q=qo_indptr,
                        context_lens=torch.tensor(kv_lens, dtype=torch.int32, device=dev),
                        slot_mapping=torch.zeros(total_q, dtype=torch.int64, device=dev),
                        block_tables=tables.to(dev), block_size=1)
    flat = kv_buffer.view(-1, 1, d)
    dv = o.shape[2]
    # fp8: q_scale / kv_scale are dequantization scales (value = code * scale)
    qd = q.float() * q_scale if fp8_q else q
    ks = float(kv_scale) if fp8_kv else 1.0
    out = torch_ref.paged_attention(qd.view(total_q, 1, heads, d), flat, flat[..., :dv], torch_ref.AttnPlan(meta),
                                    sm_scale, k_scale=ks, v_scale=ks)
    o.copy_(out.view(total_q, heads, dv))
    return torch.empty(0), torch.empty(0)
