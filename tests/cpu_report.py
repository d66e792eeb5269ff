"""Opt-in pytest plugin: where each test's wall time went, working or waiting for a CPU.

    python -m pytest -p tests.cpu_report -n 2 --dist worksteal      # (Linux; xdist or not)

Per test (setup + call + teardown): the wall time, the CPU time of the test process (``os.times``)
and of its child processes while the test runs, and the time all their threads were runnable but not
running (run-queue wait). Children's CPU and all waits are read from ``/proc/PID/task/TID/schedstat``
every half second: what a thread does after the last sample before it ends is missed. The terminal summary lists the
slowest tests and the totals.

Why: on a machine that other work shares, a test's wall time says little about the machine the suite
targets (2 dedicated cores). A test whose wall time is CPU + run-queue wait does not wait on anything
of its own: beside other load it gets its share of the cores and no more (Linux also shares them
between sessions first when ``/proc/sys/kernel/sched_autogroup_enabled`` is 1, so an xdist run's two
workers share what its session gets). Wall time well beyond CPU + run-queue wait is a sleep, a poll or
a lock in the test or in the code under test. The suite's CPU total over the number of cores is the
least wall time it can take on dedicated cores.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

_PERIOD_S = 0.5
_KEY = "cpu_report"
_SHOWN = 15


def _tree(root: int) -> list[int]:
    """``root`` and its descendants' pids."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _sample(root: int) -> dict[int, tuple[int, int]]:
    """(CPU ns, run-queue wait ns) of every thread of ``root``'s process tree, by thread id; the CPU
    only for the threads of other processes (``os.times`` counts this process's exactly)."""
    out: dict[int, tuple[int, int]] = {}
    for pid in _tree(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    cpu, wait = (int(x) for x in f.read().split()[:2])
            except (OSError, ValueError):
                continue
            out[int(tid)] = (0 if pid == root else cpu, wait)
    return out


class _Sampler(threading.Thread):
    """Samples the process tree until stopped; a thread first seen after the start counts from 0."""

    def __init__(self) -> None:
        super().__init__(name="cpu-report", daemon=True)
        self.first = _sample(os.getpid())
        self.last = dict(self.first)
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(_PERIOD_S):
            self.last.update(_sample(os.getpid()))

    def stop(self) -> tuple[float, float]:
        """(CPU s of the child processes, run-queue wait s of every thread) since the start."""
        self.done.set()
        self.join()
        self.last.update(_sample(os.getpid()))
        delta = [(c - self.first.get(tid, (0, 0))[0], w - self.first.get(tid, (0, 0))[1])
                 for tid, (c, w) in self.last.items()]
        return sum(d[0] for d in delta) / 1e9, sum(d[1] for d in delta) / 1e9


_STASH = pytest.StashKey[tuple[_Sampler, float, float]]()


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    if not os.path.isdir("/proc/self/task"):
        yield
        return
    sampler = _Sampler()
    sampler.start()
    item.stash[_STASH] = (sampler, time.perf_counter(), _cpu_s())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    if call.when != "teardown" or _STASH not in item.stash:
        return
    sampler, t0, cpu0 = item.stash[_STASH]
    children_cpu, wait = sampler.stop()
    # start / end (epoch seconds) and the xdist worker: when each worker was busy, to see a run's tail
    row = {"wall": time.perf_counter() - t0, "cpu": _cpu_s() - cpu0 + children_cpu, "wait": wait,
           "start": time.time() - (time.perf_counter() - t0), "end": time.time(),
           "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
    outcome.get_result().user_properties.append((_KEY, row))  # to the xdist controller with the report


_ROWS: dict[str, dict[str, Any]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        for key, row in report.user_properties:
            if key == _KEY:
                _ROWS[report.nodeid] = row


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if not _ROWS:
        return
    tr = terminalreporter
    total = {k: sum(r[k] for r in _ROWS.values()) for k in ("wall", "cpu", "wait")}
    n = getattr(config.option, "numprocesses", None)  # xdist's -n (0 or absent: one process)
    cores = n if isinstance(n, int) and n > 0 else 1
    if out := os.environ.get("CPU_REPORT_JSON"):  # every test's row, for grouping by file
        with open(out, "w") as f:
            json.dump(_ROWS, f, indent=0)
    tr.section("cpu report")
    tr.write_line(f"{len(_ROWS)} tests: wall {total['wall']:.0f} s, CPU {total['cpu']:.0f} s, run-queue wait "
                  f"{total['wait']:.0f} s; on {cores} dedicated core(s) at least {total['cpu'] / cores:.0f} s")
    tr.write_line(f"{'wall s':>8} {'CPU s':>8} {'runq s':>8}  test (slowest {_SHOWN})")
    for nodeid, r in sorted(_ROWS.items(), key=lambda kv: -kv[1]["wall"])[:_SHOWN]:
        tr.write_line(f"{r['wall']:8.1f} {r['cpu']:8.1f} {r['wait']:8.1f}  {nodeid}")
