"""The first command to run whenever a GPU is at hand (docs/kernels.md "GPU benchmark"): the GPU
tests, the kernel benchmark, the full-width slice end to end and ``serve --validate gsm8k`` of the
trained tiny pair, each stage time-boxed, written to ONE JSON named after the card and the date.

Stages (default boxes, 460 s in all, under 8 minutes with the set-up; ``--timeout NAME=S``):

=========  ====  ===============================================================================
tests      140   ``pytest -n 8`` over the GPU tests (tests/runtime/triton, test_models_gpu.py,
                 test_graphs.py, test_kernels_gpu_bench.py, test_device_placement.py; the AOT
                 compile test is the CPU's and is left out): counts and the failing tests' names
                 (from the junit XML; from the verbose log when the box cut the run short)
kernels    100   ``benchmarks/kernels_gpu.py`` at b = 1 / 16 / 64, triton: GB/s, % of HBM, the
                 byte floor and time / floor per kernel row
e2e        150   the 2-layer full-width slice (``eagle3 make-slice``) with graphs, triton: plain,
                 chain k = 3, ``auto`` and one tree (2,5,16) at b = 1 / 16, the plain rows against
                 the slice's decode-step floor
serve       70   ``eagle3 serve`` of the trained tiny pair, ``--device cuda --kernel-backend
                 triton --validate gsm8k`` at concurrency 1: lossless PASS / FAIL, TPOT speedup
=========  ====  ===============================================================================

A stage that runs past its box is killed (its whole process group) and recorded as ``timeout``;
the next stage still runs. The report's ``targets`` say which of issue 39's numbers are met. Writes
``benchmarks/results/gpu-session_CARD_DATE.json`` and, when ``$OUT`` is set (the device machine's
folder that comes back), a copy there with each stage's log and the charts (at most 8 files). Needs
nothing from the network: the slice and the tiny pair are generated there, the packages are the
machine's own (torch, triton, pytest-xdist). Without a CUDA / ROCm GPU it says so in one line and
exits 2; ``--dry-run`` prints the plan and exits 0 anywhere.

Example:
    PYTHONPATH=$PWD python3 benchmarks/gpu_session.py            # on the GPU machine, repo root
    python3 benchmarks/gpu_session.py --dry-run --only kernels,serve --timeout serve=120
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TEST_PATHS = ("tests/runtime/triton", "tests/runtime/test_models_gpu.py", "tests/runtime/test_graphs.py",
              "tests/runtime/test_kernels_gpu_bench.py", "tests/runtime/test_device_placement.py")
TIMEOUTS = {"tests": 140, "kernels": 100, "e2e": 150, "serve": 70}  # seconds per stage
SPEC_SHAPES = "1,3,4 auto 2,5,16"  # chain k = 3, auto (k <= 3), one tree
# issue 39's targets on H100 / H200: (kernel, batches, least fraction of the HBM peak)
KERNEL_TARGETS = (("moe_w4a16", (16, 64), 0.40), ("moe_w4a16", (1,), 0.20), ("mla_decode", (16, 64), 0.40),
                  ("mla_decode", (1,), 0.20), ("mla_decode_fp8", (16, 64), 0.40), ("mla_decode_fp8", (1,), 0.20),
                  ("linear_w4a16", (1, 16), 0.50), ("linear_bf16", (1, 16), 0.50))


@dataclass
class Stage:
    name: str
    cmd: list[str]
    timeout: float
    setup: list[list[str]]  # commands run first, inside the same box (fixtures)


def stages(work: Path, py: str = sys.executable) -> list[Stage]:
    """The four stages, their commands in the order they run."""
    bench = str(REPO / "benchmarks" / "kernels_gpu.py")
    tiny = work / "tiny"
    return [
        Stage("tests", [py, "-m", "pytest", "-n", "8", "-v", "-p", "no:cacheprovider", *TEST_PATHS,
                        "--ignore=tests/runtime/triton/test_aot_compile.py", f"--junitxml={work / 'tests.xml'}"],
              TIMEOUTS["tests"], []),
        Stage("kernels", [py, bench, "--out", str(work / "kernels.json"), "--batches", "1,16,64", "--backends",
                          "triton", "--skip-e2e"], TIMEOUTS["kernels"], []),
        Stage("e2e", [py, bench, "--out", str(work / "e2e.json"), "--skip-kernels", "--make-slice", "--make-draft",
                      "eagle3.1-mla", "--work", str(work / "slice"), "--backends", "triton", "--spec-backends",
                      "triton", "--e2e-batches", "1,16", "--e2e-kv-dtypes", "auto", "--e2e-graphs", "on",
                      "--spec-shapes", SPEC_SHAPES], TIMEOUTS["e2e"], []),
        Stage("serve", [py, "-m", "eagle3", "serve", str(tiny / "kimi-k2.5-trained"), "--draft",
                        str(tiny / "kimi-k2.5-trained-eagle3"), "--device", "cuda", "--kernel-backend", "triton",
                        "--validate", "gsm8k", "--limit", "16", "--max-tokens", "96", "--concurrency", "1",
                        "--report", str(work / "validate.json"), "--overwrite"], TIMEOUTS["serve"],
              [[py, "-m", "eagle3", "make-tiny", str(tiny), "--only", "kimi-k2.5-trained", "--only",
                "kimi-k2.5-trained-eagle3", "--overwrite"]]),
    ]


def run_stage(stage: Stage, log: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run a stage's commands in one time box (a new process group, killed whole at the deadline),
    the output to ``log``; {status: ok | failed | timeout, rc, seconds}."""
    t0 = time.monotonic()
    status, rc = "ok", 0
    with log.open("w") as f:
        for cmd in [*stage.setup, stage.cmd]:
            left = stage.timeout - (time.monotonic() - t0)
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            if left <= 0:
                status, rc = "timeout", None
                break
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                _kill(proc)
                status, rc = "timeout", None
                f.write(f"\n[gpu_session: {stage.name} killed at its {stage.timeout:g} s box]\n")
                break
            if rc != 0:
                status = "failed"
                break
    return {"status": status, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "timeout_s": stage.timeout}


