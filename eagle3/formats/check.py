"""``check_checkpoint``: a checkpoint against its architecture's schema, before any weight is read.

Reads ``config.json``, the safetensors headers and the index (never a weight, except a draft's two
small vocabulary maps) and reports, one line each naming the file and the
field or tensor:

* config fields of the wrong type or out of range (:mod:`eagle3.formats.model_config`);
* the index and the shards disagreeing (a tensor in a shard the index does not list, or the reverse);
* the config's layer count disagreeing with the layers in the files;
* missing, unexpected and mis-shaped / mis-typed tensors (:mod:`eagle3.formats.schema`), including
  ones whose byte size is right but whose shape is not;
* ``d2t`` / ``t2d`` disagreeing with each other or with ``draft_vocab_size`` (a full-vocabulary
  draft's pair must be the identity);
* an optional per-module tensor (``input_scale``, zero points, ``k_scale``, ...) of the wrong shape.

``convert``, ``quantize`` and ``train-draft`` call :func:`require_valid` before reading weights,
``serve`` / ``bench`` :func:`require_valid_pair`, ``verify`` :func:`require_valid_tree` (exit 2 with
the first problem); ``inspect`` prints every problem (``--strict``: exit 2).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.checkpoint import CheckpointReader, read_json
from eagle3.checkpoint.files import INDEX_FILE
from eagle3.errors import Eagle3Error, FormatError
from eagle3.formats import keys, sizing
from eagle3.formats.model_config import DraftConfig, TextStackConfig, parse_config
from eagle3.formats.schema import FLOAT_TAGS, Extra, Schema, schema_for, stored_format

_MAX_SHOWN = 3  # names listed in one problem line
_MAX_HINT_SCHEMAS = 4  # schemas rebuilt with one config field changed, per check, to name a culprit field
_MAX_MAP_BYTES = 64 << 20  # d2t / t2d values are read up to this size (a 160k vocab's t2d is 160 KB)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint: ``file`` and the ``subject`` (field or tensor) it is about."""

    file: Path
    subject: str
    message: str

    def __str__(self) -> str:
        return self.message


def _names(ns: list[str]) -> str:
    shown = ", ".join(repr(n) for n in ns[:_MAX_SHOWN])
    return shown + (f" and {len(ns) - _MAX_SHOWN} more" if len(ns) > _MAX_SHOWN else "")


def _index_problems(d: Path, reader: CheckpointReader) -> list[Problem]:
    """Tensors in an indexed shard that the index does not list (the reverse, an index entry whose
    shard lacks it, the reader already refuses)."""
    idx = d / INDEX_FILE
    if not idx.is_file():
        return []
    wm = read_json(idx).get("weight_map") or {}
    out = []
    for shard, names in reader.shards().items():
        unlisted = [n for n in names if wm.get(n) != shard.name]
        if unlisted:
            out.append(Problem(idx, unlisted[0], f"{idx}: does not list tensor(s) {_names(unlisted)} that "
                                                 f"{shard.name} holds (engines load by the index)"))
    return out


def _where(reader: CheckpointReader, name: str) -> Path:
    return reader.info(name).file


def _layer_problems(cfg_file: Path, schema: Schema, names: list[str]) -> list[Problem]:
    if schema.num_layers is None:
        return []
    rx = re.compile(re.escape(schema.layer_prefix) + r"(\d+)\.")
    ids = {int(m.group(1)) for n in names if (m := rx.match(n))}
    main = sorted(i for i in ids if i < schema.num_layers)
    field = ("text_config." if schema.layer_prefix.startswith("language_model.") else "") + "num_hidden_layers"
    if ids and (len(main) < schema.num_layers or max(ids) >= schema.num_layers + schema.mtp_layers):
        last = max(ids)
        return [Problem(cfg_file, field, f"{cfg_file}: field '{field}' is {schema.num_layers} but the shards hold "
                                         f"{len(ids)} decoder layer(s) (0..{last})")]
    return []


def _fields_for(cfg: dict[str, Any], typed: Any, name: str, expected: tuple[int, ...], shape: list[int],
                cache: dict[str, Schema | None], names: set[str]) -> str:
    """The config fields that determine the dimensions of tensor ``name`` the files disagree with
    (the likely culprit). A field is named only when changing it changes that dimension of the
    expected tensor (the schema rebuilt from the changed config); a field that merely has the same
    value is not. Empty when none is sure."""
    import dataclasses

    if len(shape) != len(expected):
        return ""
    bad = [i for i, (e, g) in enumerate(zip(expected, shape, strict=True)) if e != g]
    hits = []
    for f, v in dataclasses.asdict(typed).items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or all(expected[i] != v for i in bad):
            continue
        if f not in cache:
            if len(cache) >= _MAX_HINT_SCHEMAS:  # a full-size schema takes seconds to build: unsure, no hint
                continue
            cache[f] = _schema_with(cfg, f, v, names)
        other = cache[f].tensors.get(name) if cache[f] is not None else None
        if other is not None and len(other.shape) == len(expected) and any(other.shape[i] != expected[i] for i in bad):
            hits.append(f"{f}={v}")
    return f" ({', '.join(hits)})" if hits else ""


