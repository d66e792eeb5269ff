"""Convert an EAGLE-3 / 3.1 draft into the form one engine loads (``eagle3 convert --engine E``).

Reads every draft format :mod:`eagle3.formats.detect` knows (TorchSpec / lightseek / SpecForge
native ``midlayer.*``, ``layers.0.*`` exports, SpecForge reduced vocab with ``d2t``/``t2d``, the
speculators ``Eagle3Speculator`` format, MLA drafts) and writes the layout of
:data:`eagle3.formats.profiles.PROFILES` ``[engine]``. Tensors are copied byte for byte (only their
names change); quantized drafts keep their quantized tensors and their ``quantization_config``
follows the renamed keys. A tensor the target profile cannot hold is an error unless the user
drops it with ``--drop NAME``: nothing is dropped silently (except ``t2d``, which every serving
engine skips, and which is reported).

The steps: detect -> normalise to a :class:`~eagle3.formats.profiles.DraftSpec` (validating
shapes, the vocabulary map and the aux layers, and pairing with ``--target`` when given) -> plan
every output tensor -> stream them into ``<out>.partial`` -> config, side files, report, manifest
-> rename to ``<out>``.
"""

from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import (
    DEFAULT_SHARD_BYTES,
    CheckpointReader,
    read_json,
)
from eagle3.convert.common import Item, Report, write_output
from eagle3.errors import FormatError, ShapeError, UsageError
from eagle3.formats import check, detect, keys, profiles
from eagle3.formats.profiles import DraftProfile, DraftSpec

KIMI_K25_LAYERS = 61  # Kimi-K2.5 / K2.6 decoder layers: default aux ids (2, 30, 58)


@dataclass
class DraftOptions:
    engine: str
    target: str | None = None  # target checkpoint (dir or Hub id) for pairing checks and default aux ids
    aux_layer_ids: list[int] | None = None
    aux_convention: str | None = None  # "input" | "output": how to read --aux-layer-ids / the source's ids
    norm_output: bool | None = None
    drop: list[str] = field(default_factory=list)
    verifier: str | None = None  # speculators_config.verifier.name_or_path
    trust_remote_code: bool = False
    overwrite: bool = False
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    progress: bool = True
    allow_nonfinite: bool = False  # write NaN/Inf weights (refused otherwise)


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


def _canonical(name: str) -> str:
    """Source name -> canonical name (``layers.0.``, ``fc_norm.{i}.weight``)."""
    if name in keys.LEGACY_FC_NORM:
        return keys.fc_norm_key(keys.LEGACY_FC_NORM[name])
    return keys.rename_draft_layer(name, keys.LAYERS0)


def _out_name(canonical: str, profile: DraftProfile, variant: str) -> str:
    return keys.rename_draft_layer(canonical, profile.prefix(variant))


def _match_drops(patterns: list[str], names: dict[str, str]) -> set[str]:
    """Source names matched by ``--drop`` (exact or glob, on source or canonical names)."""
    hit: set[str] = set()
    for pat in patterns:
        found = {s for s, c in names.items() if fnmatch.fnmatchcase(s, pat) or fnmatch.fnmatchcase(c, pat)}
        if not found:
            raise UsageError(f"--drop {pat}: matches no tensor of the source")
        hit |= found
    return hit


def _logical_2d(info: Any) -> tuple[int, int] | None:
    """Shape of an unpacked 2-D weight (float or FP8 storage); None for packed INT4/FP4 storage."""
    if len(info.shape) != 2 or info.dtype in ("I32", "U32", "U8"):
        return None
    return int(info.shape[0]), int(info.shape[1])


def _packed_matches(info: Any, rows: int, cols: int) -> bool:
    """A packed INT4 weight (8 codes per int32) of a [rows, cols] Linear: [rows, cols/8], or Quark
    per-group transposed [cols, rows/8]."""
    if len(info.shape) != 2:
        return False
    a, b = info.shape
    return (a == rows and b * 8 == cols) or (a == cols and b * 8 == rows)


