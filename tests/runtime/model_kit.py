"""Shared helpers for the runtime model tests: a minimal paged-KV bookkeeper that builds
``AttnMetadata`` the way the engine does (block tables with scattered physical blocks), and
forwards over token chunks."""

from __future__ import annotations

import random

import torch

from eagle3.runtime.context import AttnMetadata
from eagle3.runtime.interfaces import allocate_kv_cache


class PagedKV:
    """Per-sequence block tables over one pool; ``step`` schedules ``{seq: tokens}`` and returns
    (input_ids, meta). Physical blocks are handed out in a shuffled order so that any confusion
    between logical and physical blocks shows up. Caches, ids and metadata live on the model's
    device (the backend's: a model loaded onto a GPU runs there)."""

    def __init__(self, model, num_blocks: int = 96, block_size: int = 4, seed: int = 0, num_layers: int | None = None):
        self.device = model.backend.device
        self.block_size = block_size
        self.caches = allocate_kv_cache(model.kv_cache_spec(), num_layers or model.num_layers, num_blocks, block_size,
                                        self.device)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[object, list[int]] = {}
        self.lens: dict[object, int] = {}

    def step(self, batch: dict[object, list[int]], start: dict[object, int] | None = None) -> tuple[torch.Tensor, AttnMetadata]:
        """Schedule ``batch[seq]`` new tokens per sequence (positions continue from the committed
        length, or from ``start[seq]`` to overwrite, as after a rejection)."""
        ids, pos, slots, cu, ctx = [], [], [], [0], []
        for sid, toks in batch.items():
            table = self.tables.setdefault(sid, [])
            p0 = (start or {}).get(sid, self.lens.get(sid, 0))
            for j, tok in enumerate(toks):
                p = p0 + j
                while p // self.block_size >= len(table):
                    table.append(self.free.pop())
                ids.append(tok)
                pos.append(p)
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            self.lens[sid] = p0 + len(toks)
            cu.append(cu[-1] + len(toks))
            ctx.append(self.lens[sid])
        width = max(len(self.tables[s]) for s in batch)
        bt = torch.full((len(batch), width), -1, dtype=torch.int32)
        for b, sid in enumerate(batch):
            bt[b, : len(self.tables[sid])] = torch.tensor(self.tables[sid], dtype=torch.int32)
        dev = self.device
        meta = AttnMetadata(positions=torch.tensor(pos, dtype=torch.int64, device=dev),
                            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
                            context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
                            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                            block_tables=bt.to(dev), block_size=self.block_size)
        return torch.tensor(ids, dtype=torch.int64, device=dev), meta


# ---------------------------------------------------------------------------------------------
# Quantized variants of the tiny INT4 target, built with eagle3.formats.codecs
# ---------------------------------------------------------------------------------------------

_QSPEC = {"is_dynamic": False, "symmetric": True, "round_method": "half_even", "scale_type": "float32",
          "ch_axis": None, "group_size": None, "block_size": None, "scale_format": None,
          "scale_calculation_mode": None, "observer_cls": "PerTensorMinMaxObserver", "is_scale_quant": False}


def _spec(**kw) -> dict:
    return {**_QSPEC, **kw}


def quark_config(scheme: str) -> dict:
    """A Quark 0.13-style export config for the routed experts (attention, shared experts,
    router, dense MLP and lm_head stay bf16: excluded by regex)."""
    if scheme == "w4a8":
        weight = [_spec(dtype="fp8_e4m3", qscheme="per_tensor"),
                  _spec(dtype="int4", qscheme="per_channel", ch_axis=0, observer_cls="PerChannelMinMaxObserver")]
        inp = _spec(dtype="fp8_e4m3", qscheme="per_tensor", is_dynamic=True)
    elif scheme == "int4":
        weight = _spec(dtype="int4", qscheme="per_channel", ch_axis=0, observer_cls="PerChannelMinMaxObserver")
        inp = None
    elif scheme == "mxfp4":
        weight = _spec(dtype="fp4", qscheme="per_group", group_size=32, ch_axis=-1, scale_format="e8m0",
                       scale_calculation_mode="even", round_method="even", scale_type="float",
                       observer_cls="PerBlockMXObserver", mx_element_dtype="fp4")
        inp = {**weight, "is_dynamic": True}
    else:
        raise ValueError(scheme)
    return {
        "quant_method": "quark",
        "global_quant_config": {"weight": weight, "input_tensors": inp, "output_tensors": None, "bias": None,
                                "target_device": None},
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "exclude": ["re:.*self_attn\\..*", "re:.*mlp\\.gate$", "re:.*lm_head$", "re:.*shared_experts\\..*",
                    "re:.*mlp\\.(gate|up|down)_proj$"],
        "algo_config": None, "softmax_quant_spec": None, "kv_cache_quant_config": {}, "kv_cache_post_rope": False,
        "quant_mode": "eager_mode", "version": "0.13",
        "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                   "weight_format": "real_quantized", "weight_merge_groups": None},
    }


