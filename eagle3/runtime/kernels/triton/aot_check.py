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
    mla_ptrs = dict(q_ptr=bf, kv_ptr=bf, o_ptr=bf, chunk_ptr=i32, pos_ptr=i32, bt_ptr=i32, lo_ptr=i32, path_ptr=i32,
                    order_ptr=i32)
    paged_ptrs = dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, o_ptr=bf, chunk_ptr=i32, pos_ptr=i32, bt_ptr=i32, lo_ptr=i32,
                      path_ptr=i32, order_ptr=i32)
    scales = ("scale", "v_scale")  # fp32 scalars (v_scale: an fp8 cache's value scale, 1.0 otherwise)
    bh, qt = mla_attention.tile_shape(64, 512)
    bg, gqt = paged_attention.tile_shape(8)
    mla = dict(DOT=tl.bfloat16, IEEE=False, BLOCK_H=bh, QT=qt, BLOCK_N=mla_attention.BLOCK_N, BLOCK_L=512,
               BLOCK_R=64, PATH=plan.TREE_MAX_NODES, _warps=8)
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
        ("mla bf16 64 heads 512+64", mla_attention._mla_kernel, mla_ptrs, dict(mla, TREE=False), scales),
        ("mla bf16 64 heads 512+64 tree", mla_attention._mla_kernel, mla_ptrs, dict(mla, TREE=True), scales),
        # the fp8 KV cache (runtime/kv_cache.py): OCP e4m3 (Hopper, gfx950) and e4m3fnuz (gfx942) latents
        ("mla bf16 64 heads 512+64 fp8e4nv cache", mla_attention._mla_kernel, dict(mla_ptrs, kv_ptr="*fp8e4nv"),
         dict(mla, TREE=False), scales),
        ("mla bf16 64 heads 512+64 fp8e4b8 cache", mla_attention._mla_kernel, dict(mla_ptrs, kv_ptr="*fp8e4b8"),
         dict(mla, TREE=False), scales),
        ("mla fp32 ieee 512+64", mla_attention._mla_kernel, {k: "*fp32" if v == bf else v for k, v in mla_ptrs.items()},
         dict(mla, DOT=tl.float32, IEEE=True, TREE=False), scales),
        ("paged gqa bf16 group 8 d128", paged_attention._paged_kernel, paged_ptrs, dict(paged, TREE=False), scales),
        ("paged gqa bf16 group 8 d128 tree", paged_attention._paged_kernel, paged_ptrs, dict(paged, TREE=True),
         scales),
        ("paged gqa bf16 group 8 d128 fp8e4nv cache", paged_attention._paged_kernel,
         dict(paged_ptrs, k_ptr="*fp8e4nv", v_ptr="*fp8e4nv"), dict(paged, TREE=False), scales),
    ] + _gemm_cases(linear) + _dense_cases(dense_gemm)


def _dense_cases(dense_gemm: Any) -> list[tuple[str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]]:
    """The small dense products at Kimi-K2.5 shapes: the MLA absorption (bf16, 64 heads: q_nope [128]
    @ W_UK [128 x 512], o_lat [512] @ W_UV [512 x 128]) and the fp32 router (7168 x 384, split K)
    with its split sum, with the tiles of each weight shape. Unit strides are constexprs, as the
    JIT specialises them at run time. The router serves in fp32 (named f32, not fp32:
    ``--bf16-only`` skips only the fp32 variants that exist for tests)."""
    import torch
    import triton.language as tl

    def bmm(label: str, dtype: torch.dtype, n: int, k: int) -> tuple[str, Any, dict[str, str], dict[str, Any],
                                                                     tuple[str, ...]]:
        t = dense_gemm.tiles(n, k, dtype)
        ptr, dot = ("*fp32", tl.float32) if dtype == torch.float32 else ("*bf16", tl.bfloat16)
        consts = dict(DOT=dot, IEEE=dot == tl.float32, SPLITS=t.split, KC=k // t.split, BM=t.bm, BN=t.bn, BK=t.bk,
                      s_xk=1, s_wn=1, _warps=t.warps)
        return (f"{label}, split {t.split}", dense_gemm._bmm_kernel,
                dict(x_ptr=ptr, w_ptr=ptr, o_ptr=ptr if t.split == 1 else "*fp32"), consts, ())

    router_splits = dense_gemm.tiles(384, 7168, torch.float32).split
    return [
        bmm("dense bmm bf16 mla absorption q_nope @ W_UK 128 -> 512", torch.bfloat16, 512, 128),
        bmm("dense bmm bf16 mla absorption o_lat @ W_UV 512 -> 128", torch.bfloat16, 128, 512),
        bmm("dense gemm router f32 ieee 7168 -> 384", torch.float32, 384, 7168),
        ("dense gemm split-K sum", dense_gemm._sum_splits_kernel, dict(p_ptr="*fp32", o_ptr="*fp32"),
         dict(SPLITS=router_splits, BLOCK=dense_gemm.SUM_BLOCK), ()),
    ]