def _kill(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------------------------------------
# reading each stage's output back
# ---------------------------------------------------------------------------------------------


_VERBOSE = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+::\S+)|(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED)")


def read_tests(xml: Path, log: Path | None = None) -> dict[str, Any]:
    """Counts and failing test ids from pytest's junit XML; when the box killed the run before it
    wrote one, from the verbose log's per-test lines (``"source": "log"``: the tests that finished)."""
    if not xml.is_file():
        return _tests_from_log(log) if log is not None and log.is_file() else {"counts": None}
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {"counts": counts, "failed": failed, "source": "junit"}


def _tests_from_log(log: Path) -> dict[str, Any]:
    seen: dict[str, str] = {}
    for m in _VERBOSE.finditer(log.read_text(errors="replace")):
        outcome, test = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        seen[test] = outcome
    outcomes = list(seen.values())
    counts = {"tests": len(outcomes), "failures": outcomes.count("FAILED"), "errors": outcomes.count("ERROR"),
              "skipped": outcomes.count("SKIPPED") + outcomes.count("XFAIL"),
              "passed": outcomes.count("PASSED") + outcomes.count("XPASS")}
    return {"counts": counts, "failed": sorted(t for t, o in seen.items() if o in ("FAILED", "ERROR")),
            "source": "log"}


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_validate(path: Path) -> dict[str, Any]:
    """What the validation says at concurrency 1: lossless, TPOT speedup, acceptance, accuracy."""
    rep = _load(path)
    if rep is None:
        return {"report": None}
    spec, loss, speed = rep.get("speculative") or {}, rep.get("lossless") or {}, rep.get("speedup") or {}
    lat, base = rep.get("latency") or {}, (rep.get("baseline") or {}).get("latency") or {}
    return {"lossless": "PASS" if loss.get("passed") else "FAIL" if loss.get("checked") else "not checked",
            "num_compared": loss.get("num_compared"), "num_mismatches": loss.get("num_mismatches"),
            "tpot_speedup": speed.get("tpot"), "output_throughput_speedup": speed.get("output_throughput"),
            "tpot_ms": (lat.get("tpot_ms") or {}).get("mean"), "baseline_tpot_ms": (base.get("tpot_ms") or {}).get("mean"),
            "acceptance_rate": spec.get("acceptance_rate"), "mean_acceptance_length": spec.get("mean_acceptance_length"),
            "accuracy": rep.get("accuracy"), "passed": rep.get("passed"), "failures": rep.get("failures"),
            "server": rep.get("server"), "n_samples": rep.get("n_samples")}


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 39's numbers, each met / missed / not measured, from what the stages measured."""
    out: list[dict[str, Any]] = []
    rows = [r for r in (report.get("kernels") or {}).get("rows") or [] if r.get("status") == "ok"
            and r.get("backend") == "triton"]
    for kernel, batches, least in KERNEL_TARGETS:
        got = [r for r in rows if r["kernel"] == kernel and r["batch"] in batches and r.get("hbm_fraction") is not None]
        worst = min((r["hbm_fraction"] for r in got), default=None)
        out.append({"target": f"{kernel} >= {100 * least:.0f}% of HBM at b = {', '.join(map(str, batches))}",
                    "value": worst, "met": None if len(got) < len(batches) else worst >= least})
    e2e = [r for r in (report.get("e2e") or {}).get("rows") or [] if r.get("status") == "ok" and r.get("graphs")
           and r.get("batch") == 1 and r.get("kv_cache_dtype", "auto") == "auto"]
    plain = next((r for r in e2e if r["spec"] == "plain"), None)
    chain = next((r for r in e2e if r["spec"] == "1,3,4"), None)
    xf = plain.get("x_floor") if plain else None
    out.append({"target": "slice plain decode step with graphs within 2x its byte floor at b = 1", "value": xf,
                "met": None if xf is None else xf <= 2.0})
    ratio = chain["tpot_ms"] / plain["tpot_ms"] if plain and chain else None
    out.append({"target": "slice chain k = 3 step <= 1.6x the plain step at b = 1", "value": ratio,
                "met": None if ratio is None else ratio <= 1.6})
    v = report.get("serve") or {}
    out.append({"target": "serve --validate gsm8k, trained tiny pair: lossless PASS", "value": v.get("lossless"),
                "met": None if v.get("lossless") in (None, "not checked") else v.get("lossless") == "PASS"})
    sp = v.get("tpot_speedup")
    out.append({"target": "serve --validate gsm8k: TPOT speedup >= 1.5x at concurrency 1", "value": sp,
                "met": None if sp is None else sp >= 1.5})
    t = report.get("tests") or {}
    counts = t.get("counts")
    out.append({"target": "GPU tests pass", "value": counts,
                "met": None if not counts else counts["failures"] + counts["errors"] == 0 and t.get("status") == "ok"})
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {n}" for k, n in v.items() if k in ("passed", "failures", "errors", "skipped"))
    return str(v)


