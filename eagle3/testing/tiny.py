"""Tiny synthetic checkpoints in the exact upstream on-disk formats (tests and the demo use them).

``make_tiny(out)`` writes one directory per model under ``out``:

==========================  =======================================================================
``kimi-k2.5``               Moonshot Kimi-K2.5 wrapper (``KimiK25ForConditionalGeneration``), text
                            stack ``language_model.*`` with compressed-tensors INT4 routed experts,
                            a small MoonViT ``vision_tower.*`` and ``mm_projector.*``, 3 shards.
``kimi-k2-thinking``        Moonshot Kimi-K2-Thinking text-only form (``model.*``), same text weights.
``kimi-k2.5-eagle3``        lightseek / TorchSpec EAGLE-3 Llama draft (``midlayer.*``, full vocab).
``kimi-k2.5-eagle3-d2t``    SpecForge ``to_sglang`` draft: reduced vocab with ``d2t``/``t2d``, no embed.
``kimi-k2.6-eagle3.1-mla``  lightseek EAGLE-3.1 MLA draft (``layers.0.*``, ``fc_norm``, ``norm_output``).
``speculators-eagle3``      vllm speculators ``Eagle3Speculator`` format (reduced vocab).
==========================  =======================================================================

Every file is a pure function of ``seed``: the same seed gives byte-identical files. Each tensor
family draws from its own named random stream (``_generator(seed, stream)``), so writing a subset
with ``only=`` gives the same bytes as the full run, and the Kimi-K2.5 and K2-Thinking text weights
are identical (their logits can be compared).

The dimensions are the real models' structure scaled down (see :data:`TEXT_DIMS`: hidden 128, 4
heads, 7 layers), except the MLA latent and head dims, which are Kimi's real ones (kv_lora_rank 512,
qk_rope 64, qk_nope 128, v 128) so that other engines' MLA kernels run the fixtures; every Linear
in/out dimension is a multiple of 32 (the quantizer's group size), except the MoE router's 8 rows.
Weights are written by hand with :class:`eagle3.checkpoint.CheckpointWriter` rather than with
``save_pretrained``: transformers writes wrong Moonshot names for ``kimi_k25`` (it renames
``layers`` to ``blocks``), and other loaders need the exact upstream names.

Token ids: the tiny vocabulary has 1024 ids; 0..767 are a byte-level BPE trained (deterministically,
with the ``tokenizers`` library) on a small embedded English + arithmetic corpus, and 768..1023 are
Kimi's 256 reserved special tokens at Kimi's offsets (``tiny id = kimi id - 163584 + 768``). The
video placeholder has no Kimi token id (Kimi uses id 163840 = vocab size); we put it in the free
reserved slot 792 so that every id in the configs is inside the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import CheckpointWriter, atomic_output, check_output, write_json
from eagle3.errors import UsageError
from eagle3.testing.tiny_configs import (
    AUX_LAYER_IDS,
    AUX_LAYER_IDS_OUTPUT_OF,
    DRAFT_DIMS,
    DRAFT_VOCAB_SIZE,
    GROUP_SIZE,
    TEXT_DIMS,
    VISION_DIMS,
    eagle3_config,
    eagle3_d2t_config,
    eagle31_mla_config,
    kimi_k2_thinking_config,
    kimi_k25_config,
    speculators_config,
)
from eagle3.testing.tiny_tokenizer import _write_tokenizer, build_tokenizer, chat_template, corpus_text
from eagle3.testing.tiny_vocab import (
    BOS_ID,
    BPE_VOCAB_SIZE,
    EOS_ID,
    EOT_ID,
    IM_END_ID,
    MEDIA_PAD_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    STOP_IDS,
    TOKEN_IDS,
    UNK_ID,
    VOCAB_SIZE,
    kimi_to_tiny_id,
)
from eagle3.testing.tiny_weights import (
    _draft_common,
    _generator,
    _llama_midlayer,
    _mla_midlayer,
    _norm,
    _vision_tensors,
    _write_text_stack,
    d2t_t2d,
    draft_vocab_ids,
    int4_expert,
    target_embedding,
)

MODEL_NAMES: tuple[str, ...] = (
    "kimi-k2.5",
    "kimi-k2-thinking",
    "kimi-k2.5-eagle3",
    "kimi-k2.5-eagle3-d2t",
    "kimi-k2.6-eagle3.1-mla",
    "speculators-eagle3",
)
TARGETS = ("kimi-k2.5", "kimi-k2-thinking")
# Written only when named with ``only=`` / ``--only``: package data, not a function of the seed
# (see :mod:`eagle3.testing.trained`); kept out of MODEL_NAMES, which tests iterate as the random set.
EXTRA_MODEL_NAMES: tuple[str, ...] = ("kimi-k2.5-trained", "kimi-k2.5-trained-eagle3",
                                       "kimi-k2.5-trained-eagle3.1-mla")
DRAFTS = tuple(n for n in MODEL_NAMES if n not in TARGETS)


# Writers, one per model
# ---------------------------------------------------------------------------------------------


def _write_kimi_k25(d: Path, seed: int, tokenizer: Any) -> None:
    with CheckpointWriter(d) as w:
        _write_text_stack(w, seed, "language_model.")
        w.start_shard()
        for name, t in _vision_tensors(seed):
            w.add(name, t)
    write_json(d / "config.json", kimi_k25_config())
    _write_tokenizer(d, tokenizer, "[EOS]", [EOS_ID, IM_END_ID, EOT_ID])


def _write_kimi_k2_thinking(d: Path, seed: int, tokenizer: Any) -> None:
    with CheckpointWriter(d) as w:
        _write_text_stack(w, seed, "")
    write_json(d / "config.json", kimi_k2_thinking_config())
    _write_tokenizer(d, tokenizer, "<|im_end|>", [IM_END_ID, EOS_ID, EOT_ID])


def _write_draft(d: Path, config: dict[str, Any], common: dict[str, torch.Tensor],
                 layer: Iterable[tuple[str, torch.Tensor]], *, embed: torch.Tensor | None = None,
                 fc_norms: Sequence[torch.Tensor] = (), lm_head_shard: bool = False,
                 vocab_map: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The draft layout every format shares: [embed_tokens], fc, [fc_norm.i], the decoder layer,
    norm, lm_head (in its own shard with ``lm_head_shard``, as lightseek ships it), [d2t, t2d]."""
    with CheckpointWriter(d) as w:
        if embed is not None:
            w.add("embed_tokens.weight", embed)
        w.add("fc.weight", common["fc.weight"])
        for i, t in enumerate(fc_norms):
            w.add(f"fc_norm.{i}.weight", t)
        for name, t in layer:
            w.add(name, t)
        w.add("norm.weight", common["norm.weight"])
        if lm_head_shard:
            w.start_shard()
        w.add("lm_head.weight", common["lm_head.weight"])
        if vocab_map is not None:
            w.add("d2t", vocab_map[0])
            w.add("t2d", vocab_map[1])
    write_json(d / "config.json", config)


