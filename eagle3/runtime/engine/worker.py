"""The processes of a tensor-parallel group: rank 0 is the driver (this process: it holds rank 0's
shard and runs the engine: scheduler, sampling, the draft), ranks 1..N-1 are worker processes
spawned with ``torch.multiprocessing`` (spawn), each running :func:`worker_main`.

Rank 0 keeps the step's outputs (aux hidden states, gathered logits) where the engine and the
draft need them: nothing large crosses a process boundary, only the step's small inputs (token
ids, positions, block tables, slot mapping), which go to each worker over a pipe (pickled, a few
KB a step). A pipe rather than a shared-memory ring because its end-of-file tells a worker that
the driver died (no orphans), and a dead worker shows as a broken pipe on the driver's side.

This module imports the loader (a worker loads its own shard); nothing below the engine imports
this module.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import threading
import time
from typing import Any

import torch

from eagle3.errors import Eagle3Error, UsageError
from eagle3.runtime.interfaces import allocate_kv_cache, compact_tree_kv
from eagle3.runtime.loader import load_target
from eagle3.runtime.parallel import TPGroup, free_port, init_rank, rank_device

logger = logging.getLogger("eagle3.runtime")

_READY_TIMEOUT_S = float(os.environ.get("EAGLE3_TP_LOAD_TIMEOUT", "3600"))


class TPWorkerError(Eagle3Error):
    """A tensor-parallel worker died or failed: the engine cannot run steps any more."""


def worker_main(rank: int, world: int, port: int, target: str, load_kw: dict[str, Any], conn: Any,
                 num_threads: int) -> None:
    """A worker rank: load this rank's shard, then run the driver's steps until the pipe closes."""
    # Ctrl-C reaches the whole process group; the driver decides what stops (it closes the pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(num_threads)
    try:
        device = rank_device(torch.device(load_kw.pop("device")), rank)
        init_rank(rank, world, port, device)
        model = load_target(target, device=device, tp=TPGroup(rank, world), **load_kw)
        conn.send(("ready", None))
    except BaseException as err:  # noqa: BLE001 - reported to the driver, which raises it
        _send_quietly(conn, ("error", f"{type(err).__name__}: {err}"))
        return
    kv: list[torch.Tensor] = []
    hidden: torch.Tensor | None = None
    try:
        with torch.inference_mode():
            while True:
                try:
                    msg = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    return  # the driver is gone
                op = msg[0]
                if op == "exit":
                    return
                if op == "kv":
                    kv = allocate_kv_cache(model.kv_cache_spec(), model.num_layers, msg[1], msg[2], device)
                elif op == "forward":
                    input_ids, meta, aux_ids = msg[1:]
                    hidden, _ = model.forward(input_ids.to(device), _meta_to(meta, device), kv, aux_ids)
                elif op == "logits":
                    assert hidden is not None
                    model.compute_logits(hidden[msg[1].to(device)])
                elif op == "compact":  # a draft tree's accepted path (interfaces.compact_tree_kv)
                    compact_tree_kv(kv, *msg[1:])
    except BaseException as err:  # noqa: BLE001 - the driver sees this rank's sockets close
        logger.error("tensor-parallel rank %d failed: %s: %s", rank, type(err).__name__, err)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _send_quietly(conn: Any, msg: Any, raw: bool = False) -> None:
    try:
        if raw:
            conn.send_bytes(pickle.dumps(msg))
        else:
            conn.send(msg)
    except Exception:  # noqa: BLE001
        pass


def _meta_to(meta: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return meta
    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
                                        if isinstance(getattr(meta, f.name), torch.Tensor)})


class TPWorkers:
    """The driver's handle on ranks 1..N-1: spawn, broadcast the step inputs, watch and stop them."""

    def __init__(self, world: int, target: str, load_kw: dict[str, Any], device: torch.device) -> None:
        import torch.distributed as dist
        import torch.multiprocessing as mp

        if dist.is_available() and dist.is_initialized():
            raise UsageError("a tensor-parallel LLM is already running in this process; close() it first "
                             "(one torch.distributed group per process)")
        self.world = world
        self.port = free_port()
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.dead: str | None = None
        self._lock = threading.Lock()
        threads = max(1, torch.get_num_threads())
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            kw = dict(load_kw, device=str(device))
            p = ctx.Process(target=worker_main, args=(rank, world, self.port, str(target), kw, child, threads),
                            name=f"eagle3-tp-rank{rank}", daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def start_driver_rank(self, device: torch.device) -> torch.device:
        """Join the group in a background thread, so that the driver loads its shard while the workers
        start (spawn, import torch, connect): the rendezvous waits for the slowest worker to start,
        which took as long as a TP=2 rank's load of the full-width slice here. :meth:`join_driver_rank`
        waits for it."""
        dev = rank_device(device, 0)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # (the current device is per thread)
        self._rdv_error: BaseException | None = None

        def run() -> None:
            try:
                init_rank(0, self.world, self.port, dev)
            except BaseException as err:  # noqa: BLE001 - re-raised by join_driver_rank
                self._rdv_error = err

        self._rdv = threading.Thread(target=run, name="eagle3-tp-rendezvous", daemon=True)
        self._rdv.start()
        return dev

    def join_driver_rank(self) -> None:
        """Wait for :meth:`start_driver_rank`'s rendezvous; a worker that exits meanwhile fails it at
        once instead of after the rendezvous timeout."""
        while self._rdv.is_alive():
            self._rdv.join(0.2)
            for rank, p in enumerate(self.procs, start=1):
                if self._rdv.is_alive() and not p.is_alive():
                    err = self._worker_error(rank)
                    self.close()
                    raise TPWorkerError(f"tensor-parallel worker rank {rank} exited before joining the group: {err}")
        if self._rdv_error is not None:
            self.close()
            raise TPWorkerError(f"tensor-parallel group of {self.world} ranks did not form: {self._rdv_error}")

    def _worker_error(self, rank: int) -> str:
        """What a worker that exited reported (or its exit code)."""
        p, c = self.procs[rank - 1], self.conns[rank - 1]
        try:
            if c.poll(0):
                kind, info = c.recv()
                if kind == "error":
                    return str(info)
        except (EOFError, OSError):
            pass
        return f"exit code {p.exitcode}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        for rank, (p, c) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            while not c.poll(0.2):
                if not p.is_alive():
                    self.close()
                    raise TPWorkerError(f"tensor-parallel worker rank {rank} exited while loading "
                                        f"(exit code {p.exitcode})")
                if time.monotonic() > deadline:
                    self.close()
                    raise TPWorkerError(f"tensor-parallel worker rank {rank} did not load in {_READY_TIMEOUT_S:.0f} s")
            try:
                kind, info = c.recv()
            except (EOFError, OSError):
                kind, info = "error", f"exited (exit code {p.exitcode})"
            if kind != "ready":
                self.close()
                raise TPWorkerError(f"tensor-parallel worker rank {rank} failed to load: {info}")

    def check(self) -> None:
        """Raise if a worker is gone (then for good: the group cannot run without it)."""
        if self.dead is None:
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive():
                    self.dead = f"tensor-parallel worker rank {rank} died (exit code {p.exitcode})"
                    break
        if self.dead is not None:
            raise TPWorkerError(f"{self.dead}; the engine cannot run any more steps, restart it")

    def broadcast(self, msg: tuple[Any, ...]) -> None:
        self.check()
        # Plain pickle, by value: Connection.send's pickler would move each tensor to shared memory
        # and pass a file descriptor (torch.multiprocessing's reducers), far more than a few KB cost.
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, c in enumerate(self.conns, start=1):
            try:
                c.send_bytes(data)
            except (BrokenPipeError, EOFError, OSError) as err:
                self.dead = f"tensor-parallel worker rank {rank} is gone ({type(err).__name__})"
                self.check()

    def collective_failed(self, err: BaseException) -> TPWorkerError:
        """The error for a step whose collective raised: a worker died (usually) or hung."""
        for _ in range(20):  # the dead process is reaped a moment after its sockets close
            if any(not p.is_alive() for p in self.procs):
                break
            time.sleep(0.05)
        try:
            self.check()
        except TPWorkerError as e:
            return e
        self.dead = f"a tensor-parallel collective failed ({type(err).__name__}: {err})"
        return TPWorkerError(f"{self.dead}; the engine cannot run any more steps, restart it")

    @property
    def alive(self) -> bool:
        return self.dead is None and all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        """Stop every worker (politely, then by signal) and leave the process group."""
        import torch.distributed as dist

        with self._lock:
            for c in self.conns:
                _send_quietly(c, ("exit",), raw=True)
            for p in self.procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
            for c in self.conns:
                c.close()
            self.conns = []
            self.procs = []
            if dist.is_available() and dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001
                    pass


class TPTarget:
    """Rank 0's target model as the engine sees it: each forward / logits call is broadcast to the
    workers first, then run locally (the collectives inside pair the ranks up). Everything else
    (spec, embedding, vocab size, KV layout) is the local model's."""

    def __init__(self, model: Any, workers: TPWorkers) -> None:
        self.model = model
        self.workers = workers

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["model"], name)

    def forward(self, input_ids: torch.Tensor, meta: Any, kv_caches: list[torch.Tensor],
                aux_layer_ids: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        cpu_meta = _meta_to(meta, torch.device("cpu"))
        self.workers.broadcast(("forward", input_ids.cpu(), cpu_meta, aux_layer_ids))
        try:
            return self.model.forward(input_ids, meta, kv_caches, aux_layer_ids)
        except Exception as err:  # the ranks are out of step now: the group cannot go on
            raise self.workers.collective_failed(err) from None

    def compute_logits_at(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self.workers.broadcast(("logits", rows.cpu()))
        try:
            return self.model.compute_logits(hidden[rows])
        except Exception as err:  # as in forward
            raise self.workers.collective_failed(err) from None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise UsageError("at tensor_parallel_size > 1 logits are computed by row index (compute_logits_at)")

    def compact_tree_kv(self, kv_caches: list[torch.Tensor], block_table: list[int], block_size: int, start: int,
                        node_ids: list[int]) -> None:
        """A draft tree's accepted path moved to chain positions in every rank's cache."""
        self.workers.broadcast(("compact", list(block_table), block_size, start, list(node_ids)))
        compact_tree_kv(kv_caches, block_table, block_size, start, node_ids)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self.workers.broadcast(("kv", num_blocks, block_size))
