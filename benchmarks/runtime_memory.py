"""Memory, load time and tokens/s of the bundled runtime on a full-width Kimi-K2.5 slice (issue 11).

Makes (or reuses, ``--slice DIR``) a Kimi-K2.5 slice at the real tensor shapes in Moonshot INT4
(``eagle3 make-slice``), quantizes it with ``eagle3 quantize`` (w4a8, mxfp4) into ``--work``, and for
each source format at each tensor-parallel size in ``--tp`` loads it in a fresh process and reports,
side by side:

* load time vs the time to read the checkpoint's shard files (both after dropping the files' pages
  from the page cache with ``posix_fadvise(DONTNEED)``: cold-ish, the VM's host may still cache);
* peak resident memory of the whole process tree (every process sampled, plus each one's kernel
  ``VmHWM``), per rank, vs the checkpoint bytes per rank (``eagle3.plan``'s accounting);
* the loaded model's resident weight bytes (``eagle3.runtime.loader.resident_weight_bytes``) vs the
  checkpoint bytes it was built from;
* decode tokens/s at batch 1 and 16: ``batch x decode steps / their wall time``, every engine step
  timed and the prefill steps (before every sequence has its first token) left out.

Goals (issue 11): resident weights per rank <= 1.10 x checkpoint bytes / N (+ KV cache + 1 GiB of
runtime for the peak RSS); load time <= 2 x read time.

    .venv/bin/python benchmarks/runtime_memory.py --layers 2 --experts 8 --work /tmp/membench \\
        [--slice DIR] [--tp 1,2] [--formats int4,w4a8,mxfp4] [--json runtime_memory.json] [--png FILE]

TP > 1 needs ``LLM(..., tensor_parallel_size=N)``; where the runtime lacks it the row says "not
available" instead of failing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GiB = 1 << 30
FORMATS = ("int4", "w4a8", "mxfp4")  # int4: the slice as Moonshot publishes it
RECIPES = {"w4a8": "w4a8", "mxfp4": "mxfp4"}
RESIDENT_GOAL = 1.10  # resident weights per rank / (checkpoint bytes / N)
RUNTIME_ALLOWANCE = GiB  # + KV cache + 1 GiB of runtime for the peak RSS goal
LOAD_GOAL = 2.0  # load time / read time


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def _int_list(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} {text!r}: give comma-separated integers, e.g. 1,2") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"{what} {text!r}: give positive integers, e.g. 1,2")
    return out


def _formats(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in FORMATS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"--formats {text!r}: choose from {','.join(FORMATS)}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--slice", type=Path, help="an existing make-slice output (default: written into --work)")
    ap.add_argument("--layers", type=int, default=2, help="slice layers (when the slice is made here)")
    ap.add_argument("--experts", type=int, default=8, help="slice routed experts (when made here)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=Path("runtime_memory_work"),
                    help="where the slice and the quantized checkpoints go (reused when complete)")
    ap.add_argument("--formats", type=_formats, default=list(FORMATS), help="int4,w4a8,mxfp4")
    ap.add_argument("--tp", type=lambda s: _int_list(s, "--tp"), default=[1, 2], help="TP sizes, e.g. 1,2")
    ap.add_argument("--batches", type=lambda s: _int_list(s, "--batches"), default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=4, help="decode tokens timed per batch")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads in the measured process (0: default)")
    ap.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="bytes of KV cache to allocate")
    ap.add_argument("--quantize-workers", type=int, default=1)
    ap.add_argument("--no-drop-cache", dest="drop_cache", action="store_false",
                    help="do not evict the shard files from the page cache before reading / loading")
    ap.add_argument("--interval", type=float, default=0.1, help="RSS sampling interval, seconds")
    ap.add_argument("--json", type=Path, default=Path("runtime_memory.json"))
    ap.add_argument("--png", type=Path, help="bar chart (default: the --json path with .png)")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: one measured load (JSON spec)
    args = ap.parse_args(argv)
    if args.max_tokens < 1 or args.prompt_len < 1:
        ap.error("--max-tokens and --prompt-len must be at least 1")
    if args.png is None:
        args.png = args.json.with_suffix(".png")
    return args


# ---------------------------------------------------------------------------------------------
# Peak RSS of a process tree
# ---------------------------------------------------------------------------------------------


def _proc_status(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) in bytes from /proc/PID/status; None when gone or not Linux."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    vals = {}
    for line in text.splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            k, v = line.split(":", 1)
            vals[k] = int(v.split()[0]) * 1024
    if "VmRSS" not in vals:
        return None  # a zombie has no memory lines
    return vals["VmRSS"], vals.get("VmHWM", vals["VmRSS"])


@dataclass
class TreePeak:
    """Peak memory of a process tree: per process (the larger of the sampled RSS and the kernel's
    VmHWM, read while it was alive), and of the sum over the tree at any one sample."""

    per_process: dict[int, int] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    tree: int = 0
    samples: int = 0

    @property
    def max_process(self) -> int:
        return max(self.per_process.values(), default=0)


class TreeSampler:
    """Samples the RSS of ``pid`` and all its descendants every ``interval`` s in a thread."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval = pid, interval
        self.peak = TreePeak()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        total = 0
        for p in procs:
            st = _proc_status(p.pid)
            if st is None:
                try:
                    rss = hwm = p.memory_info().rss
                except psutil.Error:
                    continue
            else:
                rss, hwm = st
            total += rss
            self.peak.per_process[p.pid] = max(self.peak.per_process.get(p.pid, 0), rss, hwm)
            if p.pid not in self.peak.names:
                try:
                    self.peak.names[p.pid] = " ".join(p.cmdline()[:3])[:80] or p.name()
                except psutil.Error:
                    self.peak.names[p.pid] = "?"
        self.peak.tree = max(self.peak.tree, total)
        self.peak.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_sampled(cmd: list[str], interval: float = 0.1, env: dict[str, str] | None = None,
                timeout: float | None = None) -> tuple[int, TreePeak, str]:
    """Run ``cmd``, sampling its process tree; (returncode, peak, stderr tail). The last sample is
    taken while the child's subprocesses may already have exited: VmHWM of every process is read
    on each sample, so a peak is not missed by more than one interval of growth."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout or []), daemon=True)
    reader.start()
    with TreeSampler(proc.pid, interval) as s:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    reader.join()
    return rc, s.peak, "".join(out)[-4000:]


# ---------------------------------------------------------------------------------------------
# Reading the checkpoint
# ---------------------------------------------------------------------------------------------


def shard_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.safetensors"))


def drop_cache(files: list[Path]) -> bool:
    """Evict the files' pages from the page cache (per file, no root needed); False if unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def read_seconds(files: list[Path], block: int = 16 << 20) -> tuple[float, int]:
    """(seconds, bytes) to read every file start to end in ``block``-sized reads."""
    buf = bytearray(block)
    view = memoryview(buf)
    n = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while True:
                k = fh.readinto(view)
                if not k:
                    break
                n += k
    return time.perf_counter() - t0, n


