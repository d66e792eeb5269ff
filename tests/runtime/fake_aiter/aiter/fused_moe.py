"""aiter.fused_moe (fake): ``fused_moe`` with aiter's documented signature (keyword-only here),
computed by eagle3's torch reference MoE over the unshuffled weights."""

from __future__ import annotations

from typing import Any

import torch

from aiter import CALLS, ActivationType, QuantType, contract
from aiter.ops.shuffle import unshuffle

_PREPARED: dict[tuple[int, int], Any] = {}  # the reference op per weight pair (prepared once)


def _unpack_pairs(b: torch.Tensor) -> torch.Tensor:
    lo = (b & 0xF).to(torch.int8)
    hi = (b >> 4).to(torch.int8)
    lo = torch.where(lo > 7, lo - 16, lo)
    hi = torch.where(hi > 7, hi - 16, hi)
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def fused_moe(*, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weight: torch.Tensor,
              topk_ids: torch.Tensor, expert_mask: Any = None, activation: ActivationType = ActivationType.Silu,
              quant_type: QuantType = QuantType.No, doweight_stage1: bool = False, w1_scale: Any = None,
              w2_scale: Any = None, a1_scale: Any = None, a2_scale: Any = None, block_size_M: Any = None,
              num_local_tokens: Any = None, moe_sorting_dispatch_policy: int = 0, dtype: Any = None,
              hidden_pad: int = 0, intermediate_pad: int = 0, bias1: Any = None, bias2: Any = None) -> torch.Tensor:
    x = hidden_states
    contract(x.dim() == 2 and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float16),
             f"hidden_states must be contiguous bf16/fp16 [T, H], got {x.dtype} {list(x.shape)}")
    t, h = x.shape
    contract(activation == ActivationType.Silu, f"activation {activation}")
    contract(topk_ids.dtype == torch.int32 and topk_ids.dim() == 2 and topk_ids.shape[0] == t,
             f"topk_ids must be int32 [T, k], got {topk_ids.dtype} {list(topk_ids.shape)}")
    contract(topk_weight.dtype == torch.float32 and topk_weight.shape == topk_ids.shape,
             f"topk_weight must be float32 {list(topk_ids.shape)}, got {topk_weight.dtype} {list(topk_weight.shape)}")
    contract(getattr(w1, "is_shuffled", False) and getattr(w2, "is_shuffled", False),
             "w1 / w2 must be preshuffled (aiter.ops.shuffle.shuffle_weight)")
    contract(w1.dim() == 3 and w2.dim() == 3 and w1.shape[0] == w2.shape[0], "w1 [E, 2I, H], w2 [E, H, I]")
    e, two_i = w1.shape[:2]
    inter = two_i // 2
    contract(dtype == x.dtype, f"dtype={dtype} must be the activations' {x.dtype}")
    from eagle3.runtime.kernels.base import DenseWeight, Int4Weight
    from eagle3.runtime.kernels.torch_ref import TorchMoE

    if quant_type == QuantType.No:
        contract(w1.dtype == x.dtype and w2.dtype == x.dtype, "unquantized weights in the activation dtype")
        contract(tuple(w1.shape) == (e, two_i, h) and tuple(w2.shape) == (e, h, inter),
                 f"w1 {list(w1.shape)} / w2 {list(w2.shape)} for hidden {h}")
        contract(w1_scale is None and w2_scale is None, "no scales with QuantType.No")
    elif quant_type == QuantType.per_1x32:
        contract(w1.dtype == torch.uint8 and w2.dtype == torch.uint8, "INT4 weights as i4x2 bytes")
        contract(tuple(w1.shape) == (e, two_i, h // 2) and tuple(w2.shape) == (e, h, inter // 2),
                 f"i4x2 w1 {list(w1.shape)} / w2 {list(w2.shape)} for hidden {h}")
        contract(w1.fake_layout[1] and w2.fake_layout[1], "INT4 weights shuffled with use_int4=True")
        contract(isinstance(w1_scale, torch.Tensor) and w1_scale.dtype == torch.bfloat16
                 and tuple(w1_scale.shape) == (e, h // 32, two_i),
                 f"w1_scale must be bf16 [E, H/32, 2I] = {[e, h // 32, two_i]}")
        contract(isinstance(w2_scale, torch.Tensor) and w2_scale.dtype == torch.bfloat16
                 and tuple(w2_scale.shape) == (e, inter // 32, h),
                 f"w2_scale must be bf16 [E, I/32, H] = {[e, inter // 32, h]}")
    else:
        contract(False, f"the fake supports QuantType.No / per_1x32, got {quant_type}")
    CALLS.append(("fused_moe", {"quant_type": quant_type.name, "experts": e, "tokens": t}))

    key = (w1.data_ptr(), w2.data_ptr())
    if key not in _PREPARED:
        u1, u2 = unshuffle(w1), unshuffle(w2)
        if quant_type == QuantType.No:
            gate = [DenseWeight(u1[i, :inter]) for i in range(e)]
            up = [DenseWeight(u1[i, inter:]) for i in range(e)]
            down = [DenseWeight(u2[i]) for i in range(e)]
        else:
            c1, c2 = _unpack_pairs(u1), _unpack_pairs(u2)
            s1, s2 = w1_scale.transpose(1, 2), w2_scale.transpose(1, 2)
            gate = [Int4Weight(c1[i, :inter], s1[i, :inter].contiguous(), 32) for i in range(e)]
            up = [Int4Weight(c1[i, inter:], s1[i, inter:].contiguous(), 32) for i in range(e)]
            down = [Int4Weight(c2[i], s2[i].contiguous(), 32) for i in range(e)]
        op = TorchMoE()
        op.prepare(gate, up, down, None, x.dtype, x.device)
        _PREPARED[key] = op
    return _PREPARED[key](x, topk_ids.to(torch.int64), topk_weight)
