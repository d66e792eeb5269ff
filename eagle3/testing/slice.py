"""A Kimi-K2.5 slice at the real tensor shapes, in Moonshot's on-disk format (``eagle3 make-slice``).

The tiny fixtures (:mod:`eagle3.testing.tiny`) prove formats and numerics; they cannot show what the
runtime does with real sizes (memory per rank, load time, tokens/s). A slice keeps every real width
(hidden 7168, 64 MLA heads, q_lora 1536, kv_lora 512, qk_nope 128 / qk_rope 64 / v 128, vocab
163840, expert width 2048, dense width 18432, one shared expert, noaux_tc sigmoid routing) and cuts
only the depth and the expert count: ``layers`` decoder layers (layer 0 dense when there are two or
more, the rest MoE; a 1-layer slice is one MoE layer so that it still has experts) with ``experts``
routed experts each (top-``min(8, experts)``).

The files are what :mod:`eagle3.testing.tiny` writes for the tiny ``kimi-k2.5``, at full width: the
``KimiK25ForConditionalGeneration`` wrapper config, ``language_model.*`` text stack in bf16 with
compressed-tensors pack-quantized INT4 group-32 routed experts (int32 ``weight_packed``, bf16
``weight_scale``, ``weight_shape``), the ``e_score_correction_bias`` in fp32, the tiny MoonViT tower
and projector (projecting to 7168), the tiny tokenizer and side files (token ids < 1024 of the
163840-row embedding are the ones in use).

``make_draft_slice`` writes an EAGLE-3 draft at the real widths for such a slice (lightseek's Llama
draft for K2.5, or the MLA EAGLE-3.1 draft; full vocabulary, aux layers that exist in the slice),
with random weights: speculative decoding with it runs every step at its real cost and accepts
nothing, which is what a GPU benchmark of step costs (chain vs tree, graphs) needs.

Written streaming: the tensor list comes from the config (:func:`eagle3.formats.sizing.config_tensors`,
the same accounting ``eagle3 plan`` uses), shards are planned up front (:class:`ShardLayout`) and each
tensor is generated and written a block of rows at a time (at most ~64 MB in memory), so a 2-layer
32-expert slice (6.8 GB) never sits in memory. Every byte is a pure function of ``seed`` (one random
stream per tensor name, fixed row blocks).

The weight matrices and the embedding are uniform (256 levels, mean 0, std ``1/sqrt(fan_in)``), not
Gaussian: they are made of random bytes, which the generator draws 8 at a time, ~7x less CPU than
``torch.randn`` (a 2-layer 32-expert slice holds ~3e9 values). Random weights only have to keep
the activations at their scale for a benchmark of step costs; their distribution's shape does not
matter there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import (
    DEFAULT_SHARD_BYTES,
    ShardFile,
    ShardLayout,
    atomic_output,
    check_output,
    dtype_from_tag,
    write_json,
)
from eagle3.checkpoint.files import INDEX_FILE
from eagle3.errors import UsageError
from eagle3.formats import sizing
from eagle3.formats.detect import new_draft_aux_layer_ids
from eagle3.formats.sizing import TensorSpec
from eagle3.testing import tiny

# The real Kimi-K2.5 text widths (moonshotai/Kimi-K2.5's config.json, text_config).
KIMI_K25_DIMS: dict[str, int] = {
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_shared_experts": 1,
}
# lightseek's K2.5 EAGLE-3 draft (LlamaForCausalLMEagle3, one decoder layer over 2 x hidden inputs).
KIMI_EAGLE3_DIMS: dict[str, int] = {
    "hidden_size": 7168,
    "intermediate_size": 12288,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "head_dim": 128,
}
DRAFT_KINDS = ("eagle3", "eagle3.1-mla")
MAX_TOP_K = 8
BLOCK_ELEMENTS = 16 * 1024 * 1024  # values generated per row block (fp32 working set ~64 MB)


def slice_config(layers: int, experts: int, vocab: int = KIMI_K25_DIMS["vocab_size"]) -> dict[str, Any]:
    """The slice's config.json: the tiny K2.5 wrapper config with the real widths, ``layers``
    layers and ``experts`` routed experts. ``vocab`` exists for fast tests of the writer only."""
    if layers < 1:
        raise UsageError(f"--layers {layers}: a slice needs at least one layer")
    if experts < 1:
        raise UsageError(f"--experts {experts}: a slice needs at least one routed expert")
    _check_vocab(vocab)
    cfg = tiny.kimi_k25_config()
    tc = cfg["text_config"]
    tc.update(KIMI_K25_DIMS)
    tc.update({"vocab_size": vocab, "num_hidden_layers": layers, "first_k_dense_replace": 1 if layers >= 2 else 0,
               "n_routed_experts": experts, "num_experts_per_tok": min(MAX_TOP_K, experts)})
    cfg["vision_config"]["text_hidden_size"] = KIMI_K25_DIMS["hidden_size"]
    return cfg


def _check_vocab(vocab: int) -> None:
    if vocab < tiny.VOCAB_SIZE:
        raise UsageError(f"--vocab {vocab}: must hold the tokenizer's {tiny.VOCAB_SIZE} ids")


def _generator(seed: int, name: str) -> torch.Generator:
    return tiny._generator(seed, f"slice/{name}")


def _random_bytes(g: torch.Generator, n: int) -> torch.Tensor:
    """``n`` uniform random bytes (uint8), drawn as int64 words: 8 bytes per draw of the generator."""
    words = torch.randint(-(2**63), 2**63 - 1, (-(-n // 8),), generator=g, dtype=torch.int64)
    return words.view(torch.uint8)[:n]


# The std of the 256 values b + 0.5 for an int8 b (symmetric about 0): sqrt((256**2 - 1) / 12).
_UNIFORM_INT8_STD = ((256**2 - 1) / 12) ** 0.5


def _uniform(g: torch.Generator, shape: tuple[int, ...], std: float, dtype: torch.dtype) -> torch.Tensor:
    """Uniform values of mean 0 and standard deviation ``std`` in ``dtype``: ``(b + 0.5) * c`` of
    random int8 ``b`` (b + 0.5 is exact in bf16; the product is the one rounding)."""
    b = _random_bytes(g, math.prod(shape)).view(torch.int8).view(shape)
    return b.to(dtype).add_(0.5).mul_(std / _UNIFORM_INT8_STD)


def _rows_per_block(shape: tuple[int, ...]) -> int:
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // max(row, 1))


def _fill(t: TensorSpec, seed: int) -> Callable[[int, int], torch.Tensor]:
    """``rows(r0, r1)`` -> rows r0:r1 of tensor ``t`` (called in order, from one random stream)."""
    g = _generator(seed, t.name)
    shape, name = t.shape, t.name
    tail = shape[1:]

    if name.endswith(".weight_packed"):
        # Uniform random words = uniform INT4 codes in [-8, 7] in every nibble.
        return lambda r0, r1: _random_bytes(g, (r1 - r0) * tail[0] * 4).view(torch.int32).view(r1 - r0, tail[0])
    if name.endswith(".weight_shape"):
        return lambda r0, r1: torch.zeros(r1 - r0, dtype=torch.int32)  # replaced in _write_tensor
    if name.endswith(".weight_scale") and t.dtype == "BF16":
        k = tail[0] * 32
        base = k**-0.5 / 4.6  # std of uniform codes in [-8, 7] is ~4.6: W = q * s has std ~ 1/sqrt(k)
        return lambda r0, r1: (base * torch.exp(0.25 * torch.randn((r1 - r0, *tail), generator=g))).to(torch.bfloat16)
    if name.endswith("e_score_correction_bias"):
        return lambda r0, r1: 0.05 * torch.randn(r1 - r0, generator=g)
    dt = dtype_from_tag(t.dtype)
    if len(shape) == 1:
        if "norm" in name and name.endswith(".weight"):
            return lambda r0, r1: (1.0 + 0.1 * torch.randn(r1 - r0, generator=g)).to(dt)
        return lambda r0, r1: (0.02 * torch.randn(r1 - r0, generator=g)).to(dt)
    std = 1.0 if "embed_tokens" in name else math.prod(tail) ** -0.5
    return lambda r0, r1: _uniform(g, (r1 - r0, *tail), std, dt)


def _write_tensor(f: ShardFile, t: TensorSpec, seed: int, logical: dict[str, tuple[int, int]]) -> None:
    if t.name.endswith(".weight_shape"):
        f.write(t.name, torch.tensor(logical[t.name[: -len(".weight_shape")]], dtype=torch.int32))
        return
    rows = _fill(t, seed)
    n = t.shape[0] if t.shape else 1
    step = _rows_per_block(t.shape)
    for r0 in range(0, n, step):
        f.write_rows(t.name, r0, rows(r0, min(n, r0 + step)))


def _plan_shards(tensors: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Shards in tensor order, capped at ``max_shard_bytes``; the vision tower and projector get a
    shard of their own, as in Moonshot's layout."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for t in tensors:
        first_vision = t.name.startswith(("vision_tower.", "mm_projector.")) and shards[-1] and \
            not shards[-1][-1].name.startswith(("vision_tower.", "mm_projector."))
        if shards[-1] and (size + t.nbytes > max_shard_bytes or first_vision):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def make_slice(out: str | Path, layers: int = 2, experts: int = 8, seed: int = 0, *,
               vocab: int = KIMI_K25_DIMS["vocab_size"], overwrite: bool = False,
               max_shard_bytes: int = DEFAULT_SHARD_BYTES,
               progress: Callable[[str, int], None] | None = None) -> Path:
    """Write a full-width Kimi-K2.5 slice into ``out`` (atomically, with ``manifest.json``).

    ``progress(name, nbytes)`` is called after each tensor (for a benchmark's or the CLI's log)."""
    tokenizer = tiny.build_tokenizer()

    def side_files(tmp: Path) -> None:
        tiny._write_tokenizer(tmp, tokenizer, "[EOS]", [tiny.EOS_ID, tiny.IM_END_ID, tiny.EOT_ID])

    return _write_checkpoint(out, slice_config(layers, experts, vocab), seed, overwrite, max_shard_bytes, progress,
                             side_files)


def draft_slice_config(kind: str, target_layers: int, vocab: int = KIMI_K25_DIMS["vocab_size"]) -> dict[str, Any]:
    """config.json of a full-width EAGLE-3 draft for a slice of ``target_layers`` layers: the tiny
    draft config of that format (``eagle3``: lightseek's Llama draft for K2.5; ``eagle3.1-mla``: the
    MLA EAGLE-3.1 draft) with the real widths, full vocabulary (its own embedding, as both ship)
    and aux ids that exist in the slice (input-to-layer, ``train-draft``'s default:
    :func:`eagle3.formats.detect.new_draft_aux_layer_ids`)."""
    if kind not in DRAFT_KINDS:
        raise UsageError(f"--draft {kind!r}: expected one of {', '.join(DRAFT_KINDS)}")
    if target_layers < 2:
        raise UsageError(f"--layers {target_layers}: a draft's three aux states need a target of at least 2 layers")
    _check_vocab(vocab)
    ids = list(new_draft_aux_layer_ids(target_layers)[0])
    eagle = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    if kind == "eagle3":
        cfg = tiny.eagle3_config()
        cfg.update(KIMI_EAGLE3_DIMS)
    else:
        cfg = tiny.eagle31_mla_config()
        cfg.update({k: KIMI_K25_DIMS[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                  "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                  "qk_rope_head_dim", "v_head_dim")})
        cfg.update({"intermediate_size": KIMI_K25_DIMS["intermediate_size"], "draft_vocab_size": vocab,
                    "target_hidden_size": KIMI_K25_DIMS["hidden_size"]})
    cfg.update({"vocab_size": vocab, "eagle_config": eagle})
    return cfg


def make_draft_slice(out: str | Path, kind: str = "eagle3.1-mla", target_layers: int = 2, seed: int = 0, *,
                     vocab: int = KIMI_K25_DIMS["vocab_size"], overwrite: bool = False,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                     progress: Callable[[str, int], None] | None = None) -> Path:
    """Write a full-width EAGLE-3 draft (random weights, :func:`draft_slice_config`) into ``out``,
    streaming as :func:`make_slice`. Its drafts are random, so speculation with it measures what
    a step costs at the real widths, never what it gains."""
    return _write_checkpoint(out, draft_slice_config(kind, target_layers, vocab), seed, overwrite, max_shard_bytes,
                             progress, None)


def _write_checkpoint(out: str | Path, cfg: dict[str, Any], seed: int, overwrite: bool, max_shard_bytes: int,
                      progress: Callable[[str, int], None] | None,
                      side_files: Callable[[Path], None] | None) -> Path:
    """The tensors ``cfg`` describes, generated a row block at a time into planned shards, with the
    index, config.json and ``side_files``; moved into ``out`` when complete."""
    out = check_output(out, overwrite)
    tensors = sizing.config_tensors(cfg, "slice config")
    logical = {t.name[: -len(".weight_packed")]: (t.shape[0], t.shape[1] * 8)
               for t in tensors if t.name.endswith(".weight_packed")}
    shards = _plan_shards(tensors, max_shard_bytes)
    with atomic_output(out, overwrite=overwrite) as tmp:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for fname, group in zip(names, shards, strict=True):
            layout = ShardLayout([(t.name, t.dtype, t.shape) for t in group])
            f = ShardFile(tmp / fname, layout)
            try:
                for t in group:
                    _write_tensor(f, t, seed, logical)
                    if progress is not None:
                        progress(t.name, t.nbytes)
            finally:
                f.close()
        write_json(tmp / INDEX_FILE, {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": dict(sorted((t.name, fname) for fname, group in zip(names, shards, strict=True)
                                      for t in group)),
        })
        write_json(tmp / "config.json", cfg)
        if side_files is not None:
            side_files(tmp)
    return out


def slice_bytes(layers: int, experts: int, vocab: int = KIMI_K25_DIMS["vocab_size"]) -> int:
    """Tensor bytes of a slice (what ``make_slice`` writes, before headers and side files)."""
    return sum(t.nbytes for t in sizing.config_tensors(slice_config(layers, experts, vocab), "slice config"))


def draft_slice_bytes(kind: str, target_layers: int, vocab: int = KIMI_K25_DIMS["vocab_size"]) -> int:
    """Tensor bytes of a draft slice (what ``make_draft_slice`` writes)."""
    return sum(t.nbytes for t in sizing.config_tensors(draft_slice_config(kind, target_layers, vocab), "slice config"))


__all__ = ["KIMI_K25_DIMS", "KIMI_EAGLE3_DIMS", "DRAFT_KINDS", "slice_config", "make_slice", "slice_bytes",
           "draft_slice_config", "make_draft_slice", "draft_slice_bytes"]
