"""The torch reference on a GPU: the tiny target and a draft load onto CUDA/ROCm, agree with the
CPU run, and stay batch invariant there too (cuBLAS picks kernels per shape like MKL does; the
fixed-shape tiles must hold on the GPU as well). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from eagle3.runtime.interfaces import default_aux_layer_ids
from eagle3.runtime.kernels.torch_ref import int8_linear
from eagle3.runtime.loader import load_draft, load_target
from tests.runtime.model_kit import PagedKV

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]


class _DevKV(PagedKV):
    """PagedKV with caches and metadata on the GPU."""

    def __init__(self, model, **kw):
        super().__init__(model, **kw)
        self.caches = [c.cuda() for c in self.caches]

    def step(self, batch, start=None):
        ids, meta = super().step(batch, start)
        for f in ("positions", "cu_seqlens_q", "context_lens", "slot_mapping", "block_tables"):
            setattr(meta, f, getattr(meta, f).cuda())
        return ids.cuda(), meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_matches_cpu_and_is_batch_invariant(tiny_dir, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 768, (19,), generator=gen).tolist()
    b = torch.randint(0, 768, (7,), generator=gen).tolist()
    cpu = load_target(tiny_dir / "kimi-k2.5", dtype=dtype)
    gpu = load_target(tiny_dir / "kimi-k2.5", dtype=dtype, device="cuda")
    aux_ids = default_aux_layer_ids(gpu.num_layers)
    kv = PagedKV(cpu)
    x, meta = kv.step({"a": a})
    with torch.no_grad():
        ref, _ = cpu(x, meta, kv.caches, aux_ids)
    kv = _DevKV(gpu)
    x, meta = kv.step({"a": a})
    with torch.no_grad():
        full, full_aux = gpu(x, meta, kv.caches, aux_ids)
    tol = 1e-3 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(full.float().cpu(), ref.float(), rtol=0, atol=tol)
    # the same tokens in another batch composition: chunked with a second sequence, then decode
    kv = _DevKV(gpu, seed=3)
    rows = []
    with torch.no_grad():
        x, meta = kv.step({"b": b, "a": a[:12]})
        h, aux = gpu(x, meta, kv.caches, aux_ids)
        rows.append((h[len(b):], aux[len(b):]))
        for t in a[12:]:
            x, meta = kv.step({"a": [t]})
            rows.append(gpu(x, meta, kv.caches, aux_ids))
    assert torch.equal(torch.cat([r[0] for r in rows]), full)
    assert torch.equal(torch.cat([r[1] for r in rows]), full_aux)
    d = load_draft(tiny_dir / "kimi-k2.6-eagle3.1-mla", gpu)
    dkv = _DevKV(d, num_layers=1)
    x, meta = dkv.step({"a": a[1:]})
    with torch.no_grad():
        y, _ = d(x, d.combine_aux(full_aux[:-1]), meta, dkv.caches[0])
    assert d.compute_logits(y).shape == (18, 1024) and y.device.type == "cuda"


def test_gpu_int8_gemm_is_exact() -> None:
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-8, 8, (64, 256), generator=g, dtype=torch.int8)
    scale = torch.rand(64, generator=g) + 0.5
    x = torch.randn(3, 256, generator=g)
    cpu = int8_linear(x, codes, scale)
    gpu = int8_linear(x.cuda(), codes.cuda(), scale.cuda(), min_rows=17)
    assert torch.equal(gpu.cpu(), cpu)
