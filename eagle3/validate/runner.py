"""Sending the workloads to one server and reading its speculative counters around each group.

A server exports only global counters (``/metrics``), so per-workload and per-category acceptance
comes from running the groups one after another (a workload, or one category of it) and scraping
before and after each: the deltas are that group's drafts and accepted tokens.

With several concurrency levels (``--concurrency 1,8,32``) the groups run at the first level (that
run gives acceptance, lossless and per-workload speed), then every item of every workload runs
together once per further level (a mixed batch as traffic would be), timed and scraped as a whole:
speed and acceptance per level.

A multi-turn item (MT-Bench) sends its next turn after its previous answer arrived, inside the same
concurrency slot; a turn after a failed one is not sent and is recorded as failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from eagle3.validate import bench, metrics_client
from eagle3.validate.endpoint import api_root
from eagle3.validate.workloads.base import Item, Workload


@dataclass
class GroupRun:
    """One category of one workload (or the whole workload), run with counters scraped around it."""

    workload: str
    category: str
    indices: list[int]  # item indices within the workload
    results: list[list[bench.RequestResult]]  # per item, per turn
    duration: float
    spec: dict[str, Any] | None

    def flat(self) -> list[bench.RequestResult]:
        return [r for turns in self.results for r in turns]


@dataclass
class LevelRun:
    """Every item at one concurrency level."""

    concurrency: int
    results: list[bench.RequestResult]
    duration: float
    spec: dict[str, Any] | None
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalRun:
    """One pass over the workloads against one server."""

    base_url: str
    model: str | None
    groups: list[GroupRun]
    levels: list[LevelRun]
    label: str = "speculative"
    server: dict[str, Any] = field(default_factory=dict)

    def workload_groups(self, name: str) -> list[GroupRun]:
        return [g for g in self.groups if g.workload == name]

    def item_results(self, workload: Workload) -> list[list[bench.RequestResult]]:
        """Per item of ``workload`` (in its order), per turn."""
        out: list[list[bench.RequestResult]] = [[] for _ in workload.items]
        for g in self.workload_groups(workload.name):
            for i, res in zip(g.indices, g.results, strict=True):
                out[i] = res
        return out

    @property
    def first(self) -> LevelRun:
        return self.levels[0]


async def run_items(base_url: str, items: Sequence[Item], model: str | None, concurrency: int,
                    api_key: str | None = None) -> tuple[list[list[bench.RequestResult]], float]:
    """Send every item (all its turns) with at most ``concurrency`` items in flight; per item, per
    turn, in item order; and the wall time from the first send to the last answer."""
    root = api_root(base_url)
    async with bench.client(base_url, concurrency) as client:
        sem = asyncio.Semaphore(concurrency)
        t0 = time.perf_counter()

        async def one(item: Item) -> list[bench.RequestResult]:
            async with sem:
                out: list[bench.RequestResult] = []
                answers: list[str] = []
                for _ in range(item.num_turns):
                    if out and not out[-1].ok:
                        out.append(bench.RequestResult(ok=False, error="not sent: the previous turn failed"))
                        continue
                    start = time.perf_counter() - t0
                    r = await bench.stream_request(client, root + item.endpoint, item.body(model, answers), api_key)
                    r.start = start
                    out.append(r)
                    answers.append(r.text)
                return out

        results = await asyncio.gather(*(one(it) for it in items))
        return list(results), time.perf_counter() - t0


def _scraped(base_url: str, api_key: str | None, items: Sequence[Item], model: str | None,
             concurrency: int) -> tuple[list[list[bench.RequestResult]], float, dict[str, Any] | None]:
    before = metrics_client.scrape(base_url, api_key)
    results, duration = asyncio.run(run_items(base_url, items, model, concurrency, api_key))
    after = metrics_client.scrape(base_url, api_key)
    return results, duration, metrics_client.spec_delta(before, after)


def run_workloads(base_url: str, workloads: Sequence[Workload], model: str | None, levels: Sequence[int],
                  api_key: str | None = None, label: str = "speculative",
                  echo: Callable[[str], None] | None = None) -> EvalRun:
    """Every group of every workload at ``levels[0]``, then everything at each further level."""
    say = echo or (lambda s: None)
    groups = []
    for w in workloads:
        for category, idx in w.groups():
            items = [w.items[i] for i in idx]
            results, duration, spec = _scraped(base_url, api_key, items, model, levels[0])
            g = GroupRun(w.name, category, idx, results, duration, spec)
            groups.append(g)
            failed = sum(not r.ok for r in g.flat())
            say(f"{label}: {w.name}" + (f" / {category}" if category != w.name else "")
                + f": {len(g.flat())} request(s) in {duration:.1f} s" + (f", {failed} failed" if failed else ""))
    flat = [r for g in groups for r in g.flat()]
    duration = sum(g.duration for g in groups)
    first = LevelRun(levels[0], flat, duration, metrics_client.merge_summaries([g.spec for g in groups]),
                     bench.compute_metrics(flat, duration))
    out = [first]
    everything = [it for w in workloads for it in w.items]
    for c in levels[1:]:
        results, duration, spec = _scraped(base_url, api_key, everything, model, c)
        level_flat = [r for turns in results for r in turns]
        out.append(LevelRun(c, level_flat, duration, spec, bench.compute_metrics(level_flat, duration)))
        say(f"{label}: all workloads at concurrency {c}: {len(level_flat)} request(s) in {duration:.1f} s")
    return EvalRun(base_url, model, groups, out, label)
