"""SwiGLU MLP and the DeepSeek-V3 MoE block (sigmoid router with correction bias, group-limited
top-k, routed experts + always-on shared experts) as in DeepSeek-V3.

Numerics as transformers: router logits ``x.float() @ W.float().T`` (the backend widens both
operands, exactly; no per-step fp32 copy of the weight on a GPU); selection on
``sigmoid + e_score_correction_bias``, weights are the unbiased scores, renormalised
(``/ (sum + 1e-20)``) and scaled by ``routed_scaling_factor``; the routed sum is taken in fp32,
cast, then the shared experts' output (activation dtype) is added.
"""

from __future__ import annotations

import torch
from torch import nn

from eagle3.runtime.kernels.base import (
    PER_TOKEN_QUANTS,
    ActQuant,
    KernelBackend,
    LinearWeight,
    MoEOp,
    QuantizedRows,
    concat_out_features,
)
from eagle3.runtime.layers.linear import Linear, RowParallelLinear, Shard
from eagle3.runtime.parallel import SINGLE, TPGroup


class DenseMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one GEMM.

    Tensor parallel by intermediate columns: this rank holds rows ``[lo, hi)`` of gate and of up
    (merged column parallel, :attr:`gate_up_shard`) and those input columns of down (row
    parallel); the output is summed over the ranks unless ``reduce_results=False`` (the MoE's shared
    experts, whose partial sum the MoE reduces together with its routed experts')."""

    def __init__(self, hidden: int, inter: int, backend: KernelBackend, name: str = "", tp: TPGroup = SINGLE,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_shard = Shard.of_rows(tp, inter)  # of gate_proj and of up_proj, each
        self.inter = self.gate_up_shard.size(inter)
        self.backend = backend
        self.tp = tp
        self.reduce_results = reduce_results
        self.gate_up = Linear(hidden, 2 * self.inter, backend, name + ".gate_up_proj")
        self.down = RowParallelLinear(inter, hidden, backend, name + ".down_proj", tp)

    def load(self, gate: LinearWeight, up: LinearWeight, down: LinearWeight, act_gate_up: ActQuant,
             act_down: ActQuant, dtype: torch.dtype, device: torch.device) -> None:
        self.gate_up.load(concat_out_features([gate, up]), act_gate_up, dtype, device)
        self.down.load(down, act_down, dtype, device)

    @property
    def token_quant(self) -> str | None:
        """The per-token quantization of this MLP's input (its gate + up GEMM's), if any."""
        return self.gate_up.token_quant

    def forward(self, x: torch.Tensor, xq: QuantizedRows | None = None) -> torch.Tensor:
        g, u = self.gate_up(x, xq).split(self.inter, dim=-1)
        y = self.down(self.backend.silu(g) * u)
        return self.tp.reduce(y) if self.reduce_results else y


class MoE(nn.Module):
    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, n_shared: int, n_group: int,
                 topk_group: int, scoring_func: str, norm_topk_prob: bool, routed_scaling_factor: float,
                 backend: KernelBackend, name: str = "", tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.hidden = hidden
        self.inter = inter
        self.num_experts = num_experts
        self.top_k = top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.scoring_func = scoring_func
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.backend = backend
        self.name = name
        self.register_buffer("gate_weight_t", torch.zeros(hidden, num_experts))  # [H, E], checkpoint dtype
        self.register_buffer("e_score_correction_bias", None)
        self.experts: MoEOp | None = None
        # Expert parallel: this rank holds experts [lo, hi) and computes them for every token; the
        # shared experts are split by their intermediate columns. forward reduces the sum of both.
        self.expert_range = tp.split(num_experts)
        self.tp = tp
        self.shared = (DenseMLP(hidden, inter * n_shared, backend, name + ".shared_experts", tp, reduce_results=False)
                       if n_shared else None)
        self.kind = "unloaded"
        self.act: ActQuant = None  # the routed experts' activation quantization

    def load_router(self, weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device) -> None:
        # The router runs in fp32 (transformers casts both operands): the weight is kept transposed in
        # its checkpoint dtype and widened exactly where it is multiplied (per call by the reference,
        # in registers by the Triton kernel), so it takes no more memory than on disk.
        self.gate_weight_t = weight.t().contiguous().to(device)
        self.e_score_correction_bias = None if bias is None else bias.float().to(device)

    def load_experts(self, gate: list[LinearWeight], up: list[LinearWeight], down: list[LinearWeight],
                     act: ActQuant, dtype: torch.dtype, device: torch.device) -> None:
        op = self.backend.moe()
        op.prepare(gate, up, down, act, dtype, device)
        self.experts = op
        self.act = act
        self.kind = f"{type(gate[0]).__name__}, act={act}"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (topk_ids int64 [T, k], topk_weights fp32 [T, k])."""
        scores, choice = self.route_scores(x)
        ids = choice.topk(self.top_k, dim=-1)[1]
        w = scores.gather(1, ids)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * self.routed_scaling_factor

    def route_scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (scores, choice) fp32 [T, E]: the experts' gate scores and the values the top-k picks
        from (bias-corrected, groups outside the best ``topk_group`` at -inf). Separate from
        :meth:`route` so that a test can see how close a token's routing is to a tie."""
        logits = self.backend.matmul(x, self.gate_weight_t, torch.float32)
        scores = self.backend.sigmoid(logits) if self.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.n_group > 1 and self.topk_group < self.n_group:
            t = choice.shape[0]
            grouped = choice.view(t, self.n_group, -1)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1)[1], True)
            choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(t, -1), float("-inf"))
        return scores, choice

    @property
    def token_quant(self) -> str | None:
        """The per-token quantization of this block's input: the routed experts' (the shared
        experts read it too when theirs is the same), if any."""
        if self.act in PER_TOKEN_QUANTS:
            return self.act
        return None if self.shared is None else self.shared.token_quant

    def forward(self, x: torch.Tensor, xq: QuantizedRows | None = None) -> torch.Tensor:
        """``xq``: ``x``'s per-token quantization made by the norm in front (:attr:`token_quant`)."""
        if self.experts is None:
            raise RuntimeError(f"{self.name}: experts not loaded")
        ids, w = self.route(x)
        if self.tp.world > 1:
            # Slots routed to another rank's experts get weight 0 here (0 * finite == 0 exactly, so the
            # local sum is this rank's experts' part) and a valid local id so that the op runs.
            lo, hi = self.expert_range
            mine = (ids >= lo) & (ids < hi)
            w = torch.where(mine, w, torch.zeros_like(w))
            ids = torch.where(mine, ids - lo, torch.zeros_like(ids))
        y = self.experts(x, ids, w, xq)
        if self.shared is not None:
            y = y + self.shared(x, xq)
        return self.tp.reduce(y)

    def resident(self) -> list[tuple[str, torch.Tensor]]:
        """The routed experts' tensors (packed as on disk; see KernelBackend ops)."""
        return [] if self.experts is None else self.experts.resident()

    def extra_repr(self) -> str:
        return f"experts={self.num_experts} top{self.top_k} inter={self.inter} ({self.kind})"
