"""The memory plan (``eagle3 plan``) and the config-only sizing it stands on.

``data/kimi-k2.5/config.json`` is the Kimi-K2.5 config.json reconstructed from the research notes
(moonshotai/Kimi-K2.5's config.json and safetensors index: the 6-entry
ignore list in text_config); it is planned with no weights present. The sizes are cross-checked
against facts known about the real checkpoints: 208,550 tensors and ~554.3 GiB for Moonshot's INT4,
139,613 tensors and total_size 558,995,180,568 B for amd/Kimi-K2.5-MXFP4, 1.015T routed parameters.
The tiny checkpoints check the config-only path against real safetensors headers, tensor by tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eagle3 import plan as P
from eagle3.formats import sizing

KIMI = Path(__file__).parent / "data" / "kimi-k2.5"
GB = 10**9


@pytest.fixture(scope="module")
def kimi_models() -> dict[str, P.Model]:
    """The real Kimi-K2.5 INT4 config and the W4A8 / MXFP4 checkpoints eagle3 quantize writes from it."""
    return {"int4": P.load_model(KIMI), "w4a8": P.load_model(KIMI, recipe="w4a8"),
            "mxfp4": P.load_model(KIMI, recipe="mxfp4")}


def test_kimi_int4_config_only_matches_the_real_checkpoint(kimi_models: dict[str, P.Model]) -> None:
    m = kimi_models["int4"]
    assert m.source == "config"
    assert len(m.tensors) == 208_550  # the real tensor count (the published index)
    total, expert_bytes, expert_params = m.totals()
    assert total == 595_148_192_736  # ~595 GB = 554.3 GiB, the published size
    assert abs(total / 2**30 - 554.3) < 0.1
    assert expert_params == 60 * 384 * 3 * 2048 * 7168  # 1.015T routed parameters
    assert 570 * GB < expert_bytes < 571 * GB  # "about 571 GB as INT4" (issue 11)
    assert m.linear_formats == {"bf16": 659, "ct-int4 g32": 69_120}


def test_kimi_mxfp4_projection_matches_amd_checkpoint(kimi_models: dict[str, P.Model]) -> None:
    m = kimi_models["mxfp4"]
    assert len(m.tensors) == 139_613  # amd/Kimi-K2.5-MXFP4 (tokenspeed's test on the real snapshot)
    scales = [t for t in m.tensors if t.name.endswith(".weight_scale")]
    assert len(scales) == 69_303  # 69,120 routed + 180 shared + 3 dense
    data = m.totals()[0]
    # AMD's total_size counts whole files: tensor data plus 64 shard headers (~141 B per entry).
    headers = 558_995_180_568 - data
    assert 130 * len(m.tensors) < headers < 150 * len(m.tensors)
    w4a8 = kimi_models["w4a8"]
    assert len(w4a8.tensors) == 208_550 and w4a8.linear_formats["quark-w4a8"] == 69_120
    assert abs(w4a8.totals()[0] / 2**30 - 497) < 1.5  # ~497 GB(iB) per the ROCm blog


# (format, gpu) -> fits; weights per rank and the KV-cache capacity are checked by formula.
PROJECTIONS = [(f, g) for f in ("int4", "w4a8", "mxfp4") for g in ("mi325x", "mi355x", "h200")]


@pytest.mark.parametrize(("fmt", "gpu"), PROJECTIONS)
def test_kimi_projection_on_eight_gpus(kimi_models: dict[str, P.Model], fmt: str, gpu: str) -> None:
    m = kimi_models[fmt]
    p = P.plan(m, gpus=8, gpu=gpu, memory_fraction=0.9)
    assert p.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272  # ~70 KB per token in bf16 (61 layers x 576 latent)
    assert p.usable_memory == int(P.GPUS[gpu].memory * 0.9)
    assert p.kv_cache_bytes == p.usable_memory - p.max_weights_per_rank - P.DEFAULT_RESERVE
    assert p.kv_tokens == p.kv_cache_bytes // 70_272
    assert p.fits and p.full_length_sequences >= 2  # at least two 262144-token sequences everywhere
    r = p.per_rank[0]
    # Expert parallel: 48 of the 384 experts per rank, exactly an eighth of the expert bytes.
    assert all(x["routed_experts"] * 8 == p.routed_expert_bytes for x in p.per_rank)
    # Replicated: the embedding (163840 x 7168 bf16), q_a/kv_a + latent norms, router; lm_head split.
    assert r["embedding"] == 163840 * 7168 * 2
    assert r["lm_head"] == 163840 * 7168 * 2 // 8
    assert r["attn_replicated"] == 61 * 2 * (1536 * 7168 + 576 * 7168 + 1536 + 512)
    assert r["router"] == 60 * (384 * 7168 * 2 + 384 * 4)
    assert r["attn_split"] == 61 * 2 * (12288 * 1536 + 16384 * 512 + 7168 * 8192) // 8
    assert p.not_loaded_bytes > 0 and p.loaded_bytes + p.not_loaded_bytes == p.checkpoint_bytes
    assert 64 * GB < p.max_weights_per_rank < 80 * GB  # the paper figure (docs/scale.md): about 75 GB


def test_int4_does_not_fit_eight_h100s(kimi_models: dict[str, P.Model]) -> None:
    p = P.plan(kimi_models["int4"], gpus=8, gpu="h100")
    assert not p.fits and p.kv_tokens == 0 and "exceed" in p.why
    fp8 = P.plan(kimi_models["int4"], gpus=8, gpu="mi325x", kv_cache_dtype="fp8")
    assert fp8.kv_bytes_per_token == 61 * 576
    split = P.plan(kimi_models["int4"], gpus=8, gpu="mi325x", embedding="vocab-split")
    assert split.per_rank[0]["embedding"] == 163840 * 7168 * 2 // 8


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run the console entry point in-process: (exit code, stdout, stderr)."""
    from eagle3.cli import main

    code = 0
    try:
        main(list(args))
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_cli_json_and_report(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "plan.json"
    code, out, _ = _main(capsys, "plan", str(tiny_dir / "kimi-k2.5"), "--gpus", "2", "--gpu-memory", "8GiB",
                         "--memory-fraction", "0.5", "--reserve", "64MiB", "--draft",
                         str(tiny_dir / "kimi-k2.6-eagle3.1-mla" / "config.json"), "--json", "--report", str(report))
    assert code == 0
    j = json.loads(out)
    assert j == json.loads(report.read_text())
    # 8 GiB: one 262144-token sequence of the 576-wide latent (7 layers + the MLA draft's) needs 2.25 GiB
    assert j["gpu_memory"] == 2**33 and j["usable_memory"] == 2**32 and j["reserve"] == 64 * 2**20
    assert j["source"] == "headers" and j["draft_source"] == "headers" and j["fits"]
    assert j["kv_tokens"] == (2**32 - j["max_weights_per_rank"] - 64 * 2**20) // j["kv_bytes_per_token"]
    assert len(j["per_rank"]) == 2 and j["schema_version"] == 1


@pytest.fixture(scope="module")
def cfg_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real config alone in a directory (no weights beside it), shared by the CLI tests below:
    one path, so the process loads its 208k-tensor inventory once for all of their plans."""
    out = tmp_path_factory.mktemp("kimi-config") / "kimi"
    out.mkdir()
    shutil.copy(KIMI / "config.json", out / "config.json")
    return out


def test_plan_cli_text_on_the_real_config(cfg_only: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _main(capsys, "plan", str(cfg_only), "--gpus", "8", "--gpu", "mi355x")
    assert code == 0
    assert "(config; Linears: bf16 x659, ct-int4 g32 x69120)" in out
    assert "1.015T routed-expert parameters, 570.76 GB" in out
    assert "routed experts" in out and "expert parallel" in out and "fits        yes" in out


def test_serve_dry_run_plan_prints_the_same_projection(cfg_only: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`eagle3 serve --dry-run --plan` is `eagle3 plan` for the serve command's target, draft and
    --tensor-parallel-size GPUs, from the config alone (no weights beside it); nothing is loaded."""
    code, served, _ = _main(capsys, "serve", str(cfg_only), "--dry-run", "--plan", "--tensor-parallel-size", "8",
                            "--gpu", "h200", "--max-model-len", "131072")
    assert code == 0
    code, planned, _ = _main(capsys, "plan", str(cfg_only), "--gpus", "8", "--gpu", "h200", "--max-model-len", "131072")
    assert code == 0 and served == planned
    assert "8 x NVIDIA H200" in served and "fits        yes" in served and "131072-token sequences" in served
    # the draft is part of the plan (replicated); fp8 KV cache as serve spells it
    draft = Path(__file__).parent / "data" / "kimi-k2.5-eagle3"
    code, served, _ = _main(capsys, "serve", str(cfg_only), "--draft", str(draft), "--dry-run", "--plan",
                            "--tensor-parallel-size", "8", "--gpu-memory", "141GiB", "--kv-cache-dtype", "fp8_e4m3")
    code2, planned, _ = _main(capsys, "plan", str(cfg_only), "--draft", str(draft), "--gpus", "8",
                              "--gpu-memory", "141GiB", "--kv-cache-dtype", "fp8")
    assert code == code2 == 0 and served == planned and "draft" in served
    # one-line errors: a GPU without --plan, --dry-run with neither --engine nor --plan, no GPU memory
    code, _, err = _main(capsys, "serve", str(cfg_only), "--gpu", "h200")
    assert code == 2 and err.strip() == "error: --gpu / --gpu-memory go with --plan"
    code, _, err = _main(capsys, "serve", str(cfg_only), "--dry-run")
    assert code == 2 and err.strip() == "error: --dry-run goes with --engine vllm|sglang|atom or --plan"
    code, _, err = _main(capsys, "serve", str(cfg_only), "--dry-run", "--plan")
    assert code == 2 and "give --gpu" in err


def test_plan_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _main(capsys, "plan", str(KIMI), "--gpu", "tpu")
    assert code == 2 and err.strip() == ("error: --gpu 'tpu': choose from h100, h100-pcie, h100-nvl, h200, mi300x, "
                                         "mi325x, mi355x (or give --gpu-memory)")
    code, _, err = _main(capsys, "plan", str(tmp_path / "nowhere"), "--gpu", "h200")
    assert code == 2 and "nowhere" in err and len(err.strip().splitlines()) == 1
    code, _, err = _main(capsys, "plan", str(KIMI))
    assert code == 2 and "--gpu-memory" in err
    code, _, err = _main(capsys, "plan", str(KIMI), "--gpu-memory", "lots")
    assert code == 2 and "--gpu-memory 'lots'" in err


# ---------------------------------------------------------------------------------------------
# Config-only sizing == safetensors headers, on real files
# ---------------------------------------------------------------------------------------------


def _specs(tensors: list[sizing.TensorSpec]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {t.name: (t.dtype, t.shape) for t in tensors}


@pytest.mark.parametrize("name", ["kimi-k2.5", "kimi-k2-thinking", "kimi-k2.5-eagle3", "kimi-k2.5-eagle3-d2t",
                                  "kimi-k2.6-eagle3.1-mla", "speculators-eagle3"])
def test_config_sizing_equals_headers_on_tiny(tiny_dir: Path, name: str) -> None:
    cfg = json.loads((tiny_dir / name / "config.json").read_text())
    assert _specs(sizing.config_tensors(cfg)) == _specs(sizing.header_tensors(tiny_dir / name) or [])


def test_a_local_model_is_loaded_again_when_its_config_changes(tiny_dir: Path, tmp_path: Path) -> None:
    """load_model hands back the same Model for unchanged files (plans share its inventory) and a
    new one once the config is rewritten or a projection / name differs."""
    d = tmp_path / "t"
    shutil.copytree(tiny_dir / "kimi-k2.5-eagle3", d)
    m = P.load_model(d)
    assert P.load_model(d) is m and P.load_model(d, name="other") is not m
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_attention_heads"] *= 2
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    again = P.load_model(d)
    assert again is not m and again.config["num_attention_heads"] == cfg["num_attention_heads"]


@pytest.mark.parametrize(("recipe", "scope"), [("w4a8", None), ("mxfp4", None), ("mxfp4", "experts")])
def test_recipe_projection_equals_quantized_headers(tiny_dir: Path, tmp_path: Path, recipe: str,
                                                    scope: str | None) -> None:
    """`plan --recipe` sizes exactly what `eagle3 quantize` writes (no weights read)."""
    from eagle3.quantize import quantize

    out = tmp_path / "q"
    quantize(tiny_dir / "kimi-k2.5", out, recipe, scope, workers=1, engine="native")
    written = _specs(sizing.header_tensors(out) or [])
    projected = P.load_model(tiny_dir / "kimi-k2.5", recipe=recipe, scope=scope)
    assert _specs(projected.tensors) == written
    assert projected.config["quantization_config"] == json.loads((out / "config.json").read_text())["quantization_config"]
    # and the written config alone sizes the written files
    assert _specs(sizing.config_tensors(json.loads((out / "config.json").read_text()))) == written
    with_headers = P.load_model(out)
    assert with_headers.source == "headers"
    a = P.plan(with_headers, gpus=2, gpu_memory=2**30, reserve=0)
    b = P.plan(projected, gpus=2, gpu_memory=2**30, reserve=0)
    assert a.per_rank == b.per_rank


def test_tiny_plan_with_draft_on_two_ranks(tiny_dir: Path) -> None:
    p = P.plan(tiny_dir / "kimi-k2.5", gpus=2, gpu_memory=2**30, reserve=0, draft=tiny_dir / "kimi-k2.5-eagle3")
    assert p.source == "headers" and p.draft_source == "headers"
    draft_bytes = sum(t.nbytes for t in sizing.header_tensors(tiny_dir / "kimi-k2.5-eagle3") or [])
    assert [r["draft"] for r in p.per_rank] == [draft_bytes, draft_bytes]  # replicated
    # target latent (512 + 64) x 7 layers + Llama draft K and V (2 x 4 heads x 32) x 1 layer, bf16
    assert p.kv_bytes_per_token_target == 7 * 576 * 2 and p.kv_bytes_per_token_draft == 2 * 4 * 32 * 2
    # 8 tiny experts: ranks hold experts 0-3 and 4-7; every byte of the checkpoint is placed once or
    # replicated, never lost
    tiny_experts = [t.nbytes for t in sizing.header_tensors(tiny_dir / "kimi-k2.5") or [] if ".mlp.experts." in t.name]
    assert sum(r["routed_experts"] for r in p.per_rank) == sum(tiny_experts)


def test_kimi_with_the_lightseek_draft_config(kimi_models: dict[str, P.Model]) -> None:
    """TorchSpec's init config of lightseekorg/kimi-k2.5-eagle3 (its published config.json): 3.18B bf16
    parameters, replicated; its one MHA layer adds 2 x 64 heads x 128 values per token to the cache."""
    draft = KIMI.parent / "kimi-k2.5-eagle3"
    p = P.plan(kimi_models["int4"], gpus=8, gpu="h200", draft=draft)
    assert p.draft_source == "config"
    assert p.draft_bytes == 3_178_262_528 * 2 and all(r["draft"] == p.draft_bytes for r in p.per_rank)
    assert p.kv_bytes_per_token == 70_272 + 2 * 64 * 128 * 2
    alone = P.plan(kimi_models["int4"], gpus=8, gpu="h200")
    assert p.max_weights_per_rank == alone.max_weights_per_rank + p.draft_bytes
    assert p.kv_tokens == (alone.kv_cache_bytes - p.draft_bytes) // p.kv_bytes_per_token


def test_plan_accepts_a_repo_id(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """A Hub repo is planned from its config and safetensors headers; no shard is downloaded."""
    from huggingface_hub import constants

    from eagle3.testing.fakehub import FakeHub

    with FakeHub() as hub:
        hub.add_repo("moonshotai/Kimi-K2.5", tiny_dir / "kimi-k2.5")
        hub.add_repo("lightseekorg/kimi-k2.5-eagle3", tiny_dir / "kimi-k2.5-eagle3")
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
        code, out, err = _main(capsys, "plan", "moonshotai/Kimi-K2.5", "--draft", "lightseekorg/kimi-k2.5-eagle3",
                               "--gpus", "2", "--gpu-memory", "1GiB", "--json")
    assert code == 0, err
    remote = json.loads(out)
    assert not list((tmp_path / "cache").rglob("*.safetensors"))
    assert remote["target"] == "moonshotai/Kimi-K2.5" and remote["source"] == remote["draft_source"] == "headers"
    local = P.plan(tiny_dir / "kimi-k2.5", gpus=2, gpu_memory=2**30, draft=tiny_dir / "kimi-k2.5-eagle3")
    assert remote["per_rank"] == local.per_rank and remote["kv_tokens"] == local.kv_tokens


def test_kimi_int4_on_two_nodes_of_eight_h100(capsys: pytest.CaptureFixture[str]) -> None:
    """The published INT4 checkpoint does not fit eight H100s but fits sixteen (two nodes of eight):
    `plan --gpus 16` and `serve --dry-run --plan --tensor-parallel-size 16 --nnodes 2` say so."""
    eight = P.plan(KIMI, gpus=8, gpu="h100")
    sixteen = P.plan(KIMI, gpus=16, gpu="h100")
    assert not eight.fits and eight.nodes == 1
    assert sixteen.fits and sixteen.nodes == 2 and sixteen.gpus_per_node == 8
    assert sixteen.max_weights_per_rank < 0.55 * eight.max_weights_per_rank  # experts and heads halve
    code, out, _ = _main(capsys, "plan", str(KIMI), "--gpus", "16", "--gpu", "h100")
    assert code == 0
    assert ("nodes       2 x 8 GPUs: eagle3 serve TARGET --tensor-parallel-size 16 --nnodes 2 --node-rank 0..1 "
            "--dist-init-addr NODE0:PORT") in out
    assert "fits        yes" in out
    code, served, _ = _main(capsys, "serve", str(KIMI), "--dry-run", "--plan", "--tensor-parallel-size", "16",
                            "--nnodes", "2", "--gpu", "h100")
    assert code == 0 and served == out


@pytest.mark.parametrize("draft", ["kimi-k2.5-eagle3", "kimi-k2.6-eagle3.1-mla"])
def test_plan_and_runtime_size_the_kv_cache_alike(tiny_dir: Path, draft: str) -> None:
    """One KV formula: the plan's bytes per token (from the configs) are what the engine's cache takes
    (from its tensors), for the MLA target with a Llama or an MLA draft, at bf16 and at fp8."""
    from eagle3.runtime.engine.llm import LLM

    for kv in ("bf16", "fp8"):
        p = P.plan(tiny_dir / "kimi-k2.5", gpus=1, gpu_memory=2**30, draft=tiny_dir / draft, kv_cache_dtype=kv)
        llm = LLM(tiny_dir / "kimi-k2.5", tiny_dir / draft, dtype="bfloat16", kv_cache_dtype=kv, num_blocks=4,
                  tokenizer=None, max_model_len=32)
        assert llm.kv_cache_info()["kv_bytes_per_token"] == p.kv_bytes_per_token, (kv, draft)