def _check_linear(reader: CheckpointReader, src: str, rows: int, cols: int, what: str) -> None:
    info = reader.info(src)
    shape = _logical_2d(info)
    if shape is None:
        if info.dtype in ("I32", "U32") and not _packed_matches(info, rows, cols):
            raise ShapeError(f"{info.file}: tensor {src!r} is packed {list(info.shape)}, which does not hold a "
                             f"[{rows}, {cols}] {what}")
        return
    if shape != (rows, cols):
        raise ShapeError(f"{info.file}: tensor {src!r} has shape {list(shape)} but {what} needs [{rows}, {cols}]")


def _parse_conv(conv: str | None) -> str | None:
    if conv is None:
        return None
    if conv not in ("input", "output"):
        raise UsageError(f"--aux-convention {conv}: expected 'input' or 'output'")
    return conv


@dataclass
class TargetFacts:
    """What pairing needs from a target: its config (and generation config) only, so that a Hub id
    costs two small files, not the weights."""

    name: str
    path: Path
    config: dict[str, Any]
    text: dict[str, Any]
    hidden_size: int
    vocab_size: int | None
    num_layers: int
    architectures: list[str]
    eos_ids: set[int]


def target_facts(target: str) -> TargetFacts:
    from eagle3 import hub

    if hub.is_local(target):
        tdir = detect.checkpoint_dir(Path(target).expanduser())
    else:
        tdir = hub.download(target, include=[detect.CONFIG_FILE, "generation_config.json"]).path
    cfg = detect.load_config(tdir)
    archs = cfg.get("architectures") if isinstance(cfg.get("architectures"), list) else []
    if "speculators_model_type" in cfg or any(a in detect.DRAFT_ARCHITECTURES for a in archs):
        raise UsageError(f"--target {target}: is an EAGLE draft ({archs}), not a target model")
    if not any(a in detect.TARGET_ARCHITECTURES for a in archs):
        raise FormatError(f"{tdir / detect.CONFIG_FILE}: field 'architectures' is {archs}, not a target eagle3 "
                          f"knows ({', '.join(sorted(detect.TARGET_ARCHITECTURES))})")
    tc = detect.text_config(cfg)
    where = "text_config." if tc is not cfg else ""
    vals = {}
    for k in ("hidden_size", "num_hidden_layers"):
        v = tc.get(k)
        if not isinstance(v, int) or isinstance(v, bool):
            raise FormatError(f"{tdir / detect.CONFIG_FILE}: field '{where}{k}' is {v!r}, expected an integer")
        vals[k] = v
    eos = _id_set(tc.get("eos_token_id")) | _id_set(cfg.get("eos_token_id"))
    gen = tdir / "generation_config.json"
    if gen.is_file():
        eos |= _id_set(read_json(gen).get("eos_token_id"))
    vocab = tc.get("vocab_size")
    return TargetFacts(name=target, path=tdir, config=cfg, text=tc, hidden_size=vals["hidden_size"],
                       vocab_size=vocab if isinstance(vocab, int) else None, num_layers=vals["num_hidden_layers"],
                       architectures=list(archs), eos_ids=eos)


def _id_set(v: Any) -> set[int]:
    if v is None:
        return set()
    if isinstance(v, list):
        return {int(x) for x in v if isinstance(x, int)}
    return {int(v)} if isinstance(v, int) else set()


