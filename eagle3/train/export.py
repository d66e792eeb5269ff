"""The trained draft on disk: the ``eagle3`` draft profile (what ``eagle3 convert --engine ...``
reads and converts to every engine), written with the profile's own config renderer
(:func:`eagle3.formats.profiles.render_config`) and :class:`eagle3.checkpoint.CheckpointWriter`.

* :func:`fresh_draft_config`: the config of a new draft sized after the target (hidden width,
  heads, RoPE, special ids; the MLA draft takes the target's MLA latent sizes).
* :func:`provisional_spec`: the runtime :class:`~eagle3.runtime.config.DraftSpec` of such a config,
  to build the module that writes the first checkpoint (afterwards the spec is always read back
  from the files by the runtime's own ``draft_spec``).
* :func:`write_draft`: tensors (bf16) + config, in the canonical order of the draft formats.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import CheckpointWriter, write_json
from eagle3.formats import detect, keys, profiles
from eagle3.runtime.config import DraftSpec, MHASpec, MLASpec, RopeSpec

_LLAMA_HEAD_DIM_LARGE = 128  # lightseek's Kimi draft: 64 heads x 128 (hidden 7168 is not a multiple of 128)


def _target_ids(tc: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = tc.get(k, top.get(k))
        if v is not None:
            out[k] = copy.deepcopy(v)
    return out


def fresh_draft_config(target: Path, arch: str, eagle31: bool, draft_vocab_size: int | None,
                       aux_ids: list[int]) -> dict[str, Any]:
    """``config.json`` (eagle3 profile) of a new one-layer draft for ``target``."""
    top = detect.load_config(target)
    tc = detect.text_config(top)
    hidden, heads = int(tc["hidden_size"]), int(tc["num_attention_heads"])
    vocab = int(tc["vocab_size"])
    common = {
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(tc["intermediate_size"]),
        "max_position_embeddings": int(tc.get("max_position_embeddings", 4096)),
        "num_attention_heads": heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": heads,
        "rms_norm_eps": float(tc["rms_norm_eps"]),
        "rope_theta": float(tc.get("rope_theta", 10000.0)),
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": vocab,
        **_target_ids(tc, top),
    }
    if tc.get("rope_scaling") is not None:
        common["rope_scaling"] = copy.deepcopy(tc["rope_scaling"])
    if arch == "mla":
        mla = {k: tc[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
        layer = {"model_type": "kimi_k2", **common, **mla,
                 "head_dim": int(mla["qk_nope_head_dim"]) + int(mla["qk_rope_head_dim"])}
    else:
        hd = hidden // heads if hidden % heads == 0 and hidden // heads <= _LLAMA_HEAD_DIM_LARGE else \
            _LLAMA_HEAD_DIM_LARGE
        layer = {"model_type": "llama", **common, "head_dim": hd}
    spec = profiles.DraftSpec(
        variant=arch, layer=layer, draft_vocab_size=draft_vocab_size or vocab, target_hidden_size=hidden,
        aux_input_ids=list(aux_ids), fc_norm=eagle31, norm_output=eagle31, norm_before_fc=False,
        norm_before_residual=False)
    cfg, _ = profiles.render_config(profiles.get_profile("eagle3"), spec)
    return cfg


def provisional_spec(cfg: dict[str, Any]) -> DraftSpec:
    """The runtime spec of a :func:`fresh_draft_config` config (no files needed)."""
    where = "fresh draft config"
    eps = float(cfg["rms_norm_eps"])
    mha = mla = None
    if cfg.get("kv_lora_rank") is not None:
        mla = MLASpec.from_config(cfg, where, eps, None)
    else:
        hd = int(cfg["head_dim"])
        mha = MHASpec(num_heads=int(cfg["num_attention_heads"]), num_kv_heads=int(cfg["num_key_value_heads"]),
                      head_dim=hd, rope=RopeSpec.from_config(cfg, hd, interleaved=False, where=where))
    ids = tuple(cfg["eagle_aux_hidden_state_layer_ids"])
    return DraftSpec(
        hidden_size=int(cfg["hidden_size"]), target_hidden_size=int(cfg["target_hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
        draft_vocab_size=int(cfg["draft_vocab_size"]), rms_norm_eps=eps, attention="mla" if mla else "mha",
        mha=mha, mla=mla, num_aux=len(ids), aux_layer_ids=ids, layer_prefix=keys.LAYERS0,
        fc_norm=bool(cfg["fc_norm"]), norm_output=bool(cfg["norm_output"]),
        has_d2t=int(cfg["draft_vocab_size"]) != int(cfg["vocab_size"]))


def _order(name: str) -> tuple[int, str]:
    """embed, fc, fc_norm, the layer, norm, lm_head, d2t: the order every draft format uses."""
    if name == keys.DRAFT_EMBED:
        return 0, name
    if name == keys.DRAFT_FC or name == keys.DRAFT_INPUT_NORM:
        return 1, name
    if keys.fc_norm_index(name) is not None:
        return 2, name
    if name == keys.DRAFT_NORM:
        return 4, name
    if name == keys.DRAFT_LM_HEAD:
        return 5, name
    if name == keys.D2T:
        return 6, name
    return 3, name


def write_draft(d: Path, config: dict[str, Any], state: dict[str, torch.Tensor], d2t: torch.Tensor | None,
                dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``state`` (module state dict: on-disk names) as a draft checkpoint in ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype) for k, v in state.items()}
    if d2t is not None:
        tensors[keys.D2T] = d2t.to(torch.int64).cpu()
    with CheckpointWriter(d) as w:
        for name in sorted(tensors, key=_order):
            w.add(name, tensors[name].contiguous())
    write_json(d / detect.CONFIG_FILE, config)
