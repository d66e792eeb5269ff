"""Ahead-of-time compile check of every Triton kernel for Hopper (sm90) and MI300 (gfx942), with no
GPU: Triton lowers to PTX / cubin and AMDGCN / hsaco on the CPU. It catches what the interpreter
cannot (dot shape and dtype rules, constexpr branches, fp8 types, shared-memory use) at the shapes
the runtime launches for Kimi-K2.5 (bf16, 64 MLA heads, latent 512 + rope 64, hidden 7168).

    TRITON_INTERPRET=0 python -m eagle3.runtime.kernels.triton.aot_check [--bf16-only] [cuda:90] [hip:gfx942]

Prints one line per (target, kernel) and exits 1 when a compile fails or a bf16 (production) kernel
needs more shared memory / LDS than the target has; fp32-compute variants (tests, not serving) only
warn. It does not run anything: speed and numerics on real GPUs are unverified until a GPU session
runs the tests there.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

# Shared memory (NVIDIA, opt-in maximum per block) / LDS (AMD, per workgroup) in bytes.
SHARED_LIMIT = {"cuda:90": 232448, "hip:gfx942": 65536, "hip:gfx950": 163840}


def _cases() -> list[tuple[str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]]:
    import triton.language as tl

    from eagle3.runtime.kernels.triton import (
        act_quant,
        dense_gemm,
        linear,
        mla_attention,
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
                 BLOCK_V=128, PATH=plan.TREE_MAX_NODES)
    return [
        ("rms_norm+residual h7168", rmsnorm._rms_norm_kernel,
         dict(x_ptr=bf, r_ptr=bf, w_ptr=bf, out_ptr=bf, r_out_ptr=bf),
         dict(HAS_RES=True, HAS_W=True, ROWS=rmsnorm.rows_per_program(7168), BLOCK=8192), ("eps",)),
        ("rope interleaved 64 heads x 64", rotary._rope_kernel, dict(x_ptr=bf, cos_ptr=bf, sin_ptr=bf, out_ptr=bf),
         dict(INTERLEAVED=True, BF16=False, TOKENS=1, BLOCK_H=64, BLOCK_D=32), ()),
        ("act quant int8 h7168", act_quant._quant_kernel, dict(x_ptr=bf, q_ptr="*i8", s_ptr="*fp32"),
         dict(QMAX=127.0, TO_INT8=True, BLOCK=8192), ()),
        ("act quant fp8 h7168", act_quant._quant_kernel, dict(x_ptr=bf, q_ptr="*fp8e4nv", s_ptr="*fp32"),
         dict(QMAX=448.0, TO_INT8=False, BLOCK=8192), ()),
        ("paged gqa bf16 group 8 d128", paged_attention._paged_kernel, paged_ptrs, dict(paged, TREE=False), scales),
        ("paged gqa bf16 group 8 d128 tree", paged_attention._paged_kernel, paged_ptrs, dict(paged, TREE=True),
         scales),
        ("paged gqa bf16 group 8 d128 fp8e4nv cache", paged_attention._paged_kernel,
         dict(paged_ptrs, k_ptr="*fp8e4nv", v_ptr="*fp8e4nv"), dict(paged, TREE=False), scales),
    ] + _mla_cases(mla_attention, plan) + _gemm_cases(linear) + _dense_cases(dense_gemm)


def _mla_cases(mla: Any, plan: Any) -> list[tuple[str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]]:
    """MLA at Kimi-K2.5's head layout (64 heads, latent 512 + rope 64), each GPU family with its own
    tiles (``_targets``): split stage 1 (decode / verify, also over trees and fp8 latents: OCP e4m3
    on Hopper and gfx950, e4m3fnuz on gfx942), the split merge, and the serial kernel (prefill; its
    tree and fp8 branches are stage 1's code)."""
    import triton.language as tl

    bf, i32, f32 = "*bf16", "*i32", "*fp32"
    index = dict(chunk_ptr=i32, pos_ptr=i32, bt_ptr=i32, lo_ptr=i32, path_ptr=i32, order_ptr=i32)
    split_ptrs = dict(index, q_ptr=bf, kv_ptr=bf, po_ptr=f32, pl_ptr=f32, pm_ptr=f32)
    serial_ptrs = dict(index, q_ptr=bf, kv_ptr=bf, o_ptr=bf, ro_ptr=f32, rl_ptr=f32, rm_ptr=f32, so_ptr=f32,
                       sl_ptr=f32, sm_ptr=f32)
    out: list[tuple[str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]] = []
    for family, targets in (("cuda", ("cuda:90",)), ("hip", ("hip:gfx942", "hip:gfx950"))):
        shape = mla.tiles(64, 512, family)
        bh, qt = shape.block_h, shape.qt
        rows = bh * qt
        tag = f"{bh} heads x {qt} token"
        base = dict(DOT=tl.bfloat16, IEEE=False, BLOCK_H=bh, QT=qt, HB=64 // bh, BLOCK_N=mla.BLOCK_N, D_LAT=512,
                    D_ROPE=64, BLOCK_L=512, BLOCK_R=64, TREE=False, PATH=plan.TREE_MAX_NODES, _warps=shape.warps,
                    _stages=shape.stages, _targets=targets)
        bf16 = fp8 = dict(base, SPLIT=mla.split_size(64, 512, 64))
        serial = dict(BD=max(16, min(512, mla.MERGE_TILE // rows)))
        fp8_types = [("fp8e4nv", targets)] + ([("fp8e4b8", ("hip:gfx942",))] if family == "hip" else [])
        out += [
            (f"mla split bf16 {tag}, 512+64", mla._mla_split_kernel, split_ptrs, bf16, ("scale",)),
            (f"mla split bf16 {tag}, 512+64 tree", mla._mla_split_kernel, split_ptrs, dict(bf16, TREE=True),
             ("scale",)),
            *[(f"mla split bf16 {tag}, 512+64 {t} cache", mla._mla_split_kernel, dict(split_ptrs, kv_ptr=f"*{t}"),
               dict(fp8, _targets=tt), ("scale",)) for t, tt in fp8_types],
            (f"mla split fp32 ieee {tag}, 512+64", mla._mla_split_kernel,
             {k: f32 if v == bf else v for k, v in split_ptrs.items()}, dict(bf16, DOT=tl.float32, IEEE=True),
             ("scale",)),
            (f"mla serial bf16 {tag}, 512+64", mla._mla_serial_kernel, serial_ptrs, dict(bf16, **serial),
             ("scale", "v_scale")),
        ]
    hg = min(64, max(1, mla.MERGE_TILE // 512))
    out.append(("mla split merge 64 heads, 512", mla._mla_merge_kernel, dict(po_ptr="*fp32", pl_ptr="*fp32",
                pm_ptr="*fp32", o_ptr="*bf16", pos_ptr="*i32"),
                dict(SPLIT=mla.split_size(64, 512, 64), D_LAT=512, HG=hg, BD=min(512, mla.MERGE_TILE // hg)),
                ("v_scale",)))
    return out


def _dense_cases(dense_gemm: Any) -> list[tuple[str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]]:
    """The small dense products at Kimi-K2.5 shapes: the MLA absorption (bf16, 64 heads, 128 x 512)
    and the fp32 router (7168 x 384, split K) with its split sum. The router serves in fp32 (named
    f32, not fp32: ``--bf16-only`` skips only the fp32 variants that exist for tests)."""
    import triton.language as tl

    def bmm(label: str, ptr: str, dot: Any, n: int, k: int) -> tuple[str, Any, dict[str, str], dict[str, Any],
                                                                      tuple[str, ...]]:
        bm, bn, bk, splits = dense_gemm.tiles(n, k)
        consts = dict(DOT=dot, IEEE=dot == tl.float32, SPLITS=splits, KC=dense_gemm.K_CHUNK, BM=bm, BN=bn, BK=bk)
        return (label, dense_gemm._bmm_kernel, dict(x_ptr=ptr, w_ptr=ptr, o_ptr=ptr if splits == 1 else "*fp32"),
                consts, ())

    _, _, _, router_splits = dense_gemm.tiles(384, 7168)
    return [
        bmm("dense bmm bf16 mla absorption 128 x 512", "*bf16", tl.bfloat16, 512, 128),
        bmm("dense gemm router f32 ieee 7168 x 384, split K", "*fp32", tl.float32, 384, 7168),
        ("dense gemm split-K sum", dense_gemm._sum_splits_kernel, dict(p_ptr="*fp32", o_ptr="*fp32"),
         dict(SPLITS=router_splits, BLOCK=dense_gemm.SUM_BLOCK), ()),
    ]


def _gemm_cases(linear: Any) -> list[tuple[str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]]:
    """The GEMM kernel as the Kimi-K2.5 MoE (hidden 7168, expert width 2048) and attention
    projections launch it, with the compiled tile shapes."""
    import triton.language as tl

    def case(label: str, fmt: int, w: str, s: str, n: int, k: int,
             **kw: Any) -> tuple[str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]:
        bm, bn, bk = linear.tiles(fmt, n, k, interpret=False)
        exact = kw.get("EXACT", False)
        a = {1: "*i8", 3: "*u8"}[kw.get("A_DIGITS", 1)] if exact else "*bf16"
        consts = dict(K=k, WFMT=fmt, PACK=0, GROUP=0, SBN=0, SBK=0, HAS_TS=False, S_RND=0, W_RND=1, OUT_RND=1,
                      EXACT=False, A_DIGITS=1, W_DIGITS=1, UNIT=1.0, GATHER=0, GLU=False, SCATTER=False,
                      DOT=tl.bfloat16, IEEE=False, BM=bm, BN=bn, BK=bk)
        consts.update(kw)
        ptrs = dict(a_ptr=a, sa_ptr="*fp32", w_ptr=w, s_ptr=s, ts_ptr="*fp32", out_ptr="*fp32" if kw.get("SCATTER")
                    else "*bf16", rw_ptr="*fp32", rows_ptr="*i32", eid_ptr="*i32")
        return (label, linear._gemm_kernel, ptrs, consts, ())

    moe1 = dict(GATHER=1, GLU=True)
    moe2 = dict(GATHER=2, SCATTER=True)
    return [  # the GLU / gather / scatter variants, the exact two-digit-group path, each weight decode
        case("gemm moe w13 w4a16 ct g32 7168", linear.INT4, "*i32", "*bf16", 2 * 2048, 7168, PACK=1, GROUP=32,
             S_RND=1, **moe1),
        case("gemm moe w2 mxfp4 2048", linear.MXFP4, "*u8", "*u8", 7168, 2048, **moe2),
        case("gemm moe w13 w4a8 fp8-stage 7168", linear.INT4, "*i32", "*fp32", 2 * 2048, 7168, PACK=2,
             EXACT=True, A_DIGITS=3, UNIT=2.0 ** -9, **moe1),
        case("gemm fp8 block 128 7168", linear.FP8, "*u8", "*fp32", 2048, 7168, SBN=128, SBK=128),
    ]


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("aot_check: unset TRITON_INTERPRET (the interpreter replaces the compiler)", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bf16_only = "--bf16-only" in argv
    specs = [a for a in argv if not a.startswith("--")]
    targets = []
    for spec in specs or ["cuda:90", "hip:gfx942"]:
        backend, arch = spec.split(":")
        targets.append(GPUTarget(backend, int(arch) if backend == "cuda" else arch, 32 if backend == "cuda" else 64))
    failed = 0
    for target in targets:
        for label, fn, ptrs, consts, floats in _cases():
            if (bf16_only and "fp32" in label) or ("fp8e4b8" in label and target.backend == "cuda"):
                continue  # fnuz fp8 is AMD's (MI300): NVIDIA targets have no such type
            consts = dict(consts)
            warps = consts.pop("_warps", 4)
            stages = consts.pop("_stages", None)
            only = consts.pop("_targets", None)  # tiles chosen per GPU family
            if only is not None and f"{target.backend}:{target.arch}" not in only:
                continue
            sig = {a: "constexpr" if a in consts else ptrs.get(a, "fp32" if a in floats else "i32")
                   for a in fn.arg_names}
            name = f"{target.backend}:{target.arch}"
            t0 = time.time()
            try:
                k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=target,
                                   options={"num_warps": warps, **({} if stages is None else {"num_stages": stages})})
            except Exception as exc:  # report every kernel, then fail
                failed += 1
                print(f"{name} {label}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                continue
            shared, limit = int(k.metadata.shared), SHARED_LIMIT.get(name)
            note = ""
            if limit is not None and shared > limit:
                if "fp32" in label:
                    note = f" (WARNING: over the {limit} B limit; fp32 compute is for tests only)"
                else:
                    failed += 1
                    note = f" (FAILED: over the {limit} B limit)"
            print(f"{name} {label}: compiled, {shared} B shared, {time.time() - t0:.1f} s{note}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
