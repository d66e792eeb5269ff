"""Valid real-world layouts the schema must accept (and the runtime load), each built here by writing
the tensors directly the way the upstream tool does (not through :mod:`eagle3.formats.sizing`), next
to a genuinely wrong variant that is still refused with one line:

* compressed-tensors ``weight_shape`` stored as int64 (its compressor saves ``torch.tensor(shape)``);
* compressed-tensors INT4 with the ``channel`` strategy: ``weight_scale`` [N, 1];
* a full-vocabulary draft that ships the identity ``d2t`` / ``t2d`` (SpecForge saves both always);
* optional per-module tensors: ``input_scale``, ``k_scale`` / ``v_scale``, ``weight_zero_point``,
  ``weight_g_idx`` (the runtime refuses the ones it would misread: a non-zero zero point, a group
  index out of column order).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.checkpoint import CheckpointReader
from eagle3.cli import main
from eagle3.errors import FormatError
from eagle3.formats.check import check_checkpoint
from eagle3.runtime.kernels.base import Int4Weight, dequantize
from eagle3.runtime.loader import WeightReader, target_spec

EXPERT = "language_model.model.layers.3.mlp.experts.5.down_proj"
ATTN = "language_model.model.layers.3.self_attn"
Tensors = dict[str, torch.Tensor]


# --- writing the fixtures (safetensors + torch only) ------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(d: Path, fn: Callable[[Tensors], None], *, first_shard_only: bool = False) -> None:
    """``fn`` edits each shard's tensors in place (new ones included); the index is rebuilt."""
    shards = sorted(d.glob("*.safetensors"))
    for f in shards[:1] if first_shard_only else shards:
        with safe_open(str(f), "pt") as st:
            meta = st.metadata()
            t = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        fn(t)
        save_file(t, str(f), metadata=meta)
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        j = json.loads(idx.read_text())
        j["weight_map"] = {}
        for f in shards:
            with safe_open(str(f), "pt") as st:
                j["weight_map"].update({k: f.name for k in st.keys()})  # noqa: SIM118
        idx.write_text(json.dumps(j, indent=2))


def _edit_config(d: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))


def _ct_packed_zero_points(codes: torch.Tensor) -> torch.Tensor:
    """compressed-tensors packs INT4 zero points [N, G] 8 to an int32 along the rows (offset by 8, low
    nibble first): int32 [N/8, G]."""
    u = (codes.to(torch.int64) + 8).t()  # [G, N]
    u = u.reshape(u.shape[0], -1, 8)
    words = sum(u[..., i] << (4 * i) for i in range(8))
    return (words - ((words >> 31) << 32)).to(torch.int32).t().contiguous()  # two's complement int32


# --- what accepting and refusing mean at the interface ----------------------------------------


def _cli(*argv: str) -> tuple[int, list[str]]:
    """``eagle3 <argv>`` as the console script runs it: (exit code, non-empty stderr lines)."""
    err = io.StringIO()
    code: int | str | None = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(list(argv))
        except SystemExit as e:
            code = e.code
    return int(code or 0), [ln for ln in err.getvalue().splitlines() if ln.strip()]


def _accepted(d: Path, tmp: Path, convert_args: tuple[str, ...]) -> None:
    assert [str(p) for p in check_checkpoint(d)] == []
    assert _cli("inspect", str(d), "--strict") == (0, [])
    code, err = _cli("convert", str(d), str(tmp / f"{d.name}-out"), *convert_args, "--quiet")
    assert code == 0, err


def _refused(d: Path, tmp: Path, name: str, convert_args: tuple[str, ...]) -> str:
    """``inspect --strict`` and ``convert`` exit 2 with one line naming ``name``; that line."""
    for argv in (("inspect", str(d), "--strict"),
                 ("convert", str(d), str(tmp / f"{d.name}-refused"), *convert_args, "--quiet")):
        code, err = _cli(*argv)
        assert code == 2 and len(err) == 1 and name in err[0], (argv[0], code, err)
    return err[0]


