"""``allocate_kv_cache`` on the CPU: zeros of the layout asked for, one buffer per layer, whose
pages become resident only when a block is written (a large default cache costs no fill)."""

from __future__ import annotations

import sys

import pytest
import torch

from eagle3.runtime.interfaces import KVCacheSpec, allocate_kv_cache


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cpu_cache_is_zeros_per_layer(dtype: torch.dtype) -> None:
    kv = allocate_kv_cache(KVCacheSpec((2, 3, 5), dtype), 2, 7, 4)
    assert [(t.shape, t.dtype, t.is_contiguous()) for t in kv] == [((7, 4, 2, 3, 5), dtype, True)] * 2
    assert not any(t.float().any() for t in kv)
    kv[0][1, 2] = 1  # the layers share no memory
    assert kv[0].float().sum() == 30 and not kv[1].float().any()
    assert allocate_kv_cache(KVCacheSpec((576,), dtype), 1, 0, 16)[0].shape == (0, 16, 576)


@pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's /proc")
def test_cpu_cache_pages_are_resident_only_once_written() -> None:
    before = _rss_bytes()
    kv = allocate_kv_cache(KVCacheSpec((576,), torch.bfloat16), 4, 4096, 16)  # 4 x 72 MiB
    assert _rss_bytes() - before < 16 << 20
    kv[0][:64] = 1.0  # 64 blocks of one layer: ~1.1 MiB
    assert _rss_bytes() - before < 16 << 20 and kv[0][63].float().sum() == 16 * 576
