"""Tensor + expert parallelism (``LLM(..., tensor_parallel_size=2)``, gloo on CPU, 2 ranks).

TP=2 must give TP=1's logits within rounding and its greedy tokens up to the first near tie (fp32;
the sums run in another order), and speculative TP=2 plain TP=2's tokens bit for bit, for the INT4
source and quantized ones; a dead worker must fail the requests in flight with a clear error, not hang.
Each TP=2 LLM spawns a worker process (~3-5 s here), so the tests reuse them across asserts, and
the next TP=2 LLM of the same checkpoint and settings reuses that process (``close(rejoin=True)``). Only
one tensor-parallel LLM can live in a process at a time (one torch.distributed group), so each is
closed before the next one starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from eagle3.runtime.engine.llm import LLM
from eagle3.runtime.sampling import SamplingParams
from eagle3.testing.numerics import (
    FP32_ROUTER_TOL,
    assert_greedy_agrees,
    assert_tokens_until_near_tie,
    forced_logits,
)
from tests.runtime.model_kit import single_thread

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# TP=2 sums each reduced layer output as (rank 0's partial + rank 1's partial) where TP=1 sums all
# the terms in one GEMM: the same values in a different order, so fp32 logits differ by rounding
# only. Measured on the tiny target (4 prompts, fp32, teacher-forced over TP=1's tokens): max |diff|
# 1.2e-5 (INT4, bf16 source, AVX2-only kernels), 3.8e-6 (W4A8 without a code flip), 1.7e-6
# (MXFP4) on logits up to |4.1|, i.e. a few fp32 ulps carried through 7 layers.
LOGITS_ATOL = 1e-4
# W4A8's routed experts quantize their input to fp8 per token, a step function: where TP=2's
# rounding moves an activation across an e4m3 rounding boundary its code moves by one step (6-12% of
# the value), and that token's outputs and every later token that attends to its cache move by far
# more than rounding (measured: 0.031 on AVX-512 kernels, 0.573 and, with other weights, 1.03 under
# the AVX2 settings of .ci/run): no tolerance bounds that. Experts are split whole across ranks, so
# the activation quantization itself is the same computation at any TP size; TP=2 vs TP=1 of such a
# format is compared with it off (activation_quant="none": the same decoded weights, continuous math,
# LOGITS_ATOL), and the served TP=2 engine with it on still gives speculative == plain bit for bit.
ACT_QUANTIZED = {"w4a8"}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 768, (n,), generator=g).tolist() for n in (3, 11, 6, 19)]


PROMPTS = _prompts()


_threads = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def w4a8(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from eagle3.quantize import pipeline

    out = tmp_path_factory.mktemp("tp-formats") / "w4a8"
    pipeline.quantize(str(tiny_dir / "kimi-k2.5"), out, "w4a8", None, workers=1, engine="native", verify=False,
                      progress=False)
    return out


# Quark INT4 per-group, which Quark stores transposed ([K, N/8] words, [K/G, N] scales).
_INT4_G32 = """name: int4-g32
description: Quark INT4 per-group 32, every Linear of the decoder layers
schema_version: 1
weight: {format: int4, qscheme: per_group, group_size: 32}
activation: {format: none}
scope:
  include: ['re:\\.(mlp|self_attn)\\.']
  exclude: ["*lm_head*", "*norm*", "*.gate"]
export: {zero_point: true}
"""


@pytest.fixture(scope="module")
def int4g(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from eagle3.quantize import pipeline

    root = tmp_path_factory.mktemp("tp-int4g")
    (root / "int4-g32.yaml").write_text(_INT4_G32)
    pipeline.quantize(str(tiny_dir / "kimi-k2.5"), root / "int4g", str(root / "int4-g32.yaml"), None, workers=1,
                      engine="native", verify=False, progress=False)
    return root / "int4g"


@pytest.fixture(scope="module")
def mxfp4(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from eagle3.quantize import pipeline

    out = tmp_path_factory.mktemp("tp-mxfp4") / "mxfp4"
    pipeline.quantize(str(tiny_dir / "kimi-k2.5"), out, "mxfp4", None, workers=1, engine="native", verify=False,
                      progress=False)
    return out


@pytest.fixture(scope="module")
def fp8(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek block-FP8 routed experts (the text-only Kimi-K2-Thinking tiny, requantized)."""
    from tests.runtime.model_kit import requantize_target

    return requantize_target(tiny_dir / "kimi-k2-thinking", tmp_path_factory.mktemp("tp-fp8") / "fp8", "fp8-block")


