"""Tensor parallelism across nodes, on one machine: two "nodes" on loopback, each its own ``eagle3
serve`` process tree (``--nnodes 2 --node-rank R --dist-init-addr 127.0.0.1:PORT``, gloo), TP=4 with
two ranks a node, or TP=2 with one where two would add nothing to the test's claim but two more
processes (each ~2 CPU-s of imports and loading). Node 0 serves (or is an LLM: in the first test this
test process's, so that its logits can be compared; one in a process of its own where a test kills
node 0); node 1 runs its ranks headless (its one rank in its own process at TP=2), each rank joining
every group node 0 forms, and exits when node 0 ends.

Every node is started in a session of its own, and its whole process group is killed at the end of
each test whatever happens (no orphans, even on a failure).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from eagle3.runtime.engine.llm import LLM
from eagle3.runtime.parallel import free_port
from eagle3.testing.numerics import (
    FP32_ROUTER_TOL,
    assert_greedy_agrees,
    assert_tokens_until_near_tie,
    forced_logits,
)
from tests.runtime.model_kit import single_thread
from tests.runtime.test_tensor_parallel import LOGITS_ATOL, PROMPTS, _tokens

REPO = Path(__file__).resolve().parents[2]
# Small liveness limits, so that a killed node is noticed in seconds (the defaults are for real
# clusters: 30 s heartbeat, 300 s collective timeout).
ENV = dict(os.environ, PYTHONPATH=str(REPO), EAGLE3_TP_HEARTBEAT_TIMEOUT="5", EAGLE3_TP_TIMEOUT="60")

_threads = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(autouse=True)
def _liveness_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    import eagle3.runtime.parallel as parallel

    monkeypatch.setattr(parallel, "_HB_TIMEOUT_S", 5.0)


def _serve_argv(target: Path, rank: int, port: int, *extra: str, tp: int = 4) -> list[str]:
    return [sys.executable, "-m", "eagle3.cli", "serve", str(target), "--tensor-parallel-size", str(tp), "--nnodes", "2",
            "--node-rank", str(rank), "--dist-init-addr", f"127.0.0.1:{port}", "--dtype", "float32", *extra]


@contextlib.contextmanager
def _node(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """One "node": a process tree in a session of its own, killed whole on the way out, with a
    temporary directory of its own, removed then: a node killed outright leaves its fork server's
    socket directory behind (engine/worker.py's _context; a short path: a socket's is limited)."""
    tmp = tempfile.mkdtemp(prefix="eagle3-node-")
    with log.open("wb") as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(ENV, TMPDIR=tmp),
                             start_new_session=True)
    try:
        yield p
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().split(")")[-1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def _gone(pgid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while _group(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _group(pgid)


def _wait_exit(p: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> int:
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"node did not exit: {log.read_text(errors='replace')[-3000:]}")


def _llm(target: Path, draft: Path | None, port: int) -> LLM:
    return LLM(target, draft, dtype="float32", tokenizer=None, num_blocks=64, tensor_parallel_size=4, nnodes=2,
               dist_init_addr=f"127.0.0.1:{port}")


@pytest.mark.slow
def test_tp4_over_two_nodes_equals_tp1_and_speculative_equals_plain(tiny_dir: Path, tmp_path: Path) -> None:
    """TP=4 over two nodes == TP=1 within rounding (logits over TP=1's tokens; greedy tokens up to
    the first near tie), speculative TP=4 == plain TP=4 bit for bit; each LLM closes with rejoin so
    that node 1 joins the next group. The Llama-style draft only: a draft runs on rank 0 alone, over
    the gathered aux states and logits however many nodes hold the ranks, and the MLA draft's
    TP run is test_tensor_parallel.py's (a third group here was one more rendezvous of both nodes)."""
    target = tiny_dir / "kimi-k2.5"
    one = LLM(target, dtype="float32", tokenizer=None, num_blocks=64)
    ref = _tokens(one)
    plain: list[list[int]] = []
    port = free_port()
    log = tmp_path / "node1.log"
    with _node(_serve_argv(target, 1, port), log) as node1:
        runs = [None, tiny_dir / "kimi-k2.5-eagle3"]
        for i, draft in enumerate(runs):
            llm = _llm(target, draft, port)
            try:
                if draft is None:
                    plain = _tokens(llm)
                    for j, (prompt, toks) in enumerate(zip(PROMPTS, ref, strict=True)):
                        history = prompt + toks[:-1]
                        assert_greedy_agrees(forced_logits(one.target, history), forced_logits(llm.target, history),
                                             LOGITS_ATOL, f"TP=4 vs TP=1, prompt {j}")
                    assert_tokens_until_near_tie(one.target, PROMPTS, ref, {"tp=4": plain}, LOGITS_ATOL,
                                                 FP32_ROUTER_TOL, "TP=4 vs TP=1")
                    assert llm.target.model.lm_head.out_features == llm.target.model.vocab_size // 4
                else:
                    assert _tokens(llm) == plain, draft  # speculative == plain at one TP size: bitwise
                    assert llm.stats.num_drafts > 0
            finally:
                llm.close(rejoin=i < len(runs) - 1)
        assert _wait_exit(node1, log) == 0, log.read_text(errors="replace")[-3000:]
        assert _gone(node1.pid)


