"""``kimi-k2.5-trained``: a tiny Kimi-architecture target pre-trained on GSM8K (package data).

Unlike the random fixtures of :mod:`eagle3.testing.tiny`, this target writes GSM8K-style answers,
so a draft trained for it can be accepted and speculation can pay off. Its shape keeps Kimi's real
MLA latent sizes (``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64, ``qk_nope_head_dim`` 128,
``v_head_dim`` 128; the sizes vLLM's MLA backends accept), 2 heads, 4 decoder layers (layer 0
dense, layers 1-3 MoE with 8 routed experts top-2, noaux_tc sigmoid routing and one shared
expert), hidden 128 and the tiny 1024-token tokenizer.

The weights are produced by ``scripts/train_tiny_kimi.py`` (seeded) and shipped under
``eagle3/testing/data/kimi_k25_trained/`` in Moonshot's text names (``model.*``, ``lm_head.weight``),
bf16, with the routed experts already in compressed-tensors INT4 group-32 form (the codes the
runtime will see; training was quantization-aware), split into files under 5 MB, plus
``train_meta.json``. ``eagle3 make-tiny DIR --only kimi-k2.5-trained`` writes them as a Kimi-K2.5
checkpoint: the wrapper config, ``language_model.`` prefix, and the random tiny MoonViT tower.
"""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import CheckpointWriter, write_json
from eagle3.testing import tiny_configs, tiny_tokenizer, tiny_vocab, tiny_weights
from eagle3.testing.tiny_configs import KIMI_MLA_LATENT

NAME = "kimi-k2.5-trained"
DATA_DIR = "kimi_k25_trained"
MAX_FILE_BYTES = 5_000_000
META_FILE = "train_meta.json"

TRAINED_DIMS: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 384,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 2,
    "q_lora_rank": 128,
    **KIMI_MLA_LATENT,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
}
# The default "2, N//2, N-3" gives (2, 2, 1) for 4 layers; drafts for this target use these.
AUX_LAYER_IDS = (1, 2, 3)

# Drafts trained for the target with ``eagle3 train-draft`` (``scripts/train_tiny_drafts.py``),
# shipped exactly as that command writes them (the ``eagle3`` draft format, convertible to every
# engine): make-tiny name -> package-data directory.
DRAFTS: dict[str, str] = {
    "kimi-k2.5-trained-eagle3": "kimi_k25_trained_eagle3",  # Llama decoder layer, EAGLE-3
    "kimi-k2.5-trained-eagle3.1-mla": "kimi_k25_trained_eagle31_mla",  # DeepSeek MLA layer, EAGLE-3.1
}
DRAFT_FILES = ("config.json", "model.safetensors")


# GSM8K-style prompts of our own for the trained pair's tests and benchmarks: one worked exemplar in
# lm-eval's format, then a new question (what the target was trained to continue).
EXEMPLAR = ("Question: Sam has 4 bags with 6 apples in each bag. He gives 5 apples to Tara. How many apples "
            "does Sam have left?\nAnswer: Sam has 4 * 6 = <<4*6=24>>24 apples.\nHe has 24 - 5 = <<24-5=19>>19 "
            "apples left.\n#### 19\n\n")
QUESTIONS = ("Tom reads 12 pages every day. How many pages does he read in 3 weeks?",
             "A farmer has 45 cows. He sells a third of them and buys 8 more. How many cows does he have now?",
             "A shop sells pencils for $2 each. Anna buys 7 pencils and pays with a $20 bill. How much change "
             "does she get?")


def gsm8k_style_prompt(question: str) -> str:
    """The exemplar, then ``question`` in lm-eval's GSM8K format."""
    return f"{EXEMPLAR}Question: {question}\nAnswer:"


def text_config() -> dict[str, Any]:
    """The K2.5 ``text_config`` (``model_type kimi_k2``) with the trained model's dimensions."""
    c = tiny_configs.text_config(tiny_configs.ROPE_SCALING_K25, tiny_configs.IGNORE_K25, tiny_vocab.EOS_ID)
    c.update(TRAINED_DIMS)
    c["num_key_value_heads"] = TRAINED_DIMS["num_attention_heads"]
    return c


def kimi_k25_config() -> dict[str, Any]:
    c = tiny_configs.kimi_k25_config()
    c["text_config"] = text_config()
    c["vision_config"]["text_hidden_size"] = TRAINED_DIMS["hidden_size"]
    return c