def _schema_with(cfg: dict[str, Any], field: str, value: int, names: set[str]) -> Schema | None:
    """The schema of ``cfg`` with ``field`` doubled wherever it holds ``value`` (None: no such
    config, or one eagle3 does not type)."""
    import copy

    changed = copy.deepcopy(cfg)
    subs = [changed] + [changed[k] for k in ("text_config", "transformer_layer_config") if isinstance(changed.get(k), dict)]
    hit = False
    for c in subs:
        if c.get(field) == value and not isinstance(c.get(field), bool):
            c[field] = 2 * value
            hit = True
    if not hit:
        return None
    typed, problems = parse_config(changed, Path("config.json"))
    if typed is None:
        return None
    try:
        return schema_for(changed, typed, names=names)
    except (FormatError, ValueError, KeyError, TypeError):
        return None


def _resolve_dense(schema: Schema, got: dict[str, Any]) -> dict[str, Any]:
    """The schema's tensors with each quantized Linear the files hold dense (a float weight of the
    logical shape and none of the layout's other tensors) expected dense."""
    tensors = dict(schema.tensors)

    def dtype_of(name: str) -> str | None:
        info = got.get(name)
        return None if info is None else info.dtype
    for module, (qnames, dense) in schema.dense_alternatives.items():
        w = got.get(dense.name)
        if (w is not None and tuple(w.shape) == dense.shape
                and stored_format(module, schema.quantized[module][2], dtype_of).scheme == sizing.DENSE):
            for n in qnames:
                tensors.pop(n, None)
            tensors[dense.name] = dense
    return tensors


def _extra_of(schema: Schema, tensors: dict[str, Any], name: str) -> Extra | None:
    """The optional extra ``name`` is, unless it is a format extra of a module stored dense (a dense
    Linear carries none; a kv-cache scale does not depend on the weight format)."""
    e = schema.extra(name)
    if e is None or schema.kv_extra(name) is not None:
        return e
    w = tensors.get(name.rpartition(".")[0] + ".weight")
    return None if w is not None and w.dtype in FLOAT_TAGS else e


def _extra_problems(schema: Schema, tensors: dict[str, Any], got: dict[str, Any], cfg_file: Path) -> list[Problem]:
    out = []
    for name, info in got.items():
        if name in tensors:
            continue
        e = _extra_of(schema, tensors, name)
        if e is not None and not e.accepts(info.dtype, tuple(info.shape)):
            out.append(Problem(info.file, name, f"{info.file}: tensor {name!r} is {info.dtype}{list(info.shape)}, "
                                                f"expected {e.describe()} for its module's format in {cfg_file.name}"))
    return out


def _tensor_problems(cfg_file: Path, schema: Schema, reader: CheckpointReader, typed: Any,
                     ignore: frozenset[str] = frozenset(), cfg: dict[str, Any] | None = None) -> list[Problem]:
    out: list[Problem] = []
    got = {i.name: i for i in reader.infos() if i.name not in ignore}
    tensors = _resolve_dense(schema, got)
    missing = [n for n in tensors if n not in got and n not in schema.optional]
    if missing:
        out.append(Problem(cfg_file, missing[0], f"{reader.path}: missing tensor(s) {_names(missing)} that the "
                                                 f"{schema.family} schema of {cfg_file.name} requires"))
    extra = [n for n in got if n not in tensors and not schema.allowed_extra(n)
             and _extra_of(schema, tensors, n) is None]
    if extra:
        out.append(Problem(_where(reader, extra[0]), extra[0],
                           f"{_where(reader, extra[0])}: unexpected tensor(s) {_names(extra)} (not in the "
                           f"{schema.family} schema of {cfg_file.name})"))
    out += _extra_problems(schema, tensors, got, cfg_file)
    hints: dict[str, Schema | None] = {}  # field -> the schema with it changed (shared by every problem)
    for name, spec in tensors.items():
        info = got.get(name)
        if info is None:
            continue
        if tuple(info.shape) != spec.shape or not schema.dtype_ok(spec.dtype, info.dtype, name):
            hint = _fields_for(cfg, typed, name, spec.shape, list(info.shape), hints, set(got)) if cfg is not None else ""
            out.append(Problem(info.file, name, f"{info.file}: tensor {name!r} is {info.dtype}{list(info.shape)}, "
                                                f"expected {spec.dtype}{list(spec.shape)} from {cfg_file.name}{hint}"))
    return out


