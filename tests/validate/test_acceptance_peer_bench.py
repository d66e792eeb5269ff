"""benchmarks/acceptance_peer.py's own machinery: vLLM's metric snapshot -> counters, the acceptance
summary, the token agreement, the figure, --help and the vLLM-failure message. vLLM is never
imported (the benchmark drives it in its own environment); no model is loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.bench_module import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("acceptance_peer")


@dataclass
class _Metric:  # the fields of vllm.v1.metrics.reader.Counter / Vector
    name: str
    labels: dict = field(default_factory=dict)
    value: int = 0
    values: list = field(default_factory=list)


def test_vllm_metric_snapshot_to_counters() -> None:
    drv = load_benchmark("acceptance_peer_vllm")
    snap = [_Metric("vllm:spec_decode_num_drafts", value=10), _Metric("vllm:spec_decode_num_draft_tokens", value=30),
            _Metric("vllm:spec_decode_num_accepted_tokens", value=17),
            _Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[8, 6, 3]),
            _Metric("vllm:num_requests_running", value=0)]
    # two label sets (engines) are summed
    snap += [_Metric("vllm:spec_decode_num_drafts", {"engine": "1"}, value=2),
             _Metric("vllm:spec_decode_num_accepted_tokens_per_pos", {"engine": "1"}, values=[1, 0, 0])]
    assert drv.spec_counters(snap) == {"num_drafts": 12, "num_draft_tokens": 30, "num_accepted_tokens": 17,
                                       "accepted_per_pos": [9, 6, 3]}


def test_spec_summary_uses_vllm_definitions(bench) -> None:
    s = bench._spec_summary({"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 15,
                             "accepted_per_pos": [8, 5]}, 3)
    assert s["acceptance_rate"] == 0.5 and s["mean_acceptance_length"] == 2.5
    assert s["accepted_per_pos"] == [8, 5, 0] and s["per_position_acceptance"] == [0.8, 0.5, 0.0]
    empty = bench._spec_summary({"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}, 2)
    assert empty["acceptance_rate"] is None and empty["per_position_acceptance"] == [None, None]


def test_agreement(bench) -> None:
    a = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    b = [[1, 2, 3, 4], [5, 6, 0, 8], [1, 9]]
    g = bench.agreement(a, b)
    assert g["identical_prompts"] == 1 and g["num_prompts"] == 3
    assert g["common_prefix_tokens"] == [4, 2, 0] and g["first_divergence"] == [None, 2, 0]
    assert g["mean_common_prefix"] == 2.0 and g["prefix_token_fraction"] == 6 / 10
    with pytest.raises(ValueError):
        bench.agreement(a, b[:2])


def test_figure(bench, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    spec = bench._spec_summary({"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6,
                                "accepted_per_pos": [3, 2, 1]}, 3)
    res = {"k": 3, "max_tokens": 4, "label": "x", "eagle3": {"spec": spec}, "vllm": {"spec": spec},
           "agreement": {"plain": bench.agreement([[1, 2, 3, 4]], [[1, 2, 0, 0]])}}
    assert bench.figure(tmp_path / "f.png", res)
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_help_has_an_example() -> None:
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "acceptance_peer.py"), "--help"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0
    assert "--vllm-python" in p.stdout and "acceptance_peer.py ./tiny/kimi-k2.5-trained ./draft-mla" in p.stdout


def test_vllm_failure_names_the_log(bench, tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ValueError: no MLA backend'\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(SystemExit) as e:
        bench.run_vllm(str(fake), tmp_path / "t", None, [[1, 2]], 4, 3, "bfloat16", tmp_path, tmp_path / "v.log", 60)
    msg = str(e.value)
    assert "exit code 3" in msg and str(tmp_path / "v.log") in msg and "no MLA backend" in msg
    req = json.loads((tmp_path / "vllm-plain-request.json").read_text())
    assert req["draft"] is None and req["prompts"] == [[1, 2]] and req["max_model_len"] == 256