def summary_lines(report: dict[str, Any]) -> list[str]:
    lines = [f"gpu_session on {report['card']} ({report['date']}): " + ", ".join(
        f"{name} {report[name]['status']} {report[name]['seconds']:.0f}/{report[name]['timeout_s']:g} s"
        for name in report["stages"])]
    for r in (report.get("kernels") or {}).get("rows") or []:
        if r.get("status") == "ok" and r.get("floor_s"):
            lines.append(f"  {r['kernel']:15s} b={r['batch']:<3d} {r['seconds'] * 1e6:9.1f} us  floor "
                         f"{r['floor_s'] * 1e6:8.1f} us  {r['x_floor']:6.1f}x  {100 * r['hbm_fraction']:5.1f}% of HBM")
    for line in (report.get("e2e") or {}).get("floor_lines") or []:
        lines.append("  " + line)
    for t in report["targets"]:
        mark = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"  [{mark}] {t['target']}: {_fmt(t['value'])}")
    return lines


# ---------------------------------------------------------------------------------------------


def card_info() -> dict[str, Any] | None:
    """The GPU's name and software (None: no CUDA / ROCm GPU here)."""
    import torch

    if not torch.cuda.is_available():
        return None
    info: dict[str, Any] = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - the report says what is missing
        info["triton"] = None
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True)
        info["nvidia_smi"] = q.stdout.strip() or None
    return info


