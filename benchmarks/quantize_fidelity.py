"""What each quantization method costs the served model, side by side in one run: docs/recipes.md's
table of methods (round to nearest vs the data-free scale search) per recipe.

    .venv/bin/python benchmarks/quantize_fidelity.py --workdir /tmp/qfid [--recipes w4a8,mxfp4]
        [--methods rtn,mse,w4a8:gptq,mxfp4:smooth+gptq] [--calibrate-samples 16] [--calibrate-tokens 2048]
        [--weight-only rtn,mse] [--limit 24] [--max-tokens 96] [--full-width] [--repeat 1]
        [--reuse-reference] [--skip-done]
        [--json fidelity.json] [--dry-run]

``--methods``: each item a method for every recipe, or ``RECIPE:METHOD`` for one; a calibrated
method (gptq, gptaq, smooth, smooth+gptq, smooth+gptaq) is quantized with ``--calibrate gsm8k
--calibrate-samples N --calibrate-tokens T`` and its row also shows the calibration pass's MLPs
calibrated / kept data-free, time and peak RSS (from the output's quantization_report.json).

On the trained tiny pair (``eagle3 make-tiny --only kimi-k2.5-trained`` and its two shipped drafts,
written into WORKDIR once), every step a command a user types:

1. the source recorded once: ``eagle3 serve SRC --draft EAGLE3 --validate gsm8k --limit N
   --max-tokens M --record-reference REF`` (its greedy continuations with their top-20 logprobs and
   the EAGLE-3 draft's acceptance on the source), and the MLA draft's acceptance on the source
   (``serve SRC --draft MLA --validate gsm8k --no-baseline``);
2. per recipe and method: ``eagle3 quantize SRC Q --recipe R --method X [--calibrate gsm8k ...]``
   (wall time and the peak RSS of its process tree), then ``serve Q --draft EAGLE3 --validate gsm8k --reference REF
   --no-baseline`` (mean / p99 KLD, top-1 agreement, identical continuations, first divergence,
   EAGLE-3's accept length), ``serve Q --draft MLA --validate gsm8k --no-baseline`` (the MLA
   draft's accept length) and ``serve Q --activation-quant none --validate gsm8k --reference REF
   --no-baseline`` (the same comparison with activations unquantized: the weights' share).

``--weight-only`` limits the weight-only serve to some methods (default: every one). ``--skip-done``
keeps the outputs and reports an interrupted run already wrote (its quantize time from the
``NAME.quantize.json`` written beside them).
``--reuse-reference`` keeps a recording (and the MLA draft's source run) already in WORKDIR from an
earlier run with the same --limit / --max-tokens (the source's greedy continuations are the same).
``--full-width`` adds the quantize time and peak RSS per recipe and data-free method on the Kimi-shaped
full-width checkpoint of benchmarks/quantize.py (hidden 7168, 32 Moonshot-INT4 experts of width
2048, a dense layer of width 18432; 3 GB), ``--repeat`` alternating rounds, best time kept (the
2-core machine is shared). Prints one table and writes every number to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET = "kimi-k2.5-trained"
DRAFTS = {"eagle3": "kimi-k2.5-trained-eagle3", "mla": "kimi-k2.5-trained-eagle3.1-mla"}
CALIBRATED = ("gptq", "gptaq", "smooth", "smooth+gptq", "smooth+gptaq")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "eagle3", *args]


def shown(cmd: list[str]) -> str:
    """A command as the user types it (``eagle3 ...``)."""
    return "eagle3 " + shlex.join(cmd[3:]) if cmd[1:3] == ["-m", "eagle3"] else shlex.join(cmd)


def validate_args(limit: int, max_tokens: int, report: Path) -> list[str]:
    return ["--validate", "gsm8k", "--limit", str(limit), "--max-tokens", str(max_tokens), "--report", str(report),
            "--overwrite"]


def record_cmd(src: Path, draft: Path, ref: Path, limit: int, max_tokens: int) -> list[str]:
    return cli("serve", str(src), "--draft", str(draft), "--validate", "gsm8k", "--limit", str(limit), "--max-tokens",
               str(max_tokens), "--record-reference", str(ref), "--overwrite")


def serve_cmd(target: Path, draft: Path | None, limit: int, max_tokens: int, report: Path, ref: Path | None = None,
              weight_only: bool = False) -> list[str]:
    cmd = cli("serve", str(target))
    if draft is not None:
        cmd += ["--draft", str(draft)]
    if weight_only:
        cmd += ["--activation-quant", "none"]
    cmd += validate_args(limit, max_tokens, report)
    if ref is not None:
        cmd += ["--reference", str(ref)]
    return cmd + ["--no-baseline"]


def quantize_cmd(src: Path, out: Path, recipe: str, method: str, calib: tuple[int, int] = (16, 2048)) -> list[str]:
    """``calib``: a calibrated method's --calibrate-samples and --calibrate-tokens (gsm8k prompts)."""
    extra = (["--calibrate", "gsm8k", "--calibrate-samples", str(calib[0]), "--calibrate-tokens", str(calib[1])]
             if method in CALIBRATED else [])
    return cli("quantize", str(src), str(out), "--recipe", recipe, "--method", method, *extra, "--overwrite",
               "--quiet", "--json")


