"""Speculative counters from Prometheus text: vLLM / eagle3 / ATOM counters, SGLang gauges."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from eagle3.validate import metrics_client as mc

VLLM = """# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {d}
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {t}
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {a}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {p0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {p1}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="2"}} {p2}
"""


def test_vllm_delta() -> None:
    before = VLLM.format(d=10, t=30, a=15, p0=8, p1=5, p2=2)
    # this run: 100 drafts of 3, accepted 0/1/2/3 tokens in 20/30/25/25 of them
    after = VLLM.format(d=110, t=330, a=15 + 30 + 50 + 75, p0=8 + 80, p1=5 + 50, p2=2 + 25)
    s = mc.spec_delta(before, after)
    assert s["source"] == "vllm" and s["num_drafts"] == 100 and s["num_draft_tokens"] == 300
    assert s["acceptance_rate"] == pytest.approx(155 / 300)
    assert s["mean_acceptance_length"] == pytest.approx(1 + 155 / 100)
    assert s["per_position_acceptance"] == pytest.approx([0.8, 0.5, 0.25])
    assert s["accepted_histogram"] == pytest.approx([20, 30, 25, 25])
    assert s["accepted_distribution"] == pytest.approx([0.2, 0.3, 0.25, 0.25])


def test_atom_counters() -> None:
    text = "\n".join([
        'atom:mtp_draft_tokens_total{dp_rank="0"} 300',
        'atom:mtp_accepted_tokens_total{dp_rank="0"} 155',
        *(f'atom:mtp_decode_steps_total{{accepted_tokens="{j}",dp_rank="0"}} {n}'
          for j, n in enumerate([20, 30, 25, 25])), ""])
    s = mc.spec_delta(None, text)
    assert s["source"] == "atom" and s["num_drafts"] == 100
    assert s["accepted_per_pos"] == [80, 50, 25]
    assert s["accepted_histogram"] == [20, 30, 25, 25]
    assert s["mean_acceptance_length"] == pytest.approx(2.55)


def test_sglang_gauges_and_nothing() -> None:
    s = mc.spec_delta("", 'sglang:spec_accept_length{tp_rank="0"} 3.04\nsglang:spec_accept_rate{tp_rank="0"} 0.68\n')
    assert s["mean_acceptance_length"] == pytest.approx(3.04) and s["acceptance_rate"] == pytest.approx(0.68)
    assert "not a delta" in s["source"]
    assert mc.spec_delta("", "process_cpu_seconds_total 1.0\n") is None
    assert mc.spec_delta(None, None) is None


def test_eagle3_server_counters_match_the_engine(spec_server: Any) -> None:
    """The /metrics deltas equal the engine's own SpecStats deltas, histogram included."""
    url, llm = spec_server
    before_text = mc.scrape(url)
    before = llm.stats.as_dict()
    for i in range(3):
        r = httpx.post(url + "/v1/completions", json={"prompt": f"count {i}:", "max_tokens": 25, "temperature": 0},
                       trust_env=False, timeout=60)
        assert r.status_code == 200
    after = llm.stats.as_dict()
    s = mc.spec_delta(before_text, mc.scrape(url))
    assert s["source"] == "eagle3"
    assert s["num_drafts"] == after["num_drafts"] - before["num_drafts"] > 0
    assert s["num_accepted_tokens"] == after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert s["accepted_histogram"] == [a - b for a, b in zip(after["accepted_hist"], before["accepted_hist"], strict=True)]


def test_scrape_without_metrics_endpoint() -> None:
    assert mc.scrape("http://127.0.0.1:9") is None


def test_clients_share_one_verification_context_and_bypass_proxies_on_loopback(monkeypatch: pytest.MonkeyPatch,
                                                                                  tmp_path: Any) -> None:
    """Every client and one-off request of a validation uses the process's one SSL context (not a
    fresh read of the CA bundle each), and a loopback server is reached without the environment's
    proxies; a remote server's context honours SSL_CERT_FILE as httpx's own default does."""
    import ssl

    from eagle3.validate.endpoint import client_options, tls

    local, remote = client_options("http://127.0.0.1:8000/v1"), client_options("https://api.example.com/v1")
    assert local["trust_env"] is False and remote["trust_env"] is True
    assert isinstance(remote["verify"], ssl.SSLContext) and client_options("https://other.example/v1") == remote
    assert local["verify"] is tls(False) and remote["verify"] is tls(True)
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "missing.pem"))
    tls.cache_clear()
    try:
        with pytest.raises(FileNotFoundError):  # the variable is read, as httpx's own default reads it
            tls(True)
    finally:
        tls.cache_clear()
