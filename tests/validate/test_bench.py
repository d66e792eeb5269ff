"""Serving benchmark: vLLM's metric definitions on known numbers, and ``eagle3 bench`` end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from eagle3.cli import main
from eagle3.validate.bench import RequestResult, compute_metrics, parse_levels
from tests.validate import lmeval


def test_metrics_definitions() -> None:
    rs = [RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, itl=[0.05, 0.05, 0.1], latency=0.3),
          RequestResult(ok=True, prompt_tokens=20, output_tokens=1, ttft=0.2, itl=[], latency=0.2),
          RequestResult(ok=True, prompt_tokens=30, output_tokens=3, ttft=0.3, itl=[0.4], latency=0.9),
          RequestResult(ok=False, error="HTTP 400: no")]
    m = compute_metrics(rs, duration=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 4.5 and m["total_token_throughput"] == 34.5
    tpots = [(0.3 - 0.1) / 4, (0.9 - 0.3) / 2]  # the 1-token request has no TPOT
    assert m["tpot_ms"]["mean"] == pytest.approx(1000 * np.mean(tpots))
    assert m["tpot_ms"]["p99"] == pytest.approx(1000 * np.percentile(tpots, 99))
    assert m["ttft_ms"]["median"] == pytest.approx(200)
    assert m["itl_ms"]["mean"] == pytest.approx(1000 * np.mean([0.05, 0.05, 0.1, 0.4]))
    assert m["e2el_ms"]["mean"] == pytest.approx(1000 * np.mean([0.3, 0.2, 0.9]))
    assert m["concurrency"] == pytest.approx(1.4 / 2.0)
    assert m["errors"] == ["HTTP 400: no"]
    assert parse_levels("1, 4,16") == (1, 4, 16)


def _bench(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(["bench", *args])
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out, out.err


def test_bench_random_against_a_server(spec_server: Any, tiny_dir: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "bench.json"
    code, out, err = _bench(["--base-url", spec_server[0], "--tokenizer", str(tiny_dir / "kimi-k2.5"),
                             "--input-len", "24", "--output-len", "8", "--num-prompts", "6", "--concurrency", "1,3",
                             "--report", str(report)], capsys)
    assert code == 0, out + err
    r = json.loads(report.read_text())
    assert [lv["max_concurrency"] for lv in r["levels"]] == [1, 3]
    for lv in r["levels"]:
        assert lv["completed"] == 6 and lv["failed"] == 0
        assert lv["total_output_tokens"] == 6 * 8  # ignore_eos: exactly output-len tokens each
        assert 6 * 12 <= lv["total_input_tokens"] <= 6 * 36
        assert lv["tpot_ms"]["mean"] > 0 and lv["ttft_ms"]["p99"] >= lv["ttft_ms"]["median"]
        assert 0 <= lv["speculative"]["acceptance_rate"] <= 1
    assert "TPOT ms" in out and "out tok/s" in out


def test_bench_gsm8k_prompts(plain_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _bench(["--base-url", plain_server[0], "--dataset", "gsm8k", "--dataset-path",
                             str(lmeval.gsm8k_dir()), "--num-prompts", "3", "--output-len", "6"], capsys)
    assert code == 0, out + err
    assert "3 gsm8k prompts" in out


def test_bench_usage_errors(spec_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _bench(["--base-url", spec_server[0]], capsys)
    assert code == 2 and "--tokenizer" in err
    code, _, err = _bench([], capsys)
    assert code == 2 and "--base-url" in err
    code, _, err = _bench(["--base-url", spec_server[0], "--concurrency", "0"], capsys)
    assert code == 2 and "--concurrency" in err
