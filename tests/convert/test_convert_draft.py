"""``eagle3 convert`` on EAGLE-3 / 3.1 drafts, through the CLI.

Every tiny draft fixture goes to every engine profile and back to the canonical ``eagle3`` form:
tensors stay bit-identical (names mapped), the output satisfies the engine's loader rules
(engine_rules.py, written from the engines' loaders independently of the converter) and the engine
would capture the same physical aux layers as the source.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3.testing import tiny
from tests.convert import engine_rules
from tests.convert.helpers import cli, load_all
from tests.formats import builders as b

ENGINES = ("vllm", "sglang", "atom", "speculators", "eagle3")
# What no engine-side layout can represent: ATOM has no d2t (its lm_head has vocab_size rows), and
# the speculators format has no MLA layer. These must fail with a one-line error (test below).
IMPOSSIBLE = {("kimi-k2.5-eagle3-d2t", "atom"), ("speculators-eagle3", "atom"), ("kimi-k2.6-eagle3.1-mla", "speculators")}
PAIRS = [(f, e) for f in tiny.DRAFTS for e in ENGINES if (f, e) not in IMPOSSIBLE]
PHYSICAL_AUX = list(tiny.AUX_LAYER_IDS)  # (2, 3, 4) input convention = outputs of layers 1, 2, 3

def same_bits(a: torch.Tensor, b_: torch.Tensor) -> bool:
    return a.dtype == b_.dtype and a.shape == b_.shape and torch.equal(
        a.contiguous().view(torch.uint8), b_.contiguous().view(torch.uint8))


def canonical(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


@pytest.fixture(scope="module")
def converted(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, Path]]:
    """(fixture, engine) -> (engine output, that output converted back to eagle3)."""
    root = tmp_path_factory.mktemp("conv")
    target = str(tiny_dir / "kimi-k2.5")
    out = {}
    for f, e in PAIRS:
        d1 = root / f"{f}--{e}"
        cli(str(tiny_dir / f), str(d1), "--engine", e, "--target", target)
        d2 = root / f"{f}--{e}--eagle3"
        cli(str(d1), str(d2), "--engine", "eagle3")
        out[(f, e)] = (d1, d2)
    return out


@pytest.mark.parametrize("fixture,engine", PAIRS)
def test_round_trip_bit_identical(converted: dict, tiny_dir: Path, fixture: str, engine: str) -> None:
    d1, d2 = converted[(fixture, engine)]
    src = load_all(tiny_dir / fixture)
    via_engine = load_all(d1)
    back = load_all(d2)
    want = {canonical(n): t for n, t in src.items() if n != "t2d"}
    assert set(back) == set(want)
    for n, t in want.items():
        assert same_bits(back[n], t), n
    # The engine's own file holds the same bytes under its names.
    assert {canonical(n) for n in via_engine if n != "t2d"} == set(want)
    for n, t in via_engine.items():
        if n == "t2d":
            assert same_bits(t, src["t2d"])  # speculators: regenerated from d2t == SpecForge's mask
            continue
        assert same_bits(t, want[canonical(n)]), n


@pytest.mark.parametrize("fixture,engine", PAIRS)
def test_engine_loader_rules(converted: dict, fixture: str, engine: str) -> None:
    d1, d2 = converted[(fixture, engine)]
    problems, seen = engine_rules.LOADERS[engine](d1)
    assert problems == []
    assert seen["aux_input_ids"] == PHYSICAL_AUX  # the engine captures the layers the draft was trained on
    if engine == "sglang":
        assert seen["aux_input_ids_old_sglang"] == PHYSICAL_AUX  # output ids starting at 1 work on every SGLang
    src_cfg = engine_rules.config(converted[(fixture, "eagle3")][0])  # fixture -> eagle3 directly
    back = engine_rules.config(d2)
    assert engine_rules.eagle3_load(d2)[0] == []
    assert back["eagle_aux_hidden_state_layer_ids"] == PHYSICAL_AUX
    assert seen["fc_norm"] == back["fc_norm"] and seen["norm_output"] == back["norm_output"]
    assert seen["norm_before_residual"] == back["norm_before_residual"] is False
    assert back == src_cfg  # the detour through an engine's layout loses nothing of the config


def test_fixture_flags_survive(converted: dict) -> None:
    mla = engine_rules.config(converted[("kimi-k2.6-eagle3.1-mla", "vllm")][0])
    assert mla["fc_norm"] is True and mla["norm_output"] is True and mla["kv_lora_rank"] == tiny.TEXT_DIMS["kv_lora_rank"]
    assert mla["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    d2t = engine_rules.config(converted[("kimi-k2.5-eagle3-d2t", "sglang")][0])
    assert d2t["draft_vocab_size"] == tiny.DRAFT_VOCAB_SIZE
    full = engine_rules.config(converted[("kimi-k2.5-eagle3", "sglang")][0])
    assert full["draft_vocab_size"] == tiny.VOCAB_SIZE  # explicit: SGLang reads null as "use the target's lm_head"
    for (f, e), (d1, _) in converted.items():
        cfg = engine_rules.config(d1)
        assert cfg["eagle_config"]["use_aux_hidden_state"] is True, (f, e)
        assert "norm_before_residual" in cfg and "draft_vocab_size" in cfg
        rep = json.loads((d1 / "convert_report.json").read_text())
        assert rep["engine"] == e and rep["tensors"]["out"] == len(load_all(d1))


def test_speculators_from_native(converted: dict) -> None:
    d1, _ = converted[("kimi-k2.5-eagle3-d2t", "speculators")]
    cfg = engine_rules.config(d1)
    assert cfg["transformer_layer_config"]["vocab_size"] == tiny.VOCAB_SIZE
    assert cfg["norm_before_residual"] is False
    ts = load_all(d1)
    assert ts["t2d"].sum().item() == tiny.DRAFT_VOCAB_SIZE
    rep = json.loads((d1 / "convert_report.json").read_text())
    assert [g["name"] for g in rep["generated"]] == ["t2d"]
    assert cfg["speculators_config"]["verifier"]["architectures"] == ["KimiK25ForConditionalGeneration"]


@pytest.mark.parametrize("fixture,engine", sorted(IMPOSSIBLE))
def test_impossible_profiles_refused(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     fixture: str, engine: str) -> None:
    from tests.convert.test_convert_errors import run_error

    err = run_error(capsys, [str(tiny_dir / fixture), str(tmp_path / "o"), "--engine", engine])
    assert ("reduced-vocabulary" in err) if engine == "atom" else ("MLA" in err)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


# ---------------------------------------------------------------------------------------------
# Aux-layer ids
# ---------------------------------------------------------------------------------------------


def _aux(d: Path) -> tuple[list[int], list[int], dict[str, Any]]:
    cfg = engine_rules.config(d)
    rep = json.loads((d / "convert_report.json").read_text())
    return cfg["eagle_aux_hidden_state_layer_ids"], cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], rep


def test_kimi_default_aux_ids(tiny_dir: Path, tmp_path: Path) -> None:
    """No ids in the source and no --target: Kimi-K2.5's 61-layer default (2, 30, 58), which is
    (1, 29, 57) in the output-of-layer convention SGLang shifts."""
    src = str(tiny_dir / "kimi-k2.5-eagle3")
    res = cli(src, str(tmp_path / "v"), "--engine", "vllm")
    top, ec, rep = _aux(tmp_path / "v")
    assert top == ec == [2, 30, 58]
    assert rep["aux_layers"]["source"] == "default" and "Kimi-K2.5 (61 layers" in rep["aux_layers"]["rule"]
    assert "[2, 30, 58]" in res.output and any("default" in w for w in rep["warnings"])
    cli(src, str(tmp_path / "s"), "--engine", "sglang")
    top, ec, _ = _aux(tmp_path / "s")
    assert top == ec == [1, 29, 57]
    assert engine_rules.sglang_load(tmp_path / "s", target_layers=61)[1]["aux_input_ids"] == [2, 30, 58]
    # and back: SGLang's output-convention ids are read as such
    cli(str(tmp_path / "s"), str(tmp_path / "e"), "--engine", "eagle3")
    assert _aux(tmp_path / "e")[0] == [2, 30, 58]
    # --target supplies the layer count instead (tiny target: 7 layers -> 2, 3, 4)
    cli(src, str(tmp_path / "t"), "--engine", "vllm", "--target", str(tiny_dir / "kimi-k2.5"))
    assert _aux(tmp_path / "t")[0] == [2, 3, 4]


@pytest.mark.parametrize("ids,conv,engine,want", [
    ("2,30,58", "input", "vllm", [2, 30, 58]),
    ("2,30,58", "input", "sglang", [1, 29, 57]),
    ("1,29,57", "output", "vllm", [2, 30, 58]),
    ("1,29,57", "output", "atom", [2, 30, 58]),
    ("1,29,57", "output", "sglang", [1, 29, 57]),
    ("1,29,57", "output", "eagle3", [2, 30, 58]),
    ("2,30,58", None, "speculators", [2, 30, 58]),  # --aux-convention defaults to input
])
def test_aux_override_both_conventions(tiny_dir: Path, tmp_path: Path, ids: str, conv: str | None, engine: str,
                                       want: list[int]) -> None:
    args = [str(tiny_dir / "kimi-k2.5-eagle3"), str(tmp_path / "o"), "--engine", engine, "--aux-layer-ids", ids]
    if conv:
        args += ["--aux-convention", conv]
    cli(*args)
    top, ec, rep = _aux(tmp_path / "o")
    assert top == ec == want
    assert rep["aux_layers"]["input_ids"] == [2, 30, 58] and rep["aux_layers"]["source"] == "--aux-layer-ids"


def test_aux_convention_override_of_source(tiny_dir: Path, tmp_path: Path) -> None:
    """The SpecForge fixture says [1, 2, 3] (output convention, detected from the first id);
    --aux-convention input reinterprets the same numbers."""
    src = str(tiny_dir / "kimi-k2.5-eagle3-d2t")
    cli(src, str(tmp_path / "a"), "--engine", "vllm")
    assert _aux(tmp_path / "a")[0] == [2, 3, 4]
    cli(src, str(tmp_path / "b"), "--engine", "vllm", "--aux-convention", "input")
    assert _aux(tmp_path / "b")[0] == [1, 2, 3]
    # input ids starting at 1 have no form that every SGLang reads right: written, with a warning
    cli(src, str(tmp_path / "c"), "--engine", "sglang", "--aux-convention", "input")
    top, _, rep = _aux(tmp_path / "c")
    assert top == [0, 1, 2] and any("PR #25454" in w for w in rep["warnings"])
    # ids whose output form does not start at 1: input form, right for SGLang >= PR #25454
    cli(src, str(tmp_path / "d"), "--engine", "sglang", "--aux-layer-ids", "3,30,58")
    top, _, rep = _aux(tmp_path / "d")
    assert top == [3, 30, 58] and any("PR #25454" in w for w in rep["warnings"])


# ---------------------------------------------------------------------------------------------
# norm_output, pairing, quantized drafts
# ---------------------------------------------------------------------------------------------


def _copy_with_config(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_specforge_norm_output_warning_and_flag(tiny_dir: Path, tmp_path: Path) -> None:
    src = _copy_with_config(tiny_dir / "kimi-k2.5-eagle3-d2t", tmp_path / "sf", norm_output=True)
    res = cli(str(src), str(tmp_path / "a"), "--engine", "vllm")
    rep = json.loads((tmp_path / "a" / "convert_report.json").read_text())
    warn = [w for w in rep["warnings"] if "SpecForge" in w]
    assert warn and "--norm-output false" in warn[0] and "--norm-output false" in res.output
    assert engine_rules.config(tmp_path / "a")["norm_output"] is True  # warned, not changed behind the user's back
    cli(str(src), str(tmp_path / "b"), "--engine", "vllm", "--norm-output", "false")
    assert engine_rules.config(tmp_path / "b")["norm_output"] is False
    # a lightseek (non-SpecForge) 3.1 draft gets no such warning
    cli(str(tiny_dir / "kimi-k2.6-eagle3.1-mla"), str(tmp_path / "c"), "--engine", "vllm")
    rep = json.loads((tmp_path / "c" / "convert_report.json").read_text())
    assert not [w for w in rep["warnings"] if "SpecForge" in w]


def test_pairing_with_target(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.convert.test_convert_errors import run_error

    src = str(tiny_dir / "kimi-k2.5-eagle3-d2t")
    cli(src, str(tmp_path / "ok"), "--engine", "vllm", "--target", str(tiny_dir / "kimi-k2-thinking"))
    other = b.write(tmp_path / "t64", b.text_config(), b.target_tensors())  # hidden 64, vocab 256
    err = run_error(capsys, [src, str(tmp_path / "o1"), "--engine", "vllm", "--target", str(other)])
    assert "target_hidden_size is 128" in err and "hidden_size 64" in err
    err = run_error(capsys, [src, str(tmp_path / "o2"), "--engine", "vllm", "--target", str(tiny_dir / "kimi-k2.5"),
                             "--aux-layer-ids", "2,3,9"])
    assert "aux layer id 9" in err and "7 decoder layers" in err
    bad = _copy_with_config(tiny_dir / "kimi-k2.5-eagle3-d2t", tmp_path / "bos", bos_token_id=5)
    err = run_error(capsys, [str(bad), str(tmp_path / "o3"), "--engine", "vllm", "--target", str(tiny_dir / "kimi-k2.5")])
    assert "bos_token_id is 5" in err and str(tiny.BOS_ID) in err
    vocab = _copy_with_config(tiny_dir / "kimi-k2.5-eagle3-d2t", tmp_path / "voc", vocab_size=2048)
    err = run_error(capsys, [str(vocab), str(tmp_path / "o4"), "--engine", "vllm", "--target",
                             str(tiny_dir / "kimi-k2.5")])
    assert "vocab_size is 2048" in err and "vocab_size 1024" in err
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))


@pytest.mark.parametrize("scheme", ["quark-int4", "quark-fp8"])
def test_quantized_draft_keeps_tensors_and_renames_config(tmp_path: Path, scheme: str) -> None:
    t = b.draft_tensors(prefix="midlayer.", layer_scheme=scheme)
    # o_proj left in bf16 and named in the exclude list (Quark exports explicit module names)
    for k in [k for k in t if k.startswith("midlayer.self_attn.o_proj.")]:
        del t[k]
    t["midlayer.self_attn.o_proj.weight"] = torch.zeros(b.DH, b.DHEADS * b.DHEAD_DIM, dtype=torch.bfloat16)
    qc = b.quark_config(scheme, ["fc", "lm_head", "midlayer.self_attn.o_proj"])
    qc["layer_quant_config"] = {"midlayer.mlp.*": qc["global_quant_config"]}
    cfg = b.llama_draft_config(quantization_config=qc, eagle_config={
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True})
    src = b.write(tmp_path / "q", cfg, t)
    for engine, prefix in (("vllm", "layers.0."), ("sglang", "midlayer."), ("atom", "midlayer."),
                           ("speculators", "layers.0.")):
        out = tmp_path / engine
        cli(str(src), str(out), "--engine", engine)
        got = load_all(out)
        assert set(got) == {prefix + n[len("midlayer."):] if n.startswith("midlayer.") else n for n in t}
        for n, v in t.items():
            m = prefix + n[len("midlayer."):] if n.startswith("midlayer.") else n
            assert same_bits(got[m], v), m
        oqc = engine_rules.config(out)["quantization_config"]
        assert oqc["exclude"] == ["fc", "lm_head", prefix + "self_attn.o_proj"]
        assert list(oqc["layer_quant_config"]) == [prefix + "mlp.*"]
        assert oqc["global_quant_config"] == qc["global_quant_config"]
        problems, _ = engine_rules.LOADERS[engine](out, target_layers=61)
        assert problems == []
    from eagle3.formats.detect import detect

    assert detect(tmp_path / "vllm").quant.scheme == scheme


def test_hub_ids_for_source_and_target(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SRC and --target given as Hub ids (a loopback stand-in for the Hub): the draft is fetched,
    the target only for its config (pairing needs no weights)."""
    from huggingface_hub import constants

    from eagle3.testing.fakehub import FakeHub

    with FakeHub() as hub:
        hub.add_repo("lightseekorg/kimi-k2.5-eagle3", tiny_dir / "kimi-k2.5-eagle3")
        hub.add_repo("moonshotai/Kimi-K2.5", tiny_dir / "kimi-k2.5")
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
        cli("lightseekorg/kimi-k2.5-eagle3", str(tmp_path / "o"), "--engine", "speculators",
            "--target", "moonshotai/Kimi-K2.5")
    cfg = engine_rules.config(tmp_path / "o")
    assert cfg["eagle_aux_hidden_state_layer_ids"] == PHYSICAL_AUX  # the target's 7 layers, read from its config
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "moonshotai/Kimi-K2.5"
    src = load_all(tiny_dir / "kimi-k2.5-eagle3")
    got = load_all(tmp_path / "o")
    assert all(same_bits(got[canonical(n)], t) for n, t in src.items())
    snaps = tmp_path / "cache" / "models--moonshotai--Kimi-K2.5" / "snapshots"
    assert not list(snaps.rglob("*.safetensors")) and list(snaps.rglob("config.json"))


def test_canonical_marker_removes_the_first_id_ambiguity(tiny_dir: Path, tmp_path: Path) -> None:
    """Input ids starting at 1 look like SpecForge's output ids to the engines' heuristic; the
    canonical form says which convention it wrote, and detection (hence the runtime) honours it."""
    from eagle3.formats.detect import detect

    cli(str(tiny_dir / "kimi-k2.5-eagle3"), str(tmp_path / "c"), "--engine", "eagle3", "--aux-layer-ids", "1,3,5")
    aux = detect(tmp_path / "c").draft.aux_layers
    assert aux.convention == "input" and aux.input_ids == [1, 3, 5]
    cli(str(tmp_path / "c"), str(tmp_path / "v"), "--engine", "vllm")
    assert engine_rules.config(tmp_path / "v")["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
