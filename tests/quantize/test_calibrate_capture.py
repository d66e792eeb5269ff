"""The calibration pass on the trained tiny target: what it streams layer by layer against the
runtime's whole-model forward (the independent reference), and what it writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.quantize import native
from eagle3.quantize.calibrate import CalibConfig, Calibrator, TensorStore, load_calibration
from eagle3.quantize.calibrate.capture import routed_tokens
from eagle3.quantize.recipes import load_recipe
from eagle3.runtime.layers.moe import MoE
from eagle3.runtime.loader import load_target
from eagle3.runtime.tokenizer import load_tokenizer
from eagle3.testing.numerics import forced_logits


@pytest.fixture(scope="module")
def target(trained_pair: Path) -> Path:
    return trained_pair / "kimi-k2.5-trained"


@pytest.fixture(scope="module")
def calib(target: Path):  # type: ignore[no-untyped-def]
    return load_calibration("gsm8k", load_tokenizer(target), samples=2, max_tokens=200)


def _reference_mlp_inputs(target: Path, sequences) -> dict[int, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Each layer's MLP input for every calibration token, from the runtime's whole-model forward
    (one prefill per sequence), recorded by a hook on the layer's MLP."""
    model = load_target(target)
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(model.num_layers)}
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: got[i].append(a[0].clone()))
             for i, layer in enumerate(model.layers)]
    try:
        for seq in sequences:
            forced_logits(model, seq)
    finally:
        for h in hooks:
            h.remove()
    return {i: torch.cat(v) for i, v in got.items()}, model


def test_streamed_layers_see_what_the_whole_model_forward_sees(target: Path, calib, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Per-expert token counts equal the runtime router's top-k over the whole-model forward's MLP
    inputs, and each expert's Hessian from the streamed layer-1 inputs equals the one from the
    forward's (the stream runs the same modules, one layer at a time)."""
    rec = load_recipe("mxfp4")
    seen: dict[int, torch.Tensor] = {}
    cal = Calibrator(target, rec, rec.scope(None), CalibConfig("gptq"), calib, TensorStore(tmp_path / "s"),
                     echo=lambda s: None, observe=lambda i, x, ids: seen.__setitem__(i, x.clone()))
    res = cal.run()
    ref, model = _reference_mlp_inputs(target, calib.sequences)
    assert sum(len(s) for s in calib.sequences) == ref[0].shape[0] == seen[0].shape[0]
    for i, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, MoE):
            assert res.layers[i].expert_tokens is None
            continue
        ids = layer.mlp.route(ref[i])[0]
        want = torch.bincount(ids.reshape(-1), minlength=layer.mlp.num_experts).tolist()
        assert res.layers[i].expert_tokens == want
        assert sum(want) == layer.mlp.top_k * ref[i].shape[0]
    torch.testing.assert_close(seen[1].float(), ref[1].float(), rtol=1e-2, atol=1e-2)
    ids1 = model.layers[1].mlp.route(ref[1])[0]
    for tok in routed_tokens(ids1, model.layers[1].mlp.num_experts):
        h_ref = ref[1][tok].double().t() @ ref[1][tok].double()
        h_got = seen[1][tok].double().t() @ seen[1][tok].double()
        assert float((h_got - h_ref).norm()) <= 1e-3 * float(h_ref.norm())
    # An MLP that fewer tokens reach than it has inputs (hidden 128) keeps its data-free values and
    # the report counts it: here most routed experts; the dense MLP and shared experts see all 400.
    few = sum(int(n < 128) for r in res.layers if r.expert_tokens for n in r.expert_tokens)
    assert few > 0 and res.fallback == few
    assert res.calibrated == sum(r.mlps for r in res.layers) - few


def test_gptaq_pass_writes_every_in_scope_module_in_the_native_layout(target: Path, calib, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rec = load_recipe("w4a8")
    store = TensorStore(tmp_path / "store")
    cfg = CalibConfig("gptaq", min_tokens_per_input=0.25)
    res = Calibrator(target, rec, rec.scope(None), cfg, calib, store, echo=lambda s: None).run()
    assert res.calibrated == 24 and res.fallback == 0  # 3 MoE layers x 8 experts (w4a8: routed experts only)
    reread = TensorStore(tmp_path / "store")
    mods = reread.modules()
    assert len(mods) == 72 and all(".mlp.experts." in m for m in mods)
    for m in mods[:6]:
        t = reread.get(m)
        want = native.expected_shapes(rec.weight, (128, 128), zero_point=False)  # experts: hidden = width = 128
        assert {s: (tuple(v.shape), v.dtype) for s, v in t.items()} == {s: (tuple(a), b) for s, (a, b) in want.items()}
    moe = [r for r in res.layers if r.expert_tokens is not None]
    assert all(r.err < r.err_rtn for r in moe)


def test_calibration_prompts_from_gsm8k_train_and_from_a_jsonl_file(target: Path, tmp_path: Path) -> None:
    from eagle3.errors import UsageError
    from eagle3.validate import gsm8k

    tok = load_tokenizer(target)
    g = load_calibration("gsm8k", tok, samples=3, max_tokens=50)
    assert len(g.sequences) == 3 and all(len(s) == 50 for s in g.sequences)
    _, test = gsm8k.load_dataset()
    held_out = {d.question for d in test}
    from eagle3.quantize.calibrate.prompts import gsm8k_texts

    assert not any(q in t for t in gsm8k_texts(3) for q in held_out)  # the evaluation's questions never appear
    f = tmp_path / "calib.jsonl"
    f.write_text('{"text": "Question: 1 + 1?"}\n\n{"prompt": "Q: 2 + 2?", "completion": " 4"}\n'
                 '{"question": "3 + 3?", "answer": "#### 6"}\n')
    c = load_calibration(f, tok, samples=10, max_tokens=1000)
    assert [len(s) for s in c.sequences] == [len(tok(t, add_special_tokens=False)["input_ids"]) for t in
                                              ("Question: 1 + 1?", "Q: 2 + 2? 4", gsm8k.exemplar(gsm8k.Doc("3 + 3?", "#### 6")))]
    f.write_text('{"text": "ok"}\n{"txt": "bad"}\n')
    with pytest.raises(UsageError, match=r"calib\.jsonl:2: expected a JSON object with 'text'"):
        load_calibration(f, tok)