def data_path(sub: str = DATA_DIR) -> Path:
    return Path(str(resources.files("eagle3.testing").joinpath("data", sub)))


def _shard_of(name: str) -> int:
    """File index of a tensor: the embedding and layers 0-1 in the first, the rest in the second."""
    if name.startswith("model.layers."):
        return 0 if int(name.split(".")[2]) < 2 else 1
    return 0 if name.startswith("model.embed_tokens") else 1


def write_package_data(out: Path, weights: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Write the trained weights (two safetensors files, each under 5 MB) and the metadata."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for k, v in weights.items():
        shards[_shard_of(k)][k] = v.contiguous()
    for i, sd in enumerate(shards):
        f = out / f"weights-{i + 1}.safetensors"
        save_file(sd, str(f), metadata={"format": "pt"})
        if f.stat().st_size > MAX_FILE_BYTES:
            raise RuntimeError(f"{f} is {f.stat().st_size} bytes, over the {MAX_FILE_BYTES} limit")
    (out / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def load_weights() -> dict[str, torch.Tensor]:
    """The shipped weights, Moonshot text names (``model.*``, ``lm_head.weight``)."""
    from safetensors.torch import load_file

    d = data_path()
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("weights-*.safetensors")):
        out.update(load_file(str(f)))
    if not out:
        raise FileNotFoundError(f"{d}: no trained weights (run scripts/train_tiny_kimi.py)")
    return out


def train_meta() -> dict[str, Any]:
    return json.loads((data_path() / META_FILE).read_text(encoding="utf-8"))


def _vision(seed: int) -> list[tuple[str, torch.Tensor]]:
    """The random tiny MoonViT + projector of :mod:`eagle3.testing.tiny`; the projector's output
    is re-drawn if the random fixtures' text width ever differs from this model's."""
    H = TRAINED_DIMS["hidden_size"]
    out = list(tiny_weights._vision_tensors(seed))
    if out[-1][1].shape[0] != H:
        g = tiny_weights._generator(seed, "vision/trained-projector")
        m = out[-2][1].shape[1]
        out[-2] = ("mm_projector.proj.2.weight", tiny_weights._linear(g, H, m))
        out[-1] = ("mm_projector.proj.2.bias", tiny_weights._bias(g, H))
    return out


def write_kimi_k25_trained(d: Path, seed: int, tokenizer: Any) -> None:
    """make-tiny writer: the K2.5 wrapper layout (``language_model.*``, 3 shards like the random
    fixture: layers split at the middle, then the vision tower)."""
    weights = load_weights()
    n = TRAINED_DIMS["num_hidden_layers"]

    def layer_of(k: str) -> int:
        return int(k.split(".")[2]) if k.startswith("model.layers.") else (-1 if "embed_tokens" in k else n)

    names = sorted(weights, key=lambda k: (layer_of(k), k))
    with CheckpointWriter(d) as w:
        split = False
        for k in names:
            if not split and layer_of(k) >= (n + 1) // 2:
                w.start_shard()
                split = True
            w.add("language_model." + k, weights[k])
        w.start_shard()
        for name, t in _vision(seed):
            w.add(name, t)
    write_json(d / "config.json", kimi_k25_config())
    tiny_tokenizer._write_tokenizer(d, tokenizer, "[EOS]", [tiny_vocab.EOS_ID, tiny_vocab.IM_END_ID, tiny_vocab.EOT_ID])


def write_trained_draft(name: str, d: Path) -> None:
    """make-tiny writer of a shipped trained draft: its files byte for byte."""
    src = data_path(DRAFTS[name])
    missing = [f for f in DRAFT_FILES if not (src / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{src / missing[0]}: trained draft {name!r} is not shipped "
                                "(run scripts/train_tiny_drafts.py)")
    for f in DRAFT_FILES:
        shutil.copyfile(src / f, d / f)


def draft_meta(name: str) -> dict[str, Any]:
    """How a shipped draft was trained: the command, steps and the held-out acceptance it reached."""
    return json.loads((data_path(DRAFTS[name]) / META_FILE).read_text(encoding="utf-8"))


__all__ = ["DRAFTS", "write_trained_draft", "draft_meta", "NAME", "TRAINED_DIMS", "AUX_LAYER_IDS", "text_config", "kimi_k25_config", "load_weights",
           "train_meta", "write_package_data", "write_kimi_k25_trained"]
