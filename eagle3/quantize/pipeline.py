"""``eagle3 quantize``: a checkpoint file to file, shard by shard, into AMD Quark's export format.

Flow: classify the source and refuse what cannot work (before anything is written) -> plan every
output tensor from the headers alone (which module is quantized, which shard receives it, the
index) -> process source shards in parallel worker processes (each writes one output shard with
the source shard's file name, then reads it back and verifies every quantized tensor against the
source) -> config.json, index, side files, report, manifest -> rename ``OUT.partial`` to ``OUT``.

Memory: a worker holds one source tensor (plus its quantized form) at a time, quantizes it in
row chunks and streams output bytes to disk, so its peak is about the largest tensor, whatever
the shard or checkpoint size.

Resume: each finished shard is renamed into ``OUT.partial/`` and recorded (with its verification
rows) under ``OUT.partial/.eagle3-quantize/``; an interrupted run started again with ``--resume``
skips those shards. A run that fails before finishing any shard leaves nothing behind.
"""

from __future__ import annotations

import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from eagle3 import __version__
from eagle3.checkpoint import (
    CheckpointReader,
    CheckpointWriter,
    atomic_output,
    check_output,
    copy_side_files,
    partial_path,
    read_json,
    write_json,
)
from eagle3.errors import Eagle3Error, UsageError
from eagle3.formats.files import INDEX_FILE
from eagle3.quantize import compat, native, report
from eagle3.quantize.recipes import Recipe, Scope, WeightSpec, load_recipe
from eagle3.quantize.sources import (
    DENSE,
    Module,
    SourceInfo,
    dense_passthrough,
    find_modules,
    inspect_source,
    open_rows,
)

ENGINES = ("native", "quark")
STATE_DIR = ".eagle3-quantize"
_SHARD_SLACK = 1 << 20


# ---------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardJob:
    """Everything a worker needs for one shard (picklable)."""

    src: str
    tmp: str  # OUT.partial
    file: str  # source shard file name == output shard file name
    steps: tuple[tuple[str, str], ...]  # ("copy", tensor) | ("quant", module) | ("dense", module)
    modules: tuple[Module, ...]  # the modules named by this shard's quant/dense steps
    spec: WeightSpec
    zero_point: bool
    engine: str
    verify: bool
    bound: float
    work_bytes: int  # progress units: source bytes (quantized ones twice when verified)
    out_bytes: int  # planned tensor bytes of the output shard (exact: shapes are known up front)
    cost: float  # scheduling estimate: quantized elements dominate, copies are kernel-side


@dataclass
class Plan:
    source: SourceInfo
    recipe: Recipe
    scope: Scope
    modules: dict[str, Module]
    quantized: list[str]
    unquantized: list[str]  # Linear-like modules left unquantized (the explicit exclude names)
    jobs: list[ShardJob]
    weight_map: dict[str, str]
    src_bytes: int


def make_plan(src_dir: Path, reader: CheckpointReader, source: SourceInfo, recipe: Recipe, scope: Scope,
              tmp: Path, engine: str, verify: bool) -> Plan:
    """Decide every output tensor from headers only; one-line errors for a scope that matches
    nothing and for a weight the scheme cannot take."""
    modules = find_modules(reader, source)
    quantized = sorted(m for m in modules if scope.matches(m))
    if not quantized:
        raise UsageError(f"recipe {recipe.name!r} scope {scope.name!r} matches none of the {len(modules)} Linear "
                         f"modules of {src_dir} (include: {', '.join(scope.include)})")
    for name in quantized:
        native.check_shape(recipe.weight, modules[name].shape, name)
    qset = set(quantized)
    by_primary = {m.primary: m for m in modules.values()}
    consumed = {t for m in modules.values() for t in m.consumed}
    jobs: list[ShardJob] = []
    weight_map: dict[str, str] = {}
    for f, names in reader.shards().items():
        steps: list[tuple[str, str]] = []
        mods: list[Module] = []
        work = out_bytes = 0
        cost = 0.0
        for name in names:
            m = by_primary.get(name)
            if m is not None:
                size = sum(reader.info(t).nbytes for t in m.consumed)
                if m.name in qset:
                    steps.append(("quant", m.name))
                    outs = native.expected_shapes(recipe.weight, m.shape, recipe.export.zero_point)
                    weight_map.update({f"{m.name}.{s}": f.name for s in outs})
                    out_bytes += sum(math.prod(shape) * dt.itemsize for shape, dt in outs.values())
                    work += size * (2 if verify else 1)
                    cost += m.numel * (2 if verify else 1)
                    mods.append(m)
                elif m.kind == DENSE:
                    steps.append(("copy", name))
                    weight_map[name] = f.name
                    work += size
                    out_bytes += size
                else:
                    steps.append(("dense", m.name))
                    weight_map[f"{m.name}.weight"] = f.name
                    work += size
                    out_bytes += m.numel * 2  # bf16
                    cost += m.numel
                    mods.append(m)
            elif name in consumed:
                continue  # read by name by the module that owns it, wherever its primary lives
            else:
                steps.append(("copy", name))
                weight_map[name] = f.name
                work += reader.info(name).nbytes
                out_bytes += reader.info(name).nbytes
        jobs.append(ShardJob(src=str(src_dir), tmp=str(tmp), file=f.name, steps=tuple(steps), modules=tuple(mods),
                             spec=recipe.weight, zero_point=recipe.export.zero_point, engine=engine, verify=verify,
                             bound=recipe.weight.max_rel_error, work_bytes=work, out_bytes=out_bytes,
                             cost=cost + out_bytes / 16))
    unquantized = sorted(m for m in modules if m not in qset)
    return Plan(source, recipe, scope, modules, quantized, unquantized, jobs, weight_map, reader.total_bytes)


