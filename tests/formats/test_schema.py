"""Every tiny fixture and every eagle3 output passes its architecture's schema; deleting, renaming or
reshaping any single tensor of it fails, with one line naming the tensor (header-only: fast)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eagle3.checkpoint import CheckpointReader
from eagle3.formats.check import check_checkpoint, check_reader
from eagle3.formats.model_config import parse_config
from eagle3.testing.tiny import MODEL_NAMES

OUTPUTS = [("convert", "kimi-k2.5-eagle3", e) for e in ("vllm", "sglang", "atom", "speculators")] + \
          [("convert", "kimi-k2.6-eagle3.1-mla", e) for e in ("vllm", "sglang", "atom")] + \
          [("quantize", "kimi-k2.5-eagle3", "int4-draft"), ("quantize", "kimi-k2.6-eagle3.1-mla", "fp8-draft"),
           ("quantize", "kimi-k2.5-eagle3-d2t", "int4-draft"), ("quantize", "speculators-eagle3", "fp8-draft"),
           ("quantize", "kimi-k2.5", "w4a8"), ("quantize", "kimi-k2.5", "mxfp4")]
TARGET_OUTPUTS = ("kimi-k2.5-w4a8", "kimi-k2.5-mxfp4", "target-text-only")
# a target's sampled tensors: every tensor of a dense and a MoE layer, the embedding, the head and a
# vision block (the other layers repeat them; all of them would be slow on 2 cores)
TARGET_SAMPLE = ("language_model.model.layers.0.", "language_model.model.layers.1.",
                 "language_model.model.layers.6.", "model.layers.0.", "model.layers.1.", "model.layers.6.",
                 "language_model.model.embed", "model.embed", "language_model.lm_head", "lm_head",
                 "language_model.model.norm", "model.norm", "vision_tower.encoder.blocks.0.", "mm_projector.")


@pytest.fixture(scope="module")
def outputs(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from eagle3.convert import convert
    from eagle3.quantize import quantize

    base = tmp_path_factory.mktemp("schema-out")
    out = {}
    for cmd, model, how in OUTPUTS:
        dst = base / f"{model}-{how}"
        if cmd == "convert":
            convert(tiny_dir / model, dst, engine=how, target=str(tiny_dir / "kimi-k2.5"), progress=False)
        else:
            # verify=False: the same tensors and config.json byte for byte (verifying only measures
            # each tensor's decode and adds the report's rows and plot), and the schema reads no more
            quantize(tiny_dir / model, dst, how, workers=1, verify=False)
        out[dst.name] = dst
    dst = base / "target-text-only"
    convert(tiny_dir / "kimi-k2.5", dst, text_only=True, progress=False)
    out[dst.name] = dst
    return out


def _headers(d: Path) -> dict[str, dict[str, Any]]:
    import struct

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        out[f.name] = json.loads(raw[8:8 + n])
    return out


def _config(d: Path) -> tuple[dict[str, Any], Any]:
    """``d``'s config.json and its typed form (read once for all of a checkpoint's mutations: they
    change only the headers)."""
    cfg = json.loads((d / "config.json").read_text())
    typed, probs = parse_config(cfg, d / "config.json")
    assert typed is not None and not probs, probs
    return cfg, typed


def _problems(d: Path, headers: dict[str, dict[str, Any]], config: tuple[dict[str, Any], Any] | None = None) -> list[str]:
    cfg, typed = config or _config(d)
    reader = CheckpointReader.from_headers(d, headers)
    return [str(p) for p in check_reader(cfg, typed, d / "config.json", reader)]


def _compact(h: dict[str, Any]) -> dict[str, Any]:
    """Offsets laid end to end again after a tensor was taken out (the header stays valid)."""
    out, pos = {}, 0
    for name, ent in sorted(((k, v) for k, v in h.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]):
        n = ent["data_offsets"][1] - ent["data_offsets"][0]
        out[name] = {**ent, "data_offsets": [pos, pos + n]}
        pos += n
    return out


def _mutations(headers: dict[str, dict[str, Any]], sample: tuple[str, ...] | None = None,
               most: int | None = None) -> list[tuple[str, str, dict[str, dict[str, Any]]]]:
    """(what, tensor, headers) with one tensor deleted, renamed or reshaped (same byte size), for the
    tensors whose names start with ``sample`` (None: all); ``most``: about that many, evenly spread
    over that list (every kind of tensor, each mutation kind). Only the mutations kept are built: a
    deletion re-lays the shard's offsets, and a target's shard holds thousands of tensors."""
    picked = [(fname, name, what) for fname, h in headers.items() for name in h
              if name != "__metadata__" and (sample is None or name.startswith(sample))
              for what in ("delete", "rename", "reshape")]
    if most is not None:
        picked = picked[:: max(1, len(picked) // most)]
    out = []
    for fname, name, what in picked:
        h = headers[fname]
        ent = h[name]
        rest = {k: v for k, v in h.items() if k != name}
        if what == "delete":
            out.append((what, name, {**headers, fname: _compact(rest)}))
        elif what == "rename":
            out.append((what, name, {**headers, fname: {**rest, name + "_x": ent}}))
        else:
            shape = ent["shape"]
            n = 1
            for s in shape:
                n *= s
            new = [n, 1] if len(shape) != 2 or shape[1] != 1 else [1, n]
            out.append((what, name, {**headers, fname: {**rest, name: {**ent, "shape": new}}}))
    return out


@pytest.fixture
def schema_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each config's schema built once per test, not once per mutation: ``schema_for`` is a pure
    function of the config (and, for a draft, of the tensor names, which pick its spelling), and
    the checks only read the Schema (frozen; check.py copies what it adjusts). The hundreds of checks
    of one checkpoint rebuilt the same schema, and the same hint schemas, each time (~2/3 of their CPU)."""
    from eagle3.formats import check
    from eagle3.formats.model_config import DraftConfig

    real, built = check.schema_for, {}

    def once(cfg: dict[str, Any], typed: Any, where: str = "config.json", names: set[str] | None = None) -> Any:
        key = (json.dumps(cfg, sort_keys=True), where,
               frozenset(names or ()) if isinstance(typed, DraftConfig) else None)
        if key not in built:
            built[key] = real(cfg, typed, where, names)
        return built[key]

    monkeypatch.setattr(check, "schema_for", once)


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_every_tiny_fixture_passes_its_schema(tiny_dir: Path, model: str) -> None:
    assert [str(p) for p in check_checkpoint(tiny_dir / model)] == []


