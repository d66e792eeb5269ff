"""The byte floor of a decode step (``eagle3 plan --decode-floor``): the expected distinct experts
against an enumeration, Kimi-K2.5 at TP 8 against bytes counted by hand from its shapes, and the
2-layer full-width slice against the identity "every loaded byte but the embedding table, plus the
batch's rows"."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3 import plan as P
from eagle3.cli.app import app
from eagle3.testing import slice as slice_mod

KIMI = Path(__file__).parent / "data" / "kimi-k2.5"


def test_expected_distinct_experts_matches_an_enumeration() -> None:
    # every way 3 tokens pick 2 distinct experts of 5, equally likely
    picks = list(itertools.combinations(range(5), 2))
    outcomes = [len(set(a) | set(b) | set(c)) for a, b, c in itertools.product(picks, repeat=3)]
    assert P.expected_distinct_experts(5, 2, 3) == pytest.approx(sum(outcomes) / len(outcomes), rel=1e-12)
    assert P.expected_distinct_experts(384, 8, 1) == pytest.approx(8.0)
    assert P.expected_distinct_experts(384, 8, 16) == pytest.approx(109.8, abs=0.05)
    assert P.expected_distinct_experts(384, 8, 64) == pytest.approx(284.2, abs=0.05)
    assert P.expected_distinct_experts(8, 8, 16) == 8.0  # the slice: top-8 of 8, every expert every step


@pytest.fixture(scope="module")
def kimi() -> P.Model:
    return P.load_model(KIMI)


def test_kimi_tp8_floor_by_hand(kimi: P.Model) -> None:
    f = P.decode_floor(kimi, gpus=8, batch=16, context=4096, hbm_tbps=4.8)
    h, bf = 7168, 2
    # one routed expert, INT4 group 32 (compressed-tensors): int32 codes [N, K/8], bf16 scales
    # [N, K/32], an int32 [2] shape, for gate and up (2048 x 7168) and down (7168 x 2048)
    expert = 2 * (2048 * 896 * 4 + 2048 * 224 * 2 + 8) + (7168 * 256 * 4 + 7168 * 64 * 2 + 8)
    touched = 48 * (1 - (376 / 384) ** 16)  # of the rank's 48 experts, per MoE layer
    want = {
        "routed_experts": 60 * touched * expert,
        "shared_experts": 60 * 3 * 2048 * h * bf / 8,
        "dense_mlp": 3 * 18432 * h * bf / 8,  # layer 0
        "attn_split": 61 * bf * (12288 * 1536 + 16384 * 512 + h * 8192) / 8,
        "attn_replicated": 61 * bf * (1536 * h + 576 * h + 1536 + 512),
        "router": 60 * (384 * h * bf + 384 * 4),
        "norms": (61 * 2 + 1) * h * bf,
        "embedding": 16 * h * bf,  # 16 rows, not the 2.3 GB table
        "lm_head": 163840 * h * bf / 8,
    }
    assert f.weight_bytes.keys() == want.keys()
    for k, v in want.items():
        assert f.weight_bytes[k] == pytest.approx(v, rel=1e-12), k
    assert f.experts_touched_per_rank == pytest.approx(touched)
    assert f.kv_read_bytes == 16 * 4096 * 61 * 576 * 2 and f.kv_write_bytes == 16 * 61 * 576 * 2
    assert f.total_bytes == pytest.approx(sum(want.values()) + f.kv_read_bytes + f.kv_write_bytes, rel=1e-12)
    assert f.floor_seconds == pytest.approx(f.total_bytes / 4.8e12)
    assert 20.3e9 < f.weight_bytes["routed_experts"] < 20.5e9  # ~340 MB a layer (the "about 350 MB")
    # fp8 KV halves the cache's bytes and nothing else
    f8 = P.decode_floor(kimi, gpus=8, batch=16, context=4096, kv_cache_dtype="fp8")
    assert f8.kv_read_bytes * 2 == f.kv_read_bytes and f8.weight_bytes == f.weight_bytes and f8.floor_seconds is None


def test_slice_floor_is_every_loaded_byte_but_the_embedding_table(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(slice_mod.slice_config(2, 8)))
    m = P.load_model(tmp_path)
    p = P.plan(m, gpus=1, gpu_memory=2**40)
    table = 163840 * 7168 * 2
    for batch in (1, 16):
        f = P.decode_floor(m, gpus=1, batch=batch, context=48)
        assert f.experts_touched_per_rank == 8.0
        weights = p.max_weights_per_rank - table + batch * 7168 * 2
        assert f.total_bytes == pytest.approx(weights + (48 + 1) * batch * 2 * 576 * 2, rel=1e-12)
    assert 3.8e9 < P.decode_floor(m, batch=1).total_bytes < 3.9e9  # lm_head 2.35 GB + dense MLP 0.79 GB + ...


def test_cli_prints_and_reports_the_floor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["plan", str(KIMI), "--gpus", "8", "--gpu", "h200", "--decode-floor", "1,16",
                            "--context", "4096", "--report", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    assert "decode floor" in r.output and "4.8 TB/s" in r.output and "13.7 of 48" in r.output
    rep = json.loads((tmp_path / "p.json").read_text())
    assert [f["batch"] for f in rep["decode_floor"]] == [1, 16]
    assert rep["decode_floor"][0]["experts_touched_per_rank"] == pytest.approx(1.0)
    from eagle3.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plan", str(KIMI), "--gpu", "h200", "--decode-floor", "0,x"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--decode-floor '0,x'" in err, err
