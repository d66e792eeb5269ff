"""Accept length of drafts beside targets, as a table: every draft with every target (issue 34).

Each target is loaded once by the runtime and decodes lm-eval's GSM8K 5-shot prompts of the first
``--prompts`` test problems greedily, ``--tokens`` new tokens each (stopping at EOS only), once
plainly (the lossless reference) and once with each draft (``k`` speculative tokens). Printed: mean
accept length (tokens per target forward, bonus included) per draft and target, the change against
the first target column, and whether every speculative output equalled the plain one. JSON with
every counter.

Example (the trained tiny pair, its MXFP4 / W4A8 requantizations, and drafts adapted to MXFP4)::

    eagle3 make-tiny tiny --only kimi-k2.5-trained --only kimi-k2.5-trained-eagle3 \\
        --only kimi-k2.5-trained-eagle3.1-mla
    eagle3 convert tiny/kimi-k2.5-trained bf16 --text-only --dequantize bf16
    eagle3 quantize bf16 mxfp4 --recipe mxfp4 && eagle3 quantize bf16 w4a8 --recipe w4a8
    eagle3 train-draft mxfp4 e3-mxfp4 --init-from tiny/kimi-k2.5-trained-eagle3 --adapt
    .venv/bin/python benchmarks/draft_acceptance.py --targets source=tiny/kimi-k2.5-trained,w4a8=w4a8,mxfp4=mxfp4 \\
        --drafts eagle3=tiny/kimi-k2.5-trained-eagle3,eagle3-adapted=e3-mxfp4 --json acceptance.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _pairs(text: str, what: str) -> dict[str, Path]:
    out = {}
    for part in text.split(","):
        name, sep, path = part.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"{what} {part!r}: give NAME=PATH[,NAME=PATH...]")
        out[name] = Path(path)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", type=lambda s: _pairs(s, "--targets"), required=True)
    ap.add_argument("--drafts", type=lambda s: _pairs(s, "--drafts"), required=True)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--fewshot", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch

    from eagle3.runtime.loader import load_target
    from eagle3.runtime.tokenizer import load_tokenizer
    from eagle3.train import acceptance

    results: dict[str, dict[str, Any]] = {d: {} for d in a.drafts}
    for tname, tpath in a.targets.items():
        target = load_target(tpath, dtype=torch.bfloat16)
        prompts = acceptance.gsm8k_prompts(load_tokenizer(tpath), a.prompts, a.fewshot)
        plain = acceptance.plain_outputs(target, prompts, a.tokens)
        for dname, dpath in a.drafts.items():
            t0 = time.perf_counter()
            h = acceptance.measure(target, dpath, prompts, k=a.k, max_tokens=a.tokens, plain=plain)
            results[dname][tname] = h
            print(f"{dname:>24} with {tname:<10} accept length {h['mean_acceptance_length']:.3f}, lossless "
                  f"{'PASS' if h['lossless'] else 'FAIL'} ({time.perf_counter() - t0:.0f} s)", flush=True)
        del target
    first = next(iter(a.targets))
    print(f"\n| draft | {' | '.join(a.targets)} |\n|---|{'---|' * len(a.targets)}")
    for dname, row in results.items():
        base = row[first]["mean_acceptance_length"]
        cells = []
        for tname in a.targets:
            v = row[tname]["mean_acceptance_length"]
            rel = "" if tname == first else f" ({100 * (v / base - 1):+.1f}%)"
            cells.append(f"{v:.2f}{rel}" + ("" if row[tname]["lossless"] else " NOT LOSSLESS"))
        print(f"| {dname} | {' | '.join(cells)} |")
    if a.json:
        a.json.write_text(json.dumps({"machine": platform.platform(), "prompts": a.prompts, "tokens": a.tokens,
                                      "k": a.k, "fewshot": a.fewshot,
                                      "targets": {k: str(v) for k, v in a.targets.items()},
                                      "drafts": {k: str(v) for k, v in a.drafts.items()}, "results": results},
                                     indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