def _vocab_map_problems(cfg_file: Path, schema: Schema, reader: CheckpointReader) -> list[Problem]:
    V, Vd = schema.vocab_map or (None, None)
    d2t = reader.info(keys.D2T) if keys.D2T in reader else None
    t2d = reader.info(keys.T2D) if keys.T2D in reader else None
    if schema.vocab_map is None:
        present = [i for i in (d2t, t2d) if i is not None]
        if len(present) == 1:  # engines would remap with a map the config says is not there
            return [Problem(present[0].file, present[0].name,
                            f"{present[0].file}: tensor {present[0].name!r} is there but {cfg_file.name} has "
                            f"no reduced vocabulary (draft_vocab_size equals vocab_size)")]
        return _identity_map_problems(cfg_file, reader, d2t, t2d) if present else []
    if d2t is None or t2d is None or list(d2t.shape) != [Vd] or list(t2d.shape) != [V] or t2d.dtype != "BOOL":
        return []  # missing / mis-shaped: reported by the schema comparison
    import torch

    values = _map_values(reader, d2t, t2d)
    if values is None:
        return []
    mask, offs = values
    trues = int(mask.sum())
    if trues != Vd:
        return [Problem(t2d.file, keys.T2D, f"{t2d.file}: tensor 't2d' marks {trues} target ids but "
                                            f"draft_vocab_size in {cfg_file.name} is {Vd}")]
    if offs.dtype not in (torch.int64, torch.int32):
        return []
    targets = offs.to(torch.int64) + torch.arange(Vd, dtype=torch.int64)
    if bool((targets < 0).any()) or bool((targets >= V).any()) or not bool(mask[targets.clamp(0, V - 1)].all()):
        return [Problem(d2t.file, keys.D2T, f"{d2t.file}: tensor 'd2t' maps draft ids to target ids that 't2d' "
                                            f"does not mark (d2t and t2d disagree)")]
    return []


def _map_values(reader: CheckpointReader, d2t: Any, t2d: Any) -> tuple[Any, Any] | None:
    """(t2d, d2t) values, or None where they are not here to read (a header-only view, too big)."""
    if d2t.nbytes > _MAX_MAP_BYTES or t2d.nbytes > _MAX_MAP_BYTES or not d2t.file.is_file() \
            or d2t.file.stat().st_size == 0:  # a header-only view (a Hub repo) has no data here
        return None
    try:
        return reader.get(keys.T2D), reader.get(keys.D2T)
    except Eagle3Error:  # a header-only view (a Hub repo): the values are not here
        return None


def _identity_map_problems(cfg_file: Path, reader: CheckpointReader, d2t: Any, t2d: Any) -> list[Problem]:
    """A full-vocabulary draft's d2t / t2d (SpecForge saves both whatever the vocabulary) must be the
    identity: engines that find d2t remap with it."""
    V = t2d.shape[0] if len(t2d.shape) == 1 else None
    if V is None or list(d2t.shape) != [V] or t2d.dtype != "BOOL":
        return []  # mis-shaped: reported by the schema comparison
    values = _map_values(reader, d2t, t2d)
    if values is None:
        return []
    mask, offs = values
    if not bool(mask.all()):
        return [Problem(t2d.file, keys.T2D, f"{t2d.file}: tensor 't2d' leaves {int((~mask).sum())} target ids "
                                            f"unmarked but {cfg_file.name} has the full vocabulary (draft_vocab_size "
                                            f"equals vocab_size)")]
    if bool(offs.ne(0).any()):
        return [Problem(d2t.file, keys.D2T, f"{d2t.file}: tensor 'd2t' is not the identity map but {cfg_file.name} "
                                            f"has the full vocabulary (draft_vocab_size equals vocab_size)")]
    return []


def check_checkpoint(path: str | Path, *, target_layers: int | None = None,
                     ignore: frozenset[str] = frozenset(), reader: CheckpointReader | None = None) -> list[Problem]:
    """Every problem of the checkpoint directory ``path`` against its schema (empty: it conforms, or
    eagle3 has no schema for its architecture). Unreadable headers or index raise their one-line
    :class:`~eagle3.errors.Eagle3Error` as the reader does. ``reader``: the tensors' headers when
    they are not files in ``path`` (a Hub repo's header-only view, ``hub.header_view``)."""
    d = Path(path)
    if not d.is_dir():
        return []
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        return []
    cfg: Any = read_json(cfg_file)
    typed, problems = parse_config(cfg, cfg_file, target_layers)
    out = [Problem(cfg_file, p.split("'")[1] if "'" in p else "", p) for p in problems]
    if typed is None:
        return out
    if reader is None:
        reader = CheckpointReader(d)
        out += _index_problems(d, reader)
    return out + check_reader(cfg, typed, cfg_file, reader, ignore)


