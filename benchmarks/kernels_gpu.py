"""GPU kernel benchmark: achieved HBM bytes/s per kernel at Kimi-K2.5 shapes, triton vs torch on the
same GPU, and end-to-end decode tokens/s on the full-width slice, with and without CUDA graphs.

Per kernel and decode batch (default 1, 4, 16, 64), each through the kernel backend's own interface
(``get_backend(name, "cuda")``: what the runtime calls), timed with CUDA events (median of
``--iters`` after warm-up), reported as bytes moved / time and as a fraction of the GPU's HBM peak:

=================  ===========================================================================
``mla_decode``     MLA attention, absorbed form, 64 heads x (512 + 64) latent, bf16, every sequence
                   ``--context`` keys, 1 query (decode) ; bytes = the latent rows read + q + out
``mla_verify``     the same with 4 queries per sequence (EAGLE verify, k = 3)
``mla_decode_fp8`` ``mla_decode`` over an fp8 (e4m3) latent cache with a per-tensor scale
                   (``kv_cache_dtype="fp8"``): the latent rows read are 1 byte per value
``mla_verify_fp8`` ``mla_verify`` over the fp8 latent
``moe_w4a16``      routed experts, 384 x (gate+up 2 x 2048, down 2048) x hidden 7168, Moonshot INT4
                   group 32, top-8 (random routing); bytes = the experts the batch touches (codes +
                   scales) + activations. Triton: ``eagle3.runtime.kernels.triton.moe.TritonMoE``
``linear_w4a16``   one INT4 group-32 GEMM 7168 -> 4096 (a shared-expert gate+up at W4A8 / INT4 recipes)
                   Triton: ``eagle3.runtime.kernels.triton.linear``
``linear_bf16``    the same shape in bf16 (attention / shared-expert projections of the native model)
``rmsnorm``        RMSNorm over hidden 7168 ; ``act_quant_int8``: per-token int8 quantization
``router_fp32``    the MoE router ``x.float() @ W_gate.T``, 7168 -> 384 in fp32 (``be.matmul(x, W, fp32)``
                   on the bf16 rows and weight); bytes = the bf16 weight + rows + fp32 logits.
                   Triton: ``triton.dense_gemm``, widening in registers (batch invariant; torch:
                   widened copies, cuBLAS on 16-row tiles)
``mla_absorb``     the MLA absorption ``q_nope[h] @ W_UK[h]``, 64 heads x 128 -> 512 in bf16 (``be.bmm``)
=================  ===========================================================================

A Triton row whose kernel module is not in this tree says ``not built`` (the backend would still
delegate that op to torch). HBM peaks by device name from the memory plan's card table
(``eagle3.plan.GPUS``: H100 SXM 3.35 TB/s, H100 PCIe 2.0, H100 NVL 3.9, H200 4.8, MI300X 5.3,
MI325X 6.0, MI355X 8.0, vendor figures; ``--hbm-peak`` overrides).
The issue's goal: MoE and MLA decode >= 60 % of HBM peak at batch <= 16 on H100 (printed). The fp8
cache's rows are printed beside bf16's (``kv_lines``): time per call and bytes/s, same batch and backend.

Byte floors: each row's bytes are the fewest one call must move (weights + KV + activations in and
out, each once), so ``floor_s`` = bytes / HBM peak is the shortest time the call can take, printed
beside the measured time with ``x_floor`` = measured / floor (1 / the HBM fraction). The MoE row
counts the distinct experts its random routing touched (``active_experts``; the uniform-routing
expectation ``expected_active_experts`` beside it). End to end, each plain row gets the slice's
decode-step floor at its batch from the memory plan (``eagle3.plan.decode_floor``: every weight the
step reads, the embedding by rows, the KV cache at the rows' mean context) and its TPOT over it.

End to end (``--slice DIR``, made by ``eagle3 make-slice DIR --layers 2 --experts 8``, or
``--make-slice`` to write one under ``--work``): ``LLM(slice, backend=torch|triton,
enforce_eager=...)`` greedy, ``--e2e-batches`` prompts of 32 random tokens; decode tokens/s =
batch x (N - 1) / (time of N tokens - time of 1 token), N = ``--e2e-tokens``; the plain rows once per
``--e2e-kv-dtypes`` (default ``auto,fp8``: the bf16 and the fp8 KV cache side by side).

Speculative rows (``--draft DIR``, made by ``eagle3 make-slice DIR --layers 2 --draft eagle3.1-mla``,
or ``--make-draft eagle3.1-mla`` under ``--work``): the same measurement with the draft, per
``--spec-shapes`` ``K,S,N`` (K = 1: a chain of S drafts; K > 1: a tree of N tokens with topk K and
S steps; ``auto``: ``num_speculative_tokens="auto"`` up to k = 3, which with these drafts should
settle on k = 0 and run at the plain rows' speed), on ``--spec-backends``, with and without graphs. The draft's weights are random, so it
accepts nothing: each step emits one token per sequence, so TPOT is the cost of a step (target
verify + draft steps) at the real widths, the number a tree has to earn back with its acceptance
(measured on the trained tiny pair, docs/trees.md). A tree drafts nothing in its last S steps (a
chain drafts fewer tokens there), so the printed comparison is per drafting step: the run's time
less its other steps at the plain row's TPOT, per step in which every sequence drafted.

Writes a JSON report and a PNG next to it. Without a CUDA / ROCm GPU it says so and exits 2.

Example:
    python benchmarks/kernels_gpu.py --out kernels_gpu.json --make-slice --work /tmp/kgpu
    python benchmarks/kernels_gpu.py --kernels mla_decode,moe_w4a16 --batches 1,16 --skip-e2e
    python benchmarks/kernels_gpu.py --kernels rmsnorm --make-slice --make-draft eagle3.1-mla --work /tmp/kgpu
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

HIDDEN, INTER, EXPERTS, TOPK = 7168, 2048, 384, 8
MLA_HEADS, D_LAT, D_ROPE = 64, 512, 64
GROUP = 32
DEVICE = "cuda"  # the kernel cases' device (a CPU dry run of the case builders sets "cpu")
AUTO_MAX_K = 3  # --spec-shapes auto: num_speculative_tokens="auto" up to this k
KERNELS = ("mla_decode", "mla_verify", "mla_decode_fp8", "mla_verify_fp8", "moe_w4a16", "linear_w4a16", "linear_bf16",
           "rmsnorm", "act_quant_int8", "router_fp32", "mla_absorb")
KV_DTYPES = ("auto", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2")  # --e2e-kv-dtypes (the engine's kv_cache_dtype)
FP8_KV_SCALE = 0.05  # the fp8 kernel rows' per-tensor scale (any value: the kernel's work does not depend on it)
BACKENDS = ("torch", "triton")
# The Triton kernels each benchmark row stands for: (module, attribute) looked up by name, so that a
# row says "not built" until the module lands (moe.py / linear.py come from a parallel change).
TRITON_KERNEL: dict[str, tuple[str, str]] = {
    "mla_decode": ("eagle3.runtime.kernels.triton.mla_attention", "mla_attention"),
    "mla_verify": ("eagle3.runtime.kernels.triton.mla_attention", "mla_attention"),
    "mla_decode_fp8": ("eagle3.runtime.kernels.triton.mla_attention", "mla_attention"),
    "mla_verify_fp8": ("eagle3.runtime.kernels.triton.mla_attention", "mla_attention"),
    "moe_w4a16": ("eagle3.runtime.kernels.triton.moe", "TritonMoE"),
    "linear_w4a16": ("eagle3.runtime.kernels.triton.linear", "launch"),
    "linear_bf16": ("eagle3.runtime.kernels.triton.linear", "launch"),
    "rmsnorm": ("eagle3.runtime.kernels.triton.rmsnorm", "rms_norm"),
    "act_quant_int8": ("eagle3.runtime.kernels.triton.act_quant", "quantize_int8_per_token"),
    "router_fp32": ("eagle3.runtime.kernels.triton.dense_gemm", "matmul"),
    "mla_absorb": ("eagle3.runtime.kernels.triton.dense_gemm", "bmm"),
}


def _csv_ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _csv_names(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        vals = [x.strip() for x in text.split(",") if x.strip()]
        bad = [v for v in vals if v not in choices]
        if bad or not vals:
            raise argparse.ArgumentTypeError(f"{', '.join(bad) or text!r}: expected some of {', '.join(choices)}")
        return vals
    return parse


def _shapes(text: str) -> list[tuple[int, int, int] | str]:
    out: list[tuple[int, int, int] | str] = []
    for part in text.split():
        if part == "auto":
            out.append(part)
            continue
        try:
            k, steps, n = (int(x) for x in part.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: expected K,S,N (e.g. 2,5,16) or auto") from None
        if k < 1 or steps < 1 or n < 2 or (k == 1 and n != steps + 1):
            raise argparse.ArgumentTypeError(f"{part!r}: K >= 1, S >= 1, N >= 2; a chain (K = 1) has N = S + 1")
        out.append((k, steps, n))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kernels_gpu.py", description=__doc__.split("\n\n")[0],
                                epilog="Example: python benchmarks/kernels_gpu.py --out kernels_gpu.json "
                                       "--make-slice --work /tmp/kgpu",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("kernels_gpu.json"), help="JSON report (PNG beside it)")
    p.add_argument("--batches", type=_csv_ints, default=[1, 4, 16, 64], help="decode batches (sequences)")
    p.add_argument("--kernels", type=_csv_names(KERNELS), default=list(KERNELS))
    p.add_argument("--backends", type=_csv_names(BACKENDS), default=list(BACKENDS))
    p.add_argument("--context", type=int, default=4096, help="keys per sequence for MLA")
    p.add_argument("--experts", type=int, default=EXPERTS, help="routed experts (384: Kimi; fewer to save memory)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hbm-peak", type=float, default=None, help="TB/s; default: from the device name")
    p.add_argument("--slice", type=Path, default=None, help="full-width slice for the end-to-end rows")
    p.add_argument("--make-slice", action="store_true", help="write a 2-layer 8-expert slice under --work")
    p.add_argument("--work", type=Path, default=Path("kernels_gpu_work"))
    p.add_argument("--e2e-batches", type=_csv_ints, default=[1, 16])
    p.add_argument("--e2e-tokens", type=int, default=32)
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--skip-kernels", action="store_true", help="end-to-end rows only")
    p.add_argument("--e2e-graphs", choices=("both", "on", "off"), default="both",
                   help="end-to-end rows with CUDA graphs (on), eager (off) or both")
    p.add_argument("--e2e-kv-gib", type=float, default=4.0, help="KV cache per end-to-end engine (GiB)")
    p.add_argument("--e2e-kv-dtypes", type=_csv_names(KV_DTYPES), default=["auto", "fp8"],
                   help="KV cache dtypes of the plain end-to-end rows (the speculative rows: auto)")
    p.add_argument("--draft", type=Path, default=None, help="full-width draft for the speculative rows")
    p.add_argument("--make-draft", choices=("eagle3", "eagle3.1-mla"), default=None,
                   help="write a draft of this format for the slice under --work")
    p.add_argument("--spec-shapes", type=_shapes, default=[(1, 3, 4), (2, 5, 16)],
                   help="K,S,N per speculative row, space separated (K = 1: chain), or auto (k <= 3)")
    p.add_argument("--spec-backends", type=_csv_names(BACKENDS), default=["triton"])
    a = p.parse_args(argv)
    if a.iters < 1 or a.context < 1 or a.experts < TOPK or a.e2e_tokens < 2:
        p.error("--iters >= 1, --context >= 1, --experts >= 8 and --e2e-tokens >= 2")
    a.png = a.out.with_suffix(".png")
    return a


def hbm_peak_tbps(device_name: str) -> float | None:
    """The HBM peak (TB/s) of a device named ``device_name``: the memory plan's figure for that card
    (``eagle3.plan.GPUS``, the one table of them; None: not in it)."""
    from eagle3.plan import gpu_for_device_name

    gpu = gpu_for_device_name(device_name)
    return None if gpu is None else gpu.hbm_tbps


def triton_kernel_status(kernel: str) -> str | None:
    """None when the Triton kernel behind ``kernel`` is in this tree, else why not ("not built ...")."""
    module, attr = TRITON_KERNEL[kernel]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and module.startswith(err.name):
            return f"not built ({module.rsplit('.', 2)[-2]}/{module.rsplit('.', 1)[-1]}.py missing)"
        raise
    if attr and not hasattr(mod, attr):
        return f"not built ({module}.{attr} missing)"
    return None


def mla_bytes(batch: int, q_len: int, context: int, elem: int = 2, kv_elem: int | None = None) -> int:
    """Latent rows read once per sequence (``kv_elem`` bytes per value: 1 for an fp8 cache) + queries
    read + outputs written (``elem`` bytes)."""
    rows = batch * q_len
    kv = elem if kv_elem is None else kv_elem
    return batch * context * (D_LAT + D_ROPE) * kv + rows * MLA_HEADS * ((D_LAT + D_ROPE) + D_LAT) * elem


def kv_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each fp8 MLA row beside its bf16 row (same kernel shape, backend, batch): time and bytes/s."""
    ok = [r for r in rows if r.get("status") == "ok"]
    out = []
    for r in ok:
        if not r["kernel"].endswith("_fp8"):
            continue
        base = next((b for b in ok if b["kernel"] == r["kernel"].removesuffix("_fp8") and b["backend"] == r["backend"]
                     and b["batch"] == r["batch"]), None)
        if base is None:
            continue
        out.append(f"{r['kernel']} vs bf16 ({r['backend']}, b={r['batch']}): {1e6 * r['seconds']:.1f} / "
                   f"{1e6 * base['seconds']:.1f} us = {base['seconds'] / r['seconds']:.2f}x faster; "
                   f"{r['bytes_per_s'] / 1e9:.0f} / {base['bytes_per_s'] / 1e9:.0f} GB/s")
    return out


