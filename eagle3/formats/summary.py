"""What ``eagle3 inspect`` reports about a checkpoint (:class:`CheckpointSummary` and its parts) and
how it prints; :mod:`eagle3.formats.detect` fills it in."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from eagle3.units import human_bytes

SCHEMA_VERSION = 1

Role = Literal["target", "draft"]
Convention = Literal["input", "output", "default"]

# ---------------------------------------------------------------------------------------------
# Object model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardStats:
    file: str  # file name relative to the checkpoint directory
    tensors: int
    bytes: int


@dataclass(frozen=True)
class TensorStats:
    count: int
    total_bytes: int
    dtypes: dict[str, int]  # safetensors dtype tag -> number of tensors
    dtype_bytes: dict[str, int]  # safetensors dtype tag -> bytes
    shards: list[ShardStats]
    indexed: bool  # a model.safetensors.index.json names the shards


@dataclass(frozen=True)
class QuantInfo:
    """How the weights are stored. ``scheme`` is one of :data:`QUANT_SCHEMES` or, unquantized,
    the dominant float dtype of the Linear weights (``bf16``/``fp16``/``fp32``)."""

    scheme: str
    method: str | None  # quantization_config.quant_method: compressed-tensors | fp8 | quark | None
    config_location: str | None  # "top-level" | "text_config" | None
    schemes: list[str]  # every scheme the config declares (Quark layer configs can mix)
    weights: str | None  # e.g. "int4 group g32 sym", "fp8_e4m3 per_tensor -> int4 per_channel"
    activations: str | None  # e.g. "fp8_e4m3 per_tensor dynamic"; None = not quantized (W-only)
    group_size: int | None
    pack_method: str | None  # Quark export.pack_method ("reorder" | "order")
    exclude: int | None  # number of ignore/exclude entries in the config
    modules: dict[str, int]  # scheme (or float dtype for unquantized Linears) -> module count

    @property
    def quantized(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class ModelDims:
    """Transformer dimensions from the text (or draft-layer) config; None where the field is absent."""

    hidden_size: int
    num_layers: int
    vocab_size: int | None
    num_attention_heads: int | None
    num_key_value_heads: int | None
    head_dim: int | None
    intermediate_size: int | None
    attention: str  # "mla" | "mha"
    q_lora_rank: int | None
    kv_lora_rank: int | None
    qk_nope_head_dim: int | None
    qk_rope_head_dim: int | None
    v_head_dim: int | None
    rms_norm_eps: float | None
    rope_theta: float | None
    rope_type: str  # "default" when the config has no rope scaling
    max_position_embeddings: int | None


@dataclass(frozen=True)
class TargetInfo:
    text_prefix: str  # "language_model." (K2.5 wrapper) or "" (text-only)
    has_vision: bool
    vision_tensors: int
    projector_tensors: int
    n_routed_experts: int | None
    num_experts_per_tok: int | None
    n_shared_experts: int | None
    first_k_dense_replace: int | None
    moe_intermediate_size: int | None
    mtp_layers: int  # num_nextn_predict_layers
    layers_in_files: int  # distinct decoder-layer indices among the tensor names
    default_aux_layer_ids: list[int]  # (2, N//2, N-3), "input" convention


@dataclass(frozen=True)
class AuxLayers:
    """The target layers whose hidden states feed the draft's ``fc``.

    ``convention`` says what an id k means: "input" = the input of decoder layer k (HF
    ``hidden_states[k]``; vLLM, ATOM, speculators), "output" = the output of layer k (SpecForge,
    TorchSpec), "default" = no ids in the config, every engine uses its default (2, N//2, N-3)
    in the input convention. ``input_ids`` are the ids rewritten to the input convention."""

    count: int
    ids: list[int] | None
    convention: Convention
    input_ids: list[int] | None
    source: str | None  # "top-level" | "eagle_config" | "both" | None
    rule: str  # why this convention (see aux_convention)
    use_aux_hidden_state: bool


@dataclass(frozen=True)
class VocabMapCheck:
    """Header facts of d2t/t2d plus, when read, the value checks."""

    d2t_length: int | None
    t2d_length: int | None
    values_checked: bool  # False: headers only
    d2t_length_ok: bool | None  # len(d2t) == draft vocab size
    d2t_in_range: bool | None  # every draft id maps into [0, vocab_size)
    d2t_increasing: bool | None  # targets strictly increasing (sorted used-token list)
    t2d_consistent: bool | None  # t2d marks exactly the d2t targets


@dataclass(frozen=True)
class DraftInfo:
    eagle_version: str  # "3" | "3.1"
    layer_prefix: str  # "midlayer" | "layers.0"
    attention: str  # "mha" | "mla"
    num_layers: int
    fc_norm: bool
    fc_norm_tensors: int
    norm_output: bool
    norm_before_fc: bool
    input_norm_tensor: bool
    norm_before_residual: bool
    defaulted: list[str]  # flags absent from the config, reported with the format's default
    aux_layers: AuxLayers
    hidden_size: int
    target_hidden_size: int
    vocab_size: int | None  # the target vocabulary the draft maps into
    draft_vocab_size: int | None  # rows of lm_head (what the head really predicts)
    config_draft_vocab_size: int | None  # the config field, None when absent
    d2t: bool
    t2d: bool
    vocab_map: VocabMapCheck
    own_embedding: bool
    own_lm_head: bool
    speculators: dict[str, Any] | None  # speculators_config facts for the speculators format


@dataclass(frozen=True)
class CheckpointSummary:
    path: Path
    config_file: Path
    role: Role
    family: str
    architecture: str
    model_type: str | None
    text_model_type: str | None
    dims: ModelDims
    quant: QuantInfo
    target: TargetInfo | None
    draft: DraftInfo | None
    tensors: TensorStats
    warnings: list[str] = field(default_factory=list)
    text_config: dict[str, Any] = field(default_factory=dict, repr=False)  # not in the JSON form

    def to_json(self) -> dict[str, Any]:
        """The stable JSON form (docs/inspect_json.md)."""
        d = asdict(self)
        d.pop("text_config")
        d["path"] = str(self.path)
        d["config_file"] = str(self.config_file)
        return {"schema_version": SCHEMA_VERSION, **d}



# ---------------------------------------------------------------------------------------------
# Human-readable output
# ---------------------------------------------------------------------------------------------


def summary_rows(s: CheckpointSummary) -> list[tuple[str, str, str]]:
    """(section, key, value) rows of the human-readable summary (also handy in logs)."""
    rows: list[tuple[str, str, str]] = []

    def add(sec: str, k: str, v: Any) -> None:
        rows.append((sec, k, "-" if v is None else str(v)))

    add("model", "path", s.path)
    add("model", "role", s.role)
    add("model", "family", s.family)
    add("model", "architecture", s.architecture)
    mt = s.model_type if s.text_model_type is None else f"{s.model_type} (text: {s.text_model_type})"
    add("model", "model_type", mt)
    d = s.dims
    add("model", "dims", f"hidden {d.hidden_size}, layers {d.num_layers}, vocab {d.vocab_size}, "
                         f"heads {d.num_attention_heads}/{d.num_key_value_heads}, attention {d.attention}")
    if d.attention == "mla":
        add("model", "mla", f"q_lora {d.q_lora_rank}, kv_lora {d.kv_lora_rank}, nope/rope/v "
                            f"{d.qk_nope_head_dim}/{d.qk_rope_head_dim}/{d.v_head_dim}")
    add("model", "rope", f"{d.rope_type}, theta {d.rope_theta}, max_pos {d.max_position_embeddings}")
    q = s.quant
    add("quant", "scheme", q.scheme if not q.method else f"{q.scheme} ({q.method}, config {q.config_location})")
    if q.method:
        add("quant", "weights", q.weights)
        add("quant", "activations", q.activations or "not quantized (weight-only)")
        if q.pack_method:
            add("quant", "pack_method", q.pack_method)
        add("quant", "exclude entries", q.exclude)
    add("quant", "modules", ", ".join(f"{k} {v}" for k, v in q.modules.items()) or "none")
    if s.target:
        t = s.target
        add("target", "text prefix", repr(t.text_prefix))
        add("target", "vision", f"{t.vision_tensors} vision + {t.projector_tensors} projector tensors"
            if t.has_vision else "none")
        add("target", "experts", f"{t.n_routed_experts} routed (top {t.num_experts_per_tok}), "
                                 f"{t.n_shared_experts} shared, first {t.first_k_dense_replace} dense")
        add("target", "layers in files", t.layers_in_files)
        add("target", "default aux ids", t.default_aux_layer_ids)
    if s.draft:
        r = s.draft
        a = r.aux_layers
        add("draft", "eagle version", r.eagle_version)
        add("draft", "layer prefix", r.layer_prefix)
        add("draft", "attention", r.attention)
        add("draft", "flags", f"fc_norm {r.fc_norm} ({r.fc_norm_tensors} tensors), norm_output {r.norm_output}, "
                              f"norm_before_fc {r.norm_before_fc}, norm_before_residual {r.norm_before_residual}")
        if r.defaulted:
            add("draft", "defaulted", ", ".join(r.defaulted))
        ids = "engine default" if a.ids is None else f"{a.ids} ({a.convention}; input form {a.input_ids})"
        add("draft", "aux layers", f"{a.count}: {ids}")
        add("draft", "aux rule", a.rule)
        add("draft", "hidden", f"{r.hidden_size} (target hidden {r.target_hidden_size})")
        add("draft", "vocab", f"draft {r.draft_vocab_size} -> target {r.vocab_size} "
                              f"(config draft_vocab_size {r.config_draft_vocab_size})")
        vm = r.vocab_map
        add("draft", "d2t / t2d", f"{'yes' if r.d2t else 'no'} / {'yes' if r.t2d else 'no'}"
            + (f" (in range {vm.d2t_in_range}, length ok {vm.d2t_length_ok})" if r.d2t else ""))
        add("draft", "own embedding", r.own_embedding)
        if r.speculators:
            add("draft", "speculators", ", ".join(f"{k} {v}" for k, v in r.speculators.items()))
    ts = s.tensors
    add("tensors", "count", ts.count)
    add("tensors", "total", human_bytes(ts.total_bytes))
    add("tensors", "dtypes", ", ".join(f"{k} {v}" for k, v in ts.dtypes.items()))
    add("tensors", "shards", f"{len(ts.shards)}{' (indexed)' if ts.indexed else ''}")
    for w in s.warnings:
        add("warnings", "!", w)
    return rows


def print_summary(s: CheckpointSummary) -> None:
    """Print the summary as a rich table (``eagle3 inspect`` without ``--json``)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{s.family} {s.role}", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold cyan")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    last = None
    for sec, k, v in summary_rows(s):
        style = "yellow" if sec == "warnings" else None
        table.add_row(sec if sec != last else "", k, v, style=style)
        last = sec
    Console().print(table)

