"""``eagle3 quantize``: a checkpoint file to file, shard by shard, into AMD Quark's export format.

Flow: classify the source and refuse what cannot work (before anything is written) -> plan every
output tensor from the headers alone (which module is quantized, which shard receives it, its
dtype, shape and byte offset in that shard, the index) -> worker threads take the planned steps
(copy a tensor, quantize a module, write an excluded module dense) shard after shard; each step
writes its tensors straight to their planned offsets -> when a shard's last step is done, its
header is checked against the plan, it is renamed into place and hashed for the manifest ->
config.json, index, side files, report, manifest -> rename ``OUT.partial`` to ``OUT``.

Why threads, not processes: the work is torch ops on ~512K-element row chunks and file I/O, which
all release the GIL; threads share the source reader and need no interpreter start-up (a spawned
worker paid ~2 s importing torch), and a shard's modules spread over all cores, so a shard with one
huge module and one with many small ones keep every core busy alike.

Verification (on by default): while a module is quantized, each row chunk's output is decoded with
eagle3's codecs and compared with the source rows it came from (relative error, SNR, max error
per tensor); after the module's tensors are written they are read back from the output file and
must equal, byte for byte, the tensors that were decoded; when the shard is complete its header is
parsed and must place every tensor where it was written. So the report describes what a loader
will read, without computing the source twice.

Memory: a worker holds one module's source (packed INT4 is small; a dense source is read whole)
plus its quantized tensors, and works on row chunks, so peak memory is about ``workers`` times the
largest module, whatever the shard or checkpoint size.

Resume: each finished shard is renamed into ``OUT.partial/`` and recorded (with its verification
rows and digest) under ``OUT.partial/.eagle3-quantize/``; an interrupted run started again with
``--resume`` skips those shards. A run that fails before finishing any shard leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import eagle3.quantize.calibrated as calibrated
import eagle3.quantize.compat as compat
import eagle3.quantize.methods as methods
import eagle3.quantize.native as native
import eagle3.quantize.report as report
from eagle3 import finite
from eagle3.checkpoint import (
    CheckpointReader,
    ShardFile,
    ShardLayout,
    atomic_output,
    check_output,
    check_side_files,
    claim_output,
    copy_side_files,
    partial_path,
    read_header,
    read_json,
    sha256_file,
    tag_from_dtype,
    write_error,
    write_json,
)
from eagle3.checkpoint.files import INDEX_FILE
from eagle3.errors import Eagle3Error, OutputError, UsageError
from eagle3.formats import check
from eagle3.quantize.calibrated import Calibration
from eagle3.quantize.expert_inputs import ExpertInputs
from eagle3.quantize.progress import Progress
from eagle3.quantize.recipes import Recipe, Scope, WeightSpec, load_recipe
from eagle3.quantize.sources import (
    DENSE,
    Module,
    RowSource,
    SourceInfo,
    dense_passthrough,
    find_modules,
    inspect_source,
    open_rows,
)
from eagle3.version import __version__

ENGINES = ("native", "quark")
# module name -> what is known about its inputs (eagle3.quantize.methods.InputStats), for a method
InputStatsFn = Callable[[str], "methods.InputStats"]
STATE_DIR = ".eagle3-quantize"


# ---------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------


Entry = tuple[str, str, tuple[int, ...]]  # output tensor: name, safetensors dtype tag, shape


@dataclass(frozen=True)
class ShardJob:
    """One source shard and the output shard of the same file name planned from it."""

    src: str
    tmp: str  # OUT.partial
    file: str  # source shard file name == output shard file name
    steps: tuple[tuple[str, str], ...]  # ("copy", tensor) | ("quant", module) | ("dense", module)
    modules: tuple[Module, ...]  # the modules named by this shard's quant/dense steps
    entries: tuple[Entry, ...]  # the output shard's tensors, in file order
    spec: WeightSpec
    zero_point: bool
    engine: str
    verify: bool
    bound: float
    work_bytes: int  # progress units: source bytes
    allow_nonfinite: bool = False
    method: str = "rtn"  # eagle3.quantize.methods: how the numbers are chosen (native engine)


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
    method: str = "rtn"


def make_plan(src_dir: Path, reader: CheckpointReader, source: SourceInfo, recipe: Recipe, scope: Scope,
              tmp: Path, engine: str, verify: bool, allow_nonfinite: bool = False, method: str = "rtn") -> Plan:
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
        entries: list[Entry] = []
        work = 0
        for name in names:
            m = by_primary.get(name)
            if m is not None and m.name in qset:
                steps.append(("quant", m.name))
                outs = native.expected_shapes(recipe.weight, m.shape, recipe.export.zero_point)
                entries += [(f"{m.name}.{sfx}", tag_from_dtype(dt), shape) for sfx, (shape, dt) in outs.items()]
                work += sum(reader.info(t).nbytes for t in m.consumed)
                mods.append(m)
            elif m is not None and m.kind != DENSE:  # stored quantized, outside the scope: dense bf16
                steps.append(("dense", m.name))
                entries.append((f"{m.name}.weight", "BF16", m.shape))
                work += sum(reader.info(t).nbytes for t in m.consumed)
                mods.append(m)
            elif m is None and name in consumed:
                continue  # read by name by the module that owns it, wherever its primary lives
            else:
                info = reader.info(name)
                steps.append(("copy", name))
                entries.append((name, info.dtype, info.shape))
                work += info.nbytes
        weight_map.update({e[0]: f.name for e in entries})
        jobs.append(ShardJob(src=str(src_dir), tmp=str(tmp), file=f.name, steps=tuple(steps), modules=tuple(mods),
                             entries=tuple(entries), spec=recipe.weight, zero_point=recipe.export.zero_point,
                             engine=engine, verify=verify, bound=recipe.weight.max_rel_error, work_bytes=work,
                             allow_nonfinite=allow_nonfinite, method=method))
    unquantized = sorted(m for m in modules if m not in qset)
    return Plan(source, recipe, scope, modules, quantized, unquantized, jobs, weight_map, reader.total_bytes, method)


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
    sha256: str | None = None  # of the finished output shard, for the manifest

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows"] = [r.to_json() for r in self.rows]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardResult:
        rows = [report.TensorReport.from_json(r) for r in d["rows"]]
        return cls(d["file"], d["out_bytes"], d["tensors"], d["seconds"], rows, d.get("sha256"))


def make_engine(name: str) -> Any:
    if name == "quark":
        from eagle3.quantize.quark import QuarkEngine

        return QuarkEngine()
    return native.NativeEngine()


class OpenShard:
    """An output shard being written: its planned file and what is left to do."""

    def __init__(self, job: ShardJob, reader: CheckpointReader, engine: Any,
                 input_stats: InputStatsFn | None = None) -> None:
        self.job, self.reader, self.engine = job, reader, engine
        self.input_stats = input_stats
        self.mods = {m.name: m for m in job.modules}
        self.work = Path(job.tmp) / STATE_DIR / f"{job.file}.part"
        self.final = Path(job.tmp) / job.file
        self.layout = ShardLayout(job.entries)
        try:
            self.file = ShardFile(self.work, self.layout) if job.entries else None
        except OSError as e:
            raise _write_error(e, self.work) from None
        self.rows: dict[str, report.TensorReport] = {}
        self.left = len(job.steps)
        self.t0 = time.perf_counter()

    def steps(self) -> list[tuple[str, str]]:
        """Largest work first, so that a shard ends on small steps and no core idles long."""
        def cost(step: tuple[str, str]) -> float:
            kind, name = step
            return self.mods[name].numel if kind != "copy" else self.reader.info(name).nbytes / 16

        return sorted(self.job.steps, key=cost, reverse=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def run_step(shard: OpenShard, kind: str, name: str, progress: Callable[[int], None]) -> report.TensorReport | None:
    """One planned step (runs on a worker thread): its output tensors go to their planned offsets."""
    reader, out = shard.reader, shard.file
    assert out is not None
    try:
        if kind == "copy":
            info = reader.info(name)
            out.copy_raw(name, info)  # file to file in the kernel: never through Python memory
            if not shard.job.allow_nonfinite and not finite.raw_all_finite(info):
                raise finite.NonFiniteError(finite.nonfinite_message(str(info.file), f"tensor {name!r}"))
            progress(info.nbytes)
            return None
        m = shard.mods[name]
        size = sum(reader.info(t).nbytes for t in m.consumed)
        if kind == "dense":
            w = dense_passthrough(reader, m)
            if not shard.job.allow_nonfinite and not finite.all_finite(w):
                raise finite.NonFiniteError(_module_nonfinite(reader, m))
            out.write(f"{name}.weight", w)
            progress(size)
            return None
        row = quantize_module(shard, m)
        progress(size)
        return row
    except OSError as e:
        raise _write_error(e, shard.work) from None


def _module_nonfinite(reader: CheckpointReader, m: Module) -> str:
    return finite.nonfinite_message(str(reader.info(m.primary).file),
                                    f"module {m.name!r} (tensors {', '.join(m.consumed)})")


class _FiniteRows(RowSource):
    """A module's source rows, refused (one line naming the module) where a chunk holds NaN/Inf:
    checked as the quantizer reads them (one min/max reduction while the chunk is in cache), for
    runs without verification, whose error pass otherwise sees every source row."""

    def __init__(self, src: RowSource, message: str) -> None:
        self._src, self._message = src, message
        self.shape, self.dtype, self.row_align = src.shape, src.dtype, src.row_align

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        x = self._src.rows(r0, r1)
        if not finite.all_finite(x):
            raise finite.NonFiniteError(self._message)
        return x

    def full(self) -> torch.Tensor:
        x = self._src.full()
        if not finite.all_finite(x):
            raise finite.NonFiniteError(self._message)
        return x


def _write_error(e: OSError, where: Path) -> OutputError:
    """One line naming the file being written and the system's reason (checkpoint.write_error); an
    OSError from the source side is already a CheckpointError naming the source."""
    return write_error(e, e.filename or where)


def quantize_module(shard: OpenShard, m: Module) -> report.TensorReport | None:
    """Quantize one module, write its tensors, and (verifying) measure each row chunk's decode
    against the source rows, then read the written tensors back and compare them byte for byte."""
    job, out = shard.job, shard.file
    assert out is not None
    src = open_rows(shard.reader, m)
    acc = report.ErrorAccumulator() if job.verify else None
    if not job.allow_nonfinite and acc is None:
        # Verifying, the error pass sees every source row anyway (its sum of squares); without it,
        # each chunk is checked as the quantizer reads it.
        src = _FiniteRows(src, _module_nonfinite(shard.reader, m))

    def observe(r0: int, r1: int, tensors: dict[str, torch.Tensor], rows: torch.Tensor) -> None:
        assert acc is not None
        acc.add(native.decode(tensors, job.spec, m.shape, r0, r1), rows)
        if acc.src_nonfinite and not job.allow_nonfinite:
            raise finite.NonFiniteError(_module_nonfinite(shard.reader, m))

    with torch.no_grad():
        if isinstance(shard.engine, native.NativeEngine):
            inputs = shard.input_stats(m.name) if shard.input_stats is not None else methods.NO_STATS
            tensors = shard.engine.quantize(src, job.spec, job.zero_point, observe if acc else None,
                                            method=methods.METHODS[job.method], inputs=inputs)
        else:  # Quark's primitives take the whole tensor: measure afterwards, a chunk at a time
            tensors = shard.engine.quantize(src, job.spec, job.zero_point)
            if acc is not None:
                n, k = m.shape
                step = native.chunk_rows(n, k, src.row_align)
                for r0 in range(0, n, step):
                    observe(r0, min(n, r0 + step), tensors, src.rows(r0, min(n, r0 + step)))
    for suffix, t in tensors.items():
        out.write(f"{m.name}.{suffix}", t)
    if acc is None:
        return None
    for suffix, t in tensors.items():
        if not _same_bytes(out.read(f"{m.name}.{suffix}"), t):
            raise Eagle3Error(f"{out.path}: tensor {m.name}.{suffix} reads back different from what was written")
    return report.TensorReport.from_acc(m.name, m.shape, acc, job.bound)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    x, y = a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    if x.numel() != y.numel():
        return False
    # Compared as int64 words where the layout allows it: ~6x faster than byte by byte.
    if x.numel() % 8 == 0 and x.storage_offset() % 8 == 0 and y.storage_offset() % 8 == 0:
        return torch.equal(x.view(torch.int64), y.view(torch.int64))
    return torch.equal(x, y)


def finish_shard(shard: OpenShard) -> ShardResult:
    """The shard's last step is done: check its header against the plan, move it into place, hash it."""
    shard.close()
    job = shard.job
    rows = [shard.rows[name] for kind, name in job.steps if kind == "quant" and name in shard.rows]
    if shard.file is None:  # every tensor of this source shard belongs to a module stored elsewhere
        return ShardResult(job.file, 0, 0, time.perf_counter() - shard.t0, rows)
    why = _layout_problem(shard.work, shard.layout)
    if why:
        raise Eagle3Error(f"{shard.work}: {why}")
    try:
        shard.work.rename(shard.final)
    except OSError as e:
        raise _write_error(e, shard.final) from None
    return ShardResult(job.file, shard.layout.data_bytes, len(shard.layout.tensors), time.perf_counter() - shard.t0,
                       rows, sha256_file(shard.final))