# ---------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------


@dataclass
class ShardResult:
    file: str
    out_bytes: int
    tensors: int
    seconds: float
    rows: list[report.TensorReport] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows"] = [{**asdict(r), "snr_db": r.snr_db if math.isfinite(r.snr_db) else None} for r in self.rows]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardResult:
        rows = [report.TensorReport(**{**r, "snr_db": math.inf if r["snr_db"] is None else r["snr_db"]})
                for r in d["rows"]]
        return cls(d["file"], d["out_bytes"], d["tensors"], d["seconds"], rows)


_worker: dict[str, Any] = {}


def _init_worker(queue: Any) -> None:
    # One intra-op thread per worker, parallelism comes from processes: the codecs run on small row
    # chunks, where OpenMP fork/join costs more than it gains (torch.round on 8K elements takes
    # ~2 us on one thread and ~13 ms on two threads of a busy 2-core machine).
    torch.set_num_threads(1)
    _worker["queue"] = queue


def _engine(name: str) -> Any:
    eng = _worker.get(f"engine:{name}")
    if eng is None:
        if name == "quark":
            from eagle3.quantize.quark import QuarkEngine

            eng = QuarkEngine()
        else:
            eng = native.NativeEngine()
        _worker[f"engine:{name}"] = eng
    return eng


def _reader(src: str) -> CheckpointReader:
    r = _worker.get(f"reader:{src}")
    if r is None:
        r = _worker[f"reader:{src}"] = CheckpointReader(src)
    return r


def _queue_progress(n: int) -> None:
    q = _worker.get("queue")
    if q is not None:
        q.put(n)


def run_shard(job: ShardJob, progress: Callable[[int], None] | None = None) -> ShardResult:
    """Quantize one source shard into ``OUT.partial/<same file name>``, then verify it from disk."""
    progress = progress or _queue_progress
    res = write_shard(job, progress)
    res.rows = check_shard(job, progress)
    return res


def check_shard(job: ShardJob, progress: Callable[[int], None] | None = None) -> list[report.TensorReport]:
    """The verification pass of a written shard (a job of its own in the pool: verifying the
    largest shard need not wait behind its own quantization on the same core)."""
    final = Path(job.tmp) / job.file
    if not job.verify or not any(k == "quant" for k, _ in job.steps) or not final.is_file():
        return []
    return verify_shard(job, _reader(job.src), final, progress or _queue_progress)