def test_every_output_passes_its_schema(outputs: dict[str, Path]) -> None:
    bad = {k: [str(p) for p in check_checkpoint(d)] for k, d in outputs.items()}
    assert {k: v for k, v in bad.items() if v} == {}


def _assert_each_mutation_fails(d: Path, sample: tuple[str, ...] | None = None, most: int | None = None) -> None:
    headers, config = _headers(d), _config(d)
    assert _problems(d, headers, config) == []
    muts = _mutations(headers, sample, most)
    assert muts
    for what, name, h in muts:
        if what == "delete" and name in ("t2d", "embed_tokens.weight"):
            continue  # optional in drafts (SpecForge drops embed_tokens; engines skip t2d)
        probs = _problems(d, h, config)
        assert probs, f"{d.name}: {what} {name} passed the schema"
        assert all("\n" not in p for p in probs)
        assert any(name in p for p in probs), f"{d.name}: {what} {name}: {probs}"


@pytest.mark.parametrize("model", [m for m in MODEL_NAMES if "eagle3" in m])
def test_single_tensor_change_of_a_draft_fails(tiny_dir: Path, model: str, schema_once: None) -> None:
    _assert_each_mutation_fails(tiny_dir / model)


def test_single_tensor_change_of_outputs_fails(outputs: dict[str, Path], schema_once: None) -> None:
    for d in outputs.values():
        if d.name in TARGET_OUTPUTS:
            _assert_each_mutation_fails(d, TARGET_SAMPLE, most=120)
        else:
            _assert_each_mutation_fails(d)


def test_single_tensor_change_of_the_target_fails(tiny_dir: Path, schema_once: None) -> None:
    # every tensor of a layer, the embedding, head and a vision block (the other layers repeat them)
    d = tiny_dir / "kimi-k2.5"
    headers = _headers(d)
    keep = ("language_model.model.layers.1.", "language_model.model.layers.6.", "language_model.model.embed",
            "language_model.lm_head", "vision_tower.encoder.blocks.0.", "mm_projector.")
    muts, config = _mutations(headers, keep), _config(d)
    assert len(muts) > 100
    for what, name, h in muts:
        probs = _problems(d, h, config)
        assert any(name in p for p in probs), f"{what} {name}: {probs}"


def test_inspect_lists_problems_and_strict_exits_2(tiny_dir: Path, tmp_path: Path, capsys: Any) -> None:
    import shutil

    from eagle3.cli import main

    d = tmp_path / "m"
    shutil.copytree(tiny_dir / "kimi-k2.5-eagle3", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = "1e-6"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(d)])
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    assert "schema problem:" in out and "rms_norm_eps" in out
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(d), "--strict"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rms_norm_eps" in err[0] and "config.json" in err[0]
