"""Memory plan of a tensor- and expert-parallel deployment: weight bytes per rank, KV-cache
capacity, and whether it fits (``eagle3 plan``; docs/scale.md).

Config-only by design: it sizes the real Kimi-K2.5 from its ``config.json`` without the 595 GB of
weights (:mod:`eagle3.formats.sizing`), and from the safetensors headers when the shards are there.
Every tensor goes to ranks by vLLM's sharding:

* MLA: ``q_b_proj`` and ``kv_b_proj`` split by heads, ``o_proj`` split along its input (rows of the
  head outputs) + reduce; ``q_a_proj`` / ``kv_a_proj_with_mqa`` and their norms replicated, and so
  is the latent KV cache (the latent is per token, not per head);
* MoE: routed experts split across ranks (expert parallel, contiguous blocks of E/N experts); the
  router (``mlp.gate`` + ``e_score_correction_bias``) replicated; shared experts and the dense MLP
  split (gate/up by output rows, down by input columns);
* embedding replicated (or vocab-split), ``lm_head`` vocab-split; norms replicated;
* the draft replicated on every rank; the vision tower and projector are not loaded (text runtime).

A split tensor's bytes divide by N, except what a split does not cut: scalars and ``weight_shape``
vectors, and the per-output-channel scale vectors of an input-split (``o_proj``, ``down_proj``)
Linear, which every rank keeps whole.

KV cache per token = target layers x (kv_lora_rank + qk_rope_head_dim) values (MLA latent) plus the
draft's one layer (MLA latent, or 2 x kv heads x head_dim for a Llama draft), in the cache dtype;
every rank holds it whole: the values per layer are :func:`eagle3.formats.sizing.kv_values_per_layer`
and the bytes the runtime's own formula (:func:`eagle3.runtime.kv_cache.cache_bytes`, which sizes the
engine's KV blocks too). Capacity = (GPU memory x fraction - weights of the fullest rank - runtime
reserve) / bytes per token.

The plan reads config files only (through :mod:`eagle3.formats`), never weights; it sits above the
runtime and ``quantize`` (``--recipe`` projects the config ``quantize`` would write).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3.errors import FormatError, UsageError
from eagle3.formats import sizing
from eagle3.formats.detect import load_config, text_config
from eagle3.formats.sizing import TensorSpec
from eagle3.runtime import kv_cache

GiB = 1024**3
DEFAULT_RESERVE = 4 * GiB  # context, communication buffers, graphs, activations of one step
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: int  # bytes the device reports
    hbm_tbps: float | None = None  # HBM peak, vendor figure (TB/s = 1e12 B/s): the decode floor's rate
    # Text in the name the driver gives the card (torch.cuda.get_device_name), upper case; the
    # longest match wins (an "H100 PCIe" is not an "H100" SXM)
    device_names: tuple[str, ...] = ()


# Device memory as the driver reports it: nvidia-smi total (H100 SXM and PCIe 81559 MiB, H100 NVL
# 95830 MiB, H200 143771 MiB); AMD Instinct HBM is 192 / 256 / 288 GiB (8 stacks of 24 / 32 / 36
# GiB), which AMD sells as "GB". HBM peaks are the vendors' datasheet figures, the one table of them
# (benchmarks/kernels_gpu.py finds its card here by device name: gpu_for_device_name).
GPUS: dict[str, Gpu] = {
    "h100": Gpu("NVIDIA H100 SXM (80 GB HBM3)", 81559 * 1024**2, 3.35, ("H100",)),
    "h100-pcie": Gpu("NVIDIA H100 PCIe (80 GB HBM2e)", 81559 * 1024**2, 2.0, ("H100 PCIE",)),
    "h100-nvl": Gpu("NVIDIA H100 NVL (94 GB HBM3)", 95830 * 1024**2, 3.9, ("H100 NVL",)),
    "h200": Gpu("NVIDIA H200 (141 GB HBM3e)", 143771 * 1024**2, 4.8, ("H200",)),
    "mi300x": Gpu("AMD Instinct MI300X (192 GB HBM3)", 192 * GiB, 5.3, ("MI300X",)),
    "mi325x": Gpu("AMD Instinct MI325X (256 GB HBM3E)", 256 * GiB, 6.0, ("MI325X",)),
    "mi355x": Gpu("AMD Instinct MI355X (288 GB HBM3E)", 288 * GiB, 8.0, ("MI355X",)),
}


def gpu_for_device_name(device_name: str) -> Gpu | None:
    """The :data:`GPUS` card whose ``device_names`` best match the driver's name for a device
    (``torch.cuda.get_device_name``: "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "AMD Instinct
    MI300X"); None for a card not in the table."""
    name = device_name.upper()
    best = max(((len(s), g) for g in GPUS.values() for s in g.device_names if s in name),
               key=lambda m: m[0], default=None)
    return None if best is None else best[1]
# Bytes per cached value, by name: the runtime's table (fp8 of any kind is one byte: twice bf16's tokens).
KV_DTYPE_BYTES = kv_cache.ELEMENT_BYTES

# Categories, in report order: (key, label, how it is placed)
CATEGORIES: list[tuple[str, str, str]] = [
    ("routed_experts", "routed experts", "expert parallel"),
    ("shared_experts", "shared experts", "split"),
    ("dense_mlp", "dense MLP", "split"),
    ("attn_split", "attention q_b / kv_b / o", "split by heads"),
    ("attn_replicated", "attention q_a / kv_a + latent norms", "replicated"),
    ("router", "router (gate + bias)", "replicated"),
    ("norms", "layer norms", "replicated"),
    ("embedding", "embedding", "replicated"),
    ("lm_head", "lm_head", "vocab-split"),
    ("other", "other tensors", "replicated"),
    ("draft", "draft", "replicated"),
]
NOT_LOADED = "multimodal"  # vision tower + projector: on disk, never loaded by the text runtime

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
_ROW_SPLIT = re.compile(r"(self_attn\.o_proj|down_proj)\.")  # Linears split along their input


_DIGITS = str.maketrans("", "", "0123456789")
_CLASS_CACHE: dict[str, tuple[str, str]] = {}


def classify(name: str) -> tuple[str, str]:
    """:func:`classify_name`, memoised on the name without its layer/expert numbers (the class
    never depends on them; the real model has 208k tensor names and ~60 distinct shapes of name)."""
    key = name.translate(_DIGITS)
    hit = _CLASS_CACHE.get(key)
    if hit is None:
        hit = _CLASS_CACHE[key] = classify_name(name)
    return hit


def classify_name(name: str) -> tuple[str, str]:
    """(category, placement) of a target tensor name; placement is ``replicated``, ``split``,
    ``split_rows`` (input-dim split), ``experts`` or ``none`` (not loaded)."""
    if name.startswith(("vision_tower.", "mm_projector.")):
        return NOT_LOADED, "none"
    n = name[len("language_model."):] if name.startswith("language_model.") else name
    if n.startswith("model.embed_tokens."):
        return "embedding", "replicated"
    if n.startswith("lm_head."):
        return "lm_head", "split"
    if n.startswith("model.norm."):
        return "norms", "replicated"
    if _LAYER.match(n) is None:
        return "other", "replicated"
    if _EXPERT.search(n):
        return "routed_experts", "experts"
    if n.endswith("layernorm.weight") and ".self_attn." not in n:
        return "norms", "replicated"
    if ".self_attn." in n:
        if any(k in n for k in (".q_a_proj.", ".kv_a_proj_with_mqa.", "_layernorm.")):
            return "attn_replicated", "replicated"
        if any(k in n for k in (".q_b_proj.", ".kv_b_proj.", ".q_proj.")):
            return "attn_split", "split"
        if ".o_proj." in n:
            return "attn_split", "split_rows"
        return "attn_replicated", "replicated"
    if ".mlp.gate." in n:
        return "router", "replicated"
    if ".mlp.shared_experts." in n:
        return "shared_experts", "split_rows" if _ROW_SPLIT.search(n) else "split"
    if re.search(r"\.mlp\.(gate|up|down)_proj\.", n):
        return "dense_mlp", "split_rows" if _ROW_SPLIT.search(n) else "split"
    return "other", "replicated"


def _split_bytes(t: TensorSpec, n: int, placement: str) -> int:
    """Bytes one rank holds of a split tensor (the fullest rank when it does not divide)."""
    if t.numel <= 2 or t.name.endswith("weight_shape"):
        return t.nbytes
    if placement == "split_rows" and len(t.shape) == 1:
        return t.nbytes  # per-output-channel scales of an input-split Linear stay whole
    per = -(-t.numel // n)
    return per * sizing.DTYPE_BYTES[t.dtype]


@dataclass
class Placement:
    """A model's tensors summed by where the ranks hold them, in one pass: classifying 208k tensor
    names and counting their bytes is the cost of a plan of the real Kimi checkpoint, and plans sweep
    rank counts, so :meth:`per_rank` spreads these sums over any number of ranks without that pass."""

    every: dict[str, int]  # bytes of the replicated tensors, by category (every rank holds them)
    split: list[tuple[str, str, TensorSpec]]  # (category, placement, tensor) of the split tensors and the embedding
    experts: dict[tuple[str, int], int]  # routed-expert bytes by (category, expert number)
    unloaded: int  # bytes on disk that no rank loads (vision)
    total: int  # bytes of every tensor
    expert_params: int  # routed-expert parameters (logical [N, K] elements: :func:`_logical_params`)

    @classmethod
    def of(cls, tensors: Iterable[TensorSpec]) -> Placement:
        every = dict.fromkeys((c for c, _, _ in CATEGORIES), 0)
        split: list[tuple[str, str, TensorSpec]] = []
        experts: dict[tuple[str, int], int] = {}
        unloaded = total = params = 0
        for t in tensors:
            nbytes = t.nbytes
            total += nbytes
            cat, place = classify(t.name)
            if place == "none":
                unloaded += nbytes
            elif place == "experts":
                key = (cat, int(_EXPERT.search(t.name).group(1)))  # type: ignore[union-attr]
                experts[key] = experts.get(key, 0) + nbytes
                params += _logical_params(t)  # classify found its expert number
            elif place == "replicated" and cat != "embedding":
                every[cat] += nbytes
            else:
                split.append((cat, place, t))
        return cls(every, split, experts, unloaded, total, params)

    def per_rank(self, ranks: int, n_routed_experts: int,
                 embedding: str = "replicated") -> tuple[list[dict[str, int]], int]:
        """Per-rank bytes by category, and the bytes that no rank loads."""
        every = dict(self.every)
        for cat, place, t in self.split:
            if cat == "embedding" and embedding == "vocab-split":
                place = "split"
            every[cat] += t.nbytes if place == "replicated" else _split_bytes(t, ranks, place)
        per = [dict(every) for _ in range(ranks)]
        for (cat, e), b in self.experts.items():
            per[e * ranks // max(n_routed_experts, e + 1)][cat] += b  # contiguous blocks of E/N experts
        return per, self.unloaded


def rank_bytes(tensors: Iterable[TensorSpec], ranks: int, n_routed_experts: int,
               embedding: str = "replicated") -> tuple[list[dict[str, int]], int]:
    """Per-rank bytes by category, and the bytes on disk that no rank loads (vision)."""
    return Placement.of(tensors).per_rank(ranks, n_routed_experts, embedding)


# ---------------------------------------------------------------------------------------------
# Checkpoints: config (+ headers when present), optional projection through a quantize recipe
# ---------------------------------------------------------------------------------------------


@dataclass
class Model:
    path: str
    config: dict[str, Any]
    tensors: list[TensorSpec]
    source: str  # "headers" | "config" | "config+recipe:<name>"
    linear_formats: dict[str, int] = field(default_factory=dict)
    _placement: Placement | None = field(default=None, repr=False)

    def placement(self) -> Placement:
        """:class:`Placement` of this model's tensors, memoised: plans for several GPU types and
        counts share it."""
        if self._placement is None:
            self._placement = Placement.of(self.tensors)
        return self._placement

    def rank_bytes(self, ranks: int, n_routed_experts: int, embedding: str) -> tuple[list[dict[str, int]], int]:
        """:func:`rank_bytes` of this model's tensors."""
        return self.placement().per_rank(ranks, n_routed_experts, embedding)

    def totals(self) -> tuple[int, int, int]:
        """(bytes of every tensor, routed-expert bytes, routed-expert parameters)."""
        p = self.placement()
        return p.total, sum(b for (cat, _), b in p.experts.items() if cat == "routed_experts"), p.expert_params


def _config_file(path: str | Path, flag: str) -> Path:
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise UsageError(f"{flag} {path}: no such checkpoint directory or config.json (plan reads local "
                         f"files; `eagle3 download REPO --include config.json` fetches a config alone)")
    return f


def project_config(cfg: dict[str, Any], recipe: str, scope: str | None = None,
                   where: str = "config.json") -> dict[str, Any]:
    """The ``config.json`` that ``eagle3 quantize --recipe RECIPE [--scope SCOPE]`` writes for a
    source with config ``cfg``: the same module selection (the recipe's scope over the source's
    Linear-like weights, Quark's name heuristic) and the same export config, from the config alone."""
    from eagle3.quantize import compat
    from eagle3.quantize.recipes import load_recipe

    rec = load_recipe(recipe)
    sc = rec.scope(scope)
    modules = [w.name for w in sizing.logical_weights(cfg, where)
               if w.kind in ("linear", "router") and not w.name.endswith("norm") and "embed" not in w.name]
    unquantized = sorted(m for m in modules if not sc.matches(m))
    if len(unquantized) == len(modules):
        raise UsageError(f"recipe {rec.name!r} scope {sc.name!r} matches none of the {len(modules)} Linear modules "
                         f"of {where}")
    qc = compat.quantization_config(rec, compat.exclude_list(unquantized, sc.exclude_regex))
    return compat.export_config(cfg, qc)


# Models loaded from local files, by what they were loaded from (see load_model): the real Kimi-K2.5
# inventory is 208k tensors (~0.8 s to build, ~2 s with a recipe's projection, and its per-rank and
# total bytes ~0.6 s each, memoised on the Model), and plans are swept over GPU types and counts.
_LOADED: dict[tuple[Any, ...], Model] = {}
_LOADED_MAX = 4


def _local_key(f: Path, path: str | Path, recipe: str | None, scope: str | None,
               name: str | None) -> tuple[Any, ...]:
    """What a local model is a function of: its config file and the shards beside it (their headers
    are read when present), by path, size and modification time, the projection asked for and the
    name the report gives it."""
    def stamp(p: Path) -> tuple[str, int, int]:
        st = p.stat()
        return str(p.resolve()), st.st_size, st.st_mtime_ns

    shards = tuple(stamp(p) for p in sorted(f.parent.glob("*.safetensors")))
    return stamp(f), shards, recipe, scope, name or str(path)


def load_model(path: str | Path, flag: str = "TARGET", recipe: str | None = None,
               scope: str | None = None, reader: Any | None = None, name: str | None = None) -> Model:
    """A checkpoint's config and tensors. ``reader``: a header-only
    :class:`~eagle3.checkpoint.CheckpointReader` of a remote repo (``eagle3.hub.header_view``),
    whose small files sit in ``path``; ``name`` is what the report calls it (the repo id).

    A local model is loaded once per process while its files are unchanged (the same :class:`Model`
    again: plans never change it), so that plans of one checkpoint on several GPU types or counts
    share its inventory and its memoised per-rank bytes."""
    f = _config_file(path, flag)
    if reader is not None:
        return _load_model(f, path, recipe, scope, reader, name)
    key = _local_key(f, path, recipe, scope, name)
    m = _LOADED.pop(key, None)
    if m is None:
        m = _load_model(f, path, recipe, scope, None, name)
    _LOADED[key] = m  # most recently used last
    while len(_LOADED) > _LOADED_MAX:
        del _LOADED[next(iter(_LOADED))]
    return m


def _load_model(f: Path, path: str | Path, recipe: str | None, scope: str | None, reader: Any | None,
                name: str | None) -> Model:
    cfg = load_config(f)
    path = name or path
    if recipe is not None:
        cfg = project_config(cfg, recipe, scope, str(f))
    tensors, formats = sizing.config_inventory(cfg, str(f))
    if recipe is not None:
        return Model(str(path), cfg, tensors, f"config+recipe:{recipe}", formats)
    headers = (sizing.header_tensors(f.parent) if reader is None else
               [TensorSpec(i.name, i.dtype, tuple(i.shape)) for i in reader.infos()])
    if headers:
        return Model(str(path), cfg, headers, "headers", formats)
    return Model(str(path), cfg, tensors, "config", formats)


def kv_bytes_per_token(cfg: dict[str, Any], where: str, kv_cache_dtype: str, draft: bool = False) -> int:
    """KV-cache bytes one token takes in every layer of this model (a draft: its one layer), by the
    runtime's formula (:func:`eagle3.runtime.kv_cache.cache_bytes`)."""
    tc = text_config(cfg)
    layers = 1 if draft else int(tc.get("num_hidden_layers") or 0)
    return kv_cache.cache_bytes(sizing.kv_values_per_layer(tc, where), layers, KV_DTYPE_BYTES[kv_cache_dtype])


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


@dataclass
class MemoryPlan:
    target: str
    draft: str | None
    source: str
    draft_source: str | None
    linear_formats: dict[str, int]
    gpus: int
    gpu: str
    gpu_memory: int
    memory_fraction: float
    usable_memory: int
    reserve: int
    embedding: str
    checkpoint_bytes: int  # every tensor on disk (target)
    loaded_bytes: int  # what the runtime loads of the target (vision tower and projector left out)
    not_loaded_bytes: int
    routed_expert_bytes: int
    routed_expert_params: int
    draft_bytes: int
    per_rank: list[dict[str, int]]  # bytes by category, per rank
    weights_per_rank: list[int]
    max_weights_per_rank: int
    kv_cache_dtype: str
    kv_bytes_per_token: int
    kv_bytes_per_token_target: int
    kv_bytes_per_token_draft: int
    kv_cache_bytes: int
    kv_tokens: int
    max_model_len: int
    full_length_sequences: int
    fits: bool
    why: str
    gpus_per_node: int  # GPUs a machine holds: the ranks span ceil(gpus / gpus_per_node) nodes
    nodes: int

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}


def _logical_params(t: TensorSpec) -> int:
    """Logical [N, K] elements that weight tensor ``t`` stores (0 for its scales and shapes)."""
    if t.name.endswith((".weight_packed", ".weight")) and t.dtype in ("I32", "U32"):
        return t.numel * 8  # 8 INT4 codes per word ([N, K/8], or [K, N/8] for Quark per-group)
    if t.name.endswith(".weight") and t.dtype == "U8":
        return t.numel * 2  # two E2M1 codes per byte
    if t.name.endswith(".weight"):
        return t.numel
    return 0


def check_options(*, gpus: int, gpu: str | None, gpu_memory: int | None, memory_fraction: float,
                  kv_cache_dtype: str, embedding: str) -> tuple[str, int]:
    """Refuse bad options before any file is read; (device name, memory per device)."""
    if gpus < 1:
        raise UsageError(f"--gpus {gpus}: must be at least 1")
    if not 0 < memory_fraction <= 1:
        raise UsageError(f"--memory-fraction {memory_fraction}: must be in (0, 1]")
    if kv_cache_dtype not in KV_DTYPE_BYTES:
        raise UsageError(f"--kv-cache-dtype {kv_cache_dtype!r}: choose from {', '.join(KV_DTYPE_BYTES)}")
    if embedding not in ("replicated", "vocab-split"):
        raise UsageError(f"--embedding {embedding!r}: choose replicated or vocab-split")
    if gpu is not None:
        key = gpu.lower()
        if key not in GPUS:
            raise UsageError(f"--gpu {gpu!r}: choose from {', '.join(GPUS)} (or give --gpu-memory)")
        dev = GPUS[key]
        name, mem = dev.name, gpu_memory or dev.memory
    elif gpu_memory is not None:
        name, mem = "custom", gpu_memory
    else:
        raise UsageError(f"give --gpu ({', '.join(GPUS)}) or --gpu-memory")
    return name, mem


def plan(target: str | Path | Model, *, gpus: int = 8, gpu: str | None = None, gpu_memory: int | None = None,
         memory_fraction: float = 0.9, draft: str | Path | Model | None = None, kv_cache_dtype: str = "bf16",
         reserve: int = DEFAULT_RESERVE, embedding: str = "replicated", recipe: str | None = None,
         scope: str | None = None, max_model_len: int | None = None,
         draft_reader: Any | None = None, draft_name: str | None = None, gpus_per_node: int = 8) -> MemoryPlan:
    """The memory plan of ``target`` (+ ``draft``) on ``gpus`` devices (one rank each). ``target``
    and ``draft`` may be :class:`Model` objects from :func:`load_model` (a repo's header-only view;
    then ``recipe``/``scope`` are not used). ``gpus_per_node``: GPUs per machine (8 on H100 / H200 /
    MI3xx servers); more GPUs than that span several nodes (``eagle3 serve --nnodes``)."""
    if gpus_per_node < 1:
        raise UsageError(f"--gpus-per-node {gpus_per_node}: must be at least 1")
    name, mem = check_options(gpus=gpus, gpu=gpu, gpu_memory=gpu_memory, memory_fraction=memory_fraction,
                              kv_cache_dtype=kv_cache_dtype, embedding=embedding)
    m = target if isinstance(target, Model) else load_model(target, "TARGET", recipe, scope)
    where = m.path
    tc = text_config(m.config)
    if tc.get("kv_lora_rank") is None and tc.get("num_attention_heads") is None:
        raise FormatError(f"{where}: not a target config (no attention fields)")
    n_experts = int(tc.get("n_routed_experts") or 0)
    per, unloaded = m.rank_bytes(gpus, n_experts, embedding)

    d = None
    if draft is not None:
        d = draft if isinstance(draft, Model) else load_model(draft, "--draft", reader=draft_reader, name=draft_name)
        dbytes = sum(t.nbytes for t in d.tensors)
        for r in per:
            r["draft"] += dbytes
    kv_t = kv_bytes_per_token(m.config, where, kv_cache_dtype)
    kv_d = kv_bytes_per_token(d.config, d.path, kv_cache_dtype, draft=True) if d is not None else 0
    weights = [sum(r.values()) for r in per]
    usable = int(mem * memory_fraction)
    kv_mem = usable - max(weights) - reserve
    kv_tokens = max(kv_mem, 0) // (kv_t + kv_d)
    mml = int(max_model_len or tc.get("max_position_embeddings") or 0)
    if kv_mem <= 0:
        fits, why = False, (f"weights ({max(weights) / 1e9:.1f} GB on the fullest rank) + reserve exceed "
                            f"{memory_fraction:g} x {mem / 1e9:.1f} GB")
    elif kv_tokens < mml:
        fits, why = False, f"KV cache holds {kv_tokens} tokens, fewer than one {mml}-token sequence"
    else:
        fits, why = True, f"KV cache holds {kv_tokens} tokens = {kv_tokens // mml} x {mml}-token sequences"
    total, expert_bytes, expert_params = m.totals()
    return MemoryPlan(
        target=m.path, draft=d.path if d is not None else None, source=m.source,
        draft_source=d.source if d is not None else None, linear_formats=m.linear_formats,
        gpus=gpus, gpu=name, gpu_memory=mem, memory_fraction=memory_fraction, usable_memory=usable,
        reserve=reserve, embedding=embedding, checkpoint_bytes=total, loaded_bytes=total - unloaded,
        not_loaded_bytes=unloaded, routed_expert_bytes=expert_bytes,
        routed_expert_params=expert_params, draft_bytes=per[0]["draft"], per_rank=per,
        weights_per_rank=weights, max_weights_per_rank=max(weights), kv_cache_dtype=kv_cache_dtype,
        kv_bytes_per_token=kv_t + kv_d, kv_bytes_per_token_target=kv_t, kv_bytes_per_token_draft=kv_d,
        kv_cache_bytes=max(kv_mem, 0), kv_tokens=kv_tokens, max_model_len=mml,
        full_length_sequences=kv_tokens // mml if mml else 0, fits=fits, why=why,
        gpus_per_node=min(gpus_per_node, gpus), nodes=-(-gpus // gpus_per_node))


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def summary_lines(p: MemoryPlan) -> list[str]:
    """The human-readable plan (GB = 1e9 bytes, as HBM capacities and checkpoint sizes are quoted)."""
    fmts = ", ".join(f"{k} x{v}" for k, v in p.linear_formats.items())
    lines = [
        f"target      {p.target}  ({p.source}; Linears: {fmts})",
        f"checkpoint  {_gb(p.checkpoint_bytes)} on disk, {_gb(p.loaded_bytes)} loaded"
        + (f" ({_gb(p.not_loaded_bytes)} vision tower + projector not loaded)" if p.not_loaded_bytes else ""),
        f"experts     {p.routed_expert_params / 1e12:.3f}T routed-expert parameters, {_gb(p.routed_expert_bytes)}",
    ]
    if p.draft:
        lines.append(f"draft       {p.draft}  ({p.draft_source}), {_gb(p.draft_bytes)} replicated")
    lines.append(f"devices     {p.gpus} x {p.gpu}, {_gb(p.gpu_memory)} each; fraction {p.memory_fraction:g} "
                 f"-> {_gb(p.usable_memory)} usable")
    if p.nodes > 1:
        lines.append(f"nodes       {p.nodes} x {p.gpus_per_node} GPUs: eagle3 serve TARGET --tensor-parallel-size {p.gpus} "
                     f"--nnodes {p.nodes} --node-rank 0..{p.nodes - 1} --dist-init-addr NODE0:PORT")
    lines.append("weights per rank (fullest rank):")
    r = max(range(p.gpus), key=lambda i: p.weights_per_rank[i])
    for key, label, place in CATEGORIES:
        b = p.per_rank[r][key]
        if b:
            shown = "vocab-split" if key == "embedding" and p.embedding == "vocab-split" else place
            lines.append(f"  {label:38s} {_gb(b):>12s}  {shown}")
    lines.append(f"  {'total':38s} {_gb(p.max_weights_per_rank):>12s}")
    lines.append(f"reserve     {_gb(p.reserve)} (runtime: context, buffers, activations)")
    per_tok = f"{p.kv_bytes_per_token_target} B target"
    if p.draft:
        per_tok += f" + {p.kv_bytes_per_token_draft} B draft"
    lines.append(f"KV cache    {_gb(p.kv_cache_bytes)} at {p.kv_cache_dtype}, {per_tok} per token "
                 f"-> {p.kv_tokens:,} tokens")
    lines.append(f"fits        {'yes' if p.fits else 'NO'}: {p.why}")
    return lines


__all__ = ["GPUS", "gpu_for_device_name", "CATEGORIES", "MemoryPlan", "plan", "rank_bytes", "classify", "load_model", "project_config",
           "kv_bytes_per_token", "summary_lines", "DEFAULT_RESERVE", "check_options"]