def _gemm_cases(linear: Any) -> list[tuple[str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]]:
    """The GEMM kernel as the Kimi-K2.5 MoE (hidden 7168, expert width 2048: gate + up 7168 -> 2 x 2048,
    down 2048 -> 7168) and a dense 7168 -> 4096 launch it, with the compiled tile shapes and
    split-K of each weight shape (``gemm_tiles``), and the split-K sum of each epilogue."""
    import triton.language as tl

    Case = tuple[str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]
    sums: list[dict[str, Any]] = []

    def case(label: str, fmt: int, w: str, s: str, n: int, k: int, group: int = 0, **kw: Any) -> list[Case]:
        t = linear.tiles(fmt, n, k, group, interpret=False)
        exact = kw.get("EXACT", False)
        a = {1: "*i8", 3: "*u8"}[kw.get("A_DIGITS", 1)] if exact else "*bf16"
        consts = dict(K=k, WFMT=fmt, GROUP=group, SBN=0, SBK=0, HAS_TS=False, S_RND=0, W_RND=1, OUT_RND=1,
                      EXACT=False, A_DIGITS=1, W_DIGITS=1, UNIT=1.0, GATHER=0, GLU=False, SCATTER=False,
                      DOT=tl.bfloat16, IEEE=False, BF16W=False, MXF=False, SPLIT=t.split, BM=t.bm, BN=t.bn, BK=t.bk,
                      _warps=t.warps)
        consts.update(kw)
        out = "*fp32" if kw.get("SCATTER") else "*bf16"
        part = ("*i64" if exact else "*fp32") if t.split > 1 else out
        ptrs = dict(a_ptr=a, sa_ptr="*fp32", w_ptr=w, s_ptr=s, ts_ptr="*fp32", out_ptr=part, rw_ptr="*fp32",
                    rows_ptr="*i32", eid_ptr="*i32")
        cases: list[Case] = [(f"{label}, split {t.split}", linear._gemm_kernel, ptrs, consts, ())]
        red = {k: consts[k] for k in ("EXACT", "UNIT", "OUT_RND", "GATHER", "GLU", "SCATTER")}
        red = dict(red, SPLIT=t.split, BR=linear.SPLITK_ROWS, BN=t.bn)
        if t.split > 1 and red not in sums:  # each distinct epilogue of the split-K sum once
            sums.append(red)
            cases.append((f"{label}: split-K sum", linear._splitk_kernel,
                          dict(part_ptr=part, sa_ptr="*fp32", s_ptr=s, out_ptr=out, rw_ptr="*fp32", pe_ptr="*i64"),
                          red, ()))
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
            sig = {a: "constexpr" if a in consts else ptrs.get(a, "fp32" if a in floats else "i32")
                   for a in fn.arg_names}
            name = f"{target.backend}:{target.arch}"
            t0 = time.time()
            try:
                k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=target,
                                   options={"num_warps": warps})
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