def plan(recipes: list[str], items: list[str]) -> list[tuple[str, str]]:
    """(recipe, method) pairs in the items' order: ``METHOD`` for every recipe, ``RECIPE:METHOD`` for one."""
    out = []
    for item in items:
        r, _, m = item.rpartition(":")
        out.extend((recipe, m) for recipe in recipes if r in ("", recipe))
    return out


def calibration(q: Path) -> dict[str, Any] | None:
    """A calibrated output's pass summary (totals only) from its quantization_report.json."""
    cal = _read(q / "quantization_report.json").get("calibration")
    if not cal:
        return None
    return {k: cal[k] for k in ("tokens", "sequences", "calibrated", "kept_data_free", "seconds", "peak_rss_mb")}


def run(cmd: list[str], dry: bool) -> dict[str, Any]:
    """Run a command (or print it with --dry-run); wall time and peak RSS of its process tree."""
    print(f"$ {shown(cmd)}", flush=True)
    if dry:
        return {"wall_s": 0.0, "peak_rss_bytes": 0}
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from quantize import measure  # benchmarks/quantize.py: the same RSS sampling

    r = measure(cmd, {"PYTHONPATH": str(ROOT)})
    r.pop("stdout", None)
    return r


def _spec(report: dict[str, Any]) -> float | None:
    spec = ((report.get("workloads") or {}).get("gsm8k") or {}).get("speculative") or {}
    v = spec.get("mean_acceptance_length")
    return float(v) if isinstance(v, (int, float)) else None


def comparison(report: dict[str, Any]) -> dict[str, Any]:
    """The numbers of a ``serve --validate --reference`` report the table shows."""
    ref = report.get("reference") or {}
    k, d = ref.get("kld") or {}, ref.get("divergence") or {}
    return {"kld_mean": k.get("mean"), "kld_p99": k.get("p99"), "top1": ref.get("top1_agreement"),
            "identical": d.get("identical"), "sequences": d.get("sequences"),
            "mean_first_divergence": d.get("mean_first_divergence"), "accept_length": _spec(report)}