def check_reader(cfg: dict[str, Any], typed: TextStackConfig | DraftConfig, cfg_file: Path,
                 reader: CheckpointReader, ignore: frozenset[str] = frozenset()) -> list[Problem]:
    """The tensors a reader's headers name against the schema of the typed config ``typed``
    (``ignore``: tensors the user drops, e.g. ``convert --drop``)."""
    out: list[Problem] = []
    try:
        schema = schema_for(cfg, typed, str(cfg_file), set(reader.names()))
    except FormatError:  # a quantization_config eagle3 cannot lay out: detect / the commands refuse it
        return []
    out += _layer_problems(cfg_file, schema, reader.names())
    out += _tensor_problems(cfg_file, schema, reader, typed, ignore, cfg)
    if isinstance(typed, DraftConfig):
        out += _vocab_map_problems(cfg_file, schema, reader)
    return out


def require_valid(path: str | Path, *, target_layers: int | None = None,
                  ignore: frozenset[str] = frozenset()) -> None:
    """Raise the first problem of :func:`check_checkpoint` as a one-line :class:`FormatError` (exit 2)."""
    try:
        problems = check_checkpoint(path, target_layers=target_layers, ignore=ignore)
    except Eagle3Error:
        raise
    except (OSError, ValueError, json.JSONDecodeError) as e:  # the reader raises its own one-liners first
        raise FormatError(f"{path}: cannot check against its schema ({e})") from None
    if problems:
        more = f" (and {len(problems) - 1} more problem(s); eagle3 inspect lists them)" if len(problems) > 1 else ""
        raise FormatError(str(problems[0]) + more)


def checkpoint_dirs(root: str | Path) -> list[Path]:
    """``root`` and the directories under it holding a ``config.json`` beside ``.safetensors`` files
    (an eagle3 output may hold the target and draft side by side): what :func:`require_valid_tree` checks."""
    d = Path(root)
    if not d.is_dir():
        return []
    found = [c.parent for c in sorted(d.rglob("config.json")) if c.is_file() and not c.is_symlink()]
    return [p for p in ([d] if d not in found else []) + found if any(p.glob("*.safetensors"))]


def require_valid_tree(root: str | Path) -> None:
    """``verify``: every checkpoint directory of an output against its schema, before any weight is
    hashed. A header or index the reader refuses is left to the manifest check, which lists every
    such problem; a model that disagrees with its schema is one :class:`FormatError` (exit 2)."""
    from eagle3.errors import CheckpointError

    for d in checkpoint_dirs(root):
        try:
            require_valid(d)
        except CheckpointError:
            continue


def require_valid_pair(target: str | Path, draft: str | Path | None) -> None:
    """``serve`` / ``bench`` / ``serve --validate``: the target, then the draft (its aux layer ids
    inside the target's layers), against their schemas before the engine reads a weight."""
    require_valid(target)
    if draft is not None:
        require_valid(draft, target_layers=target_num_layers(target))


def target_num_layers(target: str | Path) -> int | None:
    """The target's decoder layer count from its typed config (None: no config eagle3 types)."""
    cfg_file = Path(target) / "config.json"
    if not cfg_file.is_file():
        return None
    typed, _ = parse_config(read_json(cfg_file), cfg_file)
    return typed.num_hidden_layers if isinstance(typed, TextStackConfig) else None


def report_problems(path: str | Path, *, strict: bool = False, to_stderr: bool = False,
                    reader: CheckpointReader | None = None) -> list[Problem]:
    """``inspect``'s report: every problem, one line each (stdout, or stderr beside ``--json``);
    ``strict`` raises the first as a one-line :class:`FormatError` (exit 2) instead of listing them."""
    import sys

    problems = check_checkpoint(path, reader=reader) if Path(path).is_dir() else []
    if problems and strict:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise FormatError(str(problems[0]) + more)
    for p in problems:
        print(f"schema problem: {p}", file=sys.stderr if to_stderr else sys.stdout)
    return problems


__all__ = ["Problem", "check_checkpoint", "check_reader", "checkpoint_dirs", "require_valid", "require_valid_pair",
           "require_valid_tree", "report_problems", "target_num_layers"]