def _pair_check(spec: DraftSpec, layer: dict[str, Any], t: TargetFacts) -> None:
    """Draft vs target: widths, vocabulary, aux ids, special token ids. A mismatch names both values."""
    if spec.target_hidden_size != t.hidden_size:
        raise ShapeError(f"draft target_hidden_size is {spec.target_hidden_size} but target {t.name} has "
                         f"hidden_size {t.hidden_size}")
    if t.vocab_size is not None and spec.vocab_size is not None and spec.vocab_size != t.vocab_size:
        raise ShapeError(f"draft vocab_size is {spec.vocab_size} but target {t.name} has vocab_size {t.vocab_size}")
    n = t.num_layers
    bad = [i for i in spec.aux_input_ids if i >= n]
    if bad:
        raise ShapeError(f"aux layer id {bad[0]} (input-to-layer convention, ids {spec.aux_input_ids}) but target "
                         f"{t.name} has {n} decoder layers (ids must be < {n})")
    for k in ("bos_token_id", "pad_token_id"):
        dv = layer.get(k)
        tvals = _id_set(t.text.get(k)) | _id_set(t.config.get(k))
        if isinstance(dv, int) and tvals and dv not in tvals:
            raise ShapeError(f"draft {k} is {dv} but target {t.name} has {k} {sorted(tvals)[0]}")
    deos = _id_set(layer.get("eos_token_id"))
    if deos and t.eos_ids and not deos <= t.eos_ids:
        raise ShapeError(f"draft eos_token_id {sorted(deos)} is not among target {t.name}'s eos ids "
                         f"{sorted(t.eos_ids)}")


def _specforge_provenance(cfg: dict[str, Any], names: list[str]) -> bool:
    """A SpecForge export: SpecForge's class name, native ``midlayer.*`` keys, ``t2d``/``d2t`` saved
    (SpecForge always registers them; TorchSpec only when pruning, and then stamps its version)."""
    archs = cfg.get("architectures") or []
    return ("LlamaForCausalLMEagle3" in archs and "_torchspec_version" not in cfg
            and any(n.startswith(keys.MIDLAYER) for n in names) and keys.T2D in names)


# ---------------------------------------------------------------------------------------------
# The converter
# ---------------------------------------------------------------------------------------------


def _as_int64(reader: CheckpointReader, name: str) -> torch.Tensor:
    return reader.get(name).to(torch.int64)


@dataclass
class _Plan:
    """What the steps of :func:`plan_draft` share: the source, the profile and what is found so far."""

    src: Path
    opts: DraftOptions
    profile: Any
    summary: detect.CheckpointSummary
    info: Any
    cfg: dict[str, Any]
    reader: CheckpointReader
    report: Report
    variant: str
    names: list[str]
    canon: dict[str, str]
    dropped: set[str]
    present: dict[str, str]
    roles: dict[str, str] = field(default_factory=dict)


def _unpack(p: _Plan) -> tuple[Any, ...]:
    return (p.opts, p.profile, p.summary, p.info, p.cfg, p.reader, p.report, p.variant, p.names, p.canon,
            p.dropped, p.present, p.roles)


def _place_tensors(p: _Plan) -> None:
    """Every tensor must have a place in the profile (or be dropped explicitly)."""
    opts, profile, summary, info, cfg, reader, report, variant, names, canon, dropped, present, roles = _unpack(p)
    for s, c in canon.items():
        if s in dropped:
            report.drop(s, "--drop")
            continue
        role = profiles.tensor_role(c, variant)
        if role is None:
            raise FormatError(f"{reader.info(s).file}: tensor {s!r} is not part of an EAGLE-3 "
                              f"{variant} draft (pass --drop {s} to leave it out)")
        why = profiles.representable(profile, role)
        if why and role != "d2t":  # d2t: decided below, once the vocabulary is known
            raise FormatError(f"{reader.info(s).file}: tensor {s!r} cannot be written for {profile.engine}: {why} "
                              f"(pass --drop {s} to leave it out)")
        roles[c] = role