def int4_bytes(n: int, k: int) -> int:
    """Packed codes (4 bits) + bf16 group scales of one [n, k] group-32 weight."""
    return n * k // 2 + n * (k // GROUP) * 2


def moe_bytes(active_experts: int, tokens: int) -> int:
    """The routed experts the batch touches (gate+up and down) + activations in and out (bf16)."""
    per_expert = int4_bytes(2 * INTER, HIDDEN) + int4_bytes(HIDDEN, INTER)
    return active_experts * per_expert + tokens * HIDDEN * 2 * 2


def fraction(bytes_moved: int, seconds: float, peak_tbps: float | None) -> tuple[float, float | None]:
    bw = bytes_moved / seconds
    return bw, (None if peak_tbps is None else bw / (peak_tbps * 1e12))


def floor_fields(bytes_moved: float, seconds: float, peak_tbps: float | None) -> dict[str, float | None]:
    """The byte floor of a call (its bytes at the HBM peak) and the measured time over it."""
    if not peak_tbps:
        return {"floor_s": None, "x_floor": None}
    floor = bytes_moved / (peak_tbps * 1e12)
    return {"floor_s": floor, "x_floor": seconds / floor}


def e2e_floors(rows: list[dict[str, Any]], slice_dir: Path, peak_tbps: float | None, prompt: int = 32,
               tokens: int = 32) -> list[str]:
    """Add the slice's decode-step floor (``eagle3.plan.decode_floor`` at the row's batch, one GPU,
    the decode's mean context ``prompt + tokens / 2``) to each plain row, and say TPOT / floor."""
    from eagle3 import plan

    model = plan.load_model(slice_dir)
    context = prompt + tokens // 2
    out = []
    for r in rows:
        if r.get("status") != "ok" or r.get("spec") != "plain":
            continue
        kv = r.get("kv_cache_dtype", "auto")
        f = plan.decode_floor(model, gpus=1, batch=r["batch"], context=context,
                              kv_cache_dtype="bf16" if kv == "auto" else kv, hbm_tbps=peak_tbps)
        r["floor_bytes"] = f.total_bytes
        r["floor_ms"] = None if f.floor_seconds is None else 1e3 * f.floor_seconds
        r["x_floor"] = None if f.floor_seconds is None else r["tpot_ms"] / r["floor_ms"]
        out.append(f"floor e2e {r['backend']} graphs={r['graphs']} kv={kv} b={r['batch']}: step reads "
                   f"{f.total_bytes / 1e9:.2f} GB" + ("" if r["floor_ms"] is None else
                                                     f" = {r['floor_ms']:.3f} ms at {peak_tbps:g} TB/s; TPOT "
                                                     f"{r['tpot_ms']:.2f} ms = {r['x_floor']:.1f}x floor"))
    return out


