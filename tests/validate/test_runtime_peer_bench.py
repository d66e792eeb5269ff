"""benchmarks/runtime_peer.py's own machinery: the configurations, the medians and the auto-vs-best
table from given runs, the figure, --help and its one required choice (vLLM or --no-peer). No model
is loaded and vLLM is never imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_module import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("runtime_peer")


def _run(seconds: float, outputs: list[list[int]], drafts: int = 0, accepted: int = 0, per_pos=None, hist=None):
    spec = None
    if drafts:
        spec = {"num_drafts": drafts, "num_draft_tokens": 2 * drafts, "num_accepted_tokens": accepted,
                "accepted_per_pos": per_pos}
    run = {"seconds": seconds, "outputs": outputs, "spec": spec}
    if hist is not None:
        run["k_histogram"] = hist
    return run


def test_summary_medians_lossless_and_auto_against_the_best(bench) -> None:
    assert bench.configs((1, 2), True) == ["plain", "k1", "k2", "auto"]
    out = [[1, 2, 3]]
    raw = {"eagle3": {
        "plain": {1: [_run(2.0, out), _run(1.0, out), _run(4.0, out)]},
        "k1": {1: [_run(1.0, out, 4, 3, [3, 0])] * 3},
        "k2": {1: [_run(0.5, out, 4, 6, [4, 2]), _run(0.5, out, 4, 6, [4, 2]), _run(0.5, [[9]], 4, 6, [4, 2])]},
        "auto": {1: [_run(0.625, out, 4, 6, [4, 2], [1, 0, 3])] * 3},
    }}
    s = bench.summarize(raw, [1], 10, 2)
    t = s["table"]["eagle3"]
    assert t["plain"][1]["median_tok_s"] == pytest.approx(5.0)  # 10 tokens in the median 2 s
    assert t["k2"][1]["median_tok_s"] == pytest.approx(20.0) and t["k2"][1]["lossless"] is False
    assert t["k1"][1]["lossless"] is True
    assert t["auto"][1]["k_histogram"] == [3, 0, 9]
    spec = t["k2"][1]["spec"]
    assert spec["acceptance_rate"] == pytest.approx(18 / 24) and spec["per_position_acceptance"] == [1.0, 0.5]
    row = s["auto_vs_best"][1]
    assert row["best_static"] == "k2" and row["auto_over_best"] == pytest.approx(0.8)
    assert row["auto_over_plain"] == pytest.approx(3.2)


def test_figure(bench, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = [[1]]
    raw = {"eagle3": {c: {1: [_run(1.0, out)], 4: [_run(2.0, out)]} for c in ("plain", "k1")},
           "vllm": {c: {1: [_run(1.0, out)], 4: [_run(1.0, out)]} for c in ("plain", "k1")}}
    result = {"batches": [1, 4], "summary": bench.summarize(raw, [1, 4], 8, 1), "label": "x"}
    assert result["summary"]["eagle3_over_vllm"]["plain"][4] == pytest.approx(0.5)
    assert bench.figure(tmp_path / "f.png", result) and (tmp_path / "f.png").stat().st_size > 0


def test_help_and_the_peer_choice() -> None:
    script = str(ROOT / "benchmarks" / "runtime_peer.py")
    p = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "--no-peer" in p.stdout and "--vllm-python" in p.stdout
    p = subprocess.run([sys.executable, script, "t", "d"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--vllm-python" in p.stderr


def test_auto_runs_with_its_own_ceiling(bench, monkeypatch: pytest.MonkeyPatch) -> None:
    # --max-speculative-tokens is auto's ceiling even when a static k above it runs too; the auto
    # histogram is padded to the largest k so the per-batch sums line up.
    from eagle3.runtime.engine import llm as llm_mod

    made: list[dict] = []

    class Policy:
        histogram = [0, 0, 0]

    class FakeLLM:
        draft = object()

        def __init__(self, target, draft, **opts) -> None:
            made.append(opts)
            self.policy = Policy() if opts.get("num_speculative_tokens") == "auto" else None
            self.stats = type("S", (), {"as_dict": lambda s: {"num_drafts": 0, "num_draft_tokens": 0,
                                                                 "num_accepted_tokens": 0, "accepted_per_pos": [0] * 4}})()

        def generate(self, prompts, params):
            if self.policy is not None:
                self.policy.histogram = [a + b for a, b in zip(self.policy.histogram, [1, 0, 2], strict=True)]
            return [type("O", (), {"token_ids": [1]})() for _ in prompts]

        def reset_stats(self) -> None:
            pass

    monkeypatch.setattr(llm_mod, "LLM", FakeLLM)
    runs = bench.Eagle3Runs(Path("t"), Path("d"), [[1, 2]], 4, 4, "float32", "torch", auto_max=2)
    run = runs.run("auto", 1)
    assert made[0]["max_speculative_tokens"] == 2
    assert run["k_histogram"] == [1, 0, 2, 0, 0]