def _aux_width(p: _Plan) -> int:
    """fc [hidden, n_aux * target_hidden] and layer 0's 2 * hidden inputs: the number of aux states."""
    opts, profile, summary, info, cfg, reader, report, variant, names, canon, dropped, present, roles = _unpack(p)
    hidden = info.hidden_size
    th = info.target_hidden_size
    if keys.DRAFT_FC not in present:
        if info.aux_layers.use_aux_hidden_state:
            raise FormatError(f"{reader.path}: draft has no fc.weight (the [hidden, n_aux * target_hidden] "
                              f"projection of the aux hidden states)")
    fc_info = reader.info(present[keys.DRAFT_FC]) if keys.DRAFT_FC in present else None
    fc_shape = _logical_2d(fc_info) if fc_info is not None else None
    if fc_shape is not None:
        if fc_shape[0] != hidden:
            raise ShapeError(f"{fc_info.file}: tensor 'fc.weight' has {fc_shape[0]} rows but hidden_size is {hidden}")
        if fc_shape[1] % th:
            raise ShapeError(f"{fc_info.file}: tensor 'fc.weight' has shape {list(fc_info.shape)}: its width "
                             f"{fc_shape[1]} is not a multiple of target_hidden_size {th}")
        n_aux = fc_shape[1] // th
    else:
        n_aux = info.aux_layers.count
    for rel in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"):
        c = keys.LAYERS0 + rel
        if c in present:
            ci = _logical_2d(reader.info(present[c]))
            if ci is not None and ci[1] != 2 * hidden:
                raise ShapeError(f"{reader.info(present[c]).file}: tensor {present[c]!r} takes {ci[1]} inputs but "
                                 f"layer 0 reads cat(embeddings, hidden) = 2 * {hidden}")
    return n_aux


def _vocabulary(p: _Plan) -> tuple[int, str | None, bool]:
    """(draft vocab, the source's d2t name, whether an identity d2t is dropped)."""
    opts, profile, summary, info, cfg, reader, report, variant, names, canon, dropped, present, roles = _unpack(p)
    hidden = info.hidden_size
    vocab = info.vocab_size
    if keys.DRAFT_LM_HEAD not in present:
        raise FormatError(f"{reader.path}: draft has no lm_head.weight")
    head = reader.info(present[keys.DRAFT_LM_HEAD])
    head_shape = _logical_2d(head)
    draft_vocab = head_shape[0] if head_shape else (info.config_draft_vocab_size or info.draft_vocab_size)
    if draft_vocab is None:
        raise FormatError(f"{head.file}: lm_head.weight is packed {list(head.shape)} and the config has no "
                          f"draft_vocab_size: the draft vocabulary is unknown")
    if head_shape is not None and head_shape[1] != hidden:
        raise ShapeError(f"{head.file}: tensor 'lm_head.weight' has {head_shape[1]} columns but hidden_size is "
                         f"{hidden}")
    if info.config_draft_vocab_size is not None and draft_vocab != info.config_draft_vocab_size:
        raise ShapeError(f"{head.file}: tensor 'lm_head.weight' has {draft_vocab} rows but the config's "
                         f"draft_vocab_size is {info.config_draft_vocab_size}")
    d2t_src = present.get(keys.D2T)
    if d2t_src is not None:
        d2 = reader.info(d2t_src)
        if len(d2.shape) != 1 or d2.dtype not in ("I64", "I32", "U32", "I16"):
            raise ShapeError(f"{d2.file}: tensor 'd2t' is {d2.dtype}{list(d2.shape)}, expected int64 offsets "
                             f"[draft_vocab]")
        if d2.shape[0] != draft_vocab:
            raise ShapeError(f"{d2.file}: tensor 'd2t' has {d2.shape[0]} entries but the draft vocabulary "
                             f"(lm_head rows) is {draft_vocab}")
        targets = reader.get(d2t_src).to(torch.int64) + torch.arange(d2.shape[0], dtype=torch.int64)  # ~1 MB
        if vocab is not None and len(targets) and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
            raise FormatError(f"{d2.file}: tensor 'd2t' maps draft ids to target ids {int(targets.min())}.."
                              f"{int(targets.max())}, outside the target vocabulary [0, {vocab}) (d2t must hold "
                              f"offsets: target = draft + d2t[draft])")
        if len(targets) > 1 and not bool((targets[1:] > targets[:-1]).all()):
            report.warn("d2t targets are not strictly increasing (absolute ids stored as offsets?)")
    if vocab is not None and draft_vocab != vocab and d2t_src is None:
        raise FormatError(f"{reader.path}: lm_head has {draft_vocab} rows but the target vocabulary is {vocab} and "
                          f"there is no d2t to map draft ids to target ids")
    drop_identity_d2t = False
    if not profile.d2t:
        if vocab is not None and draft_vocab != vocab:
            raise FormatError(f"{reader.path}: engine {profile.engine} cannot serve a reduced-vocabulary draft "
                              f"(lm_head has {draft_vocab} rows, vocab_size is {vocab}): "
                              f"{profile.notes[0] if profile.notes else 'no d2t support'}")
        if d2t_src is not None:
            if bool((reader.get(d2t_src) != 0).any()):
                raise FormatError(f"{reader.info(d2t_src).file}: tensor 'd2t' permutes the vocabulary and engine "
                                  f"{profile.engine} has no d2t support (pass --drop {d2t_src} to leave it out)")
            drop_identity_d2t = True
    return draft_vocab, d2t_src, drop_identity_d2t