# ---------------------------------------------------------------------------------------------
# One measured load (runs in a fresh process: --child)
# ---------------------------------------------------------------------------------------------


def _own_hwm() -> int | None:
    st = _proc_status(os.getpid())
    return None if st is None else st[1]


def _prompts(batch: int, length: int) -> list[list[int]]:
    # the slice's tokenizer uses ids < 1024; distinct rows so no prefix is shared
    return [[(768 + 37 * i + 11 * j) % 1000 + 1 for j in range(length)] for i in range(batch)]


def _time_decode(llm: Any, prompts: list[list[int]], n: int) -> dict[str, Any]:
    """Step the engine through ``prompts`` (greedy, ``1 + n`` tokens each) and time every step: the
    steps before every sequence has its first token are the prefill, the rest decode ``len(prompts)``
    tokens each. Timing the steps themselves, rather than two generate() calls subtracted, keeps a
    noisy prefill out of the decode figure."""
    from eagle3.runtime.sampling import SamplingParams

    ids = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=1 + n, ignore_eos=True)) for p in prompts]
    started: set[str] = set()
    prefill_s, decode_steps = 0.0, []
    while llm.has_unfinished():
        all_started = len(started) == len(ids)
        t = time.perf_counter()
        outs = llm.step()
        dt = time.perf_counter() - t
        if all_started:
            decode_steps.append(dt)
        else:
            prefill_s += dt
        started.update(o.request_id for o in outs)
    decode_s = sum(decode_steps)
    return {"prefill_s": prefill_s, "decode_step_s": decode_steps,
            "tokens_per_s": len(prompts) * len(decode_steps) / decode_s if decode_s > 0 else None,
            "tokens_per_s_incl_prefill": len(prompts) * (1 + n) / (prefill_s + decode_s)}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Load ``spec['model']`` at TP ``spec['tp']`` and time decoding; a JSON-able dict."""
    import torch

    from eagle3.errors import UsageError
    from eagle3.runtime.engine.llm import LLM

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    batches: list[int] = spec["batches"]
    kw: dict[str, Any] = dict(dtype=spec["dtype"], max_model_len=spec["prompt_len"] + spec["max_tokens"] + 8,
                              max_num_seqs=max(batches), kv_cache_memory=spec["kv_cache_memory"])
    if spec["tp"] > 1:
        kw["tensor_parallel_size"] = spec["tp"]
    res: dict[str, Any] = {"available": True, "hwm_before_load": _own_hwm()}
    t0 = time.perf_counter()
    try:
        llm = LLM(spec["model"], **kw)
    except (TypeError, UsageError) as e:
        if spec["tp"] > 1 and "tensor_parallel" in str(e):
            return {"available": False, "why": f"{type(e).__name__}: {e}"}
        raise
    res["load_s"] = time.perf_counter() - t0
    res["hwm_after_load"] = _own_hwm()

    try:  # the driver's own model; a TP runtime may expose per-rank figures itself
        from eagle3.runtime.engine.model_runner import kv_bytes_per_block
        from eagle3.runtime.loader import resident_weight_bytes

        per_rank = getattr(llm, "resident_weight_bytes", None)
        if callable(per_rank):
            rbs = per_rank()
            rbs = rbs if isinstance(rbs, list) else [rbs]
        else:
            rbs = [resident_weight_bytes(llm.target)]
        res["resident_weights"] = [rb.weights for rb in rbs]
        res["resident_buffers"] = [rb.buffers for rb in rbs]
        res["resident_by_role"] = [rb.totals for rb in rbs]
        res["model_checkpoint_bytes"] = [rb.checkpoint_bytes for rb in rbs]
        res["kv_cache_bytes"] = llm.block_manager.num_blocks * kv_bytes_per_block(llm.target, llm.config.block_size)
    except Exception as e:  # noqa: BLE001 - a figure we cannot get must not lose the others
        res["resident_error"] = f"{type(e).__name__}: {e}"

    res["decode"] = {}
    for b in batches:
        res["decode"][str(b)] = _time_decode(llm, _prompts(b, spec["prompt_len"]), spec["max_tokens"])
    res["hwm_after_decode"] = _own_hwm()
    shutdown = getattr(llm, "shutdown", None) or getattr(llm, "close", None)
    if callable(shutdown):
        shutdown()
    return res


def _child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    out = measure(spec)
    Path(spec["out"]).write_text(json.dumps(out, indent=1))


# ---------------------------------------------------------------------------------------------
# Ratios and goals
# ---------------------------------------------------------------------------------------------


def goals(row: dict[str, Any]) -> dict[str, bool | None]:
    """Pass/fail of issue 11's goals for one (format, TP) result row (None: not measured)."""
    ck = row.get("ckpt_per_rank")
    out: dict[str, bool | None] = {"resident": None, "peak_rss": None, "load": None}
    if not row.get("available", True) or not ck:
        return out
    if row.get("resident_weights_per_rank") is not None:
        out["resident"] = row["resident_weights_per_rank"] <= RESIDENT_GOAL * ck
    if row.get("peak_rss_per_rank") is not None:
        out["peak_rss"] = row["peak_rss_per_rank"] <= peak_goal(ck, row.get("kv_cache_bytes") or 0)
    if row.get("load_s") is not None and row.get("read_s"):
        out["load"] = row["load_s"] <= LOAD_GOAL * row["read_s"]
    return out