def slug(text: str) -> str:
    """A file-name-safe form of the card's name (letters, digits, '.', '_', '-')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "gpu"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_session.py", description=__doc__.split("\n\n")[0],
                                epilog="Example: PYTHONPATH=$PWD python3 benchmarks/gpu_session.py",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(TIMEOUTS), help=f"stages to run, of {', '.join(TIMEOUTS)}")
    p.add_argument("--timeout", action="append", default=[], metavar="NAME=S", help="a stage's box in seconds")
    p.add_argument("--work", type=Path, default=Path("/tmp/eagle3-gpu-session"), help="scratch (slice, fixtures)")
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results", help="where the JSON goes")
    p.add_argument("--dry-run", action="store_true", help="print the stages and their boxes, run nothing")
    a = p.parse_args(argv)
    a.stages = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in a.stages if s not in TIMEOUTS]
    if bad or not a.stages:
        p.error(f"--only {a.only!r}: expected some of {', '.join(TIMEOUTS)}")
    a.timeouts = dict(TIMEOUTS)
    for item in a.timeout:
        name, _, val = item.partition("=")
        try:
            secs = float(val)
        except ValueError:
            secs = -1.0
        if name not in TIMEOUTS or secs <= 0:
            p.error(f"--timeout {item!r}: expected NAME=SECONDS with NAME one of {', '.join(TIMEOUTS)}")
        a.timeouts[name] = secs
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = [s for s in stages(args.work) if s.name in args.stages]
    for s in plan:
        s.timeout = args.timeouts[s.name]
    if args.dry_run:
        print(f"gpu_session plan: {len(plan)} stages, {sum(s.timeout for s in plan):g} s of boxes; work {args.work}")
        for s in plan:
            for cmd in [*s.setup, s.cmd]:
                print(f"  [{s.name} <= {s.timeout:g} s] {shlex.join(cmd)}")
        return 0
    info = card_info()
    if info is None:
        print("gpu_session.py: no CUDA / ROCm GPU on this machine (torch.cuda.is_available() is False); "
              "run it on the GPU machine (--dry-run shows the plan)", file=sys.stderr)
        return 2
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
               PYTHONUNBUFFERED="1", TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))
    env.pop("TRITON_INTERPRET", None)
    date = datetime.datetime.now(datetime.timezone.utc)
    report: dict[str, Any] = {"schema": 1, **info, "date": date.strftime("%Y-%m-%d"),
                              "started_utc": date.isoformat(timespec="seconds"), "commit": _commit(),
                              "stages": [s.name for s in plan]}
    logs = []
    for s in plan:
        log = (out_dir or args.work) / f"{s.name}.log"
        logs.append(log)
        res = run_stage(s, log, env)
        print(f"gpu_session: {s.name} {res['status']} in {res['seconds']:.0f} s (box {s.timeout:g} s)", flush=True)
        if s.name == "tests":
            res.update(read_tests(args.work / "tests.xml", log))
        elif s.name in ("kernels", "e2e"):
            bench = _load(args.work / f"{s.name}.json") or {}
            res.update({"rows": bench.get(s.name), "goals": bench.get("goals"),
                        "spec_lines": bench.get("spec_lines"), "floor_lines": bench.get("floor_lines"),
                        "kv_lines": bench.get("kv_lines"), "hbm_peak_tbps": bench.get("hbm_peak_tbps")})
        elif s.name == "serve":
            res.update(read_validate(args.work / "validate.json"))
        report[s.name] = res
    report["targets"] = targets(report)
    report["finished_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    name = f"gpu-session_{slug(info['card'])}_{report['date']}.json"
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / name
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
    if out_dir is not None:  # the device machine hands back at most 8 files: JSON, 4 logs, 3 charts
        shutil.copy(path, out_dir / name)
        for png in ("kernels.png", "e2e.png", "validate.png"):
            if (args.work / png).is_file():
                shutil.copy(args.work / png, out_dir / png)
    for line in summary_lines(report):
        print(line)
    print(f"report: {path}" + (f" (and {out_dir / name})" if out_dir else ""))
    return 0


def _commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (r.stdout.strip() or None) if r.returncode == 0 else None


if __name__ == "__main__":
    sys.exit(main())