TEXT_ONLY = ("--text-only",)


# --- 1. weight_shape as int64 ------------------------------------------------------------------


def _shapes_int64(t: Tensors) -> None:
    for k in [k for k in t if k.endswith(".weight_shape")]:
        t[k] = torch.tensor([int(x) for x in t[k].tolist()])  # what torch.tensor(weight.shape) gives: int64


def test_ct_weight_shape_int64_is_accepted_and_loads(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir / "kimi-k2.5", tmp_path / "i64")
    _edit(d, _shapes_int64)
    with safe_open(str(next(d.glob("*.safetensors"))), "pt") as st:
        some = next(k for k in st.keys() if k.endswith(".weight_shape"))  # noqa: SIM118
        assert st.get_tensor(some).dtype == torch.int64
    _accepted(d, tmp_path, TEXT_ONLY)
    ref = WeightReader(tiny_dir / "kimi-k2.5", target_spec(d).quant, torch.float32, torch.device("cpu"))
    wr = WeightReader(d, target_spec(d).quant, torch.float32, torch.device("cpu"))
    assert torch.equal(dequantize(wr.linear(EXPERT)[0], torch.float32), dequantize(ref.linear(EXPERT)[0], torch.float32))


@pytest.mark.parametrize("bad", [torch.tensor([1, 2, 3]), torch.tensor([1.0, 2.0])])
def test_ct_weight_shape_of_wrong_length_or_float_is_refused(tiny_dir: Path, tmp_path: Path, bad: torch.Tensor) -> None:
    d = _copy(tiny_dir / "kimi-k2.5", tmp_path / "bad")
    name = EXPERT + ".weight_shape"

    def fn(t: Tensors) -> None:
        if name in t:
            t[name] = bad
    _edit(d, fn)
    _refused(d, tmp_path, name, TEXT_ONLY)


# --- 2. channel-wise compressed-tensors INT4 ---------------------------------------------------


def _channel_config(cfg: dict[str, Any]) -> None:
    w = cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]
    w["strategy"], w["group_size"] = "channel", None


def _channel_scales(t: Tensors) -> None:
    for k in [k for k in t if k.endswith(".weight_scale")]:
        t[k] = t[k].float().abs().amax(dim=1, keepdim=True).to(t[k].dtype)  # one scale per row: [N, 1]


def test_ct_channel_strategy_is_accepted_and_loads(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir / "kimi-k2.5", tmp_path / "channel")
    _edit_config(d, _channel_config)
    _edit(d, _channel_scales)
    _accepted(d, tmp_path, TEXT_ONLY)
    w, _ = WeightReader(d, target_spec(d).quant, torch.float32, torch.device("cpu")).linear(EXPERT)
    assert isinstance(w, Int4Weight) and w.scale.shape[1] == 1 and w.group_size == w.shape[1]


def test_ct_channel_scale_with_groups_is_refused_without_an_unrelated_field(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir / "kimi-k2.5", tmp_path / "channel-bad")
    _edit_config(d, _channel_config)
    _edit(d, _channel_scales)
    name = EXPERT + ".weight_scale"

    def fn(t: Tensors) -> None:
        if name in t:
            t[name] = t[name].repeat(1, 4)  # [N, 4]
    _edit(d, fn)
    line = _refused(d, tmp_path, name, TEXT_ONLY)
    assert "=" not in line.split("from config.json")[-1], line  # no field sets this dimension


