"""The fp8 KV cache (``kv_cache_dtype="fp8"``, eagle3/runtime/kv_cache.py) in the torch reference:

* the quantizer against an independent rounding (every fp8 code enumerated: nearest value, ties to
  the even code, saturation at the largest finite value) and the dequantization vLLM documents
  (``value = code * scale``);
* attention over an fp8 cache equals attention over the dequantized cache in fp32 (the scales are
  folded out of the products: a few fp32 ulps), MLA latent and Llama K/V with their own scales;
* speculative greedy equals plain greedy with the same fp8 cache, chain and tree, bit for bit;
* kv scales read from compressed-tensors and Quark checkpoints; bad ones refused in one line;
* the refusals (an unknown name, bf16 under another model dtype, a loaded model in another format);
* ``/health`` and the memory plan show about twice bf16's tokens.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from eagle3.errors import FormatError, UsageError
from eagle3.runtime import kv_cache
from eagle3.runtime.engine.config import EngineConfig
from eagle3.runtime.engine.llm import LLM
from eagle3.runtime.engine.model_runner import build_attn_metadata
from eagle3.runtime.kernels import get_backend
from eagle3.runtime.sampling import SamplingParams
from eagle3.testing import tiny, trained
from eagle3.testing.kv_scales import with_kv_scales
from tests.runtime.model_kit import single_thread

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz]
TARGET, DRAFT, MLA_DRAFT = trained.NAME, "kimi-k2.5-trained-eagle3", "kimi-k2.5-trained-eagle3.1-mla"
BE = get_backend("torch")

_threads = pytest.fixture(scope="module", autouse=True)(single_thread)


def _rne_reference(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round ``x`` to ``dtype``'s values without torch's cast: the nearest of every finite code's
    value, ties to the code with an even mantissa, beyond the largest finite value saturated."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    vals = codes.float().double()
    finite = torch.isfinite(vals)
    codes, vals = torch.arange(256)[finite], vals[finite]
    top = float(vals.max())
    xs = x.double().clamp(-top, top)
    dist = (xs[:, None] - vals[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best
    even = (codes % 2 == 0)[None, :] & tied
    pick = torch.where(even.any(1), even.float().argmax(1), tied.float().argmax(1))
    return vals[pick].float()


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_quantize_matches_an_independent_rounding(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    top = torch.finfo(dtype).max
    x = torch.cat([torch.randn(4000, generator=g) * 3, torch.tensor([0.0, -0.0, 1e-9, 1e30, -1e30, math.inf])])
    scale = 0.0123
    codes = kv_cache.quantize(x, dtype, scale)
    assert codes.dtype == dtype and bool(torch.isfinite(codes.float()).all())  # saturated, never inf / NaN
    torch.testing.assert_close(codes.float(), _rne_reference(x.float() / scale, dtype), rtol=0, atol=0)
    # the dequantization vLLM and compressed-tensors define: value = code * scale
    assert torch.equal(kv_cache.dequantize(codes, scale), codes.float() * scale)
    assert float(kv_cache.quantize(torch.tensor([1e30]), dtype, scale).float()) == top


def test_names_and_formats() -> None:
    assert kv_cache.canonical("fp8") == "fp8_e4m3" and kv_cache.canonical("auto") == "auto"
    assert kv_cache.fp8_dtype("fp8_e5m2", torch.device("cpu")) == torch.float8_e5m2
    assert kv_cache.storage_scale(0.5, torch.float8_e4m3fnuz) == 1.0  # fnuz: the checkpoint scale doubled
    for bad in ("fp16", "int8", "FP8", None):
        with pytest.raises(UsageError, match=r"kv_cache_dtype \(--kv-cache-dtype\) must be one of auto, bf16, fp8"):
            EngineConfig(kv_cache_dtype=bad)


def _mla_case(seed: int = 0):
    tables, starts, counts = [[3, 0, 5], [2, 7], [4, 1, 6, 8]], [9, 2, 12], [1, 4, 3]
    meta = build_attn_metadata(tables, starts, counts, 4)
    g = torch.Generator().manual_seed(seed)
    return meta, torch.randn(40, 48, generator=g) * 2, torch.randn(meta.num_tokens, 1, 4, 48, generator=g)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_attention_over_fp8_equals_attention_over_its_values(dtype: torch.dtype) -> None:
    """write_cache quantizes; attention over the codes (scales folded out) equals attention over
    the dequantized values stored as fp32 (a few fp32 ulps: where the scale multiplies)."""
    meta, lat, q = _mla_case()
    cache = torch.zeros(40, 48, dtype=dtype)
    BE.write_cache(cache, torch.arange(40), lat, 0.03)
    assert torch.equal(cache.view(torch.uint8), kv_cache.quantize(lat, dtype, 0.03).view(torch.uint8))
    deq = kv_cache.dequantize(cache, 0.03)
    got = BE.attention(q, cache[:, None], cache[:, None, :32], meta, 0.2, k_scale=0.03, v_scale=0.03)
    want = BE.attention(q, deq[:, None], deq[:, None, :32], meta, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the Llama draft's [S, 2, Hkv, D] cache: K and V each with their own scale
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(40, 2, 2, 16, generator=g)
    c8 = torch.zeros(40, 2, 2, 16, dtype=dtype)
    BE.write_cache(c8, torch.arange(40), kv, (0.01, 0.05))
    deq = torch.stack([kv_cache.dequantize(c8[:, 0], 0.01), kv_cache.dequantize(c8[:, 1], 0.05)], 1)
    q = torch.randn(meta.num_tokens, 2, 3, 16, generator=g)
    got = BE.attention(q, c8[:, 0], c8[:, 1], meta, 0.25, k_scale=0.01, v_scale=0.05)
    torch.testing.assert_close(got, BE.attention(q, deq[:, 0], deq[:, 1], meta, 0.25), rtol=1e-5, atol=1e-5)


def test_slot_minus_one_is_skipped_and_rows_move_as_bits() -> None:
    from eagle3.runtime.interfaces import compact_tree_kv

    cache = torch.zeros(2, 4, 8, dtype=torch.float8_e4m3fn)
    vals = torch.arange(24, dtype=torch.float32).view(3, 8) / 7
    BE.write_cache(cache.view(8, 8), torch.tensor([1, -1, 2]), vals)
    flat = cache.view(8, 8)
    assert torch.equal(flat[1].float(), kv_cache.quantize(vals[0], cache.dtype, 1.0).float())
    assert float(flat[0].float().abs().sum()) == 0.0
    compact_tree_kv([cache], [0, 1], 4, 0, [2])  # node 2's row moves to position 1
    assert torch.equal(flat[1].view(torch.uint8), flat[2].view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
ENGINE = {"num_blocks": 96, "max_num_seqs": 4, "tokenizer": None, "dtype": "bfloat16", "block_size": 4}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fp8pair") / "tiny"
    tiny.make_tiny(out, only=[TARGET, DRAFT, MLA_DRAFT])
    return out


def _prompts() -> list[list[int]]:
    tok = tiny.build_tokenizer()
    return [tok.encode(trained.gsm8k_style_prompt(q)).ids for q in trained.QUESTIONS[:2]]


@pytest.fixture(scope="module")
def plain_fp8(pair: Path) -> tuple[LLM, list[list[int]]]:
    llm = LLM(pair / TARGET, None, kv_cache_dtype="fp8", **ENGINE)
    assert llm.target.kv_cache_spec().dtype == torch.float8_e4m3fn
    return llm, [o.token_ids for o in llm.generate(_prompts(), GREEDY)]


@pytest.mark.parametrize(("draft", "kw"), [(DRAFT, {}), (MLA_DRAFT, {"speculative_eagle_topk": 3,
                                                                      "speculative_num_draft_tokens": 8})],
                         ids=["llama-chain", "mla-tree"])
def test_speculative_greedy_equals_plain_greedy_with_fp8(pair: Path, plain_fp8, draft: str, kw: dict) -> None:
    """The same fp8 cache (the target's latent and the draft's K/V or latent): a token's codes do
    not depend on the batch (static scales), so verify rows are decode rows bit for bit."""
    target, want = plain_fp8
    llm = LLM(target.target, pair / draft, num_speculative_tokens=3, kv_cache_dtype="fp8", **ENGINE, **kw)
    assert llm.draft.kv_cache_spec().dtype == torch.float8_e4m3fn
    assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == want
    assert llm.stats.mean_acceptance_length > 1.5


def test_a_loaded_model_must_match_the_format(plain_fp8, pair: Path) -> None:
    target, _ = plain_fp8
    with pytest.raises(UsageError, match="target was loaded with kv_cache_dtype='fp8_e4m3'"):
        LLM(target.target, None, **ENGINE)
    with pytest.raises(UsageError, match="needs the bfloat16 model dtype"):
        LLM(pair / TARGET, None, **dict(ENGINE, dtype="float32"), kv_cache_dtype="bf16")


# ---------------------------------------------------------------------------------------------
# scales from checkpoints
# ---------------------------------------------------------------------------------------------


def test_kv_scales_are_read_from_checkpoints(pair: Path, tiny_dir: Path, tmp_path: Path) -> None:
    """compressed-tensors k_scale / v_scale on the target (the latent takes the larger), Quark
    output_scale on kv_b_proj (a Quark target) and on k_proj / v_proj (a Quark Llama draft, K and
    V their own); then speculative greedy == plain greedy through those scales."""
    from eagle3.runtime.loader import load_draft, load_target
    from tests.runtime.model_kit import requantize_target
    from tests.runtime.test_loader import _ptpc_fp8_draft

    ct = with_kv_scales(pair / TARGET, tmp_path / "ct", "compressed-tensors",
                        lambda m, which: 0.01 if which == "k" else 0.02 + 0.001 * int(m.split(".")[3]))
    model = load_target(ct, kv_cache_dtype="fp8")
    assert model.kv_scales() == pytest.approx([0.02, 0.021, 0.022, 0.023])
    assert load_target(ct).kv_scales() == [1.0] * 4  # auto: a float cache, no scale
    k_only = with_kv_scales(pair / TARGET, tmp_path / "ct-k", "compressed-tensors",
                            lambda m, which: 0.25 if which == "k" else None)
    assert load_target(k_only, kv_cache_dtype="fp8").kv_scales() == [0.25] * 4  # not max(0.25, a default 1.0)

    qt = with_kv_scales(requantize_target(tiny_dir / "kimi-k2-thinking", tmp_path / "qt0", "mxfp4"), tmp_path / "qt",
                        "quark", lambda m, which: 0.004 * (1 + int(m.split(".")[2])))
    _ptpc_fp8_draft(tiny_dir / "kimi-k2.5-eagle3", tmp_path / "qd0", tmp_path / "qd0-ref")
    qd = with_kv_scales(tmp_path / "qd0", tmp_path / "qd", "quark", lambda m, which: 0.03 if "k_proj" in m else 0.05)
    target = load_target(qt, kv_cache_dtype="fp8")
    want = [float(torch.tensor(0.004 * (1 + i)).to(torch.bfloat16)) for i in range(7)]  # stored as bf16 scalars
    assert target.kv_scales() == pytest.approx(want)
    draft = load_draft(qd, target)
    assert draft.kv_format.fp8 and draft.kv_scales() == pytest.approx((0.03, 0.05), rel=4e-3)

    prompts = [[5, 17, 300, 42, 9], [9, 8, 7, 6, 5, 4, 3, 700]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kw = dict(ENGINE, num_blocks=32)
    plain = [o.token_ids for o in LLM(target, None, kv_cache_dtype="fp8", **kw).generate(prompts, params)]
    spec = LLM(target, draft, num_speculative_tokens=3, kv_cache_dtype="fp8", **kw)
    assert [o.token_ids for o in spec.generate(prompts, params)] == plain


def _serve_error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    from eagle3.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(("value", "match"), [
    (torch.tensor([0.0]), "must be finite and > 0, got 0.0"), (torch.tensor([-0.5]), "must be finite and > 0"),
    (torch.tensor([math.inf]), "must be finite and > 0, got inf"), (torch.tensor([math.nan]), "got nan"),
    (torch.tensor([0.1, 0.2]), "k_scale"),
], ids=["zero", "negative", "inf", "nan", "shape"])
def test_a_bad_scale_is_one_line(pair: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 value: torch.Tensor, match: str) -> None:
    name = "language_model.model.layers.2.self_attn.k_scale"
    bad = with_kv_scales(pair / TARGET, tmp_path / "bad", "compressed-tensors", extra={name: value})
    err = _serve_error(capsys, ["serve", str(bad), "--kv-cache-dtype", "fp8", "--port", "0"])
    assert match in err and "k_scale" in err, err
    from eagle3.runtime.loader import load_target

    with pytest.raises(FormatError, match=r"k_scale'?: a KV cache scale must be"):  # the Python API: the loader's check
        load_target(bad, kv_cache_dtype="fp8")


def test_serve_refusals_are_one_line(pair: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _serve_error(capsys, ["serve", str(pair / TARGET), "--kv-cache-dtype", "fp16", "--port", "0"])
    assert err.startswith("error: --kv-cache-dtype must be one of auto, bf16, fp8") and "fp8_e5m2" in err, err
    err = _serve_error(capsys, ["serve", str(pair / TARGET), "--kv-cache-dtype", "bf16", "--dtype", "float32",
                                "--port", "0"])
    assert "needs the bfloat16 model dtype" in err


# ---------------------------------------------------------------------------------------------
# what a user sees: /health and the plan
# ---------------------------------------------------------------------------------------------


def test_health_and_plan_show_twice_the_tokens(pair: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import httpx

    from eagle3.cli import main
    from eagle3.serve import launcher

    health = {}
    for kv in ("bf16", "fp8"):
        llm = LLM(pair / TARGET, pair / DRAFT, kv_cache_dtype=kv, kv_cache_memory=8 << 20, dtype="bfloat16",
                  tokenizer=None, max_num_seqs=64)
        with launcher.ServerThread(launcher.build_app(llm, "t")) as url:
            health[kv] = httpx.get(url + "/health").json()
        launcher.close_llm(llm)
    bf, f8 = health["bf16"], health["fp8"]
    assert bf["kv_cache_storage"] == "bfloat16" and f8["kv_cache_dtype"] == "fp8_e4m3"
    assert f8["kv_cache_storage"] == "float8_e4m3fn" and f8["kv_bytes_per_token"] * 2 == bf["kv_bytes_per_token"]
    assert 1.95 < f8["kv_tokens_total"] / bf["kv_tokens_total"] <= 2.0
    assert f8["kv_tokens_free"] == f8["kv_tokens_total"]

    tokens = {}
    for kv in ("auto", "fp8"):
        with pytest.raises(SystemExit) as e:
            main(["serve", str(pair / TARGET), "--draft", str(pair / DRAFT), "--plan", "--dry-run", "--gpu", "h200",
                  "--tensor-parallel-size", "1", "--kv-cache-dtype", kv])
        out = capsys.readouterr().out
        assert not e.value.code, out
        line = next(ln for ln in out.splitlines() if ln.startswith("KV cache"))
        tokens[kv] = int(line.rsplit("->", 1)[1].split()[0].replace(",", ""))
        assert ("at fp8" in line) == (kv == "fp8"), line
    assert 1.99 < tokens["fp8"] / tokens["auto"] <= 2.0


def test_serve_validate_fp8(pair: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``eagle3 serve T --draft D --kv-cache-dtype fp8 --validate gsm8k`` on the trained pair (the
    bundled runtime, torch backend): lossless PASS, the fp8 cache in the report's server section.
    Kept to 2 questions x 24 tokens, 1-shot prompts (~400 tokens: a prefill over many blocks of the
    fp8 cache all the same; the default 5-shot ones were 4x the prefill, which was most of the CPU);
    docs/kernels.md has the 8 x 96 (and 32 x 96) measurement."""
    import json

    from eagle3.cli import main

    report = tmp_path / "fp8.json"
    with pytest.raises(SystemExit) as e:
        main(["serve", str(pair / TARGET), "--draft", str(pair / DRAFT), "--kv-cache-dtype", "fp8", "--validate",
              "gsm8k", "--limit", "2", "--max-tokens", "24", "--num-fewshot", "1", "--report", str(report)])
    out = capsys.readouterr()
    assert not e.value.code, out.out + out.err
    r = json.loads(report.read_text())
    assert r["passed"] and r["lossless"]["passed"] and r["lossless"]["num_compared"] == 2
    server = r["server"]
    assert server["kv_cache_dtype"] == "fp8_e4m3" and server["kv_cache_storage"] == "float8_e4m3fn"
    assert server["kv_bytes_per_token"] == 4 * 576 + 2 * 2 * 64  # 4 layers' latents + the Llama draft's K, V
    assert r["speculative"]["acceptance_rate"] > 0.5


