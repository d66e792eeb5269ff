"""A calibrated quantize's peak memory does not grow with the model: the same command on a 2-layer and
a 4-layer full-width Kimi-K2.5 slice (hidden 7168, expert width 2048, Moonshot INT4 experts), side by side.

    .venv/bin/python benchmarks/calibrated_memory.py --workdir /tmp/qmem [--layers 2,4] [--experts 2]
        [--recipe w4a8] [--method gptq] [--samples 1] [--tokens 256] [--min-tokens 0.01] [--json mem.json]

Per slice (``eagle3 make-slice WORKDIR/sliceL --layers L --experts E``, written once), the command a
user types::

    eagle3 quantize SLICE OUT --recipe R --method M --calibrate gsm8k --calibrate-samples S \\
        --calibrate-tokens T --calibrate-min-tokens F --workers 1 --quiet --json

with its wall time and the peak RSS of its process tree (sampled), and from the output's
quantization_report.json the calibration pass's own numbers: peak RSS after each layer, time per layer
(wall and CPU), MLPs calibrated. ``--min-tokens`` (default 0.01) lets a few hundred tokens calibrate
full-width experts (the default needs 7168 per expert), so the solver's Hessians and factors are in
the measured peak. The per-MoE-layer CPU time is what docs/calibration.md projects Kimi-K2.5's cost from.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def quantize_cmd(src: Path, out: Path, a: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "eagle3", "quantize", str(src), str(out), "--recipe", a.recipe, "--method", a.method,
            "--calibrate", "gsm8k", "--calibrate-samples", str(a.samples), "--calibrate-tokens", str(a.tokens),
            "--calibrate-min-tokens", str(a.min_tokens), "--workers", "1", "--overwrite", "--quiet", "--json"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--layers", default="2,4")
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--recipe", default="w4a8")
    ap.add_argument("--method", default="gptq")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--min-tokens", type=float, default=0.01)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from quantize import measure  # benchmarks/quantize.py: the same RSS sampling

    env = {"PYTHONPATH": str(ROOT)}
    a.workdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for n in (int(x) for x in a.layers.split(",")):
        src = a.workdir / f"slice{n}-e{a.experts}"
        if not (src / "config.json").is_file():
            subprocess.run([sys.executable, "-m", "eagle3", "make-slice", str(src), "--layers", str(n), "--experts",
                            str(a.experts), "--overwrite"], check=True, cwd=ROOT, env={**env, "PATH": "/usr/bin:/bin"})
        out = a.workdir / f"out{n}"
        cmd = quantize_cmd(src, out, a)
        print("$ eagle3 " + " ".join(cmd[3:]), flush=True)
        r = measure(cmd, env)
        cal = json.loads((out / "quantization_report.json").read_text())["calibration"]
        moe = [x for x in cal["layers"] if x["expert_tokens"] is not None]
        rows.append({"layers": n, "experts": a.experts, "wall_s": r["wall_s"], "peak_rss_bytes": r["peak_rss_bytes"],
                     "calibration_peak_rss_mb": cal["peak_rss_mb"], "calibration_s": cal["seconds"],
                     "calibrated": cal["calibrated"], "kept_data_free": cal["kept_data_free"],
                     "layer_peak_rss_mb": [x["peak_rss_mb"] for x in cal["layers"]],
                     "moe_layer_s": [x["seconds"] for x in moe], "moe_layer_cpu_s": [x["cpu_seconds"] for x in moe]})
        print(json.dumps(rows[-1]), flush=True)
    print("| slice | MLPs calibrated | quantize wall s | peak RSS (process tree) GiB | calibration pass peak RSS MiB "
          "| the pass's peak RSS after each layer, MiB | per MoE layer s (CPU s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        per = ", ".join(f"{w:.0f} ({c:.0f})" for w, c in zip(r["moe_layer_s"], r["moe_layer_cpu_s"], strict=True))
        layers = ", ".join(f"{m:.0f}" for m in r["layer_peak_rss_mb"])
        print(f"| {r['layers']} layers x {r['experts']} experts | {r['calibrated']} | {r['wall_s']:.0f} | "
              f"{r['peak_rss_bytes'] / 2**30:.3f} | {r['calibration_peak_rss_mb']:.0f} | {layers} | {per} |")
    if len(rows) >= 2:
        lo, hi = rows[0], rows[-1]
        tree = hi["peak_rss_bytes"] / max(lo["peak_rss_bytes"], 1)
        cal = hi["calibration_peak_rss_mb"] / max(lo["calibration_peak_rss_mb"], 1e-9)
        print(f"peak RSS, {hi['layers']} layers / {lo['layers']} layers: process tree {tree:.4f}x "
              f"({hi['peak_rss_bytes'] / 2**20:.0f} / {lo['peak_rss_bytes'] / 2**20:.0f} MiB), calibration pass "
              f"{cal:.4f}x ({hi['calibration_peak_rss_mb']:.0f} / {lo['calibration_peak_rss_mb']:.0f} MiB)")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
