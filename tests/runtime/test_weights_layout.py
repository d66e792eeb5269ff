"""The loader reads each Linear in the layout the checkpoint's config gives it, the same layout the
schema checks (:func:`eagle3.formats.sizing.resolver`, :func:`eagle3.formats.schema.stored_format`),
instead of guessing it from the tensors' dtypes:

* every Linear of every tiny fixture and of every quantize recipe's output loads as the canonical
  weight of its schema layout, reading exactly the tensors the schema lists for it;
* a tensor that contradicts the config (an FP8 ``weight`` under a W4A8 config, Quark-style words
  under a compressed-tensors one) is refused by the checker and by the loader with one line naming
  it, where a dtype probe would have decoded it as another format.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from eagle3.checkpoint import CheckpointReader, CheckpointWriter
from eagle3.errors import CheckpointError, Eagle3Error, FormatError
from eagle3.formats import codecs, detect, sizing
from eagle3.formats.check import check_checkpoint
from eagle3.quantize import quantize
from eagle3.runtime.config import QuantSpec
from eagle3.runtime.kernels.base import DenseWeight, FP8Weight, Int4Weight, MXFP4Weight
from eagle3.runtime.loader import WeightReader, load_target

KIND = {sizing.DENSE: DenseWeight, sizing.CT_INT4: Int4Weight, sizing.QUARK_INT4: Int4Weight,
        sizing.QUARK_W4A8: Int4Weight, sizing.QUARK_MXFP4: MXFP4Weight, sizing.FP8_BLOCK: FP8Weight,
        sizing.CT_FP8: FP8Weight, sizing.QUARK_FP8: FP8Weight}
FIXTURES = ("kimi-k2-thinking", "kimi-k2.5", "kimi-k2.5-eagle3", "kimi-k2.5-eagle3-d2t", "kimi-k2.6-eagle3.1-mla",
            "speculators-eagle3")
RECIPES = (("kimi-k2.5", "w4a8"), ("kimi-k2.5", "mxfp4"), ("kimi-k2.5-eagle3", "int4-draft"),
           ("kimi-k2.5-eagle3", "fp8-draft"))


@pytest.fixture(scope="module")
def recipe_outputs(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for model, recipe in RECIPES:
        out[f"{model}:{recipe}"] = root / f"{model}-{recipe}"
        quantize(tiny_dir / model, out[f"{model}:{recipe}"], recipe, workers=1)
    return out


def _reader(d: Path) -> WeightReader:
    cfg = detect.load_config(d)
    return WeightReader(d, QuantSpec.from_config(sizing.quantization_config(cfg), str(d)), torch.float32,
                        torch.device("cpu"))


def _linears(d: Path) -> list[tuple[str, sizing.LinearFormat]]:
    """(module, the config's layout) of every Linear the checkpoint holds (a draft's decoder layer
    in either spelling; the K2.5 wrapper's vision tower is never loaded)."""
    cfg = detect.load_config(d)
    fmt = sizing.resolver(cfg)
    names = set(CheckpointReader(d).names())
    out = []
    for w in sizing.logical_weights(cfg):
        if w.kind != "linear" or w.name.startswith(("vision_tower.", "mm_projector.")):
            continue
        m = w.name
        if not any(n.startswith(m + ".") for n in names) and m.startswith("midlayer."):
            m = "layers.0." + m.removeprefix("midlayer.")
        out.append((m, fmt(w.name, "linear")))
    return out


def _check_every_linear(d: Path) -> set[str]:
    """Load every Linear; each is its layout's weight kind, read from exactly its layout's tensors
    (or the dense weight a mixed-precision export left). Returns the layouts seen."""
    assert [str(p) for p in check_checkpoint(d)] == []
    wr = _reader(d)
    seen = set()
    for m, fmt in _linears(d):
        w, _ = wr.linear(m)
        stored = wr.format_of(m)
        assert stored.scheme in (fmt.scheme, sizing.DENSE), (m, stored, fmt)
        assert isinstance(w, KIND[stored.scheme]), (m, stored.scheme, type(w).__name__)
        expected = {f"{m}.{p}" for p in sizing.linear_params(stored)}
        read = {n for n in wr.used if n.startswith(m + ".")} - {f"{m}.bias"}
        assert read == expected, (m, read, expected)
        seen.add(stored.scheme)
    return seen


@pytest.mark.parametrize("name", FIXTURES)
def test_every_fixture_linear_loads_in_its_schema_layout(tiny_dir: Path, name: str) -> None:
    seen = _check_every_linear(tiny_dir / name)
    assert seen
    if name in ("kimi-k2-thinking", "kimi-k2.5"):
        assert sizing.CT_INT4 in seen  # the routed experts


@pytest.mark.parametrize("case", [f"{m}:{r}" for m, r in RECIPES])
def test_every_quantized_linear_loads_in_its_schema_layout(recipe_outputs: dict[str, Path], case: str) -> None:
    seen = _check_every_linear(recipe_outputs[case])
    want = {"w4a8": sizing.QUARK_W4A8, "mxfp4": sizing.QUARK_MXFP4, "int4-draft": sizing.QUARK_INT4,
            "fp8-draft": sizing.QUARK_FP8}[case.split(":")[1]]
    assert want in seen


# --- tensors that contradict the config -------------------------------------------------------


def _rewrite(src: Path, dst: Path, edit: dict[str, torch.Tensor | None]) -> Path:
    """A copy of ``src`` with tensors replaced, added, or (None) dropped."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    r = CheckpointReader(src)
    with CheckpointWriter(dst) as w:
        for n in r.names():
            if n not in edit:
                w.add(n, r.get(n))
        for n, t in edit.items():
            if t is not None:
                w.add(n, t)
    return dst


def _one_line(e: pytest.ExceptionInfo[BaseException], *names: str) -> None:
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in names), msg


def test_fp8_weight_under_a_w4a8_config_is_refused_not_decoded_as_fp8(recipe_outputs: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    src = recipe_outputs["kimi-k2.5:w4a8"]
    wr = _reader(src)
    m = next(m for m, f in _linears(src) if f.scheme == sizing.QUARK_W4A8)
    dense = torch.randn(wr.reader.info(f"{m}.weight_scale_2").shape[0], wr.reader.info(f"{m}.weight").shape[1] * 8)
    # a well-formed FP8 per-tensor weight (what a probe would happily decode) where W4A8 words belong
    q8 = codecs.fp8_quantize(dense, torch.tensor(0.01))
    d = _rewrite(src, tmp_path / "fp8-in-w4a8", {f"{m}.weight": q8})
    assert any(f"{m}.weight" in str(p) for p in check_checkpoint(d))
    with pytest.raises(FormatError) as e:
        _reader(d).linear(m)
    _one_line(e, f"{m}.weight", "quark-w4a8")
    with pytest.raises(FormatError) as e:  # a tensor-parallel part: the same error, not another decode
        _reader(d).linear_part(m, rows=(0, 8))
    _one_line(e, f"{m}.weight", "quark-w4a8")


def test_quark_words_under_a_compressed_tensors_config_are_refused(tiny_dir: Path, tmp_path: Path) -> None:
    src = tiny_dir / "kimi-k2.5"
    m = next(m for m, f in _linears(src) if f.scheme == sizing.CT_INT4)
    r = CheckpointReader(src)
    n, k = (int(x) for x in r.get(f"{m}.weight_shape").tolist())
    words = codecs.quark_int4_pack(torch.zeros(n, k, dtype=torch.int8), reorder=True)
    d = _rewrite(src, tmp_path / "quark-in-ct", {f"{m}.weight_packed": None, f"{m}.weight_shape": None,
                                                 f"{m}.weight": words, f"{m}.weight_scale": torch.ones(n)})
    assert check_checkpoint(d)
    with pytest.raises(CheckpointError) as e:
        _reader(d).linear(m)
    _one_line(e, f"{m}.weight_packed", "ct-int4")


def test_load_target_refuses_it_too(recipe_outputs: dict[str, Path], tmp_path: Path) -> None:
    """``load_target`` (what ``LLM`` and ``serve`` run): one line naming the checkpoint and tensor."""
    src = recipe_outputs["kimi-k2.5:w4a8"]
    m = next(m for m, f in _linears(src) if f.scheme == sizing.QUARK_W4A8)
    d = _rewrite(src, tmp_path / "i8", {f"{m}.weight": torch.zeros(8, 8, dtype=torch.int8)})
    with pytest.raises(Eagle3Error) as e:
        load_target(d, torch.float32)
    _one_line(e, str(d), f"{m}.weight")
