"""The tensor-parallel process group: this process's rank (:class:`TPGroup`), the rank-order
collectives the layers call, and joining the group (:func:`init_rank`). The worker processes that
make up the group are started by :mod:`eagle3.runtime.engine.worker`; which rows or columns of a
weight a rank holds is decided by the parallel layers themselves (``runtime/layers``).

Determinism: :meth:`TPGroup.reduce` all-gathers the partials and sums them locally in rank order, so
a row's sum does not depend on the batch (an all_reduce picks its algorithm by message size). The
sum is in a different order than a TP=1 GEMM's, so logits differ from TP=1 by rounding only.
"""

from __future__ import annotations

import ctypes
import datetime
import io
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("eagle3.runtime")

# Collective timeout: a rank that stops answering fails the step after this long instead of
# hanging it (a dead rank's closed sockets fail it at once; the heartbeat below names it).
_TIMEOUT_S = float(os.environ.get("EAGLE3_TP_TIMEOUT", "300"))


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group (``world == 1``: no parallelism)."""

    rank: int = 0
    world: int = 1

    def split(self, n: int) -> tuple[int, int]:
        """This rank's contiguous part ``[lo, hi)`` of ``n`` items (the first ``n % world`` ranks
        take one more)."""
        return split(n, self.world, self.rank)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in rank order (batch invariant, see the module docstring)."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x)
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def gather_cols(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Concatenate every rank's ``x [R, cols_r]`` (cols split as :func:`split` of ``total``) along
        the last dim; uneven parts are padded for the collective."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        width = -(-total // self.world)
        pad = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device)
        pad[:, : x.shape[1]] = x
        parts = [torch.empty_like(pad) for _ in range(self.world)]
        dist.all_gather(parts, pad)
        return torch.cat([p[:, : hi - lo] for p, (lo, hi) in
                          zip(parts, (split(total, self.world, r) for r in range(self.world)), strict=True)], dim=1)


SINGLE = TPGroup()


def split(n: int, world: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dist_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"  # ROCm builds report "cuda" and run RCCL as nccl


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank: rank r uses device index (base + r); CPU ranks share the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def parse_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); raises ValueError."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def torchrun_env() -> dict[str, Any] | None:
    """The rank layout torchrun gives every process it starts (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT), or None outside torchrun."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return {"rank": int(env["RANK"]), "world": int(env["WORLD_SIZE"]), "local_rank": int(env.get("LOCAL_RANK", "0")),
            "addr": f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"}


def init_rank(rank: int, world: int, addr: tuple[str, int], device: torch.device, generation: int = 0) -> Any:
    """Join the group of ``world`` ranks whose rendezvous store listens at ``addr`` (rank 0 hosts it,
    unless torchrun's agent already does). Returns the store: the heartbeat and the ready reports
    use it. Also creates the CPU gloo group the step inputs are broadcast on (:class:`StepChannel`)."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    # torchrun's agent hosts a store on MASTER_PORT itself (env:// then connects as a client).
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(addr[0], addr[1], world, is_master=rank == 0 and not agent_store,
                          timeout=datetime.timedelta(seconds=_TIMEOUT_S), wait_for_workers=False)
    if rank == 0:  # which group this is, for a node that joins the next one (store_generation)
        store.set(_GENERATION_KEY, str(generation))
    # Each group's keys under a prefix of its own: torchrun's store outlives a group (serve --validate
    # forms two), and a later group must not find an earlier one's ready reports or rendezvous keys.
    store = dist.PrefixStore(_prefix(generation), store)
    dist.init_process_group(_dist_backend(device), store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=_TIMEOUT_S))
    global _STEP_GROUP
    # The step inputs travel on a CPU group of their own: between two steps a worker waits on it
    # for as long as the server is idle, so its timeout is not the collectives' (a dead peer is
    # found by the heartbeat and by its closed sockets instead).
    _STEP_GROUP = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
    return store


_STEP_GROUP: Any = None
_GENERATION_KEY = "eagle3/generation"


def _prefix(generation: int) -> str:
    return f"eagle3/g{generation}/"


def leave_group() -> None:
    """Destroy the process group (and the step group, whose reference would keep rank 0's store
    listening: the next group at the same address could not bind it)."""
    import torch.distributed as dist

    global _STEP_GROUP
    _STEP_GROUP = None
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group: its sockets close with it anyway
            pass


def store_generation(addr: tuple[str, int]) -> int | None:
    """The generation rank 0's store at ``addr`` serves now, or None while none answers."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(addr[0], addr[1], is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=2))
        return int(store.get(_GENERATION_KEY))
    except Exception:  # noqa: BLE001 - not up (yet, or any more)
        return None
# Bytes of the first broadcast of a step message: a decode or verify step's inputs (token ids,
# positions, block tables, slot mapping; 0.7 KB at batch 1, 3.3 KB at batch 8 with 1k-token contexts)
# fit, so such a step costs one broadcast; a larger message (a big batch, long block tables) follows
# in a second one of its exact size. Not larger: rank 0 sends the whole head to every other rank each
# step (over the network, across nodes).
_HEAD = 8192


