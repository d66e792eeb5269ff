"""``kimi-k2.5-trained``: make-tiny writes it in Moonshot's K2.5 layout, inspect recognises it, the
runtime's logits equal transformers' DeepseekV3 on it, its greedy continuation of a GSM8K-style
prompt is a GSM8K-style answer (calculator annotations ``<<a*b=c>>c``, then ``#### N``), which a
random model of the same shape does not write, and its loss on GSM8K-style text is far below a
random model's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from eagle3.cli import app
from eagle3.testing import tiny, trained
from tests.runtime.model_kit import single_thread

NAME = "kimi-k2.5-trained"
runner = CliRunner()

# A GSM8K-style prompt of our own (one exemplar in lm-eval's format, then a new question).
PROMPT = ("Question: Sam has 4 bags with 6 apples in each bag. He gives 5 apples to Tara. How many apples "
          "does Sam have left?\nAnswer: Sam has 4 * 6 = <<4*6=24>>24 apples.\nHe has 24 - 5 = <<24-5=19>>19 "
          "apples left.\n#### 19\n\n"
          "Question: A shop sells pencils for $2 each. Anna buys 7 pencils and pays with a $20 bill. How much "
          "change does she get?\nAnswer:")


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trained") / "tiny"
    # The CLI in-process: a new interpreter would add ~2 CPU-s of imports (the installed entry
    # point in a fresh process is tests/formats/test_inspect_cli.py's).
    r = runner.invoke(app, ["make-tiny", str(out), "--only", NAME])
    assert r.exit_code == 0, r.output
    assert str(out / NAME) in r.stdout
    assert sorted(p.name for p in out.iterdir()) == [NAME, "manifest.json"]  # nothing else written
    return out / NAME


_threads = pytest.fixture(scope="module", autouse=True)(single_thread)


def test_package_data_is_small_and_described() -> None:
    d = trained.data_path()
    files = sorted(d.iterdir())
    assert files and all(f.stat().st_size < 5_000_000 for f in files)
    meta = trained.train_meta()
    assert meta["model"] == NAME and meta["steps"] > 0 and len(meta["data"]["sha256"]) == 64
    assert meta["loss"]["final_mean20"] < meta["loss"]["first"]
    # a random 1024-token model: ~6.9; smoothed bigram / trigram models of GSM8K train on the same
    # 64 test problems: 3.34 / 2.74 (scripts/ngram_baseline.py)
    assert meta["heldout"]["loss_nats_per_token"] < 2.7


def test_make_tiny_writes_moonshot_k25_layout(trained_dir: Path) -> None:
    c = json.loads((trained_dir / "config.json").read_text())
    assert c["architectures"] == ["KimiK25ForConditionalGeneration"] and c["model_type"] == "kimi_k25"
    t = c["text_config"]
    assert t["model_type"] == "kimi_k2" and t["topk_method"] == "noaux_tc" and t["scoring_func"] == "sigmoid"
    # Kimi's real MLA latent sizes (vLLM's MLA backends accept a latent of 512 + 64)
    assert (t["kv_lora_rank"], t["qk_rope_head_dim"], t["qk_nope_head_dim"], t["v_head_dim"]) == (512, 64, 128, 128)
    assert t["first_k_dense_replace"] == 1 and t["n_shared_experts"] == 1
    assert t["quantization_config"]["format"] == "pack-quantized"
    idx = json.loads((trained_dir / "model.safetensors.index.json").read_text())["weight_map"]
    names = set(idx)
    assert all(n.startswith(("language_model.", "vision_tower.", "mm_projector.")) for n in names)
    p = "language_model.model.layers.1.mlp.experts.7.down_proj."
    assert {p + s for s in ("weight_packed", "weight_scale", "weight_shape")} <= names
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in names  # dense first layer
    with safe_open(trained_dir / idx[p + "weight_packed"], "pt") as f:
        assert f.get_tensor(p + "weight_packed").dtype == torch.int32
        assert f.get_tensor(p + "weight_shape").tolist() == [128, 128]
    with safe_open(trained_dir / idx["language_model.lm_head.weight"], "pt") as f:
        assert f.get_tensor("language_model.lm_head.weight").dtype == torch.bfloat16


def test_inspect_recognises_it(trained_dir: Path) -> None:
    r = runner.invoke(app, ["inspect", str(trained_dir)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())
    assert "kimi-k25 target" in out and "kv_lora 512" in out and "ct-int4" in out


def test_logits_match_transformers(trained_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText, CompressedTensorsConfig

    from eagle3.runtime.loader import load_target
    from eagle3.testing.numerics import assert_greedy_agrees
    from tests.runtime.test_models_target import HF_LATENT_EPS, _forward

    tok = tiny.build_tokenizer()
    ids = tok.encode(PROMPT).ids
    hf, info = AutoModelForImageTextToText.from_pretrained(
        trained_dir, dtype=torch.float32, output_loading_info=True,
        quantization_config=CompressedTensorsConfig(dequantize=True))
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
    for p in hf.parameters():  # INT4 experts come back bf16 even with dtype=float32
        p.data = p.data.float()
    with torch.no_grad():
        ref = hf.eval()(input_ids=torch.tensor([ids])).logits[0].float()
    m = load_target(trained_dir, dtype=torch.float32, latent_norm_eps=HF_LATENT_EPS)
    _, _, logits = _forward(m, ids)
    # fp32 op-order noise grows with the trained logits (|logit| up to ~20): measured 4.3e-4
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-3)
    # greedy agrees wherever the margin exceeds the tolerance (atol + rtol * |logit| <= 3e-3)
    assert_greedy_agrees(ref, logits, 3e-3, "eagle3 vs transformers")


def gsm8k_answer(text: str) -> bool:
    """GSM8K's answer shape: a calculator annotation ``<<expr=value>>value``, then ``#### N``
    on a line of its own."""
    return bool(re.search(r"<<[0-9][0-9+\-*/. x]*=[0-9.]+>>[0-9]", text) and re.search(r"\n#### [0-9]+", text))


def test_runtime_predicts_gsm8k_text_and_writes_its_tokens(trained_dir: Path) -> None:
    """Teacher-forced loss of a GSM8K-style text far below a random model's (ln 1024 = 6.9; a
    random model of this shape measured 7.0), and the greedy continuation is a GSM8K-style answer
    (a random model of this shape writes '1414... Kem each each ...'). The model is small: its
    arithmetic is wrong (held-out loss 2.26 nats/token), its answers' shape is right."""
    from eagle3.runtime.engine.llm import LLM
    from eagle3.runtime.loader import load_target
    from eagle3.runtime.sampling import SamplingParams
    from tests.runtime.test_models_target import _forward

    ids = tiny.build_tokenizer().encode(PROMPT).ids
    _, _, logits = _forward(load_target(trained_dir, dtype=torch.float32), ids)
    loss = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()
    assert loss < 3.0, loss

    llm = LLM(trained_dir, dtype="float32")
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=96))[0]
    assert gsm8k_answer(out.text), out.text
    # the check is not vacuous: a random model's text, and the earlier (lr 4e-3) model's digit loop
    assert not gsm8k_answer("1414141414 Kem14 Kem each each each")
    assert not gsm8k_answer(" 2=<<20000000000000000000000000000000")
