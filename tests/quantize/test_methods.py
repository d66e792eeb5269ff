"""``--method``: how a quantized weight's numbers are chosen inside the recipe's format.

The data-free scale search (``mse``, W4A8's default) against independent references (a brute-force
fine grid of steps, every exponent tried per block), the format it writes (byte layout, config,
tensors: only the numbers differ from round to nearest), and the errors of the option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3.checkpoint import CheckpointReader, read_header, read_json
from eagle3.cli import main
from eagle3.formats import codecs
from eagle3.quantize import quantize
from eagle3.quantize.pipeline import resolve_method
from eagle3.quantize.recipes import load_recipe
from eagle3.quantize.scale_search import int4_per_channel, mxfp4_exponents
from tests.quantize.conftest import case_id

W4A8 = case_id(("kimi-k2.5", "w4a8", None))


def _lattice(rows: int, k: int, seed: int, heavy: bool = False) -> torch.Tensor:
    """fp32 rows on Moonshot's INT4 group-32 lattice (what a Kimi source's experts decode to)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=g) * 0.02
    if heavy:  # uneven input channels, a few large groups
        w *= torch.exp(torch.randn(1, k, generator=g))
    packed, scale = codecs.ct_int4_quantize(w.bfloat16(), 32)
    return codecs.ct_int4_dequantize(packed, scale, (rows, k), dtype=torch.float32)