def _eagle31_norms(p: _Plan, n_aux: int) -> tuple[bool, bool]:
    """(fc_norm, norm_before_fc) as written: flags and tensors must agree."""
    opts, profile, summary, info, cfg, reader, report, variant, names, canon, dropped, present, roles = _unpack(p)
    fc_norm_idx = sorted(keys.fc_norm_index(c) for c in present if roles.get(c) == "fc_norm")
    fc_norm = info.fc_norm
    if fc_norm_idx and not fc_norm:
        report.warn(f"{len(fc_norm_idx)} fc_norm tensors but the source config does not set fc_norm: wrote "
                    f"fc_norm true (engines build fc_norm from the flag and would ignore the tensors)")
        fc_norm = True
    if fc_norm and not fc_norm_idx:
        raise FormatError(f"{summary.config_file}: field 'fc_norm' is true but there are no fc_norm.{{i}}.weight "
                          f"tensors")
    if fc_norm and fc_norm_idx != list(range(n_aux)):
        raise FormatError(f"{reader.path}: fc_norm tensors for aux slots {fc_norm_idx} but fc.weight takes "
                          f"{n_aux} aux states")
    has_input_norm = keys.DRAFT_INPUT_NORM in present
    norm_before_fc = info.norm_before_fc
    if has_input_norm != norm_before_fc:
        if has_input_norm:
            report.warn("input_norm.weight present but norm_before_fc not set: wrote norm_before_fc true")
            norm_before_fc = True
        else:
            raise FormatError(f"{summary.config_file}: field 'norm_before_fc' is true but there is no "
                              f"input_norm.weight")
    if info.norm_before_residual and not profile.norm_before_residual:
        raise FormatError(f"{summary.config_file}: field 'norm_before_residual' is true"
                          f"{' (speculators default)' if 'norm_before_residual' in info.defaulted else ''}, "
                          f"which engine {profile.engine} does not implement (use vllm, speculators or eagle3)")
    return fc_norm, norm_before_fc


