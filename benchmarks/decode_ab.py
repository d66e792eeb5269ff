"""Decode speed of the torch reference with and without the reused decode scratch, in one process.

The packed weights are decoded per call (issue 11). ``torch_ref.packed.REUSE_SCRATCH`` (default) decodes them
into reused per-thread buffers; False decodes into per-call tensors, as before. On a shared machine
wall times drift by 2x within minutes, so comparing two runs says little: this script loads the
target once and runs every decode step twice, once per mode (alternating which goes first), with the
same inputs and KV slots, so each pair of timings is taken under the same load. It also checks that
the two modes give bit-identical logits at every step.

    python benchmarks/decode_ab.py CKPT [--batches 1,16] [--steps 2] [--prompt-len 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("checkpoint", type=Path, help="target checkpoint directory (any format the runtime loads)")
    ap.add_argument("--batches", default="1,16", help="decode batch sizes, e.g. 1,16")
    ap.add_argument("--steps", type=int, default=2, help="decode steps per batch (each run in both modes)")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--batches {args.batches!r}: give comma-separated integers")
    if not args.batches or min(args.batches) < 1 or args.steps < 1 or args.prompt_len < 1:
        ap.error("--batches, --steps and --prompt-len must be positive")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from eagle3.runtime.engine.model_runner import build_attn_metadata
    from eagle3.runtime.interfaces import allocate_kv_cache
    from eagle3.runtime.kernels import torch_ref
    from eagle3.runtime.loader import load_target

    t0 = time.perf_counter()
    model = load_target(args.checkpoint, dtype=getattr(torch, args.dtype))
    out: dict[str, Any] = {"checkpoint": str(args.checkpoint), "load_s": time.perf_counter() - t0,
                           "threads": torch.get_num_threads(), "batches": {}}
    bs, plen = 16, args.prompt_len
    for batch in args.batches:
        nblk = -(-(plen + args.steps) // bs)
        kv = allocate_kv_cache(model.kv_cache_spec(), model.num_layers, nblk * batch, bs, "cpu")
        tables = [list(range(b * nblk, (b + 1) * nblk)) for b in range(batch)]
        ids = torch.randint(2, min(1000, model.vocab_size), (batch, plen), generator=torch.Generator().manual_seed(0))
        times: dict[str, list[float]] = {"scratch": [], "per_call": []}
        identical = True
        try:
            with torch.inference_mode():
                meta = build_attn_metadata(tables, [0] * batch, [plen] * batch, bs)
                h, _ = model.forward(ids.reshape(-1), meta, kv)
                nxt = model.compute_logits(h[plen - 1::plen]).argmax(-1)
                for s in range(args.steps):
                    meta = build_attn_metadata(tables, [plen + s] * batch, [1] * batch, bs)
                    logits = {}
                    for mode in (("scratch", "per_call") if s % 2 == 0 else ("per_call", "scratch")):
                        torch_ref.packed.REUSE_SCRATCH = mode == "scratch"
                        t = time.perf_counter()
                        h, _ = model.forward(nxt, meta, kv)  # the same KV slots: rewritten with the same values
                        logits[mode] = model.compute_logits(h)
                        times[mode].append(time.perf_counter() - t)
                    identical = identical and torch.equal(logits["scratch"], logits["per_call"])
                    nxt = logits["scratch"].argmax(-1)
        finally:
            torch_ref.packed.REUSE_SCRATCH = True
        tps = {m: batch * len(v) / sum(v) for m, v in times.items()}
        out["batches"][str(batch)] = {"step_s": times, "tokens_per_s": tps,
                                      "speedup": tps["scratch"] / tps["per_call"], "bit_identical": identical}
        print(f"batch {batch}: {tps['scratch']:.3f} tok/s with the scratch, {tps['per_call']:.3f} per-call tensors "
              f"({tps['scratch'] / tps['per_call']:.2f}x); logits {'bit-identical' if identical else 'DIFFER'}",
              flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    if not all(b["bit_identical"] for b in out["batches"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