def quark_w4a8_expert(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Quark W4A8: FP8 per-tensor stage, then INT4 per-channel (reorder packing).
    Returns (tensors, the dequantized fp32 weight q * s2 * s1)."""
    from eagle3.formats import codecs

    s1 = w.abs().max() / codecs.FP8_E4M3_MAX
    x8 = codecs.fp8_quantize(w, s1).float()
    s2 = x8.abs().amax(-1) / 7.5
    q = torch.clamp(torch.round(x8 * (1 / s2)[:, None]), -8, 7).to(torch.int8)
    tensors = {"weight": codecs.quark_int4_pack(q, reorder=True), "weight_scale": s1.reshape(()).float(),
               "weight_scale_2": s2.float()}
    return tensors, q.float() * (s2 * s1)[:, None]


def quark_int4_expert(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from eagle3.formats import codecs

    s = w.abs().amax(-1) / 7.5
    q = torch.clamp(torch.round(w / s[:, None]), -8, 7).to(torch.int8)
    return {"weight": codecs.quark_int4_pack(q, reorder=True), "weight_scale": s.float()}, q.float() * s[:, None]


def mxfp4_expert(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from eagle3.formats import codecs

    packed, scale = codecs.mxfp4_quantize(w)
    return {"weight": packed, "weight_scale": scale}, codecs.mxfp4_dequantize(packed, scale)


def fp8_block_expert(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from eagle3.formats import codecs

    q, s = codecs.fp8_block_quantize(w)
    return {"weight": q, "weight_scale_inv": s}, codecs.fp8_block_dequantize(q, s, dtype=torch.float32)


FP8_BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": [128, 128]}


def requantize_target(src, out, scheme: str, reference_out=None):
    """Rewrite the tiny text-only INT4 target (``kimi-k2-thinking``) with Quark ``scheme`` routed
    experts (``w4a8`` | ``int4`` | ``mxfp4``; or DeepSeek ``fp8-block``), from the fp32-dequantized Moonshot INT4 weights as
    Quark's file-to-file path does. With ``reference_out`` also write the same model with the
    dequantized expert weights stored densely in fp32 (and no quantization_config)."""
    import json
    from pathlib import Path

    from eagle3.checkpoint import CheckpointReader, CheckpointWriter
    from eagle3.formats import codecs

    quantize = {"w4a8": quark_w4a8_expert, "int4": quark_int4_expert, "mxfp4": mxfp4_expert,
                "fp8-block": fp8_block_expert}[scheme]
    src, out = Path(src), Path(out)
    reader = CheckpointReader(src)
    cfg = json.loads((src / "config.json").read_text())
    out.mkdir(parents=True)
    ref_w = None
    if reference_out is not None:
        Path(reference_out).mkdir(parents=True)
        ref_w = CheckpointWriter(reference_out)
    with CheckpointWriter(out) as wq:
        for name in reader.names():
            if ".mlp.experts." in name and not name.endswith(".weight_packed"):
                continue  # scale / shape of a packed expert: consumed with weight_packed
            t = reader.get(name)
            if name.endswith(".weight_packed"):
                mod = name[: -len(".weight_packed")]
                w = codecs.ct_int4_dequantize(t, reader.get(mod + ".weight_scale"), reader.get(mod + ".weight_shape"),
                                              dtype=torch.float32)
                tensors, deq = quantize(w)
                for k, v in tensors.items():
                    wq.add(f"{mod}.{k}", v)
                if ref_w is not None:
                    ref_w.add(mod + ".weight", deq)
                continue
            wq.add(name, t)
            if ref_w is not None:
                ref_w.add(name, t)
    if ref_w is not None:
        ref_w.close()
        rcfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
        (Path(reference_out) / "config.json").write_text(json.dumps(rcfg, indent=1))
    qcfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    qcfg["quantization_config"] = FP8_BLOCK_CONFIG if scheme == "fp8-block" else quark_config(scheme)
    (out / "config.json").write_text(json.dumps(qcfg, indent=1))
    return out


def single_thread():
    """Generator for an autouse fixture: the tiny models are dispatch-bound, and two OpenMP threads
    on a shared 2-core box only add contention (measured 10x slower decode under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
