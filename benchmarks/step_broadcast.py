"""Per-step cost of getting a step's inputs to the other rank at TP=2 on one node: the broadcast on
the CPU gloo group that the runtime uses (``parallel.StepChannel``) against the pipe it used before
(one ``multiprocessing`` pipe per worker, pickled bytes), side by side in one run; and the pipe
carrying the runtime's encoding (``parallel.encode_step``), to compare the transports alone.

Rank 0 sends the inputs of a real step (token ids, positions, block tables, slot mapping, the
metadata, pickled as the runtime does), rank 1 receives and unpickles them, then both join a
one-element all_gather on the device group: the forward's first collective, which is where rank 0
waits for rank 1 to have its inputs. The cost of a step's hand-over is that round minus the same
all_gather alone (measured in the same run). The three kinds of round alternate, so each is taken
under the same load (the machine may be shared).

    python benchmarks/step_broadcast.py [--steps 2000] [--batches 1,8,64] [--context 1024] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eagle3.runtime import parallel
from eagle3.runtime.engine.model_runner import build_attn_metadata

# gather: the all_gather alone; pipe: the hand-over before (plain pickle over a pipe); pipe_enc: the
# pipe with the runtime's encoding (parallel.encode_step), to see the transports alone; broadcast:
# the runtime's StepChannel (encode_step + gloo broadcast).
KINDS = ("gather", "pipe", "pipe_enc", "broadcast")


def step_message(batch: int, context: int, k: int = 3, block_size: int = 16) -> tuple[Any, ...]:
    """A verify step of ``batch`` sequences of ``context`` tokens with ``k`` drafts: what rank 0
    sends (TPTarget.forward's message)."""
    blocks = -(-(context + k + 1) // block_size)
    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(batch)]
    meta = build_attn_metadata(tables, [context] * batch, [k + 1] * batch, block_size)
    ids = torch.randint(0, 160000, (batch * (k + 1),))
    return ("forward", ids, meta, (2, 30, 58))


def _round(kind: str, rank: int, msg: Any, conn: Any, channel: parallel.StepChannel, one: torch.Tensor,
           parts: list[torch.Tensor]) -> None:
    if kind == "pipe":
        if rank == 0:
            conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        else:
            pickle.loads(conn.recv_bytes())
    elif kind == "pipe_enc":
        if rank == 0:
            conn.send_bytes(parallel.encode_step(msg))
        else:
            parallel.decode_step(conn.recv_bytes())
    elif kind == "broadcast":
        if rank == 0:
            channel.send(msg)
        else:
            channel.recv()
    dist.all_gather(parts, one)


def run_rank(rank: int, port: int, conn: Any, steps: int, batches: list[int], context: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    parallel.init_rank(rank, 2, ("127.0.0.1", port), torch.device("cpu"))
    channel = parallel.StepChannel()
    one = torch.zeros(1)
    parts = [torch.empty(1) for _ in range(2)]
    out: dict[str, Any] = {}
    try:
        for batch in batches:
            msg = step_message(batch, context)
            times: dict[str, list[float]] = {k: [] for k in KINDS}
            for i in range(steps + 50):  # the first 50 rounds warm up
                order = KINDS[i % len(KINDS):] + KINDS[:i % len(KINDS)]
                for kind in order:
                    t0 = time.perf_counter()
                    _round(kind, rank, msg, conn, channel, one, parts)
                    if i >= 50:
                        times[kind].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            out[str(batch)] = {"bytes_pickle": len(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)),
                               "bytes_encoded": len(parallel.encode_step(msg)), "round_us": med,
                               **{f"{k}_us": med[k] - med["gather"] for k in KINDS[1:]}}
    finally:
        parallel.leave_group()
    return out


def _worker(port: int, conn: Any, steps: int, batches: list[int], context: int) -> None:
    run_rank(1, port, conn, steps, batches, context)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="timed rounds of each kind per batch size")
    ap.add_argument("--batches", default="1,8,64", help="sequences per step, e.g. 1,8,64")
    ap.add_argument("--context", type=int, default=1024, help="tokens of each sequence (its block table)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    port = parallel.free_port()
    p = ctx.Process(target=_worker, args=(port, child, args.steps, batches, args.context), daemon=True)
    p.start()
    try:
        res = run_rank(0, port, parent, args.steps, batches, args.context)
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    print(f"step inputs to rank 1 at TP=2 (gloo, one node), median of {args.steps} rounds, "
          f"minus the all_gather alone (us):")
    print(f"{'batch':>6} {'bytes':>7} {'pipe':>8} {'pipe+enc':>9} {'broadcast':>10} {'ratio':>6} {'ratio_enc':>9}")
    for batch, r in res.items():
        r["ratio"] = r["broadcast_us"] / r["pipe_us"] if r["pipe_us"] > 0 else float("nan")
        r["ratio_enc"] = r["broadcast_us"] / r["pipe_enc_us"] if r["pipe_enc_us"] > 0 else float("nan")
        print(f"{batch:>6} {r['bytes_encoded']:>7} {r['pipe_us']:>8.1f} {r['pipe_enc_us']:>9.1f} "
              f"{r['broadcast_us']:>10.1f} {r['ratio']:>6.2f} {r['ratio_enc']:>9.2f}")
    print("ratio: broadcast / pipe (the hand-over before this change); ratio_enc: broadcast / pipe with the "
          "same encoding (the transports alone)")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