def _aux_layers(p: _Plan, n_aux: int, th: int) -> tuple[list[int], str, str, str, list[int], TargetFacts | None]:
    """(ids, their convention, source, rule, ids in the input convention, target facts)."""
    opts, profile, summary, info, cfg, reader, report, variant, names, canon, dropped, present, roles = _unpack(p)
    conv = _parse_conv(opts.aux_convention)
    tfacts = target_facts(opts.target) if opts.target is not None else None
    a = info.aux_layers
    if opts.aux_layer_ids is not None:
        ids, conv_used, source = list(opts.aux_layer_ids), conv or "input", "--aux-layer-ids"
        rule = f"given on the command line ({conv_used} convention)"
    elif a.ids:
        ids, conv_used, source = list(a.ids), conv or a.convention, f"source config ({a.source})"
        rule = f"--aux-convention {conv}" if conv else a.rule
    else:
        if conv is not None:
            raise UsageError("--aux-convention: the source config has no aux layer ids to interpret "
                             "(give them with --aux-layer-ids)")
        if tfacts is not None:
            n_layers = tfacts.num_layers
            who = f"target {opts.target} ({n_layers} layers)"
        else:
            n_layers = KIMI_K25_LAYERS
            who = f"Kimi-K2.5 ({n_layers} layers; pass --target to use another model's layer count)"
        ids, conv_used, source = list(detect.default_aux_layer_ids(n_layers)), "input", "default"
        rule = f"no aux ids in the source: engine default (2, N//2, N-3) of {who}"
        report.warn(f"aux layer ids not in the source: using {ids} (input convention), the default of {who}")
    try:
        input_ids = detect.to_input_convention(ids, conv_used)
    except ValueError as e:
        raise UsageError(f"aux layer ids {ids}: {e}") from None
    if len(input_ids) != n_aux:
        raise ShapeError(f"{len(input_ids)} aux layer ids {ids} but fc.weight takes {n_aux} aux states of width {th}")
    if any(i < 0 for i in input_ids):
        raise UsageError(f"aux layer ids {ids} ({conv_used} convention) name a layer before the embeddings")
    return ids, conv_used, source, rule, input_ids, tfacts


def _norm_output(p: _Plan) -> bool:
    """norm_output (and SpecForge's pre-#879 semantics)."""
    opts, profile, summary, info, cfg, reader, report, variant, names, canon, dropped, present, roles = _unpack(p)
    norm_output = info.norm_output if opts.norm_output is None else opts.norm_output
    if _specforge_provenance(cfg, names) and "norm_output" not in info.defaulted and opts.norm_output is None:
        if info.norm_output:
            report.warn("SpecForge export with norm_output true: SpecForge before PR #879 trained this as plain "
                        "EAGLE-3 (pre-norm hidden fed back, norm only for logits); if it was trained before "
                        "2026-09-15 re-run with --norm-output false")
        else:
            report.warn("SpecForge export with norm_output false: SpecForge before PR #879 then computed logits "
                        "WITHOUT the final norm, which no engine reproduces; retrain or verify acceptance")
    if opts.norm_output is not None and opts.norm_output != info.norm_output:
        report.warn(f"norm_output set to {str(opts.norm_output).lower()} by --norm-output (source: "
                    f"{str(info.norm_output).lower()})")
    return norm_output