def kernel_line(row: dict[str, Any]) -> str:
    """One kernel row as printed: bytes/s, time, HBM fraction, and the byte floor beside the time."""
    head = f"{row['kernel']:15s} {row['backend']:6s} b={row['batch']:<3d} "
    if row["status"] != "ok":
        return head + row["status"]
    frac, floor = row.get("hbm_fraction"), row.get("floor_s")
    return (head + f"{row['bytes_per_s'] / 1e9:8.1f} GB/s {row['seconds'] * 1e6:8.1f} us"
            + (f"  {100 * frac:5.1f}% of HBM" if frac else "")
            + (f"  floor {floor * 1e6:7.1f} us ({row['x_floor']:.1f}x)" if floor else ""))


def goal_lines(rows: list[dict[str, Any]], device: str) -> list[str]:
    """The issue's goal: MoE and MLA decode >= 60 % of HBM peak at batch <= 16 (triton rows)."""
    out = []
    for k in ("moe_w4a16", "mla_decode"):
        got = [r for r in rows if r["kernel"] == k and r["backend"] == "triton" and r["batch"] <= 16
               and r.get("hbm_fraction") is not None]
        if not got:
            out.append(f"goal {k} >= 60% HBM at batch <= 16 on {device}: not measured")
            continue
        worst = min(r["hbm_fraction"] for r in got)
        out.append(f"goal {k} >= 60% HBM at batch <= 16 on {device}: worst {100 * worst:.0f}% "
                   f"({'met' if worst >= 0.6 else 'missed'})")
    return out


