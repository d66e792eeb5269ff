"""Rotary position embeddings: default / linear / llama3 / YaRN frequencies, interleaved
(DeepSeek, Kimi MLA) or NeoX (Llama drafts) rotation.

YaRN follows transformers' ``_compute_yarn_parameters`` (= DeepSeek's ``yarn``), verified equal:
ramped interpolation between ``base^(-2i/d)`` and ``/factor``, and
cos/sin scaled by ``attention_factor = mscale(f, mscale) / mscale(f, mscale_all_dim)`` when both
are set, else ``mscale(f)``. (vLLM's Llama YaRN ignores ``mscale``/``mscale_all_dim`` and always
scales by ``mscale(f)``; for a Llama draft with ``mscale == mscale_all_dim`` this differs: we
follow the config's meaning as transformers does.)

cos/sin are computed in fp32 from ``position * inv_freq`` and cast to the activation dtype
before rotating, as transformers does (bit-exact in bf16).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from eagle3.errors import UsageError
from eagle3.runtime.config import RopeSpec, yarn_get_mscale
from eagle3.runtime.kernels.base import KernelBackend


def compute_inv_freq(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """(inv_freq fp32 ``[dim/2]``, attention_factor for cos/sin)."""
    dim, base = spec.dim, spec.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    pos_freqs = base ** exponents
    if spec.kind in ("default", "dynamic"):
        # "dynamic" only changes inv_freq beyond the original length, and then by the batch's
        # longest sequence (not batch invariant); the runtime uses the unscaled frequencies.
        return 1.0 / pos_freqs, 1.0
    if spec.kind == "linear":
        return 1.0 / pos_freqs / spec.factor, 1.0
    if spec.kind == "llama3":
        inv = 1.0 / pos_freqs
        old = spec.original_max_position_embeddings or 8192
        low_wl, high_wl = old / spec.low_freq_factor, old / spec.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / spec.factor, inv)
        smooth = (old / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn
    f = spec.factor
    if spec.attention_factor is not None:
        attn = spec.attention_factor
    elif spec.mscale and spec.mscale_all_dim:
        attn = float(yarn_get_mscale(f, spec.mscale) / yarn_get_mscale(f, spec.mscale_all_dim))
    else:
        attn = yarn_get_mscale(f)
    orig = spec.original_max_position_embeddings or 4096

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(spec.beta_fast)), 0)
    high = min(math.ceil(corr_dim(spec.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra_factor = 1 - ramp
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (f * pos_freqs)
    return inv_inter * (1 - extra_factor) + inv_extra * extra_factor, attn


class RotaryEmbedding(nn.Module):
    def __init__(self, spec: RopeSpec, backend: KernelBackend) -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend
        inv_freq, self.attention_factor = compute_inv_freq(spec)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # per-position cos/sin (CPU)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, dim/2]`` each, in ``dtype`` (once per forward, shared by all layers). On CPU rows of
        a per-position table: every element is a function of its position alone (an elementwise
        product, cos/sin on the scalar path, elementwise scale and cast), so a table row has the
        bits a per-step computation gives. Elsewhere computed per call (no host sync: CUDA graphs).
        Metadata built on another device than the model's is one line naming both (it surfaced as
        an index_select device error deep in the first layer)."""
        if positions.device != self.inv_freq.device:
            raise UsageError(f"attention metadata (positions) on {positions.device}, the model on "
                             f"{self.inv_freq.device}: build the metadata on the model's device")
        if positions.device.type == "cpu" and positions.numel() and int(positions.min()) >= 0:
            idx = positions.to(torch.int64)
            cos, sin = self._table(int(idx.max()) + 1, dtype)
            return cos.index_select(0, idx), sin.index_select(0, idx)
        return self._compute(positions, dtype)

    def _table(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of positions ``0 .. >= n-1`` in ``dtype``, grown by doubling."""
        tab = self._tables.get(dtype)
        if tab is None or tab[0].shape[0] < n:
            size = max(256, 1 << (n - 1).bit_length())
            tab = self._compute(torch.arange(size, device=self.inv_freq.device), dtype)
            self._tables[dtype] = tab
        return tab

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = self.backend.cos_sin(freqs)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, dim]``."""
        return self.backend.rope(x, cos, sin, self.spec.interleaved)