def _layout_problem(file: Path, layout: ShardLayout) -> str | None:
    """Why ``file`` is not the planned shard (size, header entries), or None when it is."""
    size = file.stat().st_size
    if size != layout.size:
        return f"has {size} bytes, {layout.size} were planned"
    infos, _ = read_header(file)
    for name, slot in layout.tensors.items():
        got = infos.get(name)
        if got is None or (got.dtype, got.shape, got.offset) != (slot.dtype, slot.shape, slot.offset):
            return f"header entry of tensor {name!r} does not match where it was written"
    if len(infos) != len(layout.tensors):
        return f"header has {len(infos)} tensors, {len(layout.tensors)} were planned"
    return None


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
    acceptance: dict[str, Any] | None = None  # --target: the draft's acceptance before and after
    method: str = "rtn"
    fidelity: dict[str, Any] | None = None  # --eval: the output against its source (KLD, top-1, divergence)
    calibration: dict[str, Any] | None = None  # --calibrate: the calibration pass's summary (per layer)

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
    return {"eagle3": __version__, "recipe": plan.recipe.raw, "export": asdict(plan.recipe.export),
            "scope": plan.scope.name, "verify": verify, "source": src, "method": plan.method}


def _load_done(state: Path, tmp: Path, jobs: list[ShardJob]) -> dict[str, ShardResult]:
    """The finished shards of an interrupted run that are still what was finished: the planned size
    and header, and the sha256 recorded when the shard was finished (a shard damaged since, by a
    disk, a copy or a hand, would otherwise be published and fail ``eagle3 verify``). A shard that
    fails a check is redone, with one line saying so."""
    done: dict[str, ShardResult] = {}
    for job in jobs:
        rec = state / f"done-{job.file}.json"
        if not rec.is_file():
            continue
        try:
            r = ShardResult.from_json(read_json(rec))
        except (Eagle3Error, KeyError, TypeError, ValueError):
            r = None
        shard = tmp / job.file
        if r is not None and r.tensors == 0 and not job.entries:
            done[job.file] = r
            continue
        why = _damage(shard, job, r)
        if why is None and r is not None:
            done[job.file] = r
            continue
        print(f"resume: {shard}: {why}; redoing this shard", file=sys.stderr, flush=True)
        rec.unlink(missing_ok=True)
        if shard.is_file() or shard.is_symlink():
            shard.unlink()
    return done


