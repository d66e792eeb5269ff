"""The processes of a tensor-parallel group, on one node or several: rank 0 is the driver (the
serving process of node 0: it holds rank 0's shard and runs the engine: scheduler, sampling, the
draft); every other rank runs :func:`worker_main`. Each node's serving process spawns its own
ranks with ``torch.multiprocessing`` (forked from a fork server: :func:`_context`): node 0's driver
ranks 1..L-1 (:class:`TPWorkers`),
another node's headless ``eagle3 serve --node-rank R`` runs its first rank itself and spawns the
others (:func:`run_node`); under torchrun every rank is a process torchrun started. Another node's
rank stays for the next group when rank 0 says one follows (:func:`_rejoining`).

Rank 0 keeps the step's outputs (aux hidden states, gathered logits) where the engine and the
draft need them: nothing large crosses a process boundary, only the step's small inputs (token
ids, positions, block tables, slot mapping, metadata), which rank 0 broadcasts on a CPU gloo group
(:class:`~eagle3.runtime.parallel.StepChannel`): torch.distributed itself, so the same code serves
one node and many. Liveness: a dead rank's closed sockets fail the step's collectives at once, a
rank that hangs or a node that vanishes fails them at the collective timeout, and every rank's
heartbeat in the rendezvous store (:class:`~eagle3.runtime.parallel.Heartbeat`) names which rank
stopped; the workers watch rank 0's heartbeat and their parent process and exit when either goes
(no orphans).

This module imports the loader (a worker loads its own shard); nothing below the engine imports
this module.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch

from eagle3.errors import Eagle3Error, UsageError
from eagle3.runtime.interfaces import allocate_kv_cache, compact_tree_kv
from eagle3.runtime.loader import load_target
from eagle3.runtime.parallel import (
    Heartbeat,
    StepChannel,
    TPGroup,
    free_port,
    init_rank,
    leave_group,
    rank_device,
    ready_key,
)

logger = logging.getLogger("eagle3.runtime")

_READY_TIMEOUT_S = float(os.environ.get("EAGLE3_TP_LOAD_TIMEOUT", "3600"))
# A worker's exit status after rank 0's ("exit", rejoin=True): another group follows on the same
# address (serve --validate's baseline run), so a headless node starts its ranks again.
EXIT_REJOIN = 75


class TPWorkerError(Eagle3Error):
    """A tensor-parallel worker died or failed: the engine cannot run steps any more."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the ranks run: ``world`` ranks over ``nnodes`` nodes (``world // nnodes`` a node, node
    ``n`` holding ranks ``n * per_node ...``), meeting at ``addr``."""

    world: int
    nnodes: int
    addr: tuple[str, int]

    @property
    def per_node(self) -> int:
        return self.world // self.nnodes

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def name(self, rank: int) -> str:
        # (torchrun: one rank a "node" to the engine, so no node is named)
        return f"rank {rank}" + (f" (node {self.node_of(rank)})" if 1 < self.nnodes < self.world else "")


def worker_main(rank: int, layout: Layout, target: str, load_kw: dict[str, Any], num_threads: int,
                local_rank: int, parent: int | None = None, generation: int = 0, sigint: Any = signal.SIG_IGN) -> int:
    """A worker rank: join the group, load this rank's shard, then run rank 0's steps until its
    ("exit",) or its loss. Returns the exit status (0, or :data:`EXIT_REJOIN`, or 1 on a failure).
    ``sigint``: what Ctrl-C does to this process (ignored: it reaches the whole process group, and rank
    0, or the process that spawned this one, decides what stops)."""
    signal.signal(signal.SIGINT, sigint)
    torch.set_num_threads(num_threads)
    store = None
    ended = threading.Event()  # this group is over on purpose: the store's end is not rank 0's loss
    try:
        if parent is not None:  # (from the start: a parent gone during the rendezvous leaves no one to end it)
            _watch_parent(rank, parent)
        device = rank_device(torch.device(load_kw.pop("device")), local_rank)
        store = init_rank(rank, layout.world, layout.addr, device, generation)
        beat = Heartbeat(layout.addr, rank, [0], lambda r, why: _lost_driver(rank, why, ended), generation).start()
        model = load_target(target, device=device, tp=TPGroup(rank, layout.world), **load_kw)
        store.set(ready_key(rank), "ok")
    except BaseException as err:  # noqa: BLE001 - reported to rank 0, which raises it
        msg = f"{type(err).__name__}: {err}"
        logger.error("tensor-parallel %s failed to start: %s", layout.name(rank), msg)
        if store is not None:
            _quietly(lambda: store.set(ready_key(rank), f"error: {msg}"))
        return 1
    try:
        code = _serve_steps(model, device, StepChannel())
        # (before the report: rank 0 closes its store once every rank reported, and a rank that joins
        # the next group in this process must not take that for rank 0's loss and exit meanwhile)
        ended.set()
        beat.stop()
        _quietly(lambda: store.set(_exited_key(rank), "1"))  # rank 0 waits for it before closing the store
        return code
    except Exception as err:  # noqa: BLE001 - a peer is gone, or this rank failed: the group is over
        logger.error("tensor-parallel %s stopped: %s: %s", layout.name(rank), type(err).__name__, err)
        if _peer_error(err):
            # Stay (idle) until rank 0 ends the group or is gone (the heartbeat and parent watch exit
            # then): exiting now would make this rank look like the one that died, while rank 0 is
            # still finding out which did (a peer on another node shows only by its heartbeat).
            threading.Event().wait()
        # This rank's own failure: say why, and leave (its closed sockets fail the others' collectives).
        why = f"{type(err).__name__}: {err}"[:500]
        _quietly(lambda: store.set(_failed_key(rank), why))
        return 1
    finally:
        beat.stop()
        leave_group()


def _serve_steps(model: Any, device: torch.device, channel: StepChannel) -> int:
    kv: list[torch.Tensor] = []
    hidden: torch.Tensor | None = None
    with torch.inference_mode():
        while True:
            msg = channel.recv()
            op = msg[0]
            if op == "exit":
                return EXIT_REJOIN if msg[1] else 0
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


def _peer_error(err: BaseException) -> bool:
    """Whether a step failed because a peer did (a collective's transport error), not this rank."""
    import torch.distributed as dist

    text = str(err).lower()
    return isinstance(err, dist.DistError) or any(w in text for w in ("gloo", "nccl", "connection", "timed out"))


def _failed_key(rank: int) -> str:
    return f"eagle3/failed/{rank}"


def _exited_key(rank: int) -> str:
    return f"eagle3/exited/{rank}"


def _lost_driver(rank: int, why: str, ended: threading.Event) -> None:
    """A worker whose rank 0 is gone ends: nothing it could do would be seen. (After a moment: rank 0
    that stops the group on purpose closes its store just after its ("exit",), which the main thread
    then takes, setting ``ended``: it leaves, or joins the next group, on its own.)"""
    time.sleep(2.0)
    if ended.is_set():
        return
    logger.error("tensor-parallel rank %d: rank 0 is gone (%s); exiting", rank, why)
    os._exit(1)


def _watch_parent(rank: int, parent: int) -> None:
    """A started rank exits when the process that started it is gone (killed outright included).

    Watched by its pid, not as this process's parent: a rank is the fork server's child
    (:func:`_context`), and the fork server outlives the process that asked for the rank while any
    rank it forked runs."""
    def run() -> None:
        _wait_gone(parent)
        logger.error("tensor-parallel rank %d: its parent process %d is gone; exiting", rank, parent)
        os._exit(1)

    threading.Thread(target=run, name="eagle3-parent-watch", daemon=True).start()


def _wait_gone(pid: int) -> None:
    """Return once process ``pid`` has ended: blocked on its pidfd (Linux), which becomes readable
    when the process ends, else by polling whether it still exists."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd here, or the process is gone already (ESRCH)
        while _exists(pid):
            time.sleep(0.5)
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (someone else's process now)
        return True
    return True


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001
        pass


def _spawned_worker(rank: int, layout: Layout, target: str, load_kw: dict[str, Any], num_threads: int,
                    local_rank: int, parent: int, generation: int, rejoin: bool = False,
                    env: dict[str, str] | None = None) -> None:
    if env is not None:  # the environment of the process that started this rank, now (not the fork server's)
        os.environ.clear()
        os.environ.update(env)
    if rejoin:  # every group rank 0 forms at the address from ``generation`` on, in this one process
        sys.exit(_rejoining(rank, layout, target, load_kw, num_threads, local_rank, parent, generation=generation))
    sys.exit(worker_main(rank, layout, target, load_kw, num_threads, local_rank, parent, generation))


def _rejoining(rank: int, layout: Layout, target: str, load_kw: dict[str, Any], num_threads: int, local_rank: int,
               parent: int | None = None, sigint: Any = signal.SIG_IGN, generation: int = 0) -> int:
    """Rank ``rank`` of every group that rank 0 forms at ``layout.addr`` from ``generation`` on, in
    this process: again (its shard loaded again) each time rank 0 ends a group saying another follows
    (serve --validate's baseline run). Returns the exit status.

    Why in this process: a fresh process per group paid the interpreter's start and ``import torch``
    again (~2 CPU-s a rank) for nothing that the group's end leaves behind."""
    first = generation
    while True:
        code = worker_main(rank, layout, target, dict(load_kw), num_threads, local_rank,
                           parent if generation == first else None, generation, sigint)  # (one parent watch)
        if code != EXIT_REJOIN:
            return code
        generation += 1
        if not _await_generation(layout.addr, generation):
            return 0


def _meta_to(meta: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return meta
    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
                                        if isinstance(getattr(meta, f.name), torch.Tensor)})


def rank_threads(device: torch.device, local_ranks: int) -> int:
    """Intra-op threads for each of a node's ``local_ranks`` ranks: CPU ranks share the node's cores
    (this process's thread count: all of them, or OMP_NUM_THREADS), a GPU rank keeps the count.

    Why: each CPU rank at the full count oversubscribes the cores, and OpenMP's threads spin at every
    op's barrier while the other ranks' threads hold the cores: TP=2 on a busy 2-core machine took
    92 CPU-s and 198 s for 100 tiny decode steps, against 5.6 CPU-s and 6 s at one thread a rank."""
    n = max(1, torch.get_num_threads())
    return max(1, n // local_ranks) if device.type == "cpu" else n


def _context() -> Any:
    """How a node's ranks start: forked from a fork server that has imported this module (and so
    torch) once, where the platform has one, else spawned (a fresh interpreter each).

    Why: a spawned rank paid the interpreter's start and ``import torch`` (~2 CPU-s) every time; a
    process that forms groups again (a notebook's LLMs, a test session, serve --validate's groups of
    other settings) paid it again for each rank. Forked from the server, a rank costs a fork. The
    server is a fresh single-threaded process that never ran an op or touched a GPU, so a fork of it
    is as safe as a spawn (CUDA included). The rank takes the environment of the process that
    starts it (:func:`_spawned_worker`); the few settings read at import (EAGLE3_TP_TIMEOUT,
    EAGLE3_TP_HEARTBEAT_TIMEOUT) are the server's, i.e. this process's when it started its first rank."""
    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # (only read when the server starts: once a process)
    return ctx


def _spawn(ranks: range, first_local: int, layout: Layout, target: str, load_kw: dict[str, Any],
           device: torch.device, generation: int, rejoin: bool = False) -> list[Any]:
    """Start ``ranks`` as processes (:func:`_context`; local ranks from ``first_local``; the node's
    ``layout.per_node`` ranks share its cores: :func:`rank_threads`); ``rejoin``: each joins every
    group at the address (:func:`_rejoining`)."""
    ctx = _context()
    threads = rank_threads(device, layout.per_node)
    procs = []
    for i, rank in enumerate(ranks):
        kw = dict(load_kw, device=str(device))
        p = ctx.Process(target=_spawned_worker, args=(rank, layout, str(target), kw, threads, first_local + i,
                                                      os.getpid(), generation, rejoin, dict(os.environ)),
                        name=f"eagle3-tp-rank{rank}", daemon=True)
        p.start()
        procs.append(p)
    return procs


def _stop(procs: list[Any], grace: float = 5.0) -> None:
    """Wait for ``procs`` to end (they were told to), then terminate, then kill."""
    for p in procs:
        p.join(timeout=grace)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


# Groups this process formed so far at each rendezvous address: the other nodes count the groups at
# an address the same way (run_node, run_torchrun_rank: 0 first, +1 per rejoin), so a count per
# process would not match theirs once an earlier group at another address existed here.
_GENERATIONS: dict[tuple[str, int], int] = {}


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1 (its own node's, spawned here, and other nodes'): broadcast
    the step inputs, watch every rank, stop them."""

    def __init__(self, world: int, target: str, load_kw: dict[str, Any], device: torch.device,
                 nnodes: int = 1, addr: tuple[str, int] | None = None) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            raise UsageError("a tensor-parallel LLM is already running in this process; close() it first "
                             "(one torch.distributed group per process)")
        self.layout = Layout(world, nnodes, addr or ("127.0.0.1", free_port()))
        self.world = world
        self.dead: str | None = None
        self._lock = threading.Lock()
        self.store: Any = None
        self.beat: Heartbeat | None = None
        self.channel = StepChannel()
        # A group on a port of its own (no address given) is generation 0 of a fresh store and is not
        # counted: counted, a later multi-node group that the OS happens to give the same port would
        # join as generation 1 while the other nodes, new processes, wait at 0 (and hang until timeout).
        self._threads: int | None = None  # the driver's own thread count while it runs as rank 0
        self.generation = _GENERATIONS.get(self.layout.addr, 0) if addr is not None else 0
        if addr is not None:
            _GENERATIONS[self.layout.addr] = self.generation + 1
        # The local ranks of the previous group, if it closed saying this one follows (rejoin) with
        # the same ranks, checkpoint and load settings: they join this group at their address.
        self._key = (world, nnodes, addr, str(target), repr(sorted(load_kw.items())), str(device))
        parked = _take_parked(self._key)
        if parked is not None:
            self.layout = dataclasses.replace(self.layout, addr=parked.addr)
            self.generation = parked.generation
            self.procs: list[Any] = parked.procs
        else:
            self.procs = _spawn(range(1, self.layout.per_node), 1, self.layout, target, load_kw, device,
                                self.generation, rejoin=True)

    def start_driver_rank(self, device: torch.device) -> torch.device:
        """Join the group in a background thread, so that the driver loads its shard while the workers
        start (spawn, import torch, connect): the rendezvous waits for the slowest worker to start,
        which took as long as a TP=2 rank's load of the full-width slice here. :meth:`join_driver_rank`
        waits for it."""
        dev = rank_device(device, 0)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # (the current device is per thread)
        # The driver is one of this node's ranks: its share of the cores until close() (rank_threads).
        self._threads = torch.get_num_threads()
        torch.set_num_threads(rank_threads(dev, self.layout.per_node))
        self._rdv_error: BaseException | None = None

        def run() -> None:
            try:
                self.store = init_rank(0, self.world, self.layout.addr, dev, self.generation)
            except BaseException as err:  # noqa: BLE001 - re-raised by join_driver_rank
                self._rdv_error = err

        self._rdv = threading.Thread(target=run, name="eagle3-tp-rendezvous", daemon=True)
        self._rdv.start()
        return dev

    def join_driver_rank(self) -> None:
        """Wait for :meth:`start_driver_rank`'s rendezvous; a local worker that exits meanwhile fails it
        at once instead of after the rendezvous timeout. Then start watching every rank's heartbeat."""
        while self._rdv.is_alive():
            self._rdv.join(0.2)
            for rank, p in enumerate(self.procs, start=1):
                if self._rdv.is_alive() and not p.is_alive():
                    self.close()
                    raise TPWorkerError(f"tensor-parallel worker rank {rank} exited before joining the group "
                                        f"(exit code {p.exitcode})")
        if self._rdv_error is not None:
            self.close()
            raise TPWorkerError(f"tensor-parallel group of {self.world} ranks did not form: {self._rdv_error}")
        self.beat = Heartbeat(self.layout.addr, 0, list(range(1, self.world)), self._lost, self.generation).start()

    def _lost(self, rank: int | None, why: str) -> None:
        if self.dead is None:
            self.dead = f"tensor-parallel {self.layout.name(rank or 0)} stopped answering ({why})"

    def wait_ready(self) -> None:
        """Wait until every rank reports its shard loaded (in the store: ranks on other nodes too)."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        for rank in range(1, self.world):
            key = ready_key(rank)
            while not self.store.check([key]):
                time.sleep(0.1)
                try:
                    self.check()
                except TPWorkerError as err:
                    self.close()
                    raise TPWorkerError(f"{err} while loading") from None
                if time.monotonic() > deadline:
                    self.close()
                    raise TPWorkerError(f"tensor-parallel {self.layout.name(rank)} did not load in "
                                        f"{_READY_TIMEOUT_S:.0f} s")
            info = self.store.get(key).decode()
            if info != "ok":
                self.close()
                raise TPWorkerError(f"tensor-parallel {self.layout.name(rank)} failed to load: "
                                    f"{info.removeprefix('error: ')}")

    def check(self) -> None:
        """Raise if a rank is gone (then for good: the group cannot run without it)."""
        if self.dead is None:
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive():
                    why = self._failure(rank)
                    self.dead = (f"tensor-parallel worker {self.layout.name(rank)} "
                                 + (f"failed: {why}" if why else f"died (exit code {p.exitcode})"))
                    break
        if self.dead is not None:
            raise TPWorkerError(f"{self.dead}; the engine cannot run any more steps, restart it")

    def broadcast(self, msg: tuple[Any, ...]) -> None:
        self.check()
        try:
            self.channel.send(msg)
        except Exception as err:  # a rank is gone
            raise self.collective_failed(err) from None

    def _failure(self, rank: int) -> str | None:
        """What rank ``rank`` reported when its own step failed (None: nothing)."""
        try:
            key = _failed_key(rank)
            return self.store.get(key).decode() if self.store is not None and self.store.check([key]) else None
        except Exception:  # noqa: BLE001
            return None

    def _failed_rank(self) -> None:
        """Mark the first rank (of any node) that reported a failure of its own as dead."""
        for rank in range(1, self.world):
            why = self._failure(rank)
            if why is not None and self.dead is None:
                self.dead = f"tensor-parallel {self.layout.name(rank)} failed: {why}"

    def collective_failed(self, err: BaseException) -> TPWorkerError:
        """The error for a step whose collective raised: a rank died (usually) or hung. Which one: a
        local process that exited, or a rank whose heartbeat stops (other nodes)."""
        from eagle3.runtime.parallel import _HB_INTERVAL_S, _HB_TIMEOUT_S

        deadline = time.monotonic() + _HB_TIMEOUT_S + 4 * _HB_INTERVAL_S
        while time.monotonic() < deadline:
            try:
                self.check()
                self._failed_rank()
                self.check()
            except TPWorkerError as e:
                return e
            time.sleep(0.05)
        self.dead = f"a tensor-parallel collective failed ({type(err).__name__}: {err})"
        return TPWorkerError(f"{self.dead}; the engine cannot run any more steps, restart it")

    @property
    def alive(self) -> bool:
        return self.dead is None and all(p.is_alive() for p in self.procs)

    def close(self, rejoin: bool = False) -> None:
        """Stop every rank (rank 0's ("exit",); the local ones by signal if they do not stop) and
        leave the process group. ``rejoin``: another group follows at the same address."""
        with self._lock:
            self._finish_rendezvous()
            told = False
            if self.store is not None and self.dead is None and not getattr(self, "_closed", False):
                _quietly(lambda: self.channel.send(("exit", rejoin)))
                told = self._wait_exited()
            self._closed = True
            if self.beat is not None:
                self.beat.stop()
            if rejoin and told and self.procs and all(p.is_alive() for p in self.procs):
                # they wait for the next group at this address (_rejoining): no new process, no import
                _park(_Parked(self._key, self.procs, self.layout.addr, self.generation + 1))
            else:
                _stop(self.procs, grace=5.0 if self.dead is None else 0.5)  # a broken group's wait to be stopped
            self.procs = []
            leave_group()
            self.store = None
            self.beat = None
            if self._threads is not None:
                torch.set_num_threads(self._threads)  # this process's own count again
                self._threads = None

    def _finish_rendezvous(self, timeout: float = 120.0) -> None:
        """A group closed while rank 0 still joins it (the driver's own load failed meanwhile): let it
        form first, if every rank is a live process of this one (one node), so that it can be left.

        Why: the rendezvous thread, left waiting in ``init_process_group`` for ranks that were
        stopped, held up the next group this process formed until the collective timeout (300 s),
        which then failed: one LLM whose load failed (a size that does not split) made the next
        tensor-parallel LLM in a notebook or test process fail. Ranks on other nodes may never come:
        that case keeps its thread (until the timeout)."""
        rdv = getattr(self, "_rdv", None)
        deadline = time.monotonic() + timeout
        while (rdv is not None and rdv.is_alive() and self.layout.nnodes == 1 and time.monotonic() < deadline
               and all(p.is_alive() for p in self.procs)):
            rdv.join(0.1)

    def _wait_exited(self, timeout: float = 10.0) -> bool:
        """Wait (a while) until every rank has taken the ("exit",), so none mistakes the store's
        end for rank 0's death (not for ranks of this node that have ended already). Returns whether
        every rank took it."""
        deadline = time.monotonic() + timeout
        keys = [_exited_key(r) for r in range(1, self.world)]
        while time.monotonic() < deadline:
            try:
                if self.store.check(keys):
                    return True
            except Exception:  # noqa: BLE001
                return False
            if self.layout.nnodes == 1 and not any(p.is_alive() for p in self.procs):
                return False  # (a rank that failed to load leaves without taking it)
            time.sleep(0.05)
        return False


@dataclasses.dataclass
class _Parked:
    """Local ranks of a group closed with ``rejoin``, waiting to join generation ``generation`` at
    ``addr`` (:func:`_rejoining`); ``key``: the group they load for (TPWorkers._key)."""

    key: tuple[Any, ...]
    procs: list[Any]
    addr: tuple[str, int]
    generation: int


_parked: _Parked | None = None  # (one group per process at a time: at most one set waits)


def _park(parked: _Parked) -> None:
    global _parked
    _take_parked(None)
    _parked = parked


def _take_parked(key: tuple[Any, ...] | None) -> _Parked | None:
    """The waiting ranks if they are ``key``'s, else None, after stopping any that wait (a group of
    another checkpoint, size or settings follows: theirs would never form)."""
    global _parked
    parked, _parked = _parked, None
    if parked is not None and parked.key == key and all(p.is_alive() for p in parked.procs):
        return parked
    if parked is not None:
        _stop(parked.procs, grace=0)
    return None


def run_node(layout: Layout, node_rank: int, target: str, load_kw: dict[str, Any], device: torch.device) -> int:
    """A node other than node 0 (``eagle3 serve --node-rank R``): run this node's ranks headless until
    rank 0 ends them, each joining every group rank 0 forms (:func:`_rejoining`). Returns the exit
    status.

    This process runs the node's first rank itself, as node 0's driver does, and spawns the others:
    a spawned first rank was one more interpreter and ``import torch`` (~2 CPU-s, and its memory)
    beside this one, which only waited. Ctrl-C ends this process at once (its own rank ignores it
    otherwise: rank 0's Ctrl-C reaches its spawned ranks too); the spawned ranks follow when their
    parent is gone."""
    per = layout.per_node
    ranks = range(node_rank * per, (node_rank + 1) * per)
    logger.warning("eagle3: node %d: tensor-parallel ranks %d-%d joining %s:%d", node_rank, ranks[0],
                   ranks[-1], *layout.addr)
    procs = _spawn(ranks[1:], 1, layout, target, load_kw, device, 0, rejoin=True)
    code = _rejoining(ranks[0], layout, target, dict(load_kw, device=str(device)), rank_threads(device, per), 0,
                      sigint=signal.SIG_DFL)
    codes = _wait_all(procs) if code == 0 else []
    if code != 0:
        _stop(procs, grace=0)  # (the group cannot run without this rank)
    return 0 if code == 0 and all(c == 0 for c in codes) else 1


def run_torchrun_rank(rank: int, layout: Layout, target: str, load_kw: dict[str, Any]) -> int:
    """A rank torchrun started (not rank 0): this process is the rank, of every group rank 0 forms
    (serve --validate's baseline run: :func:`_rejoining`). Returns the exit status."""
    return _rejoining(rank, layout, target, load_kw, max(1, torch.get_num_threads()), 0)


def _await_generation(addr: tuple[str, int], generation: int, timeout: float = 600.0) -> bool:
    """Wait until rank 0's store at ``addr`` serves ``generation`` (the previous group's store may
    still be up a moment); False if it never comes."""
    from eagle3.runtime.parallel import store_generation

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if store_generation(addr) == generation:
            return True
        time.sleep(0.5)
    return False


def _wait_all(procs: list[Any]) -> list[int]:
    """Wait for every process; once one fails, the others are stopped (a group cannot run without it)."""
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            _stop(procs, grace=10)
            break
        time.sleep(0.2)
    return [int(p.exitcode) for p in procs]


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