def test_field_hint_names_only_the_fields_that_size_the_tensor(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir / "kimi-k2.5", tmp_path / "hint")
    # an up_proj's scale is [I, H/32]; H/32 = 4 = num_attention_heads, which does not size it
    scale = EXPERT.replace("down_proj", "up_proj") + ".weight_scale"
    emb = "language_model.model.embed_tokens.weight"

    def fn(t: Tensors) -> None:
        if scale in t:
            t[scale] = t[scale][:, :2].contiguous()
        if emb in t:
            t[emb] = t[emb][:-8].contiguous()
    _edit(d, fn)
    lines = {p.subject: str(p) for p in check_checkpoint(d)}
    assert "num_attention_heads" not in lines[scale], lines[scale]
    assert "(vocab_size=1024)" in lines[emb], lines[emb]


# --- 3. a full-vocabulary draft with d2t / t2d -------------------------------------------------

DRAFT_ARGS = ("--engine", "vllm")


def _full_maps(d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None) -> Callable[[Tensors], None]:
    def fn(t: Tensors) -> None:
        v = t["lm_head.weight"].shape[0] if "lm_head.weight" in t else 1024
        t["d2t"] = torch.zeros(v, dtype=torch.int64) if d2t is None else d2t  # SpecForge's identity buffers
        t["t2d"] = torch.ones(v, dtype=torch.bool) if t2d is None else t2d
    return fn


def test_full_vocabulary_draft_with_identity_maps_is_accepted(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir / "kimi-k2.5-eagle3", tmp_path / "full-maps")
    _edit(d, _full_maps(), first_shard_only=True)
    _accepted(d, tmp_path, (*DRAFT_ARGS, "--target", str(tiny_dir / "kimi-k2.5")))


@pytest.mark.parametrize("what,d2t,t2d", [
    ("d2t", torch.arange(1024, dtype=torch.int64) % 2, None),  # maps draft ids elsewhere
    ("t2d", None, torch.arange(1024) % 7 != 0),  # leaves target ids out
    ("d2t", torch.zeros(1000, dtype=torch.int64), None),  # not a full map
])
def test_full_vocabulary_draft_with_a_non_identity_map_is_refused(tiny_dir: Path, tmp_path: Path, what: str,
                                                                  d2t: torch.Tensor | None,
                                                                  t2d: torch.Tensor | None) -> None:
    d = _copy(tiny_dir / "kimi-k2.5-eagle3", tmp_path / "bad-maps")
    _edit(d, _full_maps(d2t, t2d), first_shard_only=True)
    _refused(d, tmp_path, repr(what), (*DRAFT_ARGS, "--target", str(tiny_dir / "kimi-k2.5")))


# --- 4. optional per-module tensors ------------------------------------------------------------


def _experts(t: Tensors) -> list[str]:
    return [k[: -len(".weight_packed")] for k in t if k.endswith(".weight_packed")]


def _with_extras(zero_code: int = 0, gidx_perm: bool = False) -> Callable[[Tensors], None]:
    """What compressed-tensors writes for an asymmetric, activation-ordered INT4 export with a static
    input scale, plus a kv-cache scheme's scales on every attention module."""
    def fn(t: Tensors) -> None:
        for m in _experts(t):
            n, k = (int(x) for x in t[m + ".weight_shape"].tolist())
            groups = t[m + ".weight_scale"].shape[1]
            codes = torch.zeros(n, groups, dtype=torch.int8)
            if m == EXPERT:
                codes[0, 0] = zero_code
            t[m + ".weight_zero_point"] = _ct_packed_zero_points(codes)
            gidx = torch.arange(k, dtype=torch.int32) // (k // groups)
            t[m + ".weight_g_idx"] = gidx.flip(0).contiguous() if gidx_perm and m == EXPERT else gidx
            t[m + ".input_scale"] = torch.tensor([0.02])
        for a in {k[: k.index(".self_attn.") + len(".self_attn")] for k in t if ".self_attn." in k}:
            t[a + ".k_scale"] = torch.tensor(0.1)
            t[a + ".v_scale"] = torch.tensor([0.1])
    return fn


