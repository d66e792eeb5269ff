"""Ahead-of-time compile check of every Triton kernel for Hopper (sm_90a), MI300 (gfx942) and MI350
(gfx950), with no GPU: Triton lowers to PTX / cubin and AMDGCN / hsaco on the CPU. It catches what
the interpreter cannot (dot shape and dtype rules, constexpr branches, fp8 types, shared-memory use)
at the shapes the runtime launches for Kimi-K2.5 (bf16, 64 MLA heads, latent 512 + rope 64, hidden
7168), and reads from the compiled code what each kernel uses (:mod:`.compiled_code`): registers,
spills, shared memory / LDS, global-load widths, matrix instructions.

    TRITON_INTERPRET=0 python -m eagle3.runtime.kernels.triton.aot_check [--bf16-only] [--table]
        [--json PATH] [--update-doc docs/kernels.md] [cuda:90] [hip:gfx942] [hip:gfx950]

Prints one line per (target, kernel) and exits 1 when a compile fails, or a production kernel (every
case but the fp32-compute variants, which exist for tests) needs more shared memory / LDS than the
target has or spills registers; the fp32 variants only warn. ``--table`` prints the markdown tables
docs/kernels.md carries, ``--update-doc`` rewrites them there (between the ``aot-table`` markers),
``--json`` writes every figure. The cases are :func:`_cases`: a kernel added there is compiled,
checked and tabled with no other change. It does not run anything: speed and numerics on real GPUs
are unverified until a GPU session runs the tests there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Shared memory (NVIDIA, opt-in maximum per block) / LDS (AMD, per workgroup) in bytes.
SHARED_LIMIT = {"cuda:90": 232448, "hip:gfx942": 65536, "hip:gfx950": 163840}
TARGETS = tuple(SHARED_LIMIT)  # the default: every target above
# Production kernels that spilled registers when this check learned to see spills (triton 3.9): the
# work issue 39 left open, allowed so the check still fails on any new spill. A row that stops
# spilling is reported (``stale_known_spills``) and the test asks for its removal: the list only shrinks.
# The split MLA kernels replaced the 16-head ones (9 spilling pairs; their gfx942 / gfx950 rows no longer
# spill but for OCP e4m3 on gfx942, which stores e4m3fnuz); on sm90 all 64 heads in one program
# hold a 64 x 512 fp32 accumulator (128 registers a thread), and Triton's pipelined wgmma loop spills a
# few more (docs/kernels.md).
KNOWN_SPILLS: dict[str, tuple[str, ...]] = {
    "mla split bf16 64 heads x 1 token [cuda], 512+64": ("cuda:90",),
    "mla split bf16 64 heads x 1 token [cuda], 512+64 tree": ("cuda:90",),
    "mla split bf16 64 heads x 1 token [cuda], 512+64 fp8e4nv cache": ("cuda:90",),
    "mla serial bf16 64 heads x 1 token [cuda], 512+64": ("cuda:90",),
    "mla split bf16 32 heads x 1 token [hip], 512+64 fp8e4nv cache": ("hip:gfx942",),
}
Case = tuple[str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]  # label, kernel, pointers, constexprs, floats
DOC_BEGIN, DOC_END = "<!-- aot-table begin (aot_check --update-doc) -->", "<!-- aot-table end -->"


def _cases() -> list[tuple[str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]]:
    import triton.language as tl

    from eagle3.runtime.kernels.triton import (
        act_quant,
        dense_gemm,
        linear,
        mla_attention,
        moe_align,
        paged_attention,
        plan,
        rmsnorm,
        rotary,
    )

    bf, i32 = "*bf16", "*i32"
    paged_ptrs = dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, o_ptr=bf, chunk_ptr=i32, pos_ptr=i32, bt_ptr=i32, lo_ptr=i32,
                      path_ptr=i32, order_ptr=i32)
    scales = ("scale", "v_scale")  # fp32 scalars (v_scale: an fp8 cache's value scale, 1.0 otherwise)
    bg, gqt = paged_attention.tile_shape(8)
    paged = dict(DOT=tl.bfloat16, IEEE=False, BLOCK_G=bg, QT=gqt, BLOCK_N=paged_attention.BLOCK_N, BLOCK_D=128,
                 BLOCK_V=128, PATH=plan.TREE_MAX_NODES,
                 _ints=dict(stride_qt=8192, stride_qh=1024, stride_qg=128, stride_ks=2048, stride_kh=128,
                            stride_vs=2048, stride_vh=128, stride_ot=8192, stride_oh=1024, stride_og=128, group=8,
                            d=128, dv=128, block_size=16))
    h = 7168  # hidden: the rows RMSNorm and the activation quantization read (contiguous)
    rows = dict(stride_x=h, stride_r=h, stride_o=h, stride_ro=h, n=h)
    norm_ptrs = dict(x_ptr=bf, r_ptr=bf, w_ptr=bf, out_ptr=bf, r_out_ptr=bf, q_ptr=bf, s_ptr=bf)
    norm = dict(HAS_RES=True, HAS_W=True, QUANT=0, QMAX=1.0, BF16=False, ROWS=rmsnorm.rows_per_program(h), BLOCK=8192,
                _ints=dict(rows, stride_q=0))
    norm_q = dict(norm, _ints=dict(rows, stride_q=h))  # + the per-token codes of the normed rows (W4A8)
    e_kimi = 384  # routed experts: the MoE alignment's bins
    return [
        ("rms_norm+residual h7168", rmsnorm._rms_norm_kernel, norm_ptrs, norm, ("eps",)),
        ("rms_norm+residual+int8 quant h7168", rmsnorm._rms_norm_kernel,
         dict(norm_ptrs, q_ptr="*i8", s_ptr="*fp32"), dict(norm_q, QUANT=1, QMAX=127.0), ("eps",)),
        ("rms_norm+residual+fp8 quant h7168", rmsnorm._rms_norm_kernel,
         dict(norm_ptrs, q_ptr="*fp8e4nv", s_ptr="*fp32"), dict(norm_q, QUANT=2, QMAX=448.0), ("eps",)),
        ("moe align 384 experts, block 16", moe_align._align_kernel,
         dict(ids_ptr="*i64", sorted_ptr="*i32", eid_ptr="*i32"),
         dict(E=e_kimi, E_PAD=512, BLOCK_M=16, CHUNK=moe_align.CHUNK), ()),
        # MLA rotates its 64 query heads and the shared key as one [T, 65, 64] tensor
        ("rope interleaved 64+1 heads x 64", rotary._rope_kernel, dict(x_ptr=bf, cos_ptr=bf, sin_ptr=bf, out_ptr=bf),
         dict(INTERLEAVED=True, BF16=False, TOKENS=1, BLOCK_H=128, BLOCK_D=32, _options=dict(enable_fp_fusion=False),
              _ints=dict(stride_xt=65 * 64, stride_xh=64, stride_ct=32, stride_st=32, stride_ot=65 * 64,
                         stride_oh=64, heads=65, half=32)), ()),
        ("act quant int8 h7168", act_quant._quant_kernel, dict(x_ptr=bf, q_ptr="*i8", s_ptr="*fp32"),
         dict(QMAX=127.0, TO_INT8=True, BLOCK=8192, _ints=dict(stride_x=h, stride_q=h, n=h)), ()),
        ("act quant fp8 h7168", act_quant._quant_kernel, dict(x_ptr=bf, q_ptr="*fp8e4nv", s_ptr="*fp32"),
         dict(QMAX=448.0, TO_INT8=False, BLOCK=8192, _ints=dict(stride_x=h, stride_q=h, n=h)), ()),
        ("paged gqa bf16 group 8 d128", paged_attention._paged_kernel, paged_ptrs, dict(paged, TREE=False), scales),
        ("paged gqa bf16 group 8 d128 tree", paged_attention._paged_kernel, paged_ptrs, dict(paged, TREE=True),
         scales),
        ("paged gqa bf16 group 8 d128 fp8e4nv cache", paged_attention._paged_kernel,
         dict(paged_ptrs, k_ptr="*fp8e4nv", v_ptr="*fp8e4nv"), dict(paged, TREE=False), scales),
    ] + _mla_cases(mla_attention, plan) + _gemm_cases(linear) + _dense_cases(dense_gemm)


def _mla_cases(mla: Any, plan: Any) -> list[tuple[str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]]:
    """MLA at Kimi-K2.5's head layout (64 heads, latent 512 + rope 64), each GPU family with its own
    tiles and launch (``mla_attention.tiles``; the family in the label, :func:`applies`): split
    stage 1 (decode / verify, also over trees and fp8 latents: OCP e4m3, and e4m3fnuz on gfx94x),
    the split merge, and the serial kernel (prefill; its tree and fp8 branches are stage 1's code)."""
    import triton.language as tl

    bf, i32, f32 = "*bf16", "*i32", "*fp32"
    index = dict(chunk_ptr=i32, pos_ptr=i32, bt_ptr=i32, lo_ptr=i32, path_ptr=i32, order_ptr=i32)
    split_ptrs = dict(index, q_ptr=bf, kv_ptr=bf, po_ptr=f32, pl_ptr=f32, pm_ptr=f32)
    serial_ptrs = dict(index, q_ptr=bf, kv_ptr=bf, o_ptr=bf, ro_ptr=f32, rl_ptr=f32, rm_ptr=f32, so_ptr=f32,
                       sl_ptr=f32, sm_ptr=f32)
    split = mla.split_size(64, 512, 64)
    # as the runtime launches them: latent rows of 576 values, 64 heads, blocks of 16 keys
    kimi = dict(stride_qt=64 * 576, stride_qh=576, stride_kv=576, stride_ot=64 * 512, stride_oh=512, heads=64,
                block_size=16)

    def ints(fn: Any) -> dict[str, int]:  # the integers each kernel takes, at Kimi's values
        return {a: v for a, v in kimi.items() if a in fn.arg_names}
    out: list[tuple[str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]] = []
    for family in ("cuda", "hip"):
        shape = mla.tiles(64, 512, family)
        tag = f"{shape.block_h} heads x {shape.qt} token [{family}]"
        base = dict(DOT=tl.bfloat16, IEEE=False, BLOCK_H=shape.block_h, QT=shape.qt, HB=64 // shape.block_h,
                    SPLIT=split, BLOCK_N=mla.BLOCK_N, D_LAT=512, D_ROPE=64, BLOCK_L=512, BLOCK_R=64, TREE=False,
                    PATH=plan.TREE_MAX_NODES, _warps=shape.warps, _stages=shape.stages,
                    _ints=ints(mla._mla_split_kernel))
        serial = dict(base, BD=max(16, min(512, mla.MERGE_TILE // (shape.block_h * shape.qt))),
                      _ints=ints(mla._mla_serial_kernel))
        out += [
            (f"mla split bf16 {tag}, 512+64", mla._mla_split_kernel, split_ptrs, base, ("scale",)),
            (f"mla split bf16 {tag}, 512+64 tree", mla._mla_split_kernel, split_ptrs, dict(base, TREE=True),
             ("scale",)),
            # the fp8 KV cache (runtime/kv_cache.py): OCP e4m3 (Hopper, gfx950) and e4m3fnuz (gfx942) latents
            *[(f"mla split bf16 {tag}, 512+64 {t} cache", mla._mla_split_kernel, dict(split_ptrs, kv_ptr=f"*{t}"),
               base, ("scale",)) for t in (("fp8e4nv",) if family == "cuda" else ("fp8e4nv", "fp8e4b8"))],
            (f"mla split fp32 ieee {tag}, 512+64", mla._mla_split_kernel,
             {k: f32 if v == bf else v for k, v in split_ptrs.items()}, dict(base, DOT=tl.float32, IEEE=True),
             ("scale",)),
            (f"mla serial bf16 {tag}, 512+64", mla._mla_serial_kernel, serial_ptrs, serial, ("scale", "v_scale")),
        ]
    hg = min(64, max(1, mla.MERGE_TILE // 512))
    out.append(("mla split merge 64 heads, 512", mla._mla_merge_kernel,
                dict(po_ptr=f32, pl_ptr=f32, pm_ptr=f32, o_ptr=bf, pos_ptr=i32),
                dict(SPLIT=split, D_LAT=512, HG=hg, BD=min(512, mla.MERGE_TILE // hg),
                     _ints=ints(mla._mla_merge_kernel)), ("v_scale",)))
    return out


def _dense_cases(dense_gemm: Any) -> list[tuple[str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]]:
    """The small dense products at Kimi-K2.5 shapes: the MLA absorption (bf16, 64 heads: q_nope [128]
    @ W_UK [128 x 512], o_lat [512] @ W_UV [512 x 128]) and the fp32 router (7168 x 384, split K,
    from the bf16 activations and weight) with its split sum, with the tiles of each weight shape.
    The router serves in fp32 (named f32, not fp32: ``--bf16-only`` skips only the fp32 variants
    that exist for tests)."""
    import torch
    import triton.language as tl

    def bmm(label: str, dtype: torch.dtype, n: int, k: int, x_strides: tuple[int, int]) -> tuple[
            str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]:
        t = dense_gemm.tiles(n, k, dtype)
        # bf16 operands either way: the router widens its bf16 activations and weight in registers
        ptr, dot = "*bf16", tl.float32 if dtype == torch.float32 else tl.bfloat16
        # x [B, M, K] read in place (its batch / row strides given), w [B, K, N] and o [B, M, N]
        # contiguous; the strides that follow the row count (s_os, s_ob) are multiples of N
        ints = dict(N=n, K=k, s_xb=x_strides[0], s_xm=x_strides[1], s_xk=1, s_wb=k * n, s_wk=n, s_wn=1,
                    s_os=16 * n if t.split > 1 else 0, s_ob=16 * n, s_om=n)
        consts = dict(DOT=dot, IEEE=dot == tl.float32, SPLITS=t.split, KC=k // t.split, BM=t.bm, BN=t.bn, BK=t.bk,
                      _warps=t.warps, _stages=t.stages, _ints=ints)
        out = "*fp32" if t.split > 1 or dtype == torch.float32 else ptr
        return (f"{label}, split {t.split}", dense_gemm._bmm_kernel, dict(x_ptr=ptr, w_ptr=ptr, o_ptr=out), consts, ())

    router_splits = dense_gemm.tiles(384, 7168, torch.float32).split
    # MLA at 64 heads: q_nope is a [T, 64, 128] view of q [T, 64, 192], o_lat a contiguous [T, 64, 512]
    return [
        bmm("dense bmm bf16 mla absorption q_nope @ W_UK 128 -> 512", torch.bfloat16, 512, 128, (192, 64 * 192)),
        bmm("dense bmm bf16 mla absorption o_lat @ W_UV 512 -> 128", torch.bfloat16, 128, 512, (512, 64 * 512)),
        bmm("dense gemm router f32 ieee 7168 -> 384, bf16 operands", torch.float32, 384, 7168, (16 * 7168, 7168)),
        ("dense gemm split-K sum", dense_gemm._sum_splits_kernel, dict(p_ptr="*fp32", o_ptr="*fp32"),
         dict(SPLITS=router_splits, BLOCK=dense_gemm.SUM_BLOCK, _ints=dict(numel=16 * 384)), ()),
    ]


def _gemm_cases(linear: Any) -> list[tuple[str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]]:
    """The GEMM kernel as the Kimi-K2.5 MoE (hidden 7168, expert width 2048: gate + up 7168 -> 2 x 2048,
    down 2048 -> 7168) and a dense 7168 -> 4096 launch it, with the compiled tile shapes and
    split-K of each weight shape (``gemm_tiles``), and the split-K sum of each epilogue."""
    import triton.language as tl

    sums: list[dict[str, Any]] = []

    def case(label: str, fmt: int, w: str, s: str, n: int, k: int, group: int = 0, **kw: Any) -> list[Case]:
        t = linear.tiles(fmt, n, k, group, interpret=False)
        exact = kw.get("EXACT", False)
        a = {1: "*i8", 3: "*u8"}[kw.get("A_DIGITS", 1)] if exact else "*bf16"
        consts = dict(K=k, WFMT=fmt, GROUP=group, SBN=0, SBK=0, HAS_TS=False, S_RND=0, W_RND=1, OUT_RND=1,
                      EXACT=False, A_DIGITS=1, W_DIGITS=1, UNIT=1.0, GATHER=0, GLU=False, SCATTER=False,
                      DOT=tl.bfloat16, IEEE=False, BF16W=False, MXF=False, SPLIT=t.split, BM=t.bm, BN=t.bn, BK=t.bk,
                      _warps=t.warps, _stages=t.stages)
        consts.update(kw)
        out = "*fp32" if kw.get("SCATTER") else "*bf16"
        part = ("*i64" if exact else "*fp32") if t.split > 1 else out
        ptrs = dict(a_ptr=a, sa_ptr="*fp32", w_ptr=w, s_ptr=s, ts_ptr="*fp32", out_ptr=part, rw_ptr="*fp32",
                    rows_ptr="*i32", eid_ptr="*i32")
        ints = _gemm_ints(fmt, n, k, group, consts)
        cases: list[Case] = [(f"{label}, split {t.split}", linear._gemm_kernel, ptrs, dict(consts, _ints=ints), ())]
        red = {k: consts[k] for k in ("EXACT", "UNIT", "OUT_RND", "GATHER", "GLU", "SCATTER")}
        red = dict(red, SPLIT=t.split, BR=linear.SPLITK_ROWS, BN=t.bn)
        if t.split > 1 and red not in sums:  # each distinct epilogue of the split-K sum once
            sums.append(red)
            red_ints = {a: ints[a] for a in ("N_OUT", "TOPK", "stride_om", "s_se", "P_STRIDE")}
            cases.append((f"{label}: split-K sum", linear._splitk_kernel,
                          dict(part_ptr=part, sa_ptr="*fp32", s_ptr=s, out_ptr=out, rw_ptr="*fp32", pe_ptr="*i64"),
                          dict(red, _ints=red_ints), ()))
        return cases

    int4, mx, w13, w2 = linear.INT4, linear.MXFP4, (2 * 2048, 7168), (7168, 2048)
    moe1 = dict(GATHER=1, GLU=True)
    moe2 = dict(GATHER=2, SCATTER=True)
    w4a16 = dict(group=32, S_RND=1, BF16W=True)  # Moonshot INT4 group 32, bf16 scales: the bf16x2 decode
    int8 = dict(EXACT=True)  # W4A8, int8 activations (per-channel INT4)
    fp8 = dict(EXACT=True, A_DIGITS=3, UNIT=2.0 ** -9)  # W4A8 FP8-stage: E4M3 activations, 3 int8 dots
    mxfp4 = dict(BF16W=True, MXF=True)  # E8M0 bytes in [2, 252]: bf16 bits of code x scale by integer ops
    return [  # every weight decode, the GLU / gather / scatter variants, the exact paths, a Linear
        *case("gemm moe w13 w4a16 g32 7168 -> 2x2048", int4, "*i32", "*bf16", *w13, **w4a16, **moe1),
        *case("gemm moe w2 w4a16 g32 2048 -> 7168", int4, "*i32", "*bf16", *w2, **w4a16, **moe2),
        *case("gemm moe w13 w4a8 int8 7168 -> 2x2048", int4, "*i32", "*fp32", *w13, **int8, **moe1),
        *case("gemm moe w2 w4a8 fp8-stage 2048 -> 7168", int4, "*i32", "*fp32", *w2, **fp8, **moe2),
        *case("gemm moe w13 mxfp4 7168 -> 2x2048", mx, "*i32", "*u8", *w13, **mxfp4, **moe1),
        *case("gemm moe w2 mxfp4 2048 -> 7168", mx, "*i32", "*u8", *w2, **mxfp4, **moe2),
        *case("gemm w4a16 g32 7168 -> 4096", int4, "*i32", "*bf16", 4096, 7168, **w4a16),
        *case("gemm bf16 7168 -> 4096", linear.DENSE, "*bf16", "*bf16", 4096, 7168),
        *case("gemm fp8 block 128 7168 -> 2048", linear.FP8, "*u8", "*fp32", 2048, 7168, SBN=128, SBK=128),
    ]


def _gemm_ints(fmt: int, n: int, k: int, group: int, consts: dict[str, Any]) -> dict[str, int]:
    """The integer arguments :func:`linear.launch` passes for a Kimi-K2.5 weight of ``n`` rows x
    ``k`` inputs (``linear.make_bank``'s layout, a top-8 MoE or a Linear), all but the row count
    ``M``. ``P_STRIDE`` (rows x output columns, or 0 without split-K) is a multiple of 16 at any
    batch: the columns are."""
    from eagle3.runtime.kernels.triton import linear

    four_bit = fmt in (linear.INT4, linear.MXFP4)
    row = k // 8 if four_bit else k  # int32 words (8 codes each), or FP8 / dense elements
    if fmt == linear.FP8 and consts["SBN"]:
        scale = (n // consts["SBN"], k // consts["SBK"])  # [E, n / 128, k / 128] fp32 block scales
    elif (fmt == linear.INT4 and group) or fmt == linear.MXFP4:
        scale = (n, k // (group or 32))  # [E, n, groups]: bf16 group scales / E8M0 bytes
    else:
        scale = (n, 0)  # [E, n] per-row fp32 (a 2-d scale: s_sn is passed as 0)
    n_out = n // 2 if consts["GLU"] else n
    return dict(N_OUT=n_out, TOPK=8 if consts["GATHER"] else 1, stride_am=k, stride_om=n_out, s_we=n * row,
                s_wn=row, s_se=scale[0] * max(scale[1], 1), s_sn=scale[1], s_tse=n if consts["HAS_TS"] else 1,
                P_STRIDE=16 * n if consts["SPLIT"] > 1 else 0)


@dataclass
class Row:
    """One (target, kernel): how it compiled and what it uses."""

    target: str  # the spec: "cuda:90", "hip:gfx942"
    kernel: str  # the case's label
    warps: int
    production: bool  # False for the fp32-compute variants (tests only: their limits only warn)
    seconds: float  # the compile's wall time (reading the code, batched per target, not included)
    resources: Any = None  # compiled_code.Resources, None when the compile failed
    error: str | None = None
    problems: tuple[str, ...] = ()  # over the shared-memory limit, spills
    known_spill: bool = False  # it spills and KNOWN_SPILLS allows it

    @property
    def failed(self) -> bool:
        return self.error is not None or (self.production and bool(self.problems))

    def to_json(self) -> dict[str, Any]:
        out = {"target": self.target, "kernel": self.kernel, "warps": self.warps, "production": self.production,
               "seconds": round(self.seconds, 2), "error": self.error, "problems": list(self.problems),
               "known_spill": self.known_spill}
        if self.resources is not None:
            out.update(self.resources.to_json())
        return out


def production(label: str) -> bool:
    """Whether a case serves models: every case but the fp32-compute variants, which exist for the
    interpreter's tests (the router's fp32 is named ``f32``: it serves)."""
    return "fp32" not in label


def applies(label: str, target: Any) -> bool:
    """fnuz fp8 (``fp8e4b8``) is MI300's (gfx94x) own type: the runtime stores OCP e4m3 elsewhere; a
    case with tiles of one GPU family (``[cuda]`` / ``[hip]`` in its label) compiles for that family."""
    family = next((f for f in ("cuda", "hip") if f"[{f}]" in label), target.backend)
    fnuz = "fp8e4b8" not in label or (target.backend == "hip" and str(target.arch).startswith("gfx94"))
    return fnuz and family == target.backend


def parse_target(spec: str) -> Any:
    from triton.backends.compiler import GPUTarget

    backend, _, arch = spec.partition(":")
    if backend not in ("cuda", "hip") or not arch or (backend == "cuda" and not arch.isdigit()):
        raise ValueError(f"target {spec!r}: expected cuda:CAPABILITY (cuda:90) or hip:ARCH (hip:gfx942)")
    return GPUTarget(backend, int(arch) if backend == "cuda" else arch, 32 if backend == "cuda" else 64)


@dataclass(frozen=True)
class Launch:
    """What ``triton.compile`` is given for a case: the signature (argument name -> type), the
    constexprs and the argument attributes, as the JIT builds them at run time."""

    signature: dict[str, str]
    constexprs: dict[str, Any]
    attrs: dict[tuple[int, ...], list[list[Any]]]
    options: dict[str, Any]


def launch_spec(fn: Any, ptrs: dict[str, str], consts: dict[str, Any], floats: tuple[str, ...],
                backend: Any = None) -> Launch:
    """The compile inputs of a case as the JIT would build them when the kernel is launched at
    Kimi-K2.5's shapes (triton 3.9's ``JITFunction.run``: ``native_specialize_impl`` per
    argument, then ``backend.parse_attr``):

    * every pointer is 16-byte aligned (``tt.divisibility = 16``): the runtime passes torch
      allocations or views at multiples of 16 bytes (Kimi's widths are multiples of 16);
    * an integer argument named in the case's ``_ints`` (its value at Kimi's shapes) is
      specialised as the JIT does it: a value of 1 becomes the constexpr 1, a multiple of 16 gets
      ``tt.divisibility = 16``; one not named (a row count: it follows the batch) stays a plain
      ``i32``, the JIT's compile for a batch that is not a multiple of 16;
    * ``_warps`` / ``_stages`` / ``_options``: the launch's ``num_warps`` / ``num_stages`` / other
      compile options (``enable_fp_fusion``), the backend's defaults where not given.

    Not modelled: AMD's ``tt.pointer_range = 32`` (buffer loads for tensors under 2 GB, from the
    tensor's storage size), so the gfx rows load through ``global_load``."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    backend = backend or BaseBackend
    consts = dict(consts)
    options = {"num_warps": consts.pop("_warps", 4), **consts.pop("_options", {})}
    if "_stages" in consts:
        options["num_stages"] = consts.pop("_stages")
    ints: dict[str, int] = consts.pop("_ints", {})
    unknown = set(ints) - set(fn.arg_names)
    if unknown:
        raise ValueError(f"{fn.__name__}: _ints names no argument: {sorted(unknown)}")
    sig: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a] = "constexpr"
            continue
        desc = ""
        if a in ptrs:
            sig[a], desc = ptrs[a], "D"
        elif a in floats:
            sig[a] = "fp32"
        elif a in ints:
            ty, desc = native_specialize_impl(backend, int(ints[a]), False, True, True)
            if ty == "constexpr":  # the JIT compiles an argument equal to 1 as the constant 1
                sig[a], consts[a] = "constexpr", desc
                continue
            sig[a] = ty
        else:
            sig[a] = "i32"
        if desc:
            attrs[(i,)] = backend.parse_attr(desc)
    return Launch(sig, consts, attrs, options)


def _compile(target: Any, label: str, fn: Any, ptrs: dict[str, str], consts: dict[str, Any],
             floats: tuple[str, ...]) -> tuple[Row, Any]:
    """Compile one case for one target as :func:`launch_spec` says the JIT would: its row and the
    compiled kernel (None when the compile failed: the row has the error)."""
    import triton
    from triton.compiler import ASTSource, make_backend

    spec = launch_spec(fn, ptrs, consts, floats, type(make_backend(target)))
    row = Row(f"{target.backend}:{target.arch}", label, spec.options["num_warps"], production(label), 0.0)
    t0 = time.time()
    kernel = None
    try:
        kernel = triton.compile(ASTSource(fn, spec.signature, constexprs=spec.constexprs, attrs=spec.attrs),
                                target=target, options=spec.options)
    except Exception as exc:  # report every kernel, then fail
        row.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    row.seconds = time.time() - t0
    return row, kernel


def _judge(row: Row) -> None:
    """The row's problems: over the target's shared memory / LDS, spills not in KNOWN_SPILLS."""
    res, limit, problems = row.resources, SHARED_LIMIT.get(row.target), []
    if limit is not None and res.shared_bytes > limit:
        problems.append(f"over the {limit} B shared-memory limit")
    if res.spills:
        row.known_spill = row.target in KNOWN_SPILLS.get(row.kernel, ())
        if not row.known_spill:
            problems.append("spills registers")
    row.problems = tuple(problems)


def compile_rows(target: Any, cases: list[Case]) -> list[Row]:
    """Compile each case for one target, then read what each compiled kernel uses from its code
    (:func:`compiled_code.resources_many`: NVIDIA's cubins go through one disassembler run, whose
    start-up would otherwise cost more than a small kernel's compile)."""
    from eagle3.runtime.kernels.triton import compiled_code

    compiled = [_compile(target, *case) for case in cases]
    done = [(row, kernel) for row, kernel in compiled if kernel is not None]
    backend, arch = target.backend, str(target.arch)
    try:
        found = compiled_code.resources_many([k for _, k in done], backend, arch)
    except compiled_code.ToolError:
        raise  # a missing or failing disassembler is the installation's fault, not a kernel's
    except Exception:  # code a reader cannot parse: read each kernel on its own to name which
        found = None
    for i, (row, kernel) in enumerate(done):
        try:
            row.resources = found[i] if found is not None else compiled_code.resources(kernel, backend, arch)
        except compiled_code.ToolError:
            raise
        except Exception as exc:  # report every kernel, then fail
            row.error = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        _judge(row)
    return [row for row, _ in compiled]


def _kib(n: int) -> str:
    return f"{n:,}"


def line(row: Row) -> str:
    """The one-line report of a row."""
    if row.error is not None:
        return f"{row.target} {row.kernel}: FAILED {row.error}"
    r = row.resources
    spill = (f"{r.spill_store_bytes} / {r.spill_load_bytes} B spilled" if r.spill_store_bytes is not None
             else f"{r.vgpr_spills} VGPR / {r.sgpr_spills} SGPR spilled")
    loads = "/".join(str(r.loads[w]) for w in ("128", "64", "32", "narrow"))
    note = " (spills: known, KNOWN_SPILLS)" if row.known_spill else ""
    if row.problems:
        note = (f" (FAILED: {'; '.join(row.problems)})" if row.production
                else f" (WARNING: {'; '.join(row.problems)}; fp32 compute is for tests only)")
    return (f"{row.target} {row.kernel}: compiled for {r.arch}, {r.registers} regs, {spill}, "
            f"{_kib(r.shared_bytes)} B shared, loads 128/64/32/narrow bit {loads}, {row.seconds:.1f} s{note}")


def _mma(r: Any) -> str:
    if not r.mma:
        return "-"
    return ", ".join(f"{op} {n}" for op, n in sorted(r.mma.items(), key=lambda kv: -kv[1]))


def table(rows: list[Row]) -> str:
    """Markdown: one table per target, a row per kernel (the figures docs/kernels.md carries)."""
    out: list[str] = []
    for target in dict.fromkeys(r.target for r in rows):
        mine = [r for r in rows if r.target == target]
        arch = next((r.resources.arch for r in mine if r.resources is not None), target)
        amd = target.startswith("hip")
        out.append(f"**{arch}** (`{target}`):")
        out.append("")
        if amd:
            out.append("| kernel | warps | VGPR / AGPR / SGPR | spilled VGPR / SGPR (scratch B) | LDS B | global loads "
                       "128 / 96 / 64 / 32 / <32 bit | of which into LDS | MFMA | waves / SIMD |")
            out.append("|---|---|---|---|---|---|---|---|---|")
        else:
            out.append("| kernel | warps | regs / thread | spill stores / loads B | shared B | global loads "
                       "128 / 64 / 32 / <32 bit | of which async | MMA |")
            out.append("|---|---|---|---|---|---|---|---|")
        for row in mine:
            if row.resources is None:
                out.append(f"| {row.kernel} | {row.warps} | compile failed: {row.error} |")
                continue
            r = row.resources
            name = row.kernel + ("" if row.production else " (fp32, tests only)")
            if r.spills:
                name = f"**{name}** (spills)"
            if amd:
                loads = " / ".join(str(r.loads[w]) for w in ("128", "96", "64", "32", "narrow"))
                out.append(f"| {name} | {row.warps} | {r.registers} / {r.agprs or 0} / {r.sgprs} | "
                           f"{r.vgpr_spills} / {r.sgpr_spills} ({_kib(r.scratch_bytes)}) | {_kib(r.shared_bytes)} | "
                           f"{loads} | {r.async_loads} | {_mma(r)} | {r.occupancy if r.occupancy is not None else '-'} |")
            else:
                loads = " / ".join(str(r.loads[w]) for w in ("128", "64", "32", "narrow"))
                out.append(f"| {name} | {row.warps} | {r.registers} | {_kib(r.spill_store_bytes)} / {_kib(r.spill_load_bytes)} | "
                           f"{_kib(r.shared_bytes)} | {loads} | {r.async_loads} | {_mma(r)} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def update_doc(path: Path, text: str) -> None:
    """Replace what stands between the aot-table markers of ``path`` with ``text`` (written aside,
    then moved into place)."""
    doc = path.read_text()
    if DOC_BEGIN not in doc or DOC_END not in doc:
        raise ValueError(f"{path}: no {DOC_BEGIN!r} ... {DOC_END!r} markers")
    head, rest = doc.split(DOC_BEGIN, 1)
    _, tail = rest.split(DOC_END, 1)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(f"{head}{DOC_BEGIN}\n{text}{DOC_END}{tail}")
    os.replace(tmp, path)


def stale_known_spills(rows: list[Row], labels: list[str] | None = None) -> list[str]:
    """KNOWN_SPILLS entries whose kernel compiled here without spilling ("target label"), and with
    ``labels`` (the case list's) entries that name no case at all (a kernel renamed or removed)."""
    stale = [f"{r.target} {r.kernel}" for r in rows if r.resources is not None and not r.resources.spills
             and r.target in KNOWN_SPILLS.get(r.kernel, ())]
    return stale + [f"{label} (no such case)" for label in KNOWN_SPILLS if labels is not None and label not in labels]


def report(rows: list[Row], labels: list[str] | None = None) -> dict[str, Any]:
    import triton

    return {"triton": triton.__version__, "targets": list(dict.fromkeys(r.target for r in rows)),
            "failed": sum(r.failed for r in rows), "stale_known_spills": stale_known_spills(rows, labels),
            "kernels": [r.to_json() for r in rows]}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m eagle3.runtime.kernels.triton.aot_check",
        description="Compile every Triton kernel for Hopper / MI300 / MI350 on the CPU and read registers, "
                    "spills, shared memory and load widths from the compiled code.",
        epilog="Example: TRITON_INTERPRET=0 python -m eagle3.runtime.kernels.triton.aot_check --bf16-only "
               "--table --json aot.json cuda:90 hip:gfx942")
    p.add_argument("targets", nargs="*", default=list(TARGETS),
                   help=f"cuda:CAPABILITY or hip:ARCH (default: {' '.join(TARGETS)}; cuda:90 is sm_90a)")
    p.add_argument("--bf16-only", action="store_true", help="skip the fp32-compute variants (tests only)")
    p.add_argument("--only", default=None, help="only the kernels whose label contains this text")
    p.add_argument("--table", action="store_true", help="print the markdown tables after the lines")
    p.add_argument("--json", type=Path, default=None, help="write every figure to this JSON file")
    p.add_argument("--update-doc", type=Path, default=None,
                   help="rewrite the tables between the aot-table markers of this markdown file")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("aot_check: unset TRITON_INTERPRET (the interpreter replaces the compiler)", file=sys.stderr)
        return 2
    from eagle3.runtime.kernels.triton.compiled_code import ToolError

    try:
        targets = [parse_target(s) for s in args.targets]
    except ValueError as err:
        print(f"aot_check: {err}", file=sys.stderr)
        return 2
    if args.update_doc is not None:
        doc = args.update_doc.read_text() if args.update_doc.is_file() else ""
        if DOC_BEGIN not in doc or DOC_END not in doc:
            print(f"aot_check: --update-doc {args.update_doc}: no such file or no aot-table markers", file=sys.stderr)
            return 2
    rows: list[Row] = []
    cases = _cases()
    labels = [c[0] for c in cases]
    try:
        for target in targets:
            mine = [c for c in cases if (production(c[0]) or not args.bf16_only) and applies(c[0], target)
                    and (args.only is None or args.only in c[0])]
            for row in compile_rows(target, mine):
                rows.append(row)
                print(line(row), flush=True)
    except ToolError as err:
        print(f"aot_check: {err}", file=sys.stderr)
        return 2
    if args.table or args.update_doc is not None:
        text = table(rows)
        if args.table:
            print(text, end="")
        if args.update_doc is not None:
            update_doc(args.update_doc, text)
    if args.json is not None:
        tmp = args.json.with_name(args.json.name + ".partial")
        tmp.write_text(json.dumps(report(rows, labels), indent=2) + "\n")
        os.replace(tmp, args.json)
    for entry in stale_known_spills(rows, labels):
        print(f"aot_check: {entry} no longer spills: remove it from KNOWN_SPILLS", file=sys.stderr)
    failed = [r for r in rows if r.failed]
    if failed:
        print(f"aot_check: {len(failed)} of {len(rows)} failed: " + "; ".join(
            f"{r.target} {r.kernel} ({r.error or ', '.join(r.problems)})" for r in failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