def _tensor_items(p: _Plan, d2t_src: str | None, drop_identity_d2t: bool) -> list[Item]:
    """The tensors to write, renamed for the profile (t2d regenerated from d2t where it wants one)."""
    opts, profile, summary, info, cfg, reader, report, variant, names, canon, dropped, present, roles = _unpack(p)
    vocab = info.vocab_size
    items: list[Item] = []
    for f, fnames in sorted(reader.shards().items(), key=lambda kv: kv[0].name):
        for s in fnames:
            report.tensors_in += 1
            report.bytes_in += reader.info(s).nbytes
            if s in dropped:
                continue
            c = canon[s]
            if roles[c] == "t2d" and profile.t2d == "drop":
                report.drop(s, "t2d is a training-only mask that every serving engine skips")
                continue
            if roles[c] == "t2d":
                continue  # regenerated from d2t below
            if roles[c] == "d2t" and drop_identity_d2t:
                report.drop(s, f"all-zero d2t of a full-vocabulary draft (the identity map); {profile.engine} "
                               f"has no d2t support")
                continue
            out = _out_name(c, profile, variant)
            if out != s:
                report.renames.append({"from": s, "to": out})
            ti = reader.info(s)
            if roles[c] == "d2t" and ti.dtype != "I64":
                report.transformed.append({"name": out, "how": f"{ti.dtype} -> int64 offsets"})
                items.append(Item(out, str(f), ti.numel * 8, make=partial(_as_int64, reader, s)))
            else:
                items.append(Item(out, str(f), ti.nbytes, raw=ti))  # bytes unchanged
    if profile.t2d == "regenerate" and d2t_src is not None and vocab is not None:
        t2d_src = present.get(keys.T2D)

        def make_t2d() -> torch.Tensor:
            d2t = reader.get(d2t_src).to(torch.int64)
            mask = torch.zeros(int(vocab), dtype=torch.bool)
            mask[d2t + torch.arange(d2t.shape[0], dtype=torch.int64)] = True
            if t2d_src is not None and not torch.equal(mask, reader.get(t2d_src)):
                report.warn("source t2d does not mark exactly the d2t targets: wrote the t2d derived from d2t")
            return mask

        last_shard = items[-1].shard if items else "generated"
        items.append(Item(keys.T2D, last_shard, int(vocab), make=make_t2d))
        report.generated.append({"name": keys.T2D, "reason": "regenerated from d2t (t2d[d + d2t[d]] = True): the "
                                                             "speculators loader sizes the target vocab from it"})
    return items