@pytest.fixture(scope="module")
def shared_head_draft(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Llama draft without an lm_head of its own: it shares the target's (full vocabulary)."""
    import shutil

    from eagle3.checkpoint import CheckpointReader, CheckpointWriter

    src = tiny_dir / "kimi-k2.5-eagle3"
    out = tmp_path_factory.mktemp("tp-draft") / "shared-head"
    out.mkdir()
    for f in src.iterdir():
        if not f.name.endswith((".safetensors", ".index.json")):
            shutil.copy(f, out / f.name)
    reader = CheckpointReader(src)
    with CheckpointWriter(out) as w:
        for name in reader.names():
            if name != "lm_head.weight":
                w.add(name, reader.get(name))
    return out


def _source(fmt: str, tiny_dir: Path, request: pytest.FixtureRequest) -> Path:
    return tiny_dir / "kimi-k2.5" if fmt == "int4" else request.getfixturevalue(fmt)


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def _llm(target: Path, draft: Path | None = None, tp: int = 1, **kw: str) -> LLM:
    return LLM(target, draft, dtype="float32", tokenizer=None, num_blocks=64, tensor_parallel_size=tp, **kw)


@contextlib.contextmanager
def _tp2(target: Path, draft: Path | None = None, *, then_same: bool = False, **kw: str) -> Iterator[LLM]:
    """A TP=2 LLM, closed at the end; ``then_same``: another TP=2 LLM of this checkpoint and settings
    follows (another draft), whose group its worker process then joins instead of a new one starting
    (LLM.close(rejoin=True); not after a failure)."""
    llm = _llm(target, draft, tp=2, **kw)
    try:
        yield llm
    except BaseException:
        llm.close()
        raise
    llm.close(rejoin=then_same)


@pytest.mark.parametrize("fmt", ["int4", "w4a8", "int4g", "mxfp4", "fp8"])
def test_tp2_equals_tp1_greedy_with_every_draft(fmt: str, tiny_dir: Path, request: pytest.FixtureRequest) -> None:
    target = _source(fmt, tiny_dir, request)
    # Both draft architectures (Llama-style, MLA). The draft runs on rank 0 alone (engine/worker.py)
    # over the target's gathered aux states and logits, so a draft's checkpoint format (speculators'
    # config) and its own vocabulary map (d2t) never meet the tensor-parallel code: TP=1 covers
    # them (tests/runtime/test_llm_tiny.py); one more TP=2 engine each here was a worker spawn each.
    drafts = {"int4": [tiny_dir / d for d in ("kimi-k2.5-eagle3", "kimi-k2.6-eagle3.1-mla")],
              "w4a8": [tiny_dir / "kimi-k2.5-eagle3"]}.get(fmt, [])
    exact = {"activation_quant": "none"} if fmt in ACT_QUANTIZED else {}
    tol = LOGITS_ATOL
    one = _llm(target, **exact)
    ref = _tokens(one)
    if fmt == "int4":
        drafts.append(request.getfixturevalue("shared_head_draft"))  # the draft gets a whole lm_head on rank 0
    with _tp2(target, then_same=bool(drafts), **exact) as plain:
        assert plain.tensor_parallel_size == 2
        rank1 = plain._workers.procs[0].pid
        tp2 = _tokens(plain)
        # TP=2 == TP=1 up to rounding (not bit for bit: another summation order): logits within tol
        # over TP=1's tokens, greedy tokens equal up to the first near tie
        for i, (prompt, toks) in enumerate(zip(PROMPTS, ref, strict=True)):
            history = prompt + toks[:-1]
            assert_greedy_agrees(forced_logits(one.target, history), forced_logits(plain.target, history), tol,
                                 f"{fmt}: TP=2 vs TP=1, prompt {i}")
        assert_tokens_until_near_tie(one.target, PROMPTS, ref, {"tp=2": tp2}, tol, FP32_ROUTER_TOL,
                                     f"{fmt}: TP=2 vs TP=1")
        del one
        # The shard really is a shard: half the heads, half the experts, half the vocabulary.
        m = plain.target.model
        assert m.lm_head.out_features == m.vocab_size // 2
        assert m.layers[1].self_attn.spec.num_heads == m.spec.mla.num_heads // 2
        assert m.layers[1].mlp.expert_range == (0, m.spec.n_routed_experts // 2)
    if exact:  # the served engine, activations quantized, for the speculative comparison below
        with _tp2(target, then_same=bool(drafts)) as plain:
            assert plain._workers.procs[0].pid != rank1  # other load settings: not the waiting rank's
            rank1 = plain._workers.procs[0].pid
            tp2 = _tokens(plain)
    for i, draft in enumerate(drafts):
        with _tp2(target, draft, then_same=i < len(drafts) - 1) as spec:
            assert spec._workers.procs[0].pid == rank1  # the waiting rank joined (close(rejoin=True))
            assert _tokens(spec) == tp2  # speculative == plain at one TP size: bitwise, batch invariance
            assert spec.stats.num_drafts > 0


def test_dead_worker_fails_requests_cleanly(tiny_dir: Path) -> None:
    llm = _llm(tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.5-eagle3", tp=2)
    try:
        proc = llm._workers.procs[0]
        assert llm.broken is None
        for p in PROMPTS:
            llm.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        llm.step()  # in flight
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        t0 = time.monotonic()
        done = {}
        while llm.has_unfinished() and time.monotonic() - t0 < 60:
            for o in llm.step():
                if o.finished:
                    done[o.request_id] = o
        assert len(done) == len(PROMPTS)
        assert all(o.finish_reason == "error" and "rank 1" in o.error for o in done.values())
        assert "rank 1" in llm.broken
        # New requests fail at once with the same reason instead of waiting on the dead rank.
        (out,) = llm.generate([PROMPTS[0]], GREEDY)
        assert out.finish_reason == "error" and "died" in out.error
    finally:
        llm.close()
    assert not any(p.is_alive() for p in llm._workers.procs)


_DRIVER = """
import os, signal, sys, time
import torch
from eagle3.runtime.engine.llm import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", tokenizer=None, num_blocks=8, tensor_parallel_size=2)
    sigterm = "default" if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else "handled"
    print(sigterm, " ".join(str(p.pid) for p in llm._workers.procs), flush=True)
    time.sleep(60)
"""


def test_workers_exit_with_the_driver(tiny_dir: Path, tmp_path: Path) -> None:
    """No orphans: a driver killed outright takes its workers along. Killed outright (SIGKILL) is the
    case that runs no code of the driver's; a SIGTERM ends it the same way while nothing in it handles
    SIGTERM (checked: a handler would need its own case here, one driver process each)."""
    how = signal.SIGKILL
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    # (a temporary directory of its own: the driver killed outright leaves its fork server's socket
    # directory there, engine/worker.py's _context; a short path: a socket's is limited)
    tmp = tempfile.mkdtemp(prefix="eagle3-driver-")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), TMPDIR=tmp)
    p = subprocess.Popen([sys.executable, str(script), str(tiny_dir / "kimi-k2.5")], stdout=subprocess.PIPE,
                         text=True, env=env)
    try:
        sigterm, *words = p.stdout.readline().split()
        assert sigterm == "default"  # SIGTERM kills the driver as SIGKILL does
        pids = [int(x) for x in words]
        assert pids
        p.send_signal(how)
        p.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids)
    finally:
        p.kill()
        p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# `eagle3 serve --validate` at tensor_parallel_size > 1 runs in tests/runtime/test_multinode.py: at TP=4