def test_a_cache_tape_gives_the_other_target_the_references_codes(tiny_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Two implementations whose latents differ by rounding store different fp8 codes where a value
    sits on a rounding boundary: here the second target's latents are perturbed (2^-14, relative),
    which flips codes and moves its logits by far more than fp32 rounding; replaying the first's
    codes (numerics.CacheTape) gives it the first's cache, and so its logits, bit for bit."""
    from eagle3.testing.numerics import CacheTape, forced_logits

    kw = dict(tokenizer=None, dtype="float32", num_blocks=8, block_size=4, kv_cache_dtype="fp8")
    target = LLM(tiny_dir / "kimi-k2.5", None, **kw).target
    history = [9, 8, 7, 6, 5, 4, 3, 2, 1, 700, 12, 5, 17]
    tape = CacheTape()
    with tape.record(target):
        want = forced_logits(target, history)
    assert tape.codes and all(c.dtype == torch.uint8 for c in tape.codes)
    quantize = kv_cache.quantize
    gen = torch.Generator().manual_seed(0)
    monkeypatch.setattr(kv_cache, "quantize", lambda v, dtype, scale: quantize(
        v.float() * (1 + 2.0 ** -14 * torch.randn(v.shape, generator=gen)), dtype, scale))
    assert float((forced_logits(target, history) - want).abs().max()) > 1e-3  # flipped codes
    with tape.replay(target):
        assert torch.equal(forced_logits(target, history), want)
    assert "write_cache" not in vars(target.backend)  # the patch is gone