def write_shard(job: ShardJob, progress: Callable[[int], None] | None = None) -> ShardResult:
    """Quantize one source shard into ``OUT.partial/<same file name>`` (no verification)."""
    progress = progress or _queue_progress
    t0 = time.perf_counter()
    reader = _reader(job.src)
    engine = _engine(job.engine)
    mods = {m.name: m for m in job.modules}
    tmp = Path(job.tmp)
    work = tmp / STATE_DIR / f"work-{job.file}"
    shutil.rmtree(work, ignore_errors=True)
    # One output file per source shard: the cap is the planned size (plus slack), which also lets
    # the writer reserve a right-sized header and write the shard once.
    writer = CheckpointWriter(work, max_shard_bytes=job.out_bytes + _SHARD_SLACK)
    n_out = 0
    out_bytes = 0

    def add(name: str, t: torch.Tensor) -> None:
        nonlocal n_out, out_bytes
        writer.add(name, t)
        n_out += 1
        out_bytes += t.numel() * t.element_size()

    for kind, name in job.steps:
        if kind == "copy":
            info = reader.info(name)
            writer.add_raw(name, info)  # file to file in the kernel: never through Python memory
            n_out += 1
            out_bytes += info.nbytes
            progress(info.nbytes)
            continue
        m = mods[name]
        size = sum(reader.info(t).nbytes for t in m.consumed)
        if kind == "dense":
            add(f"{name}.weight", dense_passthrough(reader, m))
        else:
            with torch.no_grad():
                for suffix, t in engine.quantize(open_rows(reader, m), job.spec, job.zero_point).items():
                    add(f"{name}.{suffix}", t)
        progress(size)
    files = writer.close()
    final = tmp / job.file
    if len(files) > 1:  # the plan sized the shard exactly; more files would be a bug, not bad input
        raise RuntimeError(f"{job.file}: output split into {len(files)} files (planned {job.out_bytes} bytes)")
    if files:
        files[0].rename(final)
    shutil.rmtree(work, ignore_errors=True)
    return ShardResult(job.file, out_bytes, n_out, time.perf_counter() - t0, [])


def verify_shard(job: ShardJob, reader: CheckpointReader, out_file: Path,
                 progress: Callable[[int], None]) -> list[report.TensorReport]:
    """Read every quantized tensor back from the written shard, decode it with eagle3's codecs and
    compare with the source weight (recomputed from the source files), row chunk by row chunk."""
    out = CheckpointReader(out_file)
    rows: list[report.TensorReport] = []
    mods = {x.name: x for x in job.modules}
    for kind, name in job.steps:
        if kind != "quant":
            continue
        m = mods[name]
        expect = native.expected_shapes(job.spec, m.shape, job.zero_point)
        tensors = {}
        for suffix, (shape, dtype) in expect.items():
            t = out.get(f"{name}.{suffix}")
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise Eagle3Error(f"{out_file}: tensor {name}.{suffix} was written as {t.dtype}{list(t.shape)}, "
                                  f"expected {dtype}{list(shape)}")
            tensors[suffix] = t
        src = open_rows(reader, m)
        n, k = m.shape
        acc = report.ErrorAccumulator()
        step = native.chunk_rows(n, k, src.row_align)
        with torch.no_grad():
            for r0 in range(0, n, step):
                r1 = min(n, r0 + step)
                acc.add(native.decode(tensors, job.spec, m.shape, r0, r1), src.rows(r0, r1))
        rows.append(report.TensorReport.from_acc(name, m.shape, acc, job.bound))
        progress(sum(reader.info(t).nbytes for t in m.consumed))
    return rows


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


@dataclass
class QuantizeResult:
    out: Path
    recipe: str
    scope: str
    engine: str
    source_kind: str
    quantized: int
    unquantized: int
    shards: int
    shards_resumed: int
    src_bytes: int
    out_bytes: int
    seconds: float
    rows: list[report.TensorReport]
    files: list[Path]

    @property
    def failed(self) -> list[report.TensorReport]:
        return [r for r in self.rows if not r.ok]

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("rows", "files")}
        d["out"] = str(self.out)
        d["files"] = [str(f) for f in self.files]
        d["summary"] = report.summarize(self.rows)
        d["failed"] = [r.module for r in self.failed]
        return d


def _fingerprint(plan: Plan, verify: bool) -> dict[str, Any]:
    src = [[f, os.stat(Path(plan.source.path) / f).st_size, os.stat(Path(plan.source.path) / f).st_mtime_ns]
           for f in plan.source.shard_files]
    return {"eagle3": __version__, "recipe": plan.recipe.raw, "scope": plan.scope.name, "verify": verify,
            "source": src}


def _load_done(state: Path, tmp: Path, jobs: list[ShardJob]) -> dict[str, ShardResult]:
    done: dict[str, ShardResult] = {}
    for job in jobs:
        f = state / f"done-{job.file}.json"
        if f.is_file():
            r = ShardResult.from_json(read_json(f))
            if r.tensors == 0 or (tmp / job.file).is_file():
                done[job.file] = r
    return done