# over two nodes (test_serve_validate_across_two_nodes: node 0's spawned local rank joins the baseline
# group as a single node's does, beside node 1's ranks) and under torchrun. A single-node TP=2 run here
# started the same launcher path in one more serve process and rank; the single-node rejoin itself
# (LLM.close(rejoin=True), the parked rank) is test_tp2_equals_tp1_greedy_with_every_draft's.


_SHARDED = ("q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


@pytest.mark.parametrize("fmt", ["int4", "w4a8", "int4g", "mxfp4", "fp8"])
def test_each_rank_reads_only_its_shard(fmt: str, tiny_dir: Path, request: pytest.FixtureRequest,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sharded loading: a rank reads its rows / columns of every split tensor (``get_rows``) and its
    own experts, and never a whole tensor that it splits (but Quark's all-zero zero points, 1/G of
    the weight, read whole to check them); what it reads is its share of the bytes."""
    from eagle3.checkpoint import CheckpointReader
    from eagle3.runtime.loader import load_target
    from eagle3.runtime.parallel import TPGroup

    target = _source(fmt, tiny_dir, request)
    whole = load_target(target, dtype=torch.float32).checkpoint_bytes
    read_whole: list[str] = []
    get = CheckpointReader.get
    monkeypatch.setattr(CheckpointReader, "get", lambda self, name: read_whole.append(name) or get(self, name))
    per_rank = []
    for rank in (0, 1):
        read_whole.clear()
        m = load_target(target, dtype=torch.float32, tp=TPGroup(rank, 2))  # loading needs no process group
        lo, hi = m.layers[1].mlp.expert_range
        experts = {f".experts.{e}." for e in range(m.spec.n_routed_experts)}
        mine = {f".experts.{e}." for e in range(lo, hi)}
        assert not [n for n in read_whole if any(e in n for e in experts - mine)]  # other ranks' experts
        assert not [n for n in read_whole if ".experts." not in n and not n.endswith(("weight_shape", "zero_point"))
                    and any(s in n for s in _SHARDED)]
        per_rank.append(m.checkpoint_bytes)
    # Each rank reads its half of the split tensors plus the replicated ones (embedding, q_a/kv_a,
    # router, norms): well under the whole, and together no more than whole + replicated.
    assert all(b < 0.65 * whole for b in per_rank), (per_rank, whole)


def test_ranks_on_one_cpu_share_its_cores() -> None:
    """Each of a node's CPU ranks gets its share of the process's threads (OpenMP threads beyond the
    cores spin at every barrier: TP=2 with two threads a rank on 2 cores cost 18x the CPU a token)."""
    from eagle3.runtime.engine.worker import rank_threads

    torch.set_num_threads(4)
    try:
        assert [rank_threads(torch.device("cpu"), n) for n in (1, 2, 3, 8)] == [4, 2, 1, 1]
        assert rank_threads(torch.device("cuda", 1), 8) == 4  # a GPU rank's host threads stay
    finally:
        torch.set_num_threads(1)


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.split(")")[-1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _ranks_of(pid: int) -> list[int]:
    """The rank processes that process ``pid`` started: its spawned children, or its fork server's
    (engine/worker.py's _context)."""
    out = []
    for child in _children(pid):
        cmd = _cmdline(child)
        if "spawn_main" in cmd:
            out.append(child)
        elif "forkserver" in cmd:
            out += _children(child)
    return out


def test_serve_foreground_ctrl_c_stops_every_worker(tiny_dir: Path, tmp_path: Path) -> None:
    import httpx

    ready = tmp_path / "ready.json"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.Popen([sys.executable, "-m", "eagle3.cli", "serve", str(tiny_dir / "kimi-k2.5"), "--port", "0",
                          "--tensor-parallel-size", "2", "--dtype", "float32", "--ready-file", str(ready),
                          "--log-level", "warning"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready.exists(), p.stderr.read() if p.poll() is not None else "no ready file"
        url = json.loads(ready.read_text())["url"]
        assert httpx.get(url + "/v1/models").json()["data"][0]["tensor_parallel_size"] == 2
        workers = _ranks_of(p.pid)
        assert workers
        workers += _children(p.pid)  # (and whatever else it started: a fork server, a resource tracker)
        p.send_signal(signal.SIGINT)
        assert p.wait(60) is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers)
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("fmt", ["int4", "w4a8", "int4g", "mxfp4"])
def test_shard_reads_decode_to_the_slices_of_the_whole(fmt: str, tiny_dir: Path, request: pytest.FixtureRequest) -> None:
    """Every split weight read in part (rows of a column-parallel one, input columns of a
    row-parallel one) decodes to exactly those rows / columns of the whole weight."""
    from eagle3.runtime.kernels.base import dequantize
    from eagle3.runtime.loader import WeightReader, target_spec
    from eagle3.runtime.parallel import TPGroup

    target = _source(fmt, tiny_dir, request)
    spec = target_spec(target)
    whole = WeightReader(target, spec.quant, torch.float32, torch.device("cpu"))
    p = f"{spec.prefix}model.layers."
    modules = [(f"{p}1.self_attn.q_b_proj", "rows"), (f"{p}1.self_attn.kv_b_proj", "rows"),
               (f"{p}1.self_attn.o_proj", "cols"), (f"{p}0.mlp.gate_proj", "rows"), (f"{p}0.mlp.down_proj", "cols"),
               (f"{p}1.mlp.shared_experts.down_proj", "cols"), (f"{p}1.mlp.shared_experts.up_proj", "rows")]
    for rank in (0, 1):
        part = WeightReader(target, spec.quant, torch.float32, torch.device("cpu"), tp=TPGroup(rank, 2))
        for m, how in modules:
            full, act = whole.linear(m)
            n, k = full.shape
            lo, hi = TPGroup(rank, 2).split(n if how == "rows" else k)
            got, got_act = part.linear_part(m, rows=(lo, hi)) if how == "rows" else part.linear_part(m, cols=(lo, hi))
            ref = dequantize(full, torch.float32)
            ref = ref[lo:hi] if how == "rows" else ref[:, lo:hi]
            assert type(got) is type(full) and got_act == act, m
            assert torch.equal(dequantize(got, torch.float32), ref), m


# `eagle3 bench --tensor-parallel-size` runs in tests/runtime/test_multinode.py, over two nodes
# (test_bench_across_two_nodes) and under torchrun (test_bench_under_torchrun); a single-node TP=2
# bench here started the same launcher.build_llm (which spawns node 0's local ranks) as
# test_serve_validate_tp2_cli above, in one more CLI process and worker.


def test_a_size_that_does_not_split_is_refused_in_one_line_then_health_names_a_dead_worker(tiny_dir: Path) -> None:
    """(One test: the TP=2 LLM of the health check is the proof that a refused group leaves none behind.)"""
    from eagle3.errors import Eagle3Error, UsageError

    with pytest.raises(UsageError, match="tensor_parallel_size must be"):
        LLM(tiny_dir / "kimi-k2.5", tokenizer=None, tensor_parallel_size=0)
    with pytest.raises(Eagle3Error, match="4 attention heads do not split over tensor_parallel_size=3") as e:
        _llm(tiny_dir / "kimi-k2.5", tp=3)
    assert "\n" not in str(e.value)
    import torch.distributed as dist

    assert not dist.is_initialized()  # the group is gone: the next LLM can form its own
    assert not [p for p in _ranks_of(os.getpid()) if _alive(p)]  # workers stopped
    # ... and does, at once: the refused group's rendezvous (its driver's load failed while its workers
    # joined) held up the next group in this process until the collective timeout, then failed it
    _health_says_when_a_worker_died(tiny_dir)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _health_says_when_a_worker_died(tiny_dir: Path) -> None:
    """/health and the API say which rank died (the TP=2 LLM after the refused one above)."""
    import httpx

    from eagle3.serve import launcher

    torch.set_num_threads(2)  # this process's own count: the driver (rank 0) takes half while it runs
    llm = _llm(tiny_dir / "kimi-k2.5", tp=2)
    try:
        assert torch.get_num_threads() == 1
        app = launcher.build_app(llm, "tiny")
        with launcher.ServerThread(app) as url:
            assert httpx.get(url + "/health").status_code == 200
            assert httpx.get(url + "/v1/models").json()["data"][0]["tensor_parallel_size"] == 2
            proc = llm._workers.procs[0]
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            r = httpx.get(url + "/health")
            assert r.status_code == 503 and "rank 1" in r.text
            r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4},
                           timeout=60)
            assert r.status_code == 500 and "rank 1" in r.json()["error"]["message"], r.text
    finally:
        llm.close()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
    assert threads == 2  # the process's own count again