def peak_goal(ckpt_per_rank: int, kv_bytes: int) -> float:
    return RESIDENT_GOAL * ckpt_per_rank + kv_bytes + RUNTIME_ALLOWANCE


def _r(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _g(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _mark(ok: bool | None) -> str:
    return "" if ok is None else (" ok" if ok else " MISS")


def ratio_table(rows: list[dict[str, Any]]) -> str:
    """The side-by-side table (markdown) of ratios and goals for every (format, TP) row."""
    head = ["format", "TP", "ckpt/rank GiB", "resident wts GiB", "resident/ckpt (<=1.10)",
            "peak RSS/rank GiB", "peak/ckpt", "peak goal GiB", "tree peak GiB", "load s", "read s",
            "load/read (<=2)", "tok/s b1", "tok/s b16"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if not r.get("available", True):
            cells = [r["format"], str(r["tp"]), _g(r.get("ckpt_per_rank")), "not available: " + r.get("why", "")]
            cells += [""] * (len(head) - len(cells))
            lines.append("| " + " | ".join(cells) + " |")
            continue
        g = goals(r)
        ck = r.get("ckpt_per_rank")
        tps = r.get("decode", {})
        cells = [
            r["format"], str(r["tp"]), _g(ck), _g(r.get("resident_weights_per_rank")),
            _r(r.get("resident_weights_per_rank"), ck) + _mark(g["resident"]),
            _g(r.get("peak_rss_per_rank")), _r(r.get("peak_rss_per_rank"), ck),
            _g(peak_goal(ck, r.get("kv_cache_bytes") or 0) if ck else None) + _mark(g["peak_rss"]),
            _g(r.get("peak_rss_tree")),
            "-" if r.get("load_s") is None else f"{r['load_s']:.1f}",
            "-" if r.get("read_s") is None else f"{r['read_s']:.1f}",
            _r(r.get("load_s"), r.get("read_s")) + _mark(g["load"]),
        ]
        for b in ("1", "16"):
            d = tps.get(b)
            cells.append("-" if d is None or d.get("tokens_per_s") is None else f"{d['tokens_per_s']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    """Bar chart: resident weights / ckpt and peak RSS / ckpt per rank, per (format, TP)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("available", True) and r.get("ckpt_per_rank")]
    if not ok:
        return
    labels = [f"{r['format']}\nTP={r['tp']}" for r in ok]
    res = [(r.get("resident_weights_per_rank") or 0) / r["ckpt_per_rank"] for r in ok]
    peak = [(r.get("peak_rss_per_rank") or 0) / r["ckpt_per_rank"] for r in ok]
    goal = [peak_goal(r["ckpt_per_rank"], r.get("kv_cache_bytes") or 0) / r["ckpt_per_rank"] for r in ok]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(ok), 4))
    x = list(range(len(ok)))
    ax.bar([i - 0.2 for i in x], res, 0.4, label="resident weights / ckpt per rank")
    ax.bar([i + 0.2 for i in x], peak, 0.4, label="peak RSS / ckpt per rank")
    ax.axhline(RESIDENT_GOAL, color="k", ls="--", lw=1, label="goal: weights <= 1.10x")
    ax.scatter([i + 0.2 for i in x], goal, marker="_", s=400, color="r", label="goal: peak (+KV +1 GiB)")
    ax.set_xticks(x, labels)
    ax.set_ylabel("x checkpoint bytes per rank")
    ax.set_title("Kimi-K2.5 slice: resident memory vs checkpoint")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "eagle3.cli", *args]