def _row_err(x: torch.Tensor, step: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    q = torch.clamp(torch.round(x / step[:, None]), -8, 7)
    e = (x - q * step[:, None]) ** 2
    return (e if w is None else e * w).sum(1)


def _brute_force(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """The smallest error over 600 steps from 0.1 to 1.1 times amax / 7.5 (per row)."""
    amax = x.abs().amax(1)
    return torch.stack([_row_err(x, amax * (r / 7.5), w) for r in torch.linspace(0.1, 1.1, 600).tolist()]).amin(0)


@pytest.mark.parametrize("heavy", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_int4_step_search_against_brute_force(heavy: bool, weighted: bool) -> None:
    x = _lattice(48, 1024, 1 + heavy, heavy)
    w = torch.rand(1024, generator=torch.Generator().manual_seed(5)) + 0.1 if weighted else None
    s1 = codecs.fp8_per_tensor_scale(x.abs().amax(), torch.float32)
    codes, s2 = int4_per_channel(x, w, s1)
    step = s2 * s1
    # the codes are round to nearest of the stored scales' product (what loaders dequantize with)
    assert torch.equal(codes.float(), torch.clamp(torch.round(x / step[:, None]), -8, 7))
    got = _row_err(x, step, w)
    rtn_step = _row_err(x, x.abs().amax(1) / 7.5, w)
    best = _brute_force(x, w)
    assert torch.all(got <= rtn_step * (1 + 1e-5))  # never worse than round to nearest's step
    assert got.sum() <= 1.1 * best.sum() and torch.all(got <= 1.5 * best)  # a screened search, near the best
    assert got.sum() < 0.75 * rtn_step.sum()  # and far better on such rows
    # Quark's actual round to nearest (through the FP8 stage) is no better than its step's error
    packed, _, rs2 = codecs.w4a8_quantize(x, True, torch.float32, s1)
    rtn = ((x - codecs.w4a8_dequantize(packed, s1, rs2, 1024)) ** 2 * (1 if w is None else w)).sum()
    assert got.sum() < 0.75 * rtn


def test_mxfp4_exponent_search_against_every_exponent() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=g) * torch.exp(torch.randn(64, 512, generator=g))  # outliers in blocks
    e = mxfp4_exponents(x)
    blocks = x.reshape(64, 16, 32)
    even = codecs.mxfp4_scale_even(blocks.abs().amax(-1))

    def err(ex: torch.Tensor) -> torch.Tensor:
        sc = torch.exp2(ex.double()).float()[..., None]
        return ((codecs.fp4_decode(codecs.fp4_encode(blocks / sc)) * sc - blocks) ** 2).sum(-1)

    errs = torch.stack([err(even + d) for d in (-1, 0, 1)])
    assert torch.equal(err(e), errs.amin(0)) and (e != even).any()
    assert torch.equal(e[errs[1] == errs.amin(0)], even[errs[1] == errs.amin(0)])  # even wins ties
    packed, scale = codecs.mxfp4_quantize(x, exponents=e)
    assert torch.equal(scale.to(torch.int32) - 127, e)
    # On Moonshot's INT4 group-32 lattice the even exponent is already the best of the three.
    lat = _lattice(64, 512, 4, heavy=True)
    assert torch.equal(mxfp4_exponents(lat), codecs.mxfp4_scale_even(lat.reshape(64, 16, 32).abs().amax(-1)))


def _headers(d: Path) -> dict[str, object]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        infos, _ = read_header(f)
        out[f.name] = {n: (i.dtype, i.shape, i.offset) for n, i in infos.items()}
    return out


def test_w4a8_default_is_the_search_in_the_same_format(tiny_dir: Path, native_runs: dict[str, Path],
                                                      tmp_path: Path) -> None:
    out = tmp_path / "mse"
    res = quantize(tiny_dir / "kimi-k2.5", out, "w4a8", workers=1)
    rtn = native_runs[W4A8]
    assert res.method == "mse" and load_recipe("w4a8").method == "mse"
    assert _headers(out) == _headers(rtn)  # names, dtypes, shapes, byte offsets
    assert read_json(out / "config.json") == read_json(rtn / "config.json")
    a, b = CheckpointReader(out), CheckpointReader(rtn)
    changed = [n for n in a.names() if not torch.equal(a.get(n).reshape(-1).view(torch.uint8),
                                                      b.get(n).reshape(-1).view(torch.uint8))]
    assert changed and all(n.endswith((".weight", ".weight_scale_2")) and ".experts." in n for n in changed)
    rep_mse = json.loads((out / "quantization_report.json").read_text())
    rep_rtn = json.loads((rtn / "quantization_report.json").read_text())
    assert rep_mse["method"] == "mse" and rep_rtn["method"] == "rtn"
    err = {r["module"]: r["rel_error"] for r in rep_rtn["tensors"]}
    assert all(r["rel_error"] <= err[r["module"]] for r in rep_mse["tensors"])
    assert rep_mse["summary"]["all"]["mean_rel_error"] < 0.9 * rep_rtn["summary"]["all"]["mean_rel_error"]


def test_method_resolution_and_errors(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert resolve_method(load_recipe("w4a8"), "quark", None).name == "rtn"  # Quark computes its own numbers
    assert resolve_method(load_recipe("mxfp4"), "native", None).name == "rtn"
    assert resolve_method(load_recipe("mxfp4"), "native", "mse").name == "mse"
    bad_recipe = tmp_path / "r.yaml"
    bad_recipe.write_text("name: r\nmethod: fancy\nweight: {format: int4}\nscope: {include: ['*']}\n")
    src, draft = str(tiny_dir / "kimi-k2.5"), str(tiny_dir / "kimi-k2.5-eagle3")
    cases = [
        ([src, "--recipe", "w4a8", "--method", "gptx"], "--method 'gptx': choose one of rtn, mse, gptq"),
        ([src, "--recipe", "w4a8", "--method", "mse", "--engine", "quark"], "--engine quark computes Quark's round"),
        ([draft, "--recipe", "fp8-draft", "--method", "mse"], "mse does not cover"),
        ([draft, "--recipe", str(bad_recipe)], f"{bad_recipe}: field 'method'"),
    ]
    for args, msg in cases:
        with pytest.raises(SystemExit) as e:
            main(["quantize", args[0], str(tmp_path / "o"), *args[1:]])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and len(err.strip().splitlines()) == 1, (args, err)
        assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_a_registered_method_gets_each_modules_rows_and_input_stats(tiny_dir: Path, native_runs: dict[str, Path],
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The plug-in point of calibrated methods: ``register`` a Method, and ``quantize(input_stats=)``
    hands it every module's whole-row blocks with that module's InputStats."""
    from eagle3.quantize import methods

    calls: dict[str, tuple[int, str]] = {}

    class Recording:
        name, description = "recording", "round to nearest, recording what it is given"

        def supports(self, spec):  # type: ignore[no-untyped-def]
            return True

        def rows(self, x, ctx):  # type: ignore[no-untyped-def]
            assert x.shape[1] == ctx.shape[1] and ctx.s1 is not None  # whole rows; W4A8's FP8 stage chosen
            calls[ctx.inputs.source] = (calls.get(ctx.inputs.source, (0, ""))[0] + x.shape[0], ctx.spec.format)
            return methods.RTN.rows(x, ctx)

    monkeypatch.setitem(methods.METHODS, "recording", Recording())

    def stats(module: str) -> methods.InputStats:
        return methods.InputStats(hessian=torch.eye(4), source=module)

    res = quantize(tiny_dir / "kimi-k2.5", tmp_path / "o", "w4a8", workers=1, method="recording", input_stats=stats)
    assert res.method == "recording" and len(calls) == res.quantized
    assert all(fmt == "fp8_int4" and rows > 0 for rows, fmt in calls.values())
    a, b = CheckpointReader(tmp_path / "o"), CheckpointReader(native_runs[W4A8])
    assert all(torch.equal(a.get(n).reshape(-1).view(torch.uint8), b.get(n).reshape(-1).view(torch.uint8))
               for n in b.names())