@pytest.mark.slow
def test_serve_validate_across_two_nodes(tiny_dir: Path, tmp_path: Path) -> None:
    from tests.validate import lmeval

    data = lmeval.gsm8k_dir()
    report = tmp_path / "report.json"
    port = free_port()
    # two short 1-shot questions: the claim is both nodes through both groups, not the workload. TP=4,
    # two ranks a node: this is also the single-node serve --validate's case (node 0's own spawned rank
    # parked by the speculative run and joining the baseline group: launcher._served, LLM.close(rejoin)),
    # which ran as a TP=2 CLI run of its own in test_tensor_parallel.py (one more serve process and rank)
    flags = ["--draft", str(tiny_dir / "kimi-k2.5-eagle3"), "--validate", "gsm8k", "--limit", "2", "--num-fewshot",
             "1", "--max-tokens", "8", "--concurrency", "2", "--dataset", str(data)]
    target = tiny_dir / "kimi-k2.5"
    log0, log1 = tmp_path / "node0.log", tmp_path / "node1.log"
    with _node(_serve_argv(target, 1, port, *flags), log1) as node1, \
            _node(_serve_argv(target, 0, port, *flags, "--report", str(report)), log0) as node0:
        assert _wait_exit(node0, log0, 600) == 0, log0.read_text(errors="replace")[-3000:]
        out = log0.read_text(errors="replace")
        assert "result: PASS" in out, out[-3000:]
        rep = json.loads(report.read_text())
        assert rep["passed"] and rep["lossless"]["passed"] and rep["lossless"]["num_compared"] == 2
        assert rep["server"]["tensor_parallel_size"] == 4
        assert _wait_exit(node1, log1) == 0, log1.read_text(errors="replace")[-3000:]  # both runs' groups
        assert _gone(node0.pid) and _gone(node1.pid)


@dataclasses.dataclass
class _Nodes:
    node0: subprocess.Popen[bytes]
    node1: subprocess.Popen[bytes]
    url: str
    log0: Path
    log1: Path


@contextlib.contextmanager
def _two_nodes(tiny_dir: Path, tmp_path: Path, tp: int = 4) -> Iterator[_Nodes]:
    """Node 1 headless, then node 0 serving HTTP (tiny target, TP=``tp``), once node 0 is ready."""
    target, port = tiny_dir / "kimi-k2.5", free_port()
    ready, log0, log1 = tmp_path / "ready.json", tmp_path / "node0.log", tmp_path / "node1.log"
    argv0 = _serve_argv(target, 0, port, "--port", "0", "--ready-file", str(ready), "--log-level", "warning", tp=tp)
    with _node(_serve_argv(target, 1, port, tp=tp), log1) as node1, _node(argv0, log0) as node0:
        yield _Nodes(node0, node1, _wait_ready(ready, node0, log0), log0, log1)