def _auto_workers(jobs: list[ShardJob]) -> int:
    """One worker per core and per shard, but no more than the available memory holds: a worker
    needs about its interpreter (~0.5 GiB with torch) plus twice the largest tensor it reads."""
    n = min(os.cpu_count() or 1, len(jobs))
    largest = max((m.numel * 4 for j in jobs for m in j.modules), default=0)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not Linux: trust the core count
        return max(1, n)
    return max(1, min(n, avail // (2**29 + 2 * largest)))


def quantize(src: str | os.PathLike[str], out: str | os.PathLike[str], recipe: str | Recipe,
             scope: str | None = None, *, workers: int = 0, engine: str = "native", overwrite: bool = False,
             resume: bool = False, verify: bool = True, trust_remote_code: bool = False,
             progress: bool = False) -> QuantizeResult:
    """Quantize ``src`` (a local checkpoint directory or a Hub repo id) into ``out``.

    ``workers=0`` picks one process per CPU core (at most one per shard). Raises Eagle3Error
    subclasses (one line) for bad input, before anything is written."""
    from eagle3 import hub

    t0 = time.perf_counter()
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if workers < 0:
        raise UsageError(f"--workers {workers}: must be >= 0 (0 = one per CPU core)")
    rec = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    sc = rec.scope(scope)
    src_dir = Path(hub.resolve(src))
    out_p = Path(out)
    if out_p.resolve() == src_dir.resolve() or src_dir.resolve() in out_p.resolve().parents:
        raise UsageError(f"{out_p}: the output must not be the source directory or inside it")
    source, reader = inspect_source(src_dir)
    dst = check_output(out_p, overwrite)
    tmp = partial_path(dst)
    plan = make_plan(src_dir, reader, source, rec, sc, tmp, engine, verify)
    quark_cfg = None
    if engine == "quark":  # fail on a missing Quark before anything is written; its classes build the config
        from eagle3.quantize import quark as quark_engine

        quark_cfg = quark_engine.quantization_config(rec, compat.exclude_list(plan.unquantized, sc.exclude_regex))

    if tmp.exists() and not resume:
        shutil.rmtree(tmp)
    state = tmp / STATE_DIR
    fp = _fingerprint(plan, verify)
    done: dict[str, ShardResult] = {}
    if resume and (state / "state.json").is_file():
        if read_json(state / "state.json") != fp:
            raise UsageError(f"{tmp}: was written by a run with another recipe, scope or source; "
                             f"rerun without --resume to start over")
        done = _load_done(state, tmp, plan.jobs)
    with atomic_output(out_p, overwrite=overwrite, resume=True) as tmp_dir:
        try:
            state.mkdir(parents=True, exist_ok=True)
            write_json(state / "state.json", fp)
            todo = [j for j in plan.jobs if j.file not in done]
            results = dict(done)
            results.update(_run_jobs(todo, workers, state, progress))
            _finish(tmp_dir, src_dir, plan, results, quark_cfg, trust_remote_code)
        except BaseException:
            finished = any((state / f"done-{j.file}.json").is_file() for j in plan.jobs)
            if not finished:  # nothing worth resuming: leave nothing behind
                shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        shutil.rmtree(state, ignore_errors=True)
    rows = [r for j in plan.jobs for r in results[j.file].rows]
    files = [dst / report.REPORT_JSON] + ([dst / report.REPORT_PNG] if (dst / report.REPORT_PNG).exists() else [])
    return QuantizeResult(out=dst, recipe=rec.name, scope=sc.name, engine=engine, source_kind=source.kind,
                          quantized=len(plan.quantized), unquantized=len(plan.unquantized), shards=len(plan.jobs),
                          shards_resumed=len(done), src_bytes=plan.src_bytes,
                          out_bytes=sum(r.out_bytes for r in results.values()),
                          seconds=time.perf_counter() - t0, rows=rows, files=files)


def _run_jobs(todo: list[ShardJob], workers: int, state: Path, progress: bool) -> dict[str, ShardResult]:
    """Run shard jobs (in-process for one worker, else a spawn pool), recording each as it finishes."""
    results: dict[str, ShardResult] = {}
    if not todo:
        return results
    n = workers or _auto_workers(todo)
    n = min(n, len(todo))
    total = sum(j.work_bytes for j in todo)
    bar = _Progress(total, enabled=progress)

    def record(r: ShardResult) -> None:
        write_json(state / f"done-{r.file}.json", r.to_json())
        results[r.file] = r

    # Costliest shards first: the pool then ends with small ones and the cores stay busy.
    todo = sorted(todo, key=lambda j: -j.cost)
    try:
        if n == 1:
            threads = torch.get_num_threads()
            _init_worker(None)
            try:
                for job in todo:
                    record(run_shard(job, bar.advance))
            finally:
                torch.set_num_threads(threads)  # the caller's setting, when used as a library
            return results
        ctx = get_context("spawn")  # fork after torch has started its thread pools can deadlock
        queue = ctx.Queue()
        drain = threading.Thread(target=_drain, args=(queue, bar), daemon=True)
        drain.start()
        with ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=_init_worker,
                                 initargs=(queue,)) as ex:
            # Writing jobs first (costliest first); each shard's verification is queued as its own
            # job when the shard is written, so that the work spreads over the cores.
            kind: dict[Future[Any], tuple[str, ShardJob]] = {ex.submit(write_shard, j): ("write", j) for j in todo}
            written: dict[str, ShardResult] = {}
            pending: set[Future[Any]] = set(kind)
            try:
                while pending:
                    finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        what, job = kind.pop(fut)
                        if what == "write" and job.verify:
                            written[job.file] = fut.result()
                            nxt = ex.submit(check_shard, job)
                            kind[nxt] = ("check", job)
                            pending.add(nxt)
                        elif what == "write":
                            record(fut.result())
                        else:
                            r = written.pop(job.file)
                            r.rows = fut.result()
                            record(r)
            except BaseException:
                for fut in pending:
                    fut.cancel()
                raise
        queue.put(None)
        drain.join(timeout=5)
        return results
    finally:
        bar.close()


def _drain(queue: Any, bar: _Progress) -> None:
    while True:
        n = queue.get()
        if n is None:
            return
        bar.advance(n)


class _Progress:
    """A rich progress bar over work bytes (source bytes, quantized ones counted twice when verified)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._p = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            # stderr: stdout stays clean for the summary (or --json).
            self._p = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                               TransferSpeedColumn(), TimeRemainingColumn(), transient=False,
                               console=Console(stderr=True))
            self._p.start()
            self._task = self._p.add_task("quantize", total=total)
        self._lock = threading.Lock()

    def advance(self, n: int) -> None:
        if self._p is not None:
            with self._lock:
                self._p.advance(self._task, n)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()
            self._p = None


def _finish(tmp: Path, src_dir: Path, plan: Plan, results: dict[str, ShardResult],
            quark_cfg: dict[str, Any] | None, trust_remote_code: bool) -> None:
    """Index, config.json, side files and the report, next to the shards in ``OUT.partial``."""
    written = {j.file for j in plan.jobs if results[j.file].tensors}
    weight_map = {k: v for k, v in sorted(plan.weight_map.items()) if v in written}
    if plan.source.indexed or len(written) > 1:
        total = sum(results[f].out_bytes for f in written)
        write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    exclude = compat.exclude_list(plan.unquantized, plan.scope.exclude_regex)
    qcfg = quark_cfg if quark_cfg is not None else compat.quantization_config(plan.recipe, exclude)
    write_json(tmp / "config.json", compat.export_config(plan.source.config, qcfg))
    # Tokenizer, chat template, generation config (and *.py remote code only when asked).
    copy_side_files(src_dir, tmp, trust_remote_code=trust_remote_code)
    rows = [r for j in plan.jobs for r in results[j.file].rows]
    meta = {"eagle3_version": __version__, "source": str(src_dir), "source_format": plan.source.kind,
            "recipe": plan.recipe.name, "recipe_source": plan.recipe.source, "scope": plan.scope.name,
            "weight": plan.recipe.weight.describe(), "activation": plan.recipe.activation.describe(),
            "expected_max_rel_error": plan.recipe.weight.max_rel_error, "quantized_modules": len(plan.quantized),
            "unquantized_linear_modules": len(plan.unquantized), "verified": bool(rows)}
    report.write_report(tmp, rows, meta)


def print_summary(result: QuantizeResult) -> None:
    """The table ``eagle3 quantize`` prints: error per module kind, then one line of totals."""
    from rich.console import Console

    con = Console()
    title = f"{result.recipe} ({result.scope}), engine {result.engine}: verification of {result.out.name}"
    if result.rows:
        con.print(report.summary_table(result.rows, title))
    mb = result.src_bytes / 1e6
    con.print(f"quantized {result.quantized} modules ({result.unquantized} Linear modules left unquantized) "
              f"from a {result.source_kind} source: {mb:.1f} MB in {result.seconds:.1f} s "
              f"({mb / max(result.seconds, 1e-9):.1f} MB/s), output {result.out_bytes / 1e6:.1f} MB"
              + (f", {result.shards_resumed} of {result.shards} shards resumed" if result.shards_resumed else ""))
    con.print(f"wrote {result.out} (report: {', '.join(f.name for f in result.files)})")
    if result.failed:
        con.print(f"[yellow]warning: {len(result.failed)} tensor(s) exceed the scheme's expected error, e.g. "
                  f"{result.failed[0].module} (rel. error {result.failed[0].rel_error:.3f})[/yellow]")