def _damage(shard: Path, job: ShardJob, r: ShardResult | None) -> str | None:
    """Why a recorded finished shard cannot be reused, or None."""
    if r is None:
        return "its record under .eagle3-quantize is unreadable"
    if shard.is_symlink() or not shard.is_file():
        return "missing or not a regular file"
    try:
        why = _layout_problem(shard, ShardLayout(job.entries))
    except Eagle3Error as e:
        return f"bad header ({e})"
    if why:
        return why
    if not r.sha256 or sha256_file(shard) != r.sha256:
        return "its sha256 differs from the one recorded when it was finished"
    return None


def _auto_workers(jobs: list[ShardJob]) -> int:
    """One worker thread per core, but no more than the available memory holds: a worker holds
    one module's source and its quantized tensors (at most about twice its fp32 size) at a time."""
    n = os.cpu_count() or 1
    largest = max((m.numel * 4 for j in jobs for m in j.modules), default=0)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not Linux: trust the core count
        return max(1, n)
    return max(1, min(n, avail // (2**26 + 2 * largest)))


def quantize(src: str | os.PathLike[str], out: str | os.PathLike[str], recipe: str | Recipe,
             scope: str | None = None, *, workers: int = 0, engine: str = "native", overwrite: bool = False,
             resume: bool = False, verify: bool = True, trust_remote_code: bool = False,
             progress: bool = False, allow_nonfinite: bool = False, any_architecture: bool = False,
             quark_zero_points: bool = False, measure: Callable[[Path, Path], dict[str, Any]] | None = None,
             method: str | None = None, input_stats: InputStatsFn | None = None,
             calibration: Calibration | None = None, echo: Callable[[str], None] | None = None) -> QuantizeResult:
    """Quantize ``src`` (a local checkpoint directory or a Hub repo id) into ``out``.

    ``measure(src_dir, out_dir)``: called on the finished output before it is published; its result
    is a report section (``acceptance`` for a draft, ``eagle3.quantize.acceptance``; ``fidelity`` for
    a target, ``eagle3.serve.fidelity``).

    ``method``: how the numbers are chosen within the recipe's format (:mod:`eagle3.quantize.methods`);
    None takes the recipe's (``rtn`` with ``engine="quark"``, which computes Quark's own numbers).
    ``input_stats(module)``: what is known about a module's inputs (a calibrated method's Hessian, say),
    handed to the method with its rows; None: nothing (the data-free methods need nothing).
    ``calibration``: the prompts of a calibrated ``method`` (required by one, refused by the others);
    their pass runs first, inside ``OUT.partial`` (:mod:`eagle3.quantize.calibrated`), printing a
    line per layer through ``echo`` (None: silent), and its summary goes into the report.

    ``workers=0`` picks one worker thread per CPU core. Raises Eagle3Error subclasses (one line)
    for bad input, before anything is written: the source goes through the same model validation
    as ``convert`` and ``serve`` (:func:`validate_source`). ``allow_nonfinite`` writes weights
    that hold NaN/Inf (refused otherwise); ``any_architecture`` quantizes a model eagle3 does not
    know file to file (a plain Llama, say); ``quark_zero_points`` also writes the all-zero
    zero-point tensors of symmetric INT4 that Quark's own importer wants (vLLM's loaders refuse them).

    Failure policy: ``OUT.partial`` is removed on every error, except an interruption or a failed
    write (disk full, ...) after at least one shard was finished; then it is kept and the message
    says that ``--resume`` continues from it."""
    from eagle3 import hub

    t0 = time.perf_counter()
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if workers < 0:
        raise UsageError(f"--workers {workers}: must be >= 0 (0 = one per CPU core)")
    rec = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    if quark_zero_points:
        rec = with_quark_zero_points(rec)
    meth = resolve_method(rec, engine, method)
    calibrated.check_method(meth, calibration)
    sc = rec.scope(scope)
    src_dir = Path(hub.resolve(src))
    if src_dir.exists() and not src_dir.is_dir():
        raise UsageError(f"{src_dir}: is a file, not a checkpoint directory (quantize reads the whole model: "
                         f"give the directory that holds config.json and the shards)")
    out_p = Path(out)
    inputs = [src, src_dir, rec.source]  # the output must not be, contain or lie inside any of them
    dst = check_output(out_p, overwrite, inputs, resume)
    source, reader = inspect_source(src_dir, any_architecture=any_architecture)
    validate_source(source)
    if measure is not None and source.role != getattr(measure, "role", "draft"):
        raise UsageError(measure.wrong_role(src_dir) if hasattr(measure, "wrong_role") else
                         f"{src_dir}: a {source.role}, which this measurement does not take")
    if not any_architecture:  # the model against its schema, before any weight is read
        check.require_valid(src_dir)
    check_side_files(src_dir, trust_remote_code)  # refused before anything is written, not at the end
    calib_set = calibrated.load_set(src_dir, calibration) if calibration is not None else None
    # W4A8's data-free values of routed experts' down_proj use a model of their inputs (expert_inputs):
    # mse's, and a calibrated run's for the experts it leaves data-free
    uses_model = rec.weight.format == "fp8_int4" and (meth.name == "mse" or calibration is not None)
    experts = ExpertInputs(reader, source) if uses_model else None
    if input_stats is None and meth.name == "mse":
        input_stats = experts
    tmp = partial_path(dst)
    plan = make_plan(src_dir, reader, source, rec, sc, tmp, engine, verify, allow_nonfinite, meth.name)
    quark_cfg = None
    if engine == "quark":  # fail on a missing Quark before anything is written; its classes build the config
        import eagle3.quantize.quark as quark_engine

        quark_cfg = quark_engine.quantization_config(rec, compat.exclude_list(plan.unquantized, sc.exclude_regex))

    claim_output(out_p, overwrite, inputs, resume)  # the OUT lock, held until atomic_output ends
    if tmp.exists() and not resume:
        shutil.rmtree(tmp)
    state = tmp / STATE_DIR
    fp = _fingerprint(plan, verify)
    if calibration is not None:
        fp["calibration"] = calibration.to_json()
    done: dict[str, ShardResult] = {}
    if resume and (state / "state.json").is_file():
        if read_json(state / "state.json") != fp:
            raise UsageError(f"{tmp}: was written by a run with another recipe, method, scope or source; "
                             f"rerun without --resume to start over")
        done = _load_done(state, tmp, plan.jobs)
    digests: dict[str, str] = {}
    try:
        with atomic_output(out_p, overwrite=overwrite, resume=True, known_digests=digests,
                           inputs=inputs) as tmp_dir:
            state.mkdir(parents=True, exist_ok=True)
            write_json(state / "state.json", fp)
            todo = [j for j in plan.jobs if j.file not in done]
            calib_section = None
            if calib_set is not None and (todo or (state / calibrated.SUMMARY).is_file()):  # resumed: its summary
                calib_section, input_stats = calibrated.run_pass(src_dir, rec, sc, meth.name, calibration, calib_set, state,
                                                                 echo, experts)
            results = dict(done)
            results.update(_run_jobs(todo, workers, state, progress, input_stats))
            digests.update({r.file: r.sha256 for r in results.values() if r.sha256 and r.tensors})
            _finish(tmp_dir, src_dir, plan, results, quark_cfg, trust_remote_code)
            if calib_section is not None:
                report.add_section(tmp_dir, "calibration", calib_section)
            section = getattr(measure, "section", "acceptance")
            measured = report.add_section(tmp_dir, section, measure(src_dir, tmp_dir)) if measure else None
            shutil.rmtree(state, ignore_errors=True)
    except BaseException as e:
        err = _write_error(e, tmp) if isinstance(e, OSError) else e  # disk full, read-only, ...: one line
        _after_failure(err, tmp, state, plan)
        if err is not e:
            raise err from None
        raise
    rows = [r for j in plan.jobs for r in results[j.file].rows]
    files = [dst / report.REPORT_JSON] + ([dst / report.REPORT_PNG] if (dst / report.REPORT_PNG).exists() else [])
    return QuantizeResult(out=dst, recipe=rec.name, scope=sc.name, engine=engine, method=meth.name,
                          source_kind=source.kind,
                          quantized=len(plan.quantized), unquantized=len(plan.unquantized), shards=len(plan.jobs),
                          shards_resumed=len(done), src_bytes=plan.src_bytes,
                          out_bytes=sum(r.out_bytes for r in results.values()),
                          seconds=time.perf_counter() - t0 - (measured or {}).get("seconds", 0.0), rows=rows,
                          files=files, acceptance=measured if measure and section == "acceptance" else None,
                          fidelity=measured if measure and section == "fidelity" else None,
                          calibration=calib_section)


def _after_failure(e: BaseException, tmp: Path, state: Path, plan: Plan) -> None:
    """Keep ``OUT.partial`` only where ``--resume`` is worth it: at least one shard was finished and
    the run stopped for a reason outside its inputs (an interruption, a failed write such as a full
    disk). Anything else (bad input, NaN weights, a verification failure, a bug) removes it: a rerun
    would meet the same error, and nothing half-written is left behind."""
    finished = sum((state / f"done-{j.file}.json").is_file() for j in plan.jobs)
    resumable = isinstance(e, (KeyboardInterrupt, SystemExit, OutputError))
    if not finished or not resumable:
        shutil.rmtree(tmp, ignore_errors=True)
        return
    note = (f"{finished} of {len(plan.jobs)} shards finished are kept in {tmp}: run the same command with "
            f"--resume to continue")
    if isinstance(e, Eagle3Error):
        e.args = (f"{e.args[0]}; {note}",)
    else:
        print(note, file=sys.stderr, flush=True)


def resolve_method(rec: Recipe, engine: str, method: str | None) -> methods.Method:
    """The method of this run: ``--method``, else the recipe's; ``--engine quark`` computes Quark's own
    round to nearest, so it takes ``rtn`` whatever the recipe says and refuses another ``--method``."""
    if engine == "quark":
        if method not in (None, methods.RTN.name):
            raise UsageError(f"--method {method}: --engine quark computes Quark's round to nearest only; use --method "
                             f"rtn or --engine native")
        return methods.RTN
    name = method or rec.method
    try:
        return methods.get_method(name, rec.weight, rec.name)
    except UsageError as e:
        if method is None:  # the recipe's own choice: the message names its file and field
            raise UsageError(f"{rec.source}: field 'method' {e.args[0].split(': ', 1)[1]}") from None
        raise


def with_quark_zero_points(rec: Recipe) -> Recipe:
    """``rec`` exporting the zero-point tensors Quark's importer wants (symmetric INT4 only)."""
    import dataclasses

    if rec.weight.format not in ("int4", "fp8_int4"):
        raise UsageError(f"--quark-zero-points: recipe {rec.name!r} stores {rec.weight.format} weights; zero points "
                         f"exist for symmetric INT4 (int4, fp8_int4) only")
    return dataclasses.replace(rec, export=dataclasses.replace(rec.export, zero_point=True))


def validate_source(source: SourceInfo) -> None:
    """The model validation ``convert`` and ``serve`` run, run before quantizing (one-line errors,
    nothing written): a draft goes through convert's draft planner (hidden and vocab sizes against
    the tensors, d2t length, range and sign), a target through convert's target planner (detection
    checks the embedding against the config) and the runtime's config check."""
    if source.role == "draft":
        from eagle3.convert.draft import DraftOptions, plan_draft

        plan_draft(source.path, DraftOptions(engine="eagle3", progress=False))
    elif source.role == "target":
        from eagle3.convert.target import TargetOptions, plan_target
        from eagle3.runtime.loader import target_spec

        plan_target(source.path, TargetOptions(progress=False))  # detect checks embedding vs config
        target_spec(source.path)


def _run_jobs(todo: list[ShardJob], workers: int, state: Path, progress: bool,
              input_stats: InputStatsFn | None = None) -> dict[str, ShardResult]:
    """Run every shard's steps on a thread pool (in this thread for one worker), two shards open at
    a time so that the cores stay busy across shard boundaries; record each shard as it finishes."""
    results: dict[str, ShardResult] = {}
    if not todo:
        return results
    n = min(workers or _auto_workers(todo), sum(max(1, len(j.steps)) for j in todo))
    bar = Progress(sum(j.work_bytes for j in todo), enabled=progress)
    reader = CheckpointReader(todo[0].src)
    engine = make_engine(todo[0].engine)
    if todo[0].verify:
        report.preload_plotting()
    threads = torch.get_num_threads()
    # One intra-op thread per worker: the codecs run on small row chunks, where OpenMP fork/join
    # costs more than it gains (torch.round on 8K elements: ~2 us on one thread, ~13 ms on two
    # threads of a busy 2-core machine); the parallelism comes from the worker threads.
    torch.set_num_threads(1)
    ex: Any = ThreadPoolExecutor(max_workers=n, thread_name_prefix="eagle3-quantize") if n > 1 else _Inline()
    queue = deque(todo)
    max_live = 2 if n > 1 else 1  # inline, a shard is finished and recorded before the next starts
    live: list[OpenShard] = []
    kind: dict[Future[Any], tuple[str, OpenShard]] = {}

    def open_next() -> None:
        sh = OpenShard(queue.popleft(), reader, engine, input_stats)
        live.append(sh)
        if sh.left == 0:
            kind[ex.submit(finish_shard, sh)] = ("finish", sh)
        for k, name in sh.steps():
            kind[ex.submit(run_step, sh, k, name, bar.advance)] = ("step", sh)

    def record(r: ShardResult, sh: OpenShard) -> None:
        write_json(state / f"done-{r.file}.json", r.to_json())
        results[r.file] = r
        live.remove(sh)

    try:
        while queue or kind:
            while queue and len(live) < max_live:
                open_next()
            done, _ = wait(set(kind), return_when=FIRST_COMPLETED)
            failed = [f for f in done if f.exception() is not None]
            for fut in done - set(failed):
                what, sh = kind.pop(fut)
                r = fut.result()
                if what == "finish":
                    record(r, sh)
                    continue
                if r is not None:
                    sh.rows[r.module] = r
                sh.left -= 1
                if sh.left == 0:
                    kind[ex.submit(finish_shard, sh)] = ("finish", sh)
            if failed:
                failed[0].result()
    except BaseException:
        for fut in kind:
            fut.cancel()
        ex.shutdown(wait=True, cancel_futures=True)
        # A shard whose finish completed while the failure surfaced is recorded: never redone.
        for fut, (what, sh) in kind.items():
            if what == "finish" and fut.done() and not fut.cancelled() and fut.exception() is None:
                record(fut.result(), sh)
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
        for sh in live:
            sh.close()
        torch.set_num_threads(threads)  # the caller's setting, when used as a library
        bar.close()
    return results


class _Inline:
    """The executor interface, running each call at once in this thread (one worker)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - re-raised by fut.result() in the driver loop
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


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
            "method": plan.method, "method_description": methods.METHODS[plan.method].description,
            "expected_max_rel_error": plan.recipe.weight.max_rel_error, "quantized_modules": len(plan.quantized),
            "unquantized_linear_modules": len(plan.unquantized), "verified": bool(rows)}
    report.write_report(tmp, rows, meta)