def _kv_config(cfg: dict[str, Any]) -> None:
    cfg["text_config"]["quantization_config"]["kv_cache_scheme"] = {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


@pytest.fixture(scope="module")
def extras(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target with every optional module tensor and a kv-cache scheme, built once for the
    module (rewriting each shard is most of a case's cost); each test takes a copy."""
    d = _copy(tiny_dir / "kimi-k2.5", tmp_path_factory.mktemp("extras") / "extras")
    _edit_config(d, _kv_config)
    _edit(d, _with_extras())
    return d


def test_optional_module_tensors_are_accepted_and_load(extras: Path, tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(extras, tmp_path / "extras")
    _accepted(d, tmp_path, TEXT_ONLY)
    ref = WeightReader(tiny_dir / "kimi-k2.5", target_spec(d).quant, torch.float32, torch.device("cpu"))
    wr = WeightReader(d, target_spec(d).quant, torch.float32, torch.device("cpu"))
    assert torch.equal(dequantize(wr.linear(EXPERT)[0], torch.float32), dequantize(ref.linear(EXPERT)[0], torch.float32))
    part, _ = wr.linear_part(EXPERT, rows=(0, 8))
    assert torch.equal(dequantize(part, torch.float32), dequantize(ref.linear(EXPERT)[0], torch.float32)[:8])


@pytest.mark.parametrize("name,bad", [
    (EXPERT + ".weight_zero_point", torch.zeros(3, 5, dtype=torch.int32)),
    (EXPERT + ".weight_g_idx", torch.zeros(7, dtype=torch.int32)),
    (EXPERT + ".input_scale", torch.ones(4)),
    (ATTN + ".k_scale", torch.ones(2)),
    (ATTN + ".q_b_proj.input_scale", torch.ones(1)),  # a Linear the config leaves dense carries none
    ("language_model.model.layers.3.mlp.k_scale", torch.ones(1)),  # not an attention module
])
def test_optional_module_tensor_of_wrong_shape_or_place_is_refused(extras: Path, tmp_path: Path, name: str,
                                                                   bad: torch.Tensor) -> None:
    d = _copy(extras, tmp_path / "extras-bad")

    def fn(t: Tensors) -> None:
        t[name] = bad
    _edit(d, fn, first_shard_only=True)
    _refused(d, tmp_path, name, TEXT_ONLY)


def test_k_scale_without_a_quantized_format_is_unexpected(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir / "kimi-k2.5-eagle3", tmp_path / "dense-kv")
    _edit(d, lambda t: t.__setitem__("midlayer.self_attn.k_scale", torch.ones(1)), first_shard_only=True)
    _refused(d, tmp_path, "midlayer.self_attn.k_scale", (*DRAFT_ARGS, "--target", str(tiny_dir / "kimi-k2.5")))


@pytest.mark.parametrize("zero_code,gidx_perm,what", [(1, False, "weight_zero_point"), (0, True, "weight_g_idx")])
def test_runtime_refuses_what_it_would_misread(tiny_dir: Path, tmp_path: Path, zero_code: int, gidx_perm: bool,
                                               what: str) -> None:
    d = _copy(tiny_dir / "kimi-k2.5", tmp_path / "misread")
    _edit(d, _with_extras(zero_code, gidx_perm))
    assert [str(p) for p in check_checkpoint(d)] == []  # valid files: the schema lets them through
    wr = WeightReader(d, target_spec(d).quant, torch.float32, torch.device("cpu"))
    for call in (lambda: wr.linear(EXPERT), lambda: wr.linear_part(EXPERT, rows=(0, 8))):
        with pytest.raises(FormatError) as e:
            call()
        assert f"{EXPERT}.{what}" in str(e.value) and "\n" not in str(e.value)


def _static_fp8(cfg: dict[str, Any]) -> None:
    """Quark FP8 with static per-tensor activations: the export saves each Linear's input_scale."""
    cfg["quantization_config"]["global_quant_config"]["input_tensors"].update(
        {"is_dynamic": False, "qscheme": "per_tensor", "ch_axis": None})


def _input_scales(shape: tuple[int, ...]) -> Callable[[Tensors], None]:
    def fn(t: Tensors) -> None:
        for k in [k for k in t if k.endswith(".weight") and t[k].dtype == torch.float8_e4m3fn]:
            t[k[: -len("weight")] + "input_scale"] = torch.full(shape, 0.05)  # 0-d, as Quark writes it
    return fn


@pytest.fixture(scope="module")
def fp8_draft(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny draft quantized fp8-draft, once for the module (each test edits a copy). Unverified:
    verifying measures each tensor's decode for the report; the tensors and config.json are the same."""
    from eagle3.quantize import quantize

    d = tmp_path_factory.mktemp("fp8-draft") / "fp8-draft"
    quantize(tiny_dir / "kimi-k2.5-eagle3", d, "fp8-draft", workers=1, verify=False)
    return d


@pytest.mark.parametrize("shape,ok", [((), True), ((1,), True), ((128,), False)])
def test_static_fp8_draft_input_scales(fp8_draft: Path, tiny_dir: Path, tmp_path: Path, shape: tuple[int, ...],
                                       ok: bool) -> None:
    d = _copy(fp8_draft, tmp_path / "fp8-static")
    _edit_config(d, _static_fp8)
    _edit(d, _input_scales(shape))
    args = (*DRAFT_ARGS, "--target", str(tiny_dir / "kimi-k2.5"))
    if ok:
        _accepted(d, tmp_path, args)
    else:
        _refused(d, tmp_path, "input_scale", args)


# --- 6. Quark exports: W4A8's INT4-stage zero points, a kv-cache scheme's output_scale ---------

KV_B = "language_model.model.layers.3.self_attn.kv_b_proj"


@pytest.fixture(scope="module")
def w4a8_zp(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target quantized W4A8 with ``--quark-zero-points`` (``weight_zero_point_2`` on every
    quantized expert): eagle3's own output, which every command must take back."""
    out = tmp_path_factory.mktemp("w4a8zp") / "w4a8zp"
    code, err = _cli("quantize", str(tiny_dir / "kimi-k2.5"), str(out), "--recipe", "w4a8", "--workers", "1",
                     "--quark-zero-points", "--quiet")
    assert code == 0, err
    return out


def _quark_kv_config(cfg: dict[str, Any]) -> None:
    """What Quark's export records for an FP8 KV cache on an MLA model: a per-tensor static FP8
    ``output_tensors`` spec under ``kv_cache_quant_config`` for the projection that makes k and v."""
    qc = cfg["quantization_config"]  # Quark's export writes it at the top of the K2.5 wrapper's config
    spec = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False, "symmetric": True,
            "observer_cls": "PerTensorMinMaxObserver"}
    qc["kv_cache_quant_config"] = {"*kv_b_proj": {"input_tensors": None, "weight": None, "output_tensors": spec}}


def _output_scales(t: Tensors) -> None:
    for k in [k for k in t if k.endswith("self_attn.kv_b_proj.weight")]:
        t[k.removesuffix("weight") + "output_scale"] = torch.tensor(0.02, dtype=torch.bfloat16)  # 0-d, as Quark


def test_quark_w4a8_zero_points_pass_every_command_and_load(w4a8_zp: Path, tiny_dir: Path, tmp_path: Path) -> None:
    names = [n for n in CheckpointReader(w4a8_zp).names() if n.endswith(".weight_zero_point_2")]
    assert names
    assert [str(p) for p in check_checkpoint(w4a8_zp)] == []
    assert _cli("inspect", str(w4a8_zp), "--strict") == (0, [])
    assert _cli("verify", str(w4a8_zp)) == (0, [])
    plain = tmp_path / "plain"
    # the reference for the dequantized weights only: its decode need not be measured again (--no-verify)
    assert _cli("quantize", str(tiny_dir / "kimi-k2.5"), str(plain), "--recipe", "w4a8", "--workers", "1",
                "--no-verify", "--quiet") == (0, [])
    module = names[0].removesuffix(".weight_zero_point_2")
    got = WeightReader(w4a8_zp, target_spec(w4a8_zp).quant, torch.float32, torch.device("cpu")).linear(module)[0]
    ref = WeightReader(plain, target_spec(plain).quant, torch.float32, torch.device("cpu")).linear(module)[0]
    assert torch.equal(dequantize(got, torch.float32), dequantize(ref, torch.float32))


@pytest.mark.parametrize("bad", [torch.zeros(3, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32),
                                 torch.zeros(1, dtype=torch.float32)])
def test_quark_w4a8_zero_points_of_wrong_shape_or_dtype_are_refused(w4a8_zp: Path, tmp_path: Path,
                                                                     bad: torch.Tensor) -> None:
    d = _copy(w4a8_zp, tmp_path / "zp-bad")
    name = next(n for n in CheckpointReader(d).names() if n.endswith(".weight_zero_point_2"))
    _edit(d, lambda t: t.__setitem__(name, bad) if name in t else None)
    code, err = _cli("inspect", str(d), "--strict")
    assert code == 2 and len(err) == 1 and name in err[0], err


def test_quark_zero_point_2_beside_a_non_w4a8_format_is_unexpected(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir / "kimi-k2.5", tmp_path / "ct-zp2")
    _edit(d, lambda t: t.__setitem__(EXPERT + ".weight_zero_point_2", torch.zeros(2, dtype=torch.int32)),
          first_shard_only=True)
    _refused(d, tmp_path, EXPERT + ".weight_zero_point_2", TEXT_ONLY)


def test_quark_kv_cache_output_scale_is_accepted_on_a_dense_kv_b_proj_and_loads(w4a8_zp: Path, tmp_path: Path) -> None:
    d = _copy(w4a8_zp, tmp_path / "kv")
    _edit_config(d, _quark_kv_config)
    _edit(d, _output_scales)
    assert KV_B + ".output_scale" in CheckpointReader(d)
    assert [str(p) for p in check_checkpoint(d)] == []
    assert _cli("inspect", str(d), "--strict") == (0, [])
    # the runtime keeps the KV cache in the compute dtype: the static scale is not read, the weights are
    wr = WeightReader(d, target_spec(d).quant, torch.float32, torch.device("cpu"))
    ref = WeightReader(w4a8_zp, target_spec(w4a8_zp).quant, torch.float32, torch.device("cpu"))
    assert torch.equal(dequantize(wr.linear(KV_B)[0], torch.float32), dequantize(ref.linear(KV_B)[0], torch.float32))


@pytest.mark.parametrize("name,bad", [
    (KV_B + ".output_scale", torch.ones(4)),  # not a per-tensor scale
    ("language_model.model.layers.3.self_attn.q_b_proj.output_scale", torch.tensor(0.5)),  # not a kv-cache Linear
])
def test_quark_output_scale_of_wrong_shape_or_place_is_refused(w4a8_zp: Path, tmp_path: Path, name: str,
                                                               bad: torch.Tensor) -> None:
    d = _copy(w4a8_zp, tmp_path / "kv-bad")
    _edit_config(d, _quark_kv_config)
    _edit(d, _output_scales)
    _edit(d, lambda t: t.__setitem__(name, bad), first_shard_only=True)
    code, err = _cli("inspect", str(d), "--strict")
    assert code == 2 and len(err) == 1 and name in err[0], err


def test_output_scale_without_a_kv_cache_scheme_is_unexpected(w4a8_zp: Path, tmp_path: Path) -> None:
    d = _copy(w4a8_zp, tmp_path / "kv-none")
    _edit(d, _output_scales)
    code, err = _cli("inspect", str(d), "--strict")
    assert code == 2 and len(err) == 1 and "output_scale" in err[0], err
