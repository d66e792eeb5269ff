"""Draft trees against the chain through ``eagle3 serve --validate gsm8k`` (the bundled server, greedy).

For each draft and each tree shape ``K,S,N`` (``--speculative-eagle-topk K --num-speculative-tokens S
--speculative-num-draft-tokens N``; ``1,S,S+1`` is the chain) runs one validation with ``--no-baseline``
and reads its report; the target alone is validated once, and a run is lossless when every greedy
completion equals that run's (the check ``--validate`` does with its baseline, done once instead of
once per shape). Reports mean accepted tokens per target forward (bonus included), tokens accepted
per depth, output throughput at the chosen concurrency, and the lossless result. JSON to stdout
(and ``--report``); the per-run validation reports stay in ``--work-dir``.

Example (trained tiny pair; see docs/trees.md "Measured"):

    eagle3 make-tiny ./tiny --only kimi-k2.5-trained --only kimi-k2.5-trained-eagle3 \\
        --only kimi-k2.5-trained-eagle3.1-mla
    python benchmarks/tree_validate.py ./tiny/kimi-k2.5-trained \\
        --drafts ./tiny/kimi-k2.5-trained-eagle3 ./tiny/kimi-k2.5-trained-eagle3.1-mla \\
        --shapes 1,3,4 2,3,4 2,3,8 4,3,8 4,5,16 --dataset $GSM8K_DIR --limit 16 --report trees.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _shape(text: str) -> tuple[int, int, int]:
    k, s, n = (int(x) for x in text.split(","))
    return k, s, n


def _validate(target: Path, draft: Path | None, shape: tuple[int, int, int] | None, args: argparse.Namespace,
              report: Path) -> dict[str, Any]:
    """One ``eagle3 serve --validate`` run; its JSON report."""
    cmd = [sys.executable, "-m", "eagle3", "serve", str(target), "--validate", "gsm8k", "--limit", str(args.limit),
           "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens), "--report", str(report),
           "--overwrite", "--dtype", args.dtype]
    if args.dataset is not None:
        cmd += ["--dataset", str(args.dataset)]
    if draft is not None and shape is not None:
        k, s, n = shape
        cmd += ["--draft", str(draft), "--no-baseline", "--num-speculative-tokens", str(s),
                "--speculative-eagle-topk", str(k)]
        if k > 1:
            cmd += ["--speculative-num-draft-tokens", str(n)]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    # exit 1 is a missed threshold (none are set here); the report still says what happened
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode not in (0, 1) or not report.exists():
        raise SystemExit(f"validation failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    out = json.loads(report.read_text())
    out["_wall_s"] = time.perf_counter() - t0
    return out


def _mismatches(run: dict[str, Any], base: dict[str, Any]) -> list[int]:
    """Questions whose greedy completion differs from the target-only run's."""
    want = {s["doc_id"]: s["completion"] for s in base["samples"]}
    return [s["doc_id"] for s in run["samples"] if s.get("error") or want.get(s["doc_id"]) != s["completion"]]


def _row(draft: Path, shape: tuple[int, int, int], run: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    spec = run["speculative"]
    k, s, n = shape
    bad = _mismatches(run, base)
    drafts = spec["num_drafts"] or 1
    return {"draft": draft.name, "topk": k, "steps": s, "draft_tokens": n, "kind": "chain" if k == 1 else "tree",
            "mean_accepted_tokens_per_forward": spec["mean_acceptance_length"],
            "accepted_at_depth": [c / drafts for c in spec["accepted_per_pos"]],
            "num_verifies": spec["num_drafts"],
            "output_throughput_tok_s": run["throughput"]["output_throughput"],
            "baseline_output_throughput_tok_s": base["throughput"]["output_throughput"],
            "lossless": not bad, "mismatched_questions": bad,
            "exact_match_strict": run["accuracy"]["strict-match"]["exact_match"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("--drafts", nargs="+", type=Path, required=True)
    ap.add_argument("--shapes", nargs="+", type=_shape, default=[(1, 3, 4), (2, 3, 4), (2, 3, 8), (4, 5, 16)])
    ap.add_argument("--dataset", type=Path, default=None, help="directory with train.jsonl + test.jsonl")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16",
                    help="bfloat16 (the server default) | float32 (exact ties in bf16 logits can flip a greedy "
                         "token between differently shaped forwards)")
    ap.add_argument("--work-dir", type=Path, default=Path("tree_validate_runs"))
    ap.add_argument("--report", type=Path, default=None)
    args = ap.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)

    base = _validate(args.target, None, None, args, args.work_dir / "baseline.json")
    rows = []
    for draft in args.drafts:
        for shape in args.shapes:
            name = f"{draft.name}-{'-'.join(map(str, shape))}.json"
            rows.append(_row(draft, shape, _validate(args.target, draft, shape, args, args.work_dir / name), base))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {"target": str(args.target), "dtype": args.dtype, "limit": args.limit, "concurrency": args.concurrency,
              "max_tokens": args.max_tokens, "num_fewshot": base["num_fewshot"],
              "baseline_output_throughput_tok_s": base["throughput"]["output_throughput"], "runs": rows}
    text = json.dumps(result, indent=2)
    if args.report is not None:
        args.report.write_text(text + "\n")
    print(text)
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