def _write_eagle3(d: Path, seed: int, tokenizer: Any) -> None:
    g = _generator(seed, "draft/kimi-k2.5-eagle3")
    common = _draft_common(g, VOCAB_SIZE)
    _write_draft(d, eagle3_config(), common, _llama_midlayer(g, "midlayer."), embed=target_embedding(seed),
                 lm_head_shard=True)


def _write_eagle3_d2t(d: Path, seed: int, tokenizer: Any) -> None:
    g = _generator(seed, "draft/kimi-k2.5-eagle3-d2t")
    common = _draft_common(g, DRAFT_VOCAB_SIZE)
    # SpecForge to_sglang drops embed_tokens (the target's is used).
    _write_draft(d, eagle3_d2t_config(), common, _llama_midlayer(g, "midlayer."),
                 vocab_map=d2t_t2d(draft_vocab_ids(tokenizer)))


def _write_eagle31_mla(d: Path, seed: int, tokenizer: Any) -> None:
    g = _generator(seed, "draft/kimi-k2.6-eagle3.1-mla")
    common = _draft_common(g, VOCAB_SIZE)
    fc_norms = [_norm(g, TEXT_DIMS["hidden_size"]) for _ in AUX_LAYER_IDS]  # drawn before the layer
    _write_draft(d, eagle31_mla_config(), common, _mla_midlayer(g, "layers.0."), embed=target_embedding(seed),
                 fc_norms=fc_norms, lm_head_shard=True)