def _wait_file(ready: Path, p: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    while not ready.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"node 0 did not start: {log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)


def _wait_ready(ready: Path, p: subprocess.Popen[bytes], log: Path) -> str:
    _wait_file(ready, p, log)
    return str(json.loads(ready.read_text())["url"])


def test_killing_node1_fails_requests_in_flight_and_health(tiny_dir: Path, tmp_path: Path) -> None:
    import httpx

    with _two_nodes(tiny_dir, tmp_path) as n:
        node0, node1, url, log0 = n.node0, n.node1, n.url, n.log0
        assert httpx.get(url + "/health").status_code == 200
        body = {"model": "kimi-k2.5", "prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        text: list[str] = []
        started = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    text.append(line)
                    started.set()
            started.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert started.wait(120)
        os.killpg(node1.pid, signal.SIGKILL)  # the whole node: its headless process (rank 2) and rank 3
        t.join(120)
        assert not t.is_alive()
        errors = [json.loads(x[6:])["error"]["message"] for x in text if x.startswith("data: {\"error\"")]
        # node 1's ranks stop together: whichever of them rank 0 finds silent first is named
        assert len(errors) == 1 and re.search(r"rank [23] \(node 1\)", errors[0]), text[-3:]
        assert "\n" not in errors[0]
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and re.search(r"rank [23] \(node 1\)", r.text), r.text
        assert _gone(node1.pid)
        workers = [pid for pid in _group(node0.pid) if pid != node0.pid]
        assert workers  # node 0's own rank 1
        node0.send_signal(signal.SIGINT)
        _wait_exit(node0, log0)
        assert _gone(node0.pid)


def test_an_idle_server_notices_a_lost_node_by_its_heartbeat(tiny_dir: Path, tmp_path: Path) -> None:
    """No step runs, so no collective fails: the heartbeat alone turns /health to 503, naming node 1's
    rank. TP=2, one rank a node: a rank's heartbeat is the same at any number a node, and naming the
    node of a node's several ranks is the test above's."""
    import httpx

    with _two_nodes(tiny_dir, tmp_path, tp=2) as n:
        node0, node1, url, log0 = n.node0, n.node1, n.url, n.log0
        assert httpx.get(url + "/health").status_code == 200
        os.killpg(node1.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (r := httpx.get(url + "/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert r.status_code == 503 and "rank 1 stopped answering" in r.text, r.text
        assert _gone(node1.pid)
        node0.send_signal(signal.SIGINT)
        _wait_exit(node0, log0)
        assert _gone(node0.pid)


# Node 0 as an LLM in a process of its own (as the first test's node 0 is this process's LLM): it
# writes READY once the group it formed with node 1 is up, then waits to be killed.
_LLM_NODE0 = """
import signal, sys
from pathlib import Path
from eagle3.runtime.engine.llm import LLM
llm = LLM(sys.argv[1], dtype="float32", tokenizer=None, num_blocks=64, tensor_parallel_size=2, nnodes=2,
          dist_init_addr=sys.argv[2])
Path(sys.argv[3]).write_text("{}")
signal.pause()
"""


def test_killing_node0_ends_node1(tiny_dir: Path, tmp_path: Path) -> None:
    # TP=2, one rank a node: each of a node's ranks watches rank 0 on its own, so one shows it (a node
    # of one rank runs it in its own process: worker.run_node). Node 0 is an LLM rather than a server:
    # what node 1 watches is rank 0 (its heartbeat, its store), whatever serves above it, and the
    # server's transformers import, tokenizer and HTTP app were ~2.5 of the test's ~5 CPU-s.
    target, port, ready = tiny_dir / "kimi-k2.5", free_port(), tmp_path / "ready"
    log0, log1 = tmp_path / "node0.log", tmp_path / "node1.log"
    argv0 = [sys.executable, "-c", _LLM_NODE0, str(target), f"127.0.0.1:{port}", str(ready)]
    with _node(_serve_argv(target, 1, port, tp=2), log1) as node1, _node(argv0, log0) as node0:
        _wait_file(ready, node0, log0)
        assert node1.poll() is None and _group(node1.pid)  # its rank joined: node 0 is ready
        os.killpg(node0.pid, signal.SIGKILL)
        assert _wait_exit(node1, log1) != 0  # its ranks lost rank 0
        assert _gone(node1.pid) and _gone(node0.pid)


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from eagle3.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    return int(e.value.code or 0), capsys.readouterr().err


@pytest.mark.parametrize(("flags", "named"), [
    (["--tensor-parallel-size", "4", "--nnodes", "2"], "--dist-init-addr"),
    (["--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "--node-rank"),
    (["--tensor-parallel-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "--tensor-parallel-size"),
    (["--tensor-parallel-size", "4", "--nnodes", "2", "--dist-init-addr", "nohostport"], "--dist-init-addr"),
    (["--tensor-parallel-size", "4", "--nnodes", "0"], "--nnodes"),
    (["--node-rank", "1"], "--node-rank"),
])
def test_bad_node_flags_are_one_line(flags: list[str], named: str, tiny_dir: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in (["serve"], ["bench"]):
        code, err = _main([*cmd, str(tiny_dir / "kimi-k2.5"), *flags], capsys)
        assert code == 2 and named in err and err.count("\n") == 1, (cmd, err)


def test_bench_across_two_nodes(tiny_dir: Path, tmp_path: Path) -> None:
    # TP=2, one rank a node: bench builds its LLM as serve does (launcher.build_llm), so node 0's
    # spawned local rank is the serving tests' (TP=4 above, TP=2 in test_tensor_parallel.py)
    report, port = tmp_path / "bench.json", free_port()
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}", "--dtype",
             "float32", "--draft", str(tiny_dir / "kimi-k2.5-eagle3"), "--input-len", "8", "--output-len", "4",
             "--num-prompts", "2"]
    bench = [sys.executable, "-m", "eagle3.cli", "bench", str(tiny_dir / "kimi-k2.5"), *flags]
    log0, log1 = tmp_path / "node0.log", tmp_path / "node1.log"
    with _node([*bench, "--node-rank", "1"], log1) as node1, \
            _node([*bench, "--node-rank", "0", "--report", str(report)], log0) as node0:
        assert _wait_exit(node0, log0, 300) == 0, log0.read_text(errors="replace")[-3000:]
        assert _wait_exit(node1, log1) == 0, log1.read_text(errors="replace")[-3000:]
        assert _gone(node0.pid) and _gone(node1.pid)
    rep = json.loads(report.read_text())
    assert rep["tensor_parallel_size"] == 2
    assert [(lv["completed"], lv["failed"]) for lv in rep["levels"]] == [(2, 0)]


def _torchrun(tmp_path: Path) -> list[str]:
    """torchrun with two ranks; its logs under the test's directory (by default it makes a
    ``torchelastic_*`` directory in the system's temporary directory and leaves it there)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
            "--log-dir", str(tmp_path / "torchrun-logs")]


def test_bench_under_torchrun(tiny_dir: Path, tmp_path: Path) -> None:
    """torchrun starts every rank (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* from its environment):
    rank 0 benchmarks, rank 1 runs headless and ends with it."""
    report = tmp_path / "bench.json"
    argv = [*_torchrun(tmp_path), "-m", "eagle3.cli", "bench", str(tiny_dir / "kimi-k2.5"), "--draft", str(tiny_dir / "kimi-k2.5-eagle3"),
            "--dtype", "float32", "--input-len", "8", "--output-len", "4", "--num-prompts", "2", "--report",
            str(report)]
    log = tmp_path / "torchrun.log"
    with _node(argv, log) as p:
        assert _wait_exit(p, log, 300) == 0, log.read_text(errors="replace")[-3000:]
        assert _gone(p.pid)
    rep = json.loads(report.read_text())
    assert rep["tensor_parallel_size"] == 2
    assert [(lv["completed"], lv["failed"]) for lv in rep["levels"]] == [(2, 0)]


@pytest.mark.slow
def test_serve_validate_under_torchrun(tiny_dir: Path, tmp_path: Path) -> None:
    """serve --validate forms two groups (speculative, then baseline): torchrun's rank 1 joins both."""
    from tests.validate import lmeval

    data = lmeval.gsm8k_dir()
    report = tmp_path / "report.json"
    argv = [*_torchrun(tmp_path), "-m", "eagle3.cli", "serve", str(tiny_dir / "kimi-k2.5"), "--draft", str(tiny_dir / "kimi-k2.5-eagle3"),
            "--dtype", "float32", "--validate", "gsm8k", "--limit", "2", "--num-fewshot", "1", "--max-tokens", "8",
            "--concurrency", "2", "--dataset", str(data), "--report", str(report)]  # short: the claim is the groups
    log = tmp_path / "torchrun.log"
    with _node(argv, log) as p:
        assert _wait_exit(p, log, 400) == 0, log.read_text(errors="replace")[-3000:]
        assert _gone(p.pid)
    rep = json.loads(report.read_text())
    assert rep["passed"] and rep["lossless"]["passed"] and rep["server"]["tensor_parallel_size"] == 2


def test_torchrun_environment_gives_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle3.cli.options import node_layout
    from eagle3.errors import UsageError

    for k, v in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                 "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    fields, headless = node_layout(1, 1, 0, None, "cuda")
    assert fields == {"tensor_parallel_size": 4, "nnodes": 4, "node_rank": 3, "dist_init_addr": "10.0.0.1:29500",
                      "device": "cuda:1"}
    assert headless == 3
    monkeypatch.setenv("RANK", "0")
    assert node_layout(4, 1, 0, None, "cpu")[1] is None  # rank 0 serves
    with pytest.raises(UsageError, match="--tensor-parallel-size 8"):
        node_layout(8, 1, 0, None, "cpu")


def test_step_channel_frames_small_and_large_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """What rank 0 sends is what a rank receives: one broadcast for a step's inputs, a second for
    whatever does not fit the first (the broadcasts replayed from a recording, no processes)."""
    import torch.distributed as dist

    from eagle3.runtime import parallel
    from eagle3.runtime.engine.model_runner import build_attn_metadata

    wire: list[bytes] = []
    monkeypatch.setattr(dist, "broadcast", lambda t, src, group=None: wire.append(bytes(t.tolist())))
    meta = build_attn_metadata([[0, 1], [2]], [0, 3], [20, 5], 16)
    msgs = [("forward", torch.arange(25), meta, (1, 2)), ("big", bytes(range(256)) * 200), ("exit", False)]
    sender = parallel.StepChannel()
    for m in msgs:
        sender.send(m)
    assert len(wire) == 4  # one broadcast each, two for the big one

    def replay(t: torch.Tensor, src: int, group: object = None) -> None:
        t.copy_(torch.tensor(list(wire.pop(0)), dtype=torch.uint8))

    monkeypatch.setattr(dist, "broadcast", replay)
    receiver = parallel.StepChannel()
    got = [receiver.recv() for _ in msgs]
    assert torch.equal(got[0][1], msgs[0][1]) and got[0][3] == (1, 2)
    assert torch.equal(got[0][2].slot_mapping, meta.slot_mapping)
    assert got[1:] == msgs[1:]


def test_a_rank_that_fails_on_its_own_is_named_with_its_error(tiny_dir: Path) -> None:
    """A rank whose step fails by its own fault (not a peer's) reports why in the store and leaves;
    rank 0 names it with that reason (here: logits asked for before any forward)."""
    llm = LLM(tiny_dir / "kimi-k2.5", dtype="float32", tokenizer=None, num_blocks=8, tensor_parallel_size=2)
    try:
        w = llm._workers
        w.broadcast(("logits", torch.tensor([0])))
        w.procs[0].join(60)
        assert w.procs[0].exitcode == 1
        assert llm.broken is not None and "rank 1 failed: AssertionError" in llm.broken, llm.broken
    finally:
        llm.close()


def test_group_generations_count_per_rendezvous_address(monkeypatch: pytest.MonkeyPatch) -> None:
    # The other nodes count the groups at node 0's address from 0 (run_node); rank 0 must count the
    # same way even when this process formed groups at other addresses before (a pytest worker, a
    # notebook): a count per process made node 0 wait under another key prefix than node 1's.
    from eagle3.runtime.engine import worker

    monkeypatch.setattr(worker, "_spawn", lambda *a, **k: [])
    monkeypatch.setattr(worker, "_GENERATIONS", {})

    def generation(addr: tuple[str, int], nnodes: int = 2) -> int:
        return worker.TPWorkers(4, "t", {}, torch.device("cpu"), nnodes=nnodes, addr=addr).generation

    assert generation(("127.0.0.1", 1111), nnodes=1) == 0  # an earlier single-node group
    assert generation(("10.0.0.1", 29500)) == 0  # the first group at node 0's address
    assert generation(("10.0.0.1", 29500)) == 1  # serve --validate's baseline group: node 1 rejoins as 1
    # A single-node group on a free port of its own is a fresh store, not counted: a later multi-node
    # group that the OS gives the same port starts at 0, as its other nodes do.
    monkeypatch.setattr(worker, "free_port", lambda: 29501)
    assert worker.TPWorkers(2, "t", {}, torch.device("cpu")).generation == 0
    assert generation(("127.0.0.1", 29501)) == 0
    # A rank spawned for a later group at an address joins that one first (then the ones after it).
    joined: list[int] = []
    monkeypatch.setattr(worker, "worker_main", lambda *a: joined.append(a[7]) or 0)
    with pytest.raises(SystemExit):
        worker._spawned_worker(1, worker.Layout(2, 2, ("10.0.0.1", 29500)), "t", {}, 1, 0, os.getpid(), 3, True)
    assert joined == [3]