def prepare(args: argparse.Namespace, log: Any = print) -> dict[str, Path]:
    """The checkpoints per format: the slice (made unless given) and its quantized versions."""
    args.work.mkdir(parents=True, exist_ok=True)
    src = args.slice or args.work / f"slice-{args.layers}l{args.experts}e"
    if not (src / "manifest.json").exists() and args.slice is None:
        log(f"making the slice: {src} ({args.layers} layers, {args.experts} experts)")
        t0 = time.perf_counter()
        subprocess.run(_cli("make-slice", str(src), "--layers", str(args.layers), "--experts",
                            str(args.experts), "--seed", str(args.seed)), check=True)
        log(f"  {time.perf_counter() - t0:.0f} s")
    ckpts = {"int4": src}
    for fmt in args.formats:
        if fmt == "int4":
            continue
        out = args.work / f"{src.name}-{fmt}"
        if not (out / "manifest.json").exists():
            log(f"quantizing {src} -> {out} (--recipe {RECIPES[fmt]})")
            t0 = time.perf_counter()
            subprocess.run(_cli("quantize", str(src), str(out), "--recipe", RECIPES[fmt], "--no-verify",
                                "--workers", str(args.quantize_workers)), check=True)
            log(f"  {time.perf_counter() - t0:.0f} s")
        ckpts[fmt] = out
    return {f: ckpts[f] for f in args.formats}


def ckpt_per_rank(ckpt: Path, tp: int) -> tuple[int, int]:
    """(bytes the fullest rank loads, bytes every rank together loads) from the plan's accounting."""
    from eagle3.plan import plan

    p = plan(ckpt, gpus=tp, gpu_memory=1 << 50)
    return p.max_weights_per_rank, p.loaded_bytes