# ---------------------------------------------------------------------------------------------
# measuring (GPU only below)
# ---------------------------------------------------------------------------------------------


def time_cuda(fn: Callable[[], Any], iters: int, warmup: int) -> float:
    """Median seconds of ``fn`` over ``iters`` CUDA-event-timed calls after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _mla_case(batch: int, q_len: int, context: int, fp8: Any = None) -> tuple[Any, Any, Any]:
    """Metadata, latent cache (``fp8``: that torch dtype's codes at :data:`FP8_KV_SCALE`) and queries."""
    import torch

    from eagle3.runtime import kv_cache
    from eagle3.runtime.engine.model_runner import build_attn_metadata

    bs = 16
    blocks = -(-context // bs)
    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(batch)]
    meta = build_attn_metadata(tables, [context - q_len] * batch, [q_len] * batch, bs, DEVICE)
    cache = torch.randn(batch * blocks * bs, 1, D_LAT + D_ROPE, device=DEVICE, dtype=torch.bfloat16)
    if fp8 is not None:
        cache = kv_cache.quantize(cache, fp8, FP8_KV_SCALE)
    q = torch.randn(batch * q_len, 1, MLA_HEADS, D_LAT + D_ROPE, device=DEVICE, dtype=torch.bfloat16)
    return meta, cache, q


def _int4_weight(n: int, k: int, gen: Any) -> Any:
    import torch

    from eagle3.runtime.kernels import Int4Weight

    words = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device=DEVICE, dtype=torch.int32, generator=gen)
    scale = (torch.rand(n, k // GROUP, device=DEVICE, generator=gen) / 50).to(torch.bfloat16)
    return Int4Weight(words, scale, GROUP, packing="ct", in_features=k)


class Kernels:
    """Builds each case once per (kernel, batch) and times it on each backend."""

    def __init__(self, args: argparse.Namespace, peak: float | None) -> None:
        import torch

        self.args = args
        self.peak = peak
        self.gen = torch.Generator(device=DEVICE).manual_seed(0)
        self._moe_weights: Any = None
        self._ops: dict[tuple[str, str], Any] = {}  # prepared weighted ops, reused across batches

    def moe_weights(self) -> tuple[list, list, list]:
        if self._moe_weights is None:
            e = self.args.experts
            self._moe_weights = ([_int4_weight(INTER, HIDDEN, self.gen) for _ in range(e)],
                                 [_int4_weight(INTER, HIDDEN, self.gen) for _ in range(e)],
                                 [_int4_weight(HIDDEN, INTER, self.gen) for _ in range(e)])
        return self._moe_weights

    def case(self, kernel: str, backend: str, batch: int) -> tuple[Callable[[], Any], int, dict[str, Any]]:
        """(the call to time, bytes it moves, extra fields for the row)."""
        import torch

        from eagle3.runtime.kernels import DenseWeight, get_backend

        be = get_backend(backend, DEVICE)
        dev = torch.device(DEVICE)
        x = torch.randn(batch, HIDDEN, device=dev, dtype=torch.bfloat16)
        if kernel.startswith(("mla_decode", "mla_verify")):
            q_len = 1 if kernel.startswith("mla_decode") else 4
            fp8 = be.kv_storage("fp8_e4m3", torch.bfloat16) if kernel.endswith("_fp8") else None
            meta, cache, q = _mla_case(batch, q_len, self.args.context, fp8)
            plan = be.plan_attention(meta)  # once per forward, shared by the layers: not timed
            scale = (128 + 64) ** -0.5
            sc = FP8_KV_SCALE if fp8 is not None else 1.0
            return (lambda: be.attention(q, cache, cache[..., :D_LAT], meta, scale, plan, k_scale=sc, v_scale=sc),
                    mla_bytes(batch, q_len, self.args.context, kv_elem=1 if fp8 is not None else 2),
                    {"context": self.args.context, "q_len": q_len, "kv_cache": str(cache.dtype).removeprefix("torch.")})
        if kernel == "moe_w4a16":
            if (kernel, backend) not in self._ops:
                self._ops = {}  # one backend's experts at a time (8.4 GB each at 384 experts)
                torch.cuda.empty_cache()
                op = be.moe()
                gate, up, down = self.moe_weights()
                op.prepare(gate, up, down, None, torch.bfloat16, dev)
                self._ops[(kernel, backend)] = op
            op = self._ops[(kernel, backend)]
            ids = torch.stack([torch.randperm(self.args.experts, device=dev, generator=self.gen)[:TOPK]
                               for _ in range(batch)])
            w = torch.rand(batch, TOPK, device=dev, generator=self.gen)
            active = int(torch.unique(ids).numel())
            from eagle3.plan import expected_distinct_experts

            return (lambda: op(x, ids, w), moe_bytes(active, batch),
                    {"experts": self.args.experts, "active_experts": active, "op": type(op).__name__,
                     "expected_active_experts": expected_distinct_experts(self.args.experts, TOPK, batch)})
        if kernel in ("linear_w4a16", "linear_bf16"):
            op = be.linear()
            if kernel == "linear_w4a16":
                weight, nbytes = _int4_weight(2 * INTER, HIDDEN, self.gen), int4_bytes(2 * INTER, HIDDEN)
            else:
                weight = DenseWeight(torch.randn(2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16))
                nbytes = 2 * INTER * HIDDEN * 2
            op.prepare(weight, None, torch.bfloat16, dev)
            return (lambda: op(x), nbytes + batch * (HIDDEN + 2 * INTER) * 2,
                    {"n": 2 * INTER, "k": HIDDEN, "op": type(op).__name__})
        if kernel == "rmsnorm":
            wn = torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)
            return lambda: be.rms_norm(x, wn, 1e-6), 2 * batch * HIDDEN * 2 + HIDDEN * 2, {}
        if kernel == "act_quant_int8":
            if backend == "triton":
                fn: Callable[[], Any] = lambda: be.quantize_act(x, "int8")  # noqa: E731
            else:
                from eagle3.runtime.kernels.torch_ref import quantize_int8_per_token

                fn = lambda: quantize_int8_per_token(x)  # noqa: E731
            return fn, batch * HIDDEN * (2 + 1) + batch * 4, {}
        if kernel == "router_fp32":
            # as MoE.route_scores: the bf16 rows and weight, multiplied in fp32
            wt = torch.randn(HIDDEN, EXPERTS, device=dev, generator=self.gen).to(torch.bfloat16)
            return (lambda: be.matmul(x, wt, torch.float32),
                    HIDDEN * EXPERTS * 2 + batch * HIDDEN * 2 + batch * EXPERTS * 4, {})
        if kernel == "mla_absorb":
            w_uk = torch.randn(MLA_HEADS, 128, D_LAT, device=dev, dtype=torch.bfloat16, generator=self.gen)
            q = torch.randn(batch, MLA_HEADS, 128, device=dev, dtype=torch.bfloat16, generator=self.gen)
            qt = q.transpose(0, 1)  # as the model passes it (q_nope, read in place)
            return lambda: be.bmm(qt, w_uk), MLA_HEADS * (128 * D_LAT + batch * (128 + D_LAT)) * 2, {}
        raise ValueError(kernel)

    def row(self, kernel: str, backend: str, batch: int) -> dict[str, Any]:
        row: dict[str, Any] = {"kernel": kernel, "backend": backend, "batch": batch}
        if backend == "triton":
            why = triton_kernel_status(kernel)
            if why is not None:
                return {**row, "status": why}
        try:
            fn, nbytes, extra = self.case(kernel, backend, batch)
            s = time_cuda(fn, self.args.iters, self.args.warmup)
        except Exception as err:  # noqa: BLE001 - one failing case must not lose the others' figures
            return {**row, "status": f"error: {type(err).__name__}: {err}".splitlines()[0]}
        bw, frac = fraction(nbytes, s, self.peak)
        return {**row, **extra, "status": "ok", "seconds": s, "bytes": nbytes, "bytes_per_s": bw,
                "hbm_fraction": frac, **floor_fields(nbytes, s, self.peak)}


def _generate_s(llm: Any, prompts: list[list[int]], n: int) -> float:
    """Seconds for greedy generation of ``n`` tokens per prompt (device synchronized)."""
    import torch

    from eagle3.runtime.sampling import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    sync()
    dt = time.perf_counter() - t0
    # A request that failed inside the engine ends early with finish_reason "error": its row would
    # time less work and look fast (a first GPU run printed trees at 0.77 ms TPOT that way).
    bad = [o for o in outs if o.finish_reason == "error" or len(o.token_ids) != n]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(outs)} requests did not generate {n} tokens "
                           f"({bad[0].finish_reason}: {bad[0].error or len(bad[0].token_ids)})")
    return dt