def _tensor_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)


class _StepPickler(pickle.Pickler):
    """Pickles a tensor as its raw bytes + dtype + shape: a step's few small CPU tensors cost tens of
    microseconds this way, against ~0.5 ms each way through torch's own tensor pickling (storages)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            return _tensor_from_bytes, (ctypes.string_at(t.data_ptr(), t.nbytes), str(t.dtype).removeprefix("torch."),
                                        tuple(t.shape))
        return NotImplemented


def encode_step(obj: Any) -> bytes:
    """A step message as bytes (:func:`decode_step` reverses it)."""
    buf = io.BytesIO()
    _StepPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def decode_step(data: bytes) -> Any:
    return pickle.loads(data)


class StepChannel:
    """Rank 0 sends each step's inputs (any picklable object) to every other rank with a broadcast on
    the CPU gloo group, the same code for ranks on this machine and on other nodes.

    Not ``dist.broadcast_object_list`` (deliberately): it always broadcasts twice (the size, then the
    payload) and pickles tensors through torch's storage reducers; a step's inputs fit one fixed 8 KiB
    broadcast with the size in its header, and :func:`encode_step` writes tensors as raw bytes."""

    def __init__(self) -> None:
        self._head = bytearray(_HEAD)
        self._head_t = torch.frombuffer(self._head, dtype=torch.uint8)  # shares self._head's memory

    def send(self, obj: Any) -> None:
        import torch.distributed as dist

        data = encode_step(obj)
        first = min(len(data), _HEAD - 8)
        self._head[:8] = len(data).to_bytes(8, "little")
        self._head[8:8 + first] = data[:first]
        dist.broadcast(self._head_t, 0, group=_STEP_GROUP)
        if len(data) > first:
            dist.broadcast(torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8), 0, group=_STEP_GROUP)

    def recv(self) -> Any:
        import torch.distributed as dist

        dist.broadcast(self._head_t, 0, group=_STEP_GROUP)
        n = int.from_bytes(self._head[:8], "little")
        first = min(n, _HEAD - 8)
        data = bytes(self._head[8:8 + first])
        if n > first:
            rest = bytearray(n - first)
            dist.broadcast(torch.frombuffer(rest, dtype=torch.uint8), 0, group=_STEP_GROUP)
            data += rest
        return decode_step(data)


# Liveness: every rank adds 1 to its key in the rendezvous store every _HB_INTERVAL_S; a rank whose
# count stops moving for _HB_TIMEOUT_S is dead (a peer on another node that loses power closes no
# socket, so without this it would be noticed only at the next collective's timeout).
_HB_INTERVAL_S = 0.5
_HB_TIMEOUT_S = float(os.environ.get("EAGLE3_TP_HEARTBEAT_TIMEOUT", "30"))


def _hb_key(rank: int) -> str:
    return f"eagle3/heartbeat/{rank}"


class Heartbeat:
    """A daemon thread that bumps this rank's count in the store and watches ``watch`` ranks' counts;
    ``on_lost(rank, why)`` is called once when one stops (``rank`` None: the store itself is gone,
    i.e. rank 0's process, which hosts it)."""

    def __init__(self, addr: tuple[str, int], rank: int, watch: list[int],
                 on_lost: Callable[[int | None, str], None], generation: int = 0) -> None:
        import torch.distributed as dist

        # A client of its own: the thread never shares a connection with the process group's.
        client = dist.TCPStore(addr[0], addr[1], is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=max(5.0, _HB_TIMEOUT_S)))
        self.store = dist.PrefixStore(_prefix(generation), client)
        self.rank = rank
        self.watch = watch
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"eagle3-heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self.store.add(_hb_key(self.rank), 1)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        seen = {r: (-1, time.monotonic()) for r in self.watch}
        while not self._stop.wait(_HB_INTERVAL_S):
            try:
                self.store.add(_hb_key(self.rank), 1)
                now = time.monotonic()
                for r in self.watch:
                    count = self.store.add(_hb_key(r), 0)  # reads without waiting for the key
                    if count != seen[r][0]:
                        seen[r] = (count, now)
                    elif now - seen[r][1] > _HB_TIMEOUT_S:
                        if not self._stop.is_set():
                            self.on_lost(r, f"no heartbeat for {_HB_TIMEOUT_S:.0f} s")
                        return
            except Exception as err:  # noqa: BLE001 - the store's host (rank 0) is gone
                if not self._stop.is_set():
                    self.on_lost(None, f"the rendezvous store is unreachable ({type(err).__name__})")
                return


def ready_key(rank: int) -> str:
    """The store key a rank sets to "ok" (or "error: ...") once its shard is loaded."""
    return f"eagle3/ready/{rank}"
