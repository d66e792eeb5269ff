"""What the calibrated methods do to a served model's fidelity to its source, side by side with
today's round to nearest, on the trained tiny target (or any target + draft).

    .venv/bin/python benchmarks/calibrated_fidelity.py --src tiny/kimi-k2.5-trained \
        --draft tiny/kimi-k2.5-trained-eagle3 --workdir /tmp/fid [--recipes w4a8,mxfp4] \
        [--methods gptq,gptaq,smooth,smooth+gptq] [--samples 16] [--limit 24] [--max-tokens 96]

Per recipe: ``eagle3 quantize SRC --recipe R`` (the native engine: round to nearest), then per
method the calibration pass (:func:`eagle3.quantize.calibrate.calibrate`) and a copy of the native
output with the calibrated modules' tensors put in place of the native ones (same names, dtypes and
shapes: every other byte is the native output's). Every output is served with the draft and
compared with the source exactly as ``eagle3 serve Q --draft D --validate gsm8k --limit N
--max-tokens M --reference SRC --no-baseline`` does; the source is recorded once
(``--record-reference``) and every run compared with that recording. Prints one table (mean / p99
KLD, top-1 agreement, identical continuations, mean accept length, calibration time and peak RSS)
and writes it to ``WORKDIR/fidelity.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch


def patch_output(out: Path, store_dir: Path) -> int:
    """Put the store's tensors in place of the same-named tensors of ``out``'s shards."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from eagle3.quantize.calibrate import TensorStore

    store = TensorStore(store_dir)
    wanted = {f"{m}.{sfx}": t for m in store.modules() for sfx, t in store.get(m).items()}
    done = 0
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            meta = h.metadata()
            tensors = {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118 - safe_open has no iteration
        hit = [k for k in tensors if k in wanted]
        if not hit:
            continue
        for k in hit:
            new = wanted[k]
            old = tensors[k]
            if new.dtype != old.dtype or tuple(new.shape) != tuple(old.shape):
                raise SystemExit(f"{f}: {k} is {old.dtype}{list(old.shape)}, calibrated {new.dtype}{list(new.shape)}")
            tensors[k] = new.contiguous()
        tmp = f.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(f)
        done += len(hit)
    if done != len(wanted):
        raise SystemExit(f"{out}: placed {done} of {len(wanted)} calibrated tensors")
    return done


def parse_method(spec: str) -> tuple[str, Any]:
    """``METHOD[:FIELD=VALUE;...]`` -> (method, CalibConfig), e.g. ``gptaq:alpha=1.0;scales=mse``."""
    import dataclasses

    from eagle3.quantize.calibrate import CalibConfig

    method, _, rest = spec.partition(":")
    kw: dict[str, Any] = {}
    types = {f.name: f.type for f in dataclasses.fields(CalibConfig)}
    for item in filter(None, rest.split(";")):
        k, _, v = item.partition("=")
        t = types[k]
        kw[k] = v if "str" in str(t) else (v == "True" if "bool" in str(t) else float(v) if "float" in str(t)
                                           else int(v))
    return method, CalibConfig(method=method, **kw)


def serve(model: Path, draft: Path, ref: str, report: Path, args: argparse.Namespace, record: Path | None = None
          ) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "eagle3", "serve", str(model), "--draft", str(draft), "--validate", "gsm8k",
           "--limit", str(args.limit), "--max-tokens", str(args.max_tokens), "--reference", ref, "--no-baseline",
           "--report", str(report), "--overwrite"]
    if record is not None:
        cmd += ["--record-reference", str(record)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(report.read_text())


def summarize(rep: dict[str, Any]) -> dict[str, Any]:
    """The reference comparison's numbers from a validation report (its ``reference`` block)."""
    ref = rep["reference"]
    served = next(iter(ref["workloads"].values()))["acceptance"]["served"] or {}
    return {"kld_mean": ref["kld"]["mean"], "kld_p99": ref["kld"]["p99"], "top1": ref["top1_agreement"],
            "identical": ref["divergence"]["identical"], "first_divergence": ref["divergence"]["mean_first_divergence"],
            "accept_length": served.get("mean_acceptance_length")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--recipes", default="w4a8,mxfp4")
    ap.add_argument("--methods", default="gptq,gptaq,smooth,smooth+gptq",
                    help="comma-separated METHOD[:FIELD=VALUE;...] (CalibConfig fields), e.g. gptaq:alpha=1.0")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--calib-max-tokens", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the calibration (default 1: per-core "
                    "timings, and no thread-pool thrash on a shared machine)")
    ap.add_argument("--reference", type=Path, default=None, help="a recording to reuse (default: record once)")
    args = ap.parse_args()

    from eagle3.quantize import quantize
    from eagle3.quantize.calibrate import calibrate

    torch.set_num_threads(args.threads)
    wd = args.workdir
    wd.mkdir(parents=True, exist_ok=True)
    ref_file = args.reference or wd / "reference.json"
    rows: list[dict[str, Any]] = []
    for recipe in args.recipes.split(","):
        base = wd / f"{recipe}-native"
        if not base.exists():
            quantize(args.src, base, recipe, workers=1)
        record = None if ref_file.exists() else ref_file
        base_report = wd / f"{recipe}-native.report.json"
        rep = (json.loads(base_report.read_text()) if base_report.exists() and not record else
               serve(base, args.draft, str(args.src if record else ref_file), base_report, args, record))
        rows.append({"recipe": recipe, "method": "rtn (native)", **summarize(rep)})
        print(rows[-1], flush=True)
        for spec in args.methods.split(","):
            method, cfg = parse_method(spec)
            tag = f"{recipe}-{spec.replace('+', '-').replace(':', '-').replace('=', '').replace(';', '-')}"
            store = wd / f"{tag}.store"
            shutil.rmtree(store, ignore_errors=True)
            t0 = time.perf_counter()
            res = calibrate(args.src, store, recipe, method=method, samples=args.samples,
                            max_tokens=args.calib_max_tokens, config=cfg)
            secs = time.perf_counter() - t0
            out = wd / tag
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(base, out)
            patch_output(out, store)
            rep = serve(out, args.draft, str(ref_file), wd / f"{tag}.report.json", args)
            rows.append({"recipe": recipe, "method": spec, **summarize(rep), "calib_seconds": round(secs, 1),
                         "calib_peak_rss_mb": round(res.peak_rss_mb), "fallback": res.fallback,
                         "calibrated": res.calibrated,
                         "layer_err": [(round(r.err_rtn, 5), round(r.err, 5)) for r in res.layers if r.mlps]})
            print(rows[-1], flush=True)
    (wd / "fidelity.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{'recipe':8} {'method':14} {'KLD mean':>9} {'p99':>8} {'top-1':>7} {'ident.':>6} {'accept':>6}")
    for r in rows:
        print(f"{r['recipe']:8} {r['method']:14} {r['kld_mean']!s:>9.9} {r['kld_p99']!s:>8.8} {r['top1']!s:>7.7} "
              f"{r['identical']!s:>6} {r['accept_length']!s:>6.6}")


if __name__ == "__main__":
    main()