def _spec_kwargs(shape: tuple[int, int, int] | str | None) -> dict[str, Any]:
    if shape is None:
        return {}
    if shape == "auto":
        return {"num_speculative_tokens": "auto", "max_speculative_tokens": AUTO_MAX_K}
    assert isinstance(shape, tuple)
    k, steps, n = shape
    kw: dict[str, Any] = {"num_speculative_tokens": steps}
    if k > 1:
        kw.update(speculative_eagle_topk=k, speculative_num_draft_tokens=n)
    return kw


def e2e_rows(args: argparse.Namespace, slice_dir: Path, draft: Path | None = None) -> list[dict[str, Any]]:
    """Plain rows per backend (graphs off / on), then with ``draft`` the speculative rows per
    ``--spec-shapes`` on ``--spec-backends``."""
    import torch

    from eagle3.runtime.engine import graphs
    from eagle3.runtime.engine.llm import LLM

    # Where no graphs can be captured (a CPU dry run), the graphs-on engine is the eager one
    # (LLM.cuda_graphs is off either way): it is built once and serves both rows, each still run.
    one_engine = not graphs.available(torch.device(DEVICE))
    configs: list[tuple[str, tuple[int, int, int] | str | None, str]] = [
        (b, None, kv) for b in args.backends for kv in args.e2e_kv_dtypes]
    if draft is not None:
        configs += [(b, shape, "auto") for b in args.spec_backends for shape in args.spec_shapes]
    rows = []
    for backend, shape, kv in configs:
        settings = {"both": (True, False), "on": (False,), "off": (True,)}[getattr(args, "e2e_graphs", "both")]
        shared: tuple[Any, list[int]] | None = None
        for i, eager in enumerate(settings):
            row: dict[str, Any] = {"backend": backend, "graphs": not eager, "kv_cache_dtype": kv,
                                   "spec": "plain" if shape is None else shape if isinstance(shape, str)
                                   else ",".join(map(str, shape))}
            if shared is None:
                try:
                    llm = LLM(slice_dir, None if shape is None else draft, tokenizer=None, dtype="bfloat16",
                              device=DEVICE, backend=backend, enforce_eager=eager,
                              max_num_seqs=max(args.e2e_batches), kv_cache_memory=int(args.e2e_kv_gib * 2**30),
                              kv_cache_dtype=kv, **_spec_kwargs(shape))
                except Exception as err:  # noqa: BLE001
                    rows.append({**row, "status": f"error: {type(err).__name__}: {err}".splitlines()[0]})
                    print(e2e_line(rows[-1]), flush=True)
                    continue
                steps = _count_steps(llm)
            else:
                llm, steps = shared
            n_before = len(rows)
            g = torch.Generator().manual_seed(0)
            for batch in args.e2e_batches:
                prompts = [torch.randint(0, 1000, (32,), generator=g).tolist() for _ in range(batch)]
                try:
                    if shared is None:  # a shared engine ran these very prompts for the row before
                        _generate_s(llm, prompts, args.e2e_tokens)  # warm-up: graph capture, autotuning
                    s0 = steps[0]
                    t1 = _generate_s(llm, prompts, 1)  # the prefill steps alone
                    prefill_steps = steps[0] - s0
                    s0, v0, a0 = steps[0], llm.stats.num_drafts, llm.stats.num_accepted_tokens
                    tn = _generate_s(llm, prompts, args.e2e_tokens)
                    tps = batch * (args.e2e_tokens - 1) / max(tn - t1, 1e-9)
                    rows.append({**row, "batch": batch, "status": "ok", "decode_tokens_per_s": tps,
                                 "tpot_ms": 1000 * batch / tps, "seconds": tn - t1,
                                 "decode_steps": steps[0] - s0 - prefill_steps, **_graph_fields(llm),
                                 "kv_tokens_total": llm.kv_cache_info()["kv_tokens_total"]})
                    if shape is not None:  # this run's counters only (not the warm-up's)
                        verifies = llm.stats.num_drafts - v0
                        rows[-1]["verifies"] = verifies
                        rows[-1]["drafting_steps"] = verifies / batch  # steps whose sequences all drafted
                        rows[-1]["tokens_per_forward"] = (1 + (llm.stats.num_accepted_tokens - a0) / verifies
                                                          if verifies else 1.0)
                except Exception as err:  # noqa: BLE001
                    rows.append({**row, "batch": batch, "status": f"error: {type(err).__name__}: {err}".splitlines()[0]})
            for r in rows[n_before:]:  # as they come: a run cut short still shows its finished rows
                print(e2e_line(r), flush=True)
            if one_engine and i + 1 < len(settings):
                shared = (llm, steps)
                continue
            llm.close()
            del llm
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    return rows