def _write_speculators(d: Path, seed: int, tokenizer: Any) -> None:
    g = _generator(seed, "draft/speculators-eagle3")
    common = _draft_common(g, DRAFT_VOCAB_SIZE)
    _write_draft(d, speculators_config(), common, _llama_midlayer(g, "layers.0."), embed=target_embedding(seed),
                 vocab_map=d2t_t2d(draft_vocab_ids(tokenizer)))


def _write_kimi_k25_trained(d: Path, seed: int, tokenizer: Any) -> None:
    from eagle3.testing import trained

    trained.write_kimi_k25_trained(d, seed, tokenizer)


def _write_trained_draft(d: Path, seed: int, tokenizer: Any) -> None:
    from eagle3.testing import trained

    trained.write_trained_draft(d.name, d)


_WRITERS: dict[str, Callable[[Path, int, Any], None]] = {
    "kimi-k2.5": _write_kimi_k25,
    "kimi-k2-thinking": _write_kimi_k2_thinking,
    "kimi-k2.5-eagle3": _write_eagle3,
    "kimi-k2.5-eagle3-d2t": _write_eagle3_d2t,
    "kimi-k2.6-eagle3.1-mla": _write_eagle31_mla,
    "speculators-eagle3": _write_speculators,
    "kimi-k2.5-trained": _write_kimi_k25_trained,
    "kimi-k2.5-trained-eagle3": _write_trained_draft,
    "kimi-k2.5-trained-eagle3.1-mla": _write_trained_draft,
}


def _select(only: Iterable[str] | None) -> list[str]:
    if only is None:
        return list(MODEL_NAMES)
    wanted = list(only)
    unknown = [n for n in wanted if n not in _WRITERS]
    if unknown:
        raise UsageError(f"--only: unknown model {unknown[0]!r} "
                         f"(choose from {', '.join(MODEL_NAMES + EXTRA_MODEL_NAMES)})")
    if not wanted:
        raise UsageError("--only: no model named")
    return [n for n in MODEL_NAMES + EXTRA_MODEL_NAMES if n in wanted]


def make_tiny(out: str | Path, seed: int = 0, only: Iterable[str] | None = None,
              overwrite: bool = False) -> dict[str, Path]:
    """Write the tiny checkpoints into ``out/<name>`` (atomically, with ``out/manifest.json``).

    Returns ``{name: path}`` in :data:`MODEL_NAMES` order (then :data:`EXTRA_MODEL_NAMES`, written
    only when named in ``only``). Refuses an existing ``out`` unless
    ``overwrite`` (:class:`eagle3.errors.OutputExistsError`)."""
    names = _select(only)
    out = check_output(out, overwrite)  # refuse before any work
    tokenizer = build_tokenizer()
    with atomic_output(out, overwrite=overwrite) as tmp:
        for name in names:
            d = tmp / name
            d.mkdir()
            _WRITERS[name](d, seed, tokenizer)
    return {name: out / name for name in names}


__all__ = [
    "MODEL_NAMES", "EXTRA_MODEL_NAMES", "TARGETS", "DRAFTS", "VOCAB_SIZE", "BPE_VOCAB_SIZE", "SPECIAL_TOKENS", "TOKEN_IDS",
    "BOS_ID", "EOS_ID", "IM_END_ID", "EOT_ID", "PAD_ID", "UNK_ID", "MEDIA_PAD_ID", "STOP_IDS",
    "TEXT_DIMS", "DRAFT_DIMS", "VISION_DIMS", "AUX_LAYER_IDS", "AUX_LAYER_IDS_OUTPUT_OF", "DRAFT_VOCAB_SIZE",
    "GROUP_SIZE", "kimi_to_tiny_id", "make_tiny", "build_tokenizer", "draft_vocab_ids", "d2t_t2d",
    "int4_expert", "target_embedding", "corpus_text", "chat_template",
]