def bench_one(args: argparse.Namespace, fmt: str, ckpt: Path, tp: int, read_s: float | None) -> dict[str, Any]:
    per_rank, loaded = ckpt_per_rank(ckpt, tp)
    row: dict[str, Any] = {"format": fmt, "tp": tp, "checkpoint": str(ckpt), "ckpt_per_rank": per_rank,
                           "ckpt_loaded_bytes": loaded,
                           "ckpt_file_bytes": sum(f.stat().st_size for f in shard_files(ckpt)),
                           "read_s": read_s}
    out = args.work / f"result-{fmt}-tp{tp}.json"
    out.unlink(missing_ok=True)
    spec = {"model": str(ckpt), "tp": tp, "batches": args.batches, "max_tokens": args.max_tokens,
            "prompt_len": args.prompt_len, "dtype": args.dtype, "threads": args.threads,
            "kv_cache_memory": args.kv_cache_memory, "out": str(out)}
    if args.drop_cache:
        drop_cache(shard_files(ckpt))
    rc, peak, tail = run_sampled([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                                 args.interval)
    if rc != 0 or not out.exists():
        last = tail.strip().splitlines()[-1] if tail.strip() else ""
        row.update(available=False, why=f"exit {rc}: {last}")
        row["log_tail"] = tail
        return row
    res = json.loads(out.read_text())
    row.update(res)
    if not res.get("available", True):
        return row
    row["peak_rss_per_process"] = {str(k): v for k, v in peak.per_process.items()}
    row["process_names"] = {str(k): v for k, v in peak.names.items()}
    row["peak_rss_per_rank"] = peak.max_process
    row["peak_rss_tree"] = peak.tree
    row["rss_samples"] = peak.samples
    rw = res.get("resident_weights")
    row["resident_weights_per_rank"] = max(rw) if rw else None
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        _child_main(args.child)
        return
    t_start = time.perf_counter()
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None  # a shared box skews wall times
    ckpts = prepare(args)
    rows: list[dict[str, Any]] = []
    reads: dict[str, dict[str, Any]] = {}
    for fmt, ckpt in ckpts.items():
        files = shard_files(ckpt)
        dropped = drop_cache(files) if args.drop_cache else False
        cold_s, nbytes = read_seconds(files)
        warm_s, _ = read_seconds(files)
        reads[fmt] = {"cold_s": cold_s, "warm_s": warm_s, "bytes": nbytes, "cache_dropped": dropped}
        print(f"{fmt}: read {nbytes / GiB:.2f} GiB in {cold_s:.1f} s "
              f"({'after fadvise DONTNEED' if dropped else 'page cache not dropped'}), warm {warm_s:.1f} s",
              flush=True)
        for tp in args.tp:
            print(f"{fmt} TP={tp}: loading {ckpt} in a fresh process ...", flush=True)
            row = bench_one(args, fmt, ckpt, tp, cold_s if dropped else warm_s)
            row["read_kind"] = "cold (fadvise DONTNEED)" if dropped else "warm"
            rows.append(row)
            if row.get("available", True):
                tps = ", ".join(f"b{b}: {d['tokens_per_s'] or 0:.2f}" for b, d in row["decode"].items())
                print(f"  load {row['load_s']:.1f} s, peak RSS {row['peak_rss_per_rank'] / GiB:.2f} GiB/rank, "
                      f"tok/s {tps}", flush=True)
            else:
                print(f"  not available: {row.get('why', '')}", flush=True)
    table = ratio_table(rows)
    print()
    print(table)
    print(f"\ngoals: resident weights per rank <= {RESIDENT_GOAL:.2f} x checkpoint bytes / N; peak RSS per rank "
          f"<= that + KV cache + 1 GiB; load time <= {LOAD_GOAL:g} x read time")
    import torch

    report = {"schema_version": 1, "argv": sys.argv, "machine": {
        "platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": args.threads or torch.get_num_threads(), "loadavg_start": load_start,
        "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "child"},
        "reads": reads, "rows": rows, "goals": {
            "resident_per_rank_over_ckpt": RESIDENT_GOAL, "runtime_allowance_bytes": RUNTIME_ALLOWANCE,
            "load_over_read": LOAD_GOAL}, "table": table, "wall_s": time.perf_counter() - t_start}
    args.json.write_text(json.dumps(report, indent=1, default=lambda o: asdict(o)))
    plot(rows, args.png)
    print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