def e2e_line(r: dict[str, Any]) -> str:
    return (f"e2e {r['backend']:6s} graphs={r['graphs']!s:5s} {r['spec']:8s} kv={r['kv_cache_dtype']:5s} "
            f"b={r.get('batch', '-')} "
            + (f"{r['decode_tokens_per_s']:.1f} tok/s, TPOT {r['tpot_ms']:.2f} ms" if r["status"] == "ok"
               else r["status"]))


def _count_steps(llm: Any) -> list[int]:
    """A counter of the engine's steps (``runner.step`` calls), wrapped around this engine only."""
    count = [0]
    step = llm.runner.step

    def counted(*a: Any, **kw: Any) -> Any:
        count[0] += 1
        return step(*a, **kw)

    llm.runner.step = counted
    return count


def _graph_fields(llm: Any) -> dict[str, Any]:
    """Whether the target's and the draft's graphs captured (and replayed), and why not."""
    out: dict[str, Any] = {}
    for name in ("target", "draft"):
        g = getattr(llm.runner, f"{name}_graphs", None)
        out[f"{name}_graphs"] = None if g is None else {
            "failed": g.failed, "tree_failed": g.tree_failed, "replays": g.replays,
            "keys": sorted(",".join(map(str, k)) for k in g.graphs)}
    out["graphs_captured"] = out["target_graphs"] is not None and out["target_graphs"]["failed"] is None
    return out