def table(rows: list[dict[str, Any]], source: dict[str, Any]) -> list[str]:
    """docs/recipes.md's table: one line per recipe and method."""
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    def pct(v: Any) -> str:
        return "-" if v is None else f"{100 * v:.1f} %"

    out = [f"source (bf16 + INT4 experts): accept length EAGLE-3 {f(source.get('accept_eagle3'), '.2f')}, "
           f"EAGLE-3.1 MLA {f(source.get('accept_mla'), '.2f')}",
           "| recipe | method | mean KLD | p99 KLD | top-1 | identical | first div. | weight-only KLD | weight-only "
           "top-1 | accept EAGLE-3 | accept MLA | quantize s | peak RSS MiB | full-width s | full-width peak GiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        full, wo = r["full"], r["weight_only"]
        fw = r.get("full_width") or {}
        out.append(f"| {r['recipe']} | {r['method']} | {f(full['kld_mean'], '.5f')} | {f(full['kld_p99'], '.4f')} | "
                   f"{pct(full['top1'])} | "
                   f"{full['identical']}/{full['sequences']} | {f(full['mean_first_divergence'], '.1f')} | "
                   f"{f(wo['kld_mean'], '.5f')} | {pct(wo['top1'])} | "
                   f"{f(full['accept_length'], '.2f')} | {f(r['accept_mla'], '.2f')} | "
                   f"{f(r['quantize']['wall_s'], '.1f')} | {f(r['quantize']['peak_rss_bytes'] / 2**20, '.0f')} | "
                   f"{f(fw.get('wall_s'), '.1f')} | "
                   f"{f(fw['peak_rss_bytes'] / 2**30 if fw.get('peak_rss_bytes') else None, '.2f')} |")
    return out


def full_width(workdir: Path, pairs: list[tuple[str, str]], repeat: int, dry: bool) -> dict[str, Any]:
    """Quantize time and peak RSS of each recipe and data-free method on benchmarks/quantize.py's
    checkpoint (a calibrated method's cost at full width: benchmarks/calibrated_memory.py)."""
    pairs = [(r, m) for r, m in pairs if m not in CALIBRATED]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import quantize as qbench

    src = workdir / "kimi-slice-e32-v32768"
    if not src.exists() and not dry:
        print(f"generating {src} ...", flush=True)
        qbench.make_checkpoint(src, 32, 32768)
    out: dict[str, Any] = {}
    for _ in range(repeat):  # rounds alternate the methods: a slow spell hits them alike
        for recipe, method in pairs:
            r = run(quantize_cmd(src, workdir / "fw-out", recipe, method), dry)
            key = f"{recipe}:{method}"
            prev = out.get(key)
            walls = [*(prev or {}).get("walls_s", []), r["wall_s"]]
            if prev is None or r["wall_s"] < prev["wall_s"]:
                out[key] = r
            out[key]["walls_s"] = walls
            out[key]["peak_rss_bytes"] = max(r["peak_rss_bytes"], (prev or {}).get("peak_rss_bytes", 0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--recipes", default="w4a8,mxfp4")
    ap.add_argument("--methods", default="rtn,mse", help="METHOD or RECIPE:METHOD items, comma-separated")
    ap.add_argument("--calibrate-samples", type=int, default=16)
    ap.add_argument("--calibrate-tokens", type=int, default=2048)
    ap.add_argument("--reuse-reference", action="store_true", help="keep WORKDIR's recording from an earlier run")
    ap.add_argument("--skip-done", action="store_true", help="keep the outputs and reports already in WORKDIR")
    ap.add_argument("--weight-only", default=None, help="methods that get the weight-only serve (default: all)")
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--full-width", action="store_true", help="also time each method on the full-width checkpoint")
    ap.add_argument("--repeat", type=int, default=1, help="--full-width rounds, alternating; best time kept")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = ap.parse_args()
    recipes = a.recipes.split(",")
    pairs = plan(recipes, a.methods.split(","))
    w, dry = a.workdir, a.dry_run
    tiny = w / "tiny"
    if not (tiny / TARGET).is_dir() and not dry:
        w.mkdir(parents=True, exist_ok=True)
        only = [x for name in (TARGET, *DRAFTS.values()) for x in ("--only", name)]
        subprocess.run(cli("make-tiny", str(tiny), "--overwrite", *only), check=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    src, ref = tiny / TARGET, w / "reference.jsonl.gz"
    drafts = {k: tiny / v for k, v in DRAFTS.items()}
    t0 = time.perf_counter()
    if not (a.reuse_reference and ref.is_file() and (w / "source-mla.json").is_file()):
        run(record_cmd(src, drafts["eagle3"], ref, a.limit, a.max_tokens), dry)
        run(serve_cmd(src, drafts["mla"], a.limit, a.max_tokens, w / "source-mla.json"), dry)
    source = {} if dry else {"accept_mla": _spec(_read(w / "source-mla.json"))}
    rows = []
    for recipe, method in pairs:
        q = w / f"{recipe}-{method}"
        name = f"{recipe}-{method}"
        qjson = w / f"{name}.quantize.json"
        if a.skip_done and qjson.is_file() and (q / "quantization_report.json").is_file():
            qrun = _read(qjson)
        else:
            qrun = run(quantize_cmd(src, q, recipe, method, (a.calibrate_samples, a.calibrate_tokens)), dry)
            if not dry:
                qjson.write_text(json.dumps(qrun) + "\n")
        wo = a.weight_only is None or method in a.weight_only.split(",")
        for rep, cmd in ((w / f"{name}.json", serve_cmd(q, drafts["eagle3"], a.limit, a.max_tokens, w / f"{name}.json",
                                                         ref)),
                         (w / f"{name}-mla.json", serve_cmd(q, drafts["mla"], a.limit, a.max_tokens,
                                                             w / f"{name}-mla.json")),
                         (w / f"{name}-weight-only.json", serve_cmd(q, None, a.limit, a.max_tokens,
                                                                    w / f"{name}-weight-only.json", ref,
                                                                    weight_only=True) if wo else None)):
            if cmd is not None and not (a.skip_done and rep.is_file()):
                run(cmd, dry)
        if dry:
            continue
        full = _read(w / f"{name}.json")
        # the EAGLE-3 draft's acceptance on the source, recorded with the reference
        src_spec = (((full.get("reference") or {}).get("workloads") or {}).get("gsm8k") or {}).get("acceptance")
        source.setdefault("accept_eagle3", ((src_spec or {}).get("source") or {}).get("mean_acceptance_length"))
        rows.append({"recipe": recipe, "method": method, "quantize": qrun, "full": comparison(full),
                     "weight_only": comparison(_read(w / f"{name}-weight-only.json") if wo else {}),
                     "accept_mla": _spec(_read(w / f"{name}-mla.json")), "calibration": calibration(q)})
        with open(w / "rows.jsonl", "a") as f:  # each row as soon as it is measured
            f.write(json.dumps(rows[-1]) + "\n")
    fw = full_width(w, pairs, a.repeat, dry) if a.full_width else {}
    if dry:
        return
    for r in rows:
        r["full_width"] = fw.get(f"{r['recipe']}:{r['method']}")
    summary = {"source": source, "limit": a.limit, "max_tokens": a.max_tokens, "rows": rows,
               "seconds": time.perf_counter() - t0}
    for line in table(rows, source):
        print(line)
    for recipe in recipes:  # every method against round to nearest, per recipe, measured in this run
        by = {r["method"]: r for r in rows if r["recipe"] == recipe}
        if "rtn" not in by or not by["rtn"]["full"]["kld_mean"]:
            continue
        base = by["rtn"]
        for m, r in by.items():
            if m == "rtn" or r["full"]["kld_mean"] is None:
                continue
            ratio = r["full"]["kld_mean"] / base["full"]["kld_mean"]
            entry = {"kld_over_rtn": ratio, "top1": r["full"]["top1"],
                     "accept_eagle3_vs_rtn": [r["full"]["accept_length"], base["full"]["accept_length"]],
                     "accept_mla_vs_rtn": [r["accept_mla"], base["accept_mla"]]}
            line = f"{recipe}: mean KLD {m} / rtn {ratio:.3f}x"
            if fw and r.get("full_width") and base.get("full_width"):
                entry["full_width_time_over_rtn"] = r["full_width"]["wall_s"] / max(base["full_width"]["wall_s"], 1e-9)
                line += f", full-width time {entry['full_width_time_over_rtn']:.2f}x"
            summary.setdefault("ratios", {}).setdefault(recipe, {})[m] = entry
            print(line)
    if a.json:
        a.json.write_text(json.dumps(summary, indent=2) + "\n")


def _read(p: Path) -> dict[str, Any]:
    return json.loads(p.read_text())


if __name__ == "__main__":
    main()
