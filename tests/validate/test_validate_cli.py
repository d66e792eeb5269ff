"""``eagle3 validate --base-url`` end to end: report, figure, lossless check, thresholds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eagle3.cli import main
from tests.validate import lmeval

COMMON = ["--limit", "6", "--num-fewshot", "1", "--max-tokens", "12", "--concurrency", "3"]


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(["validate", "--dataset", str(lmeval.gsm8k_dir()), *args])
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out, out.err


def test_report_figure_and_lossless(spec_server: Any, plain_server: Any, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.json"
    code, out, err = _run(["--base-url", spec_server[0], "--baseline-url", plain_server[0], *COMMON,
                           "--report", str(report)], capsys)
    assert code == 0, out + err
    r = json.loads(report.read_text())
    assert r["passed"] and r["failures"] == [] and r["n_samples"] == 6 and r["num_fewshot"] == 1
    assert r["lossless"]["checked"] and r["lossless"]["passed"] and r["lossless"]["num_compared"] == 6
    spec = r["speculative"]
    assert spec["source"] == "eagle3" and spec["num_speculative_tokens"] == 3
    assert 0 <= spec["acceptance_rate"] <= 1 and 1 <= spec["mean_acceptance_length"] <= 4
    assert sum(spec["accepted_histogram"]) == spec["num_drafts"] > 0
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(r["latency"][key]) >= {"mean", "median", "p99"}
    assert r["latency"]["tpot_ms"]["mean"] > 0 and r["throughput"]["output_throughput"] > 0
    assert r["baseline"]["latency"]["tpot_ms"]["mean"] > 0 and r["speedup"]["tpot"] > 0
    assert r["baseline"]["accuracy"] == r["accuracy"]
    assert [s["doc_id"] for s in r["samples"]] == list(range(6))
    assert all(s["completion_tokens"] >= 1 and s["error"] is None for s in r["samples"])
    fig = Path(r["figure"])
    assert fig == tmp_path / "r.png" and fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "lossless (greedy output identical without speculation): PASS" in out
    assert "acceptance rate" in out and "result: PASS" in out
    # an existing report is not replaced silently
    code, _, err = _run(["--base-url", spec_server[0], *COMMON, "--report", str(report)], capsys)
    assert code == 2 and "--overwrite" in err


def test_lossless_mismatch_fails(spec_server: Any, other_server: Any, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.json"
    code, out, _ = _run(["--base-url", spec_server[0], "--baseline-url", other_server[0], *COMMON,
                         "--report", str(report)], capsys)
    assert code == 1
    r = json.loads(report.read_text())
    assert not r["passed"] and not r["lossless"]["passed"]
    assert r["lossless"]["num_mismatches"] == 6
    first = r["lossless"]["mismatches"][0]
    assert first["doc_id"] == 0 and first["speculative"] != first["baseline"]
    assert "lossless check failed" in out and "result: FAIL" in out


def test_thresholds(spec_server: Any, plain_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["--base-url", spec_server[0], *COMMON, "--min-accuracy", "0.5",
                         "--min-acceptance", "0.0"], capsys)
    assert code == 1 and "< --min-accuracy 0.5" in out and "acceptance rate" in out
    code, out, _ = _run(["--base-url", spec_server[0], *COMMON, "--min-acceptance", "0.999"], capsys)
    assert code == 1 and "< --min-acceptance 0.999" in out
    code, out, _ = _run(["--base-url", plain_server[0], *COMMON, "--min-acceptance", "0.1"], capsys)
    assert code == 1 and "reports no speculative acceptance" in out
    code, out, _ = _run(["--base-url", plain_server[0], *COMMON, "--min-accuracy", "0"], capsys)
    assert code == 0 and "speculative: no counters" in out


def test_usage_errors(spec_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["--base-url", spec_server[0], "--task", "mmlu"], capsys)
    assert code == 2 and "gsm8k" in err
    code, _, err = _run(["--base-url", spec_server[0], "--min-accuracy", "7"], capsys)
    assert code == 2 and "--min-accuracy" in err


def test_unreachable_server_fails_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["--base-url", "http://127.0.0.1:9", "--limit", "2", "--max-tokens", "4"], capsys)
    assert code == 1 and "2 request(s) failed" in out