def drafting_step_ms(row: dict[str, Any], plain: dict[str, Any]) -> float | None:
    """ms of one step in which every sequence drafted: the run's time less its steps without drafts
    (a tree drafts nothing in its last S steps, a chain fewer tokens), each counted at ``plain``'s
    TPOT (the drafts accept nothing, so a step emits one token per sequence either way)."""
    n = row.get("drafting_steps") or 0
    if n <= 0:
        return None
    other = max(row["decode_steps"] - n, 0)
    return (1000 * row["seconds"] - other * plain["tpot_ms"]) / n


def spec_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per backend, graphs setting and batch: each tree's cost per drafting step against the chain's
    (the first chain row): what a tree's extra accepted tokens have to pay for."""
    ok = [r for r in rows if r.get("status") == "ok"]

    def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return (a["backend"] == b["backend"] and a["graphs"] == b["graphs"] and a["batch"] == b["batch"]
                and a.get("kv_cache_dtype", "auto") == b.get("kv_cache_dtype", "auto"))

    out = []
    for r in ok:
        if r["spec"] in ("plain", "auto") or r["spec"].startswith("1,"):
            continue
        chain = next((c for c in ok if c["spec"].startswith("1,") and same(c, r)), None)
        plain = next((p for p in ok if p["spec"] == "plain" and same(p, r)), None)
        if chain is None or plain is None:
            continue
        tree_ms, chain_ms = drafting_step_ms(r, plain), drafting_step_ms(chain, plain)
        if tree_ms is None or chain_ms is None:
            continue
        out.append(f"tree {r['spec']} vs chain {chain['spec']} ({r['backend']}, graphs={r['graphs']}, "
                   f"b={r['batch']}): {tree_ms:.2f} / {chain_ms:.2f} ms per drafting step = "
                   f"{tree_ms / chain_ms:.2f}x (plain step {plain['tpot_ms']:.2f} ms; random drafts: cost only)")
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["kernels"] if r.get("status") == "ok"]
    kernels = [k for k in KERNELS if any(r["kernel"] == k for r in ok)]
    batches = sorted({r["batch"] for r in ok})
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    ax = axes[0]
    width = 0.8 / max(1, 2 * len(batches))
    for i, (backend, b) in enumerate((be, b) for be in BACKENDS for b in batches):
        ys = []
        for k in kernels:
            r = next((r for r in ok if r["kernel"] == k and r["backend"] == backend and r["batch"] == b), None)
            v = None if r is None else (r["hbm_fraction"] if r["hbm_fraction"] is not None else r["bytes_per_s"] / 1e12)
            ys.append(math.nan if v is None else v)
        ax.bar([j + i * width for j in range(len(kernels))], ys, width, label=f"{backend} b={b}")
    ax.set_xticks([j + 0.4 for j in range(len(kernels))], kernels, rotation=30, ha="right")
    ax.set_ylabel("fraction of HBM peak" if report.get("hbm_peak_tbps") else "TB/s")
    ax.axhline(0.6, color="gray", linestyle="--", linewidth=0.8)
    ax.set_title(f"kernels on {report['device']}")
    ax.legend(fontsize=6, ncol=2)
    ax = axes[1]
    e2e = [r for r in report.get("e2e", []) if r.get("status") == "ok"]
    labels = [f"{r['backend']}{' +graphs' if r['graphs'] else ''} {r.get('spec', 'plain')}"
              f"{' kv ' + r['kv_cache_dtype'] if r.get('kv_cache_dtype', 'auto') != 'auto' else ''} b={r['batch']}"
              for r in e2e]
    ax.bar(range(len(e2e)), [r["decode_tokens_per_s"] for r in e2e])
    ax.set_xticks(range(len(e2e)), labels, rotation=30, ha="right")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("end to end, full-width slice" if e2e else "end to end: not run")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".partial.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("kernels_gpu.py: no CUDA / ROCm GPU on this machine (torch.cuda.is_available() is False); "
              "run it on an H100 / H200 / MI300-class GPU", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    peak = args.hbm_peak if args.hbm_peak is not None else hbm_peak_tbps(device)
    report: dict[str, Any] = {
        "device": device, "hbm_peak_tbps": peak, "torch": torch.__version__,
        "hip": getattr(torch.version, "hip", None), "cuda": torch.version.cuda,
        "triton": _version("triton"), "args": {k: str(v) for k, v in vars(args).items()}, "kernels": [],
        "e2e": []}
    if peak is None:
        print(f"note: {device!r} is not in the HBM peak table; pass --hbm-peak TB/s for fractions", file=sys.stderr)
    k = Kernels(args, peak)
    for kernel in [] if args.skip_kernels else args.kernels:
        for batch in args.batches:
            for backend in args.backends:
                row = k.row(kernel, backend, batch)
                report["kernels"].append(row)
                print(kernel_line(row), flush=True)
    if not args.skip_e2e:
        slice_dir = args.slice
        if slice_dir is None and args.make_slice:
            from eagle3.testing import slice as slice_mod

            slice_dir = args.work / "k25-slice-2x8"
            if not (slice_dir / "config.json").is_file():
                slice_mod.make_slice(slice_dir, layers=2, experts=8, seed=0)
        draft = args.draft
        if draft is None and args.make_draft and slice_dir is not None:
            from eagle3.testing import slice as slice_mod

            layers = json.loads((slice_dir / "config.json").read_text())["text_config"]["num_hidden_layers"]
            draft = args.work / f"draft-{args.make_draft}-{layers}"
            if not (draft / "config.json").is_file():
                slice_mod.make_draft_slice(draft, args.make_draft, target_layers=layers, seed=0)
        if slice_dir is None:
            report["e2e_note"] = "no --slice / --make-slice: end-to-end rows not run"
        else:
            report["slice"] = str(slice_dir)
            report["draft"] = None if draft is None else str(draft)
            report["e2e"] = e2e_rows(args, slice_dir, draft)
            report["spec_lines"] = spec_lines(report["e2e"])
            report["floor_lines"] = e2e_floors(report["e2e"], slice_dir, peak, tokens=args.e2e_tokens)
            for line in report["spec_lines"] + report["floor_lines"]:
                print(line)
    report["goals"] = goal_lines(report["kernels"], device)
    report["kv_lines"] = kv_lines(report["kernels"])
    for line in report["goals"] + report["kv_lines"]:
        print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".partial")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, args.out)
    plot(report, args.png)
    print(f"report: {args.out} ({args.png})")
    return 0


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())