def plan_draft(src: Path, opts: DraftOptions, summary: detect.CheckpointSummary | None = None
               ) -> tuple[dict[str, Any], list[Item], Report, CheckpointReader]:
    """Validate and plan a draft conversion: (output config, items to write, report, reader).

    Raises before anything is written: FormatError / ShapeError for what the source or the profile
    cannot do, UsageError for flags that conflict with the source."""
    profile = profiles.get_profile(opts.engine)
    summary = summary or detect.detect(src)
    if summary.role != "draft" or summary.draft is None:
        raise UsageError(f"{src}: is a {summary.family} target, not a draft")
    info = summary.draft
    cfg = detect.load_config(src)
    reader = CheckpointReader(summary.path)
    report = Report(kind="draft", source=str(src), output="", engine=profile.engine)
    report.source_warnings = list(summary.warnings)
    variant = "mla" if info.attention == "mla" else "llama"
    report.source_format = {"family": summary.family, "architecture": summary.architecture,
                            "layer_prefix": info.layer_prefix, "attention": info.attention,
                            "eagle_version": info.eagle_version, "quant": summary.quant.scheme}

    if variant not in profile.variants:
        raise FormatError(f"{summary.config_file}: an {variant.upper()} draft ({summary.architecture}) cannot be "
                          f"written for engine {profile.engine}: {profile.notes[0] if profile.notes else ''}")
    if info.num_layers > 1 and not profile.multi_layer:
        raise FormatError(f"{summary.config_file}: field 'num_hidden_layers' is {info.num_layers}; engine "
                          f"{profile.engine} serves single-layer drafts only")

    names = reader.names()
    canon = {n: _canonical(n) for n in names}
    if len(set(canon.values())) != len(canon):
        raise FormatError(f"{reader.path}: two tensors map to the same name after renaming midlayer./layers.0.")
    dropped = _match_drops(list(opts.drop), canon)
    present = {canon[n]: n for n in names if n not in dropped}  # canonical -> source, after --drop

    p = _Plan(src, opts, profile, summary, info, cfg, reader, report, variant, names, canon, dropped, present)
    _place_tensors(p)
    layer, eagle, extra = profiles.split_source_config(cfg)
    th = info.target_hidden_size
    n_aux = _aux_width(p)
    draft_vocab, d2t_src, drop_identity_d2t = _vocabulary(p)
    fc_norm, norm_before_fc = _eagle31_norms(p, n_aux)
    ids, conv_used, source, rule, input_ids, tfacts = _aux_layers(p, n_aux, th)
    norm_output = _norm_output(p)
    a = info.aux_layers

    # -- the normalised spec ----------------------------------------------------------------------
    src_ec = eagle.get("eagle_config") if isinstance(eagle.get("eagle_config"), dict) else {}
    ec_extra = {k: v for k, v in src_ec.items()
                if k not in ("eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state", "norm_before_fc")}
    qc = eagle.get("quantization_config") if isinstance(eagle.get("quantization_config"), dict) else None
    if qc is not None:
        qc, n_changed = profiles.rename_quant_config(qc, profile.prefix(variant))
        if n_changed:
            report.config["quantization_config_renamed"] = n_changed
    verifier = opts.verifier or opts.target
    ver_arch = tfacts.architectures if tfacts is not None and verifier == opts.target else None
    if verifier is not None and Path(verifier).expanduser().exists():
        # A local directory as typed (``tiny/kimi-k2.5``) would be looked up relative to wherever the
        # draft is later loaded from, and then on the Hub: write it absolute. A Hub id stays as is.
        verifier = str(Path(verifier).expanduser().absolute())
    spec = DraftSpec(
        variant=variant, layer=layer, draft_vocab_size=int(draft_vocab), target_hidden_size=int(th),
        aux_input_ids=input_ids, fc_norm=fc_norm, norm_output=norm_output, norm_before_fc=norm_before_fc,
        norm_before_residual=info.norm_before_residual, use_aux_hidden_state=a.use_aux_hidden_state,
        eagle_config_extra=ec_extra, extra=extra, quantization_config=qc,
        speculators_config=cfg.get("speculators_config") if isinstance(cfg.get("speculators_config"), dict) else None,
        speculators_version=cfg.get("speculators_version"),
        verifier=verifier, verifier_architectures=ver_arch,
    )
    if tfacts is not None:
        _pair_check(spec, layer, tfacts)
    out_cfg, aux = profiles.render_config(profile, spec)
    aux.update({"source": source, "rule": rule, "source_ids": ids, "source_convention": conv_used})
    if aux.get("warning"):
        report.warn(aux["warning"])
    report.aux = aux
    if profile.config_style == "speculators" and not opts.verifier and not opts.target and spec.speculators_config is None:
        report.warn(f"speculators_config.verifier.name_or_path set to {profiles.DEFAULT_VERIFIER} (pass --target or "
                    f"--verifier to name the target)")
    if variant == "llama" and not profile.rope_scaling_llama and (layer.get("rope_scaling") or layer.get(
            "rope_parameters", {}).get("rope_type", "default") not in ("default", None)):
        report.warn(f"{profile.engine}'s Llama draft ignores rope_scaling and uses rope_theta only")
    report.config.update({
        "architectures": out_cfg["architectures"],
        **profiles.eagle_flags(spec),
        "defaulted_in_source": list(info.defaulted),
    })
    report.output_format = {"engine": profile.engine, "architecture": profile.arch(variant),
                            "layer_prefix": profile.prefix(variant).rstrip("."), "config_style": profile.config_style,
                            "engine_reads": list(profile.reads), "notes": list(profile.notes)}

    items = _tensor_items(p, d2t_src, drop_identity_d2t)
    return out_cfg, items, report, reader


def convert_draft(src: str | Path, out: str | Path, opts: DraftOptions,
                  summary: detect.CheckpointSummary | None = None) -> Report:
    """Convert the draft at ``src`` into ``out`` for ``opts.engine``; returns the report (also
    written to ``out/convert_report.json``)."""
    t0 = time.perf_counter()
    src = Path(src)
    out = Path(out)
    out_cfg, items, report, reader = plan_draft(src, opts, summary)
    # The model against its schema, after the plan's own (more specific) checks and before any
    # weight is written; tensors the user drops with --drop are not held against it.
    check.require_valid(src, ignore=frozenset(d["name"] for d in report.drops if d["reason"] == "--drop"))
    return write_output(Path(out), out_cfg, items, report, reader.path, opts, t0)
