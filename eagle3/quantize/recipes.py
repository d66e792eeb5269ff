"""Quantization recipes: YAML files that name a weight scheme, the activation scheme recorded in the
exported config, the scope (which Linear modules are quantized) and export options.

Shipped recipes live in ``eagle3/recipes/*.yaml`` (package data) and are addressed by name
(``w4a8``); anything else is read as a path to a user's YAML file. The schema (documented with an
example in docs/recipes.md)::

    name: my-recipe
    description: one line
    weight: {format: int4, qscheme: per_group, group_size: 128}
    activation: {format: none}
    method: rtn                   # how the numbers are chosen: rtn | mse (eagle3.quantize.methods)
    scopes:                       # or a single `scope: {...}`
      all:
        include: ["re:\\.mlp\\.", "*self_attn.o_proj"]
        exclude: ["*lm_head"]
        exclude_regex: ["re:.*lm_head$"]   # copied into the exported config for the engines
    default_scope: all
    export: {zero_point: true}

Patterns match a module name (the tensor name without ``.weight``), in the checkpoint's own naming:
a glob is ``fnmatch`` on the whole name (Quark's ``exclude`` semantics), ``re:<regex>`` is Python
``re.search``. A module is quantized when it matches an ``include`` and no ``exclude`` pattern.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from eagle3.errors import UsageError

SCHEMA_VERSION = 1

# Weight formats and what each one allows. ``row_separable``: every output row is quantized on its
# own (per-channel / per-group scales), so a weight may be processed in row chunks (bounded memory,
# cache-friendly) with bit-identical results; per-tensor stages need the whole tensor's amax.
WEIGHT_FORMATS: dict[str, dict[str, Any]] = {
    # Quark ProgressiveSpec: FP8-E4M3 per-tensor, then INT4 per-output-channel symmetric.
    "fp8_int4": {"qschemes": ("per_channel",), "k_multiple": 8, "row_separable": False,
                 "zero_point": False, "max_rel_error": 0.25},
    # Quark Int4PerChannelSpec(ch_axis=0) / Int4PerGroupSpec(ch_axis=-1), symmetric.
    "int4": {"qschemes": ("per_channel", "per_group"), "k_multiple": 8, "row_separable": True,
             "zero_point": True, "max_rel_error": 0.25},
    # OCP MXFP4: E2M1 elements, E8M0 "even" scale per 32 inputs.
    "mxfp4": {"qschemes": ("per_group",), "k_multiple": 32, "row_separable": True,
              "zero_point": False, "max_rel_error": 0.2},
    # FP8-E4M3 static weights, per output channel or per tensor.
    "fp8": {"qschemes": ("per_channel", "per_tensor"), "k_multiple": 1, "row_separable": True,
            "zero_point": False, "max_rel_error": 0.06},
}
ACTIVATION_FORMATS: dict[str, tuple[str, ...]] = {
    "none": (),
    "fp8": ("per_tensor", "per_token"),
    "int8": ("per_token",),
    "mxfp4": ("per_group",),
}
INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class WeightSpec:
    format: str
    qscheme: str
    group_size: int | None = None

    @property
    def k_multiple(self) -> int:
        """The input dimension must be a multiple of this (group size or packing width)."""
        base = WEIGHT_FORMATS[self.format]["k_multiple"]
        return max(base, self.group_size or 1)

    @property
    def row_separable(self) -> bool:
        if self.format == "fp8" and self.qscheme == "per_tensor":
            return False
        return bool(WEIGHT_FORMATS[self.format]["row_separable"])

    @property
    def max_rel_error(self) -> float:
        """Relative Frobenius error a healthy weight stays under (report flag and tests)."""
        return float(WEIGHT_FORMATS[self.format]["max_rel_error"])

    def describe(self) -> str:
        if self.format == "fp8_int4":
            return "fp8_e4m3 per_tensor -> int4 per_channel sym"
        if self.format == "int4":
            return "int4 per_channel sym" if self.qscheme == "per_channel" else f"int4 per_group g{self.group_size} sym"
        if self.format == "mxfp4":
            return "mxfp4 (fp4 e2m1, e8m0 per 32)"
        return f"fp8_e4m3 {self.qscheme}"


@dataclass(frozen=True)
class ActivationSpec:
    format: str  # "none" = weight-only
    qscheme: str | None = None

    def describe(self) -> str:
        return "none (weight-only)" if self.format == "none" else f"{self.format} {self.qscheme} dynamic"


@dataclass(frozen=True)
class Scope:
    name: str
    include: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    exclude_regex: tuple[str, ...] = ()  # verbatim "re:" entries for the exported config

    def matches(self, module: str) -> bool:
        # one compiled test per pattern list: a scope is matched against every module name of a
        # checkpoint (140k for Kimi-K2.5's experts)
        return any_match(self.include)(module) and not any_match(self.exclude)(module)


@dataclass(frozen=True)
class ExportOptions:
    # Write the zero-point zeros of symmetric INT4 (weight_zero_point; weight_zero_point_2 for the INT4
    # stage of fp8_int4): Quark's importer needs them, vLLM's DeepSeek/Kimi MoE loader refuses them.
    zero_point: bool


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    weight: WeightSpec
    activation: ActivationSpec
    scopes: dict[str, Scope]
    default_scope: str
    export: ExportOptions
    source: str  # "builtin:<name>" or the YAML path
    # How the numbers are chosen within the format (eagle3.quantize.methods; --method overrides it):
    # "rtn" (Quark's round to nearest, the default) or "mse" (the data-free scale search).
    method: str = "rtn"
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def scope(self, name: str | None = None) -> Scope:
        key = name or self.default_scope
        if key not in self.scopes:
            raise UsageError(f"recipe {self.name!r}: unknown scope {key!r} (choose from {', '.join(self.scopes)})")
        return self.scopes[key]


# ---------------------------------------------------------------------------------------------
# Pattern matching
# ---------------------------------------------------------------------------------------------

_REGEX_CACHE: dict[str, re.Pattern[str]] = {}


@functools.lru_cache(maxsize=256)
def any_match(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """``name -> any(match(p, name) for p in patterns)``, with the glob patterns compiled into one
    regex (fnmatch's own translation), so that a name costs one regex match, not one per pattern."""
    globs = [p for p in patterns if not p.startswith("re:")]
    regexes = [p for p in patterns if p.startswith("re:")]
    glob = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in globs)) if globs else None

    def test(name: str) -> bool:
        return (glob is not None and glob.match(name) is not None) or any(match(p, name) for p in regexes)

    return test


def match(pattern: str, name: str) -> bool:
    """``re:<regex>`` -> ``re.search``; anything else -> ``fnmatch`` (case-sensitive) on the whole name."""
    if pattern.startswith("re:"):
        rx = _REGEX_CACHE.get(pattern)
        if rx is None:
            rx = _REGEX_CACHE[pattern] = re.compile(pattern[3:])
        return rx.search(name) is not None
    return fnmatch.fnmatchcase(name, pattern)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def builtin_names() -> list[str]:
    """Names of the recipes shipped in ``eagle3/recipes``."""
    root = resources.files("eagle3") / "recipes"
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A shipped recipe by name, or a user's YAML file by path."""
    s = str(name_or_path)
    if s in builtin_names():
        text = (resources.files("eagle3") / "recipes" / f"{s}.yaml").read_text()
        return parse_recipe(text, f"builtin:{s}")
    p = Path(s)
    if not p.is_file():
        raise UsageError(f"--recipe {s!r}: no built-in recipe of that name ({', '.join(builtin_names())}) "
                         f"and no such file")
    try:
        text = p.read_text()
    except OSError as e:
        raise UsageError(f"{p}: cannot read recipe ({e.strerror or e})") from None
    return parse_recipe(text, str(p))


def _fail(where: str, field_: str, msg: str) -> UsageError:
    return UsageError(f"{where}: field '{field_}' {msg}")


def _str_list(v: Any, where: str, field_: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise _fail(where, field_, "must be a list of non-empty strings")
    for x in v:
        if x.startswith("re:"):
            try:
                re.compile(x[3:])
            except re.error as e:
                raise _fail(where, field_, f"has a bad regex {x!r} ({e})") from None
    return tuple(v)


def _scope(name: str, d: Any, where: str, field_: str) -> Scope:
    if not isinstance(d, dict):
        raise _fail(where, field_, "must be a mapping with include/exclude/exclude_regex")
    unknown = set(d) - {"include", "exclude", "exclude_regex"}
    if unknown:
        raise _fail(where, f"{field_}.{sorted(unknown)[0]}", "is not a scope field (include, exclude, exclude_regex)")
    include = _str_list(d.get("include"), where, f"{field_}.include")
    if not include:
        raise _fail(where, f"{field_}.include", "is empty (a scope must include something)")
    regexes = _str_list(d.get("exclude_regex"), where, f"{field_}.exclude_regex")
    for r in regexes:
        if not r.startswith("re:"):
            raise _fail(where, f"{field_}.exclude_regex", f"entry {r!r} must start with 're:' (engines read it as a regex)")
    return Scope(name, include, _str_list(d.get("exclude"), where, f"{field_}.exclude"), regexes)


def parse_recipe(text: str, where: str) -> Recipe:
    """YAML text -> Recipe, with one-line errors naming the field."""
    try:
        d = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{where}: not valid YAML{at} ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(d, dict):
        raise UsageError(f"{where}: a recipe must be a YAML mapping")
    known = {"name", "description", "schema_version", "weight", "activation", "method", "scope", "scopes",
             "default_scope", "export"}
    unknown = set(d) - known
    if unknown:
        raise _fail(where, sorted(unknown)[0], f"is not a recipe field ({', '.join(sorted(known))})")
    ver = d.get("schema_version", SCHEMA_VERSION)
    if ver != SCHEMA_VERSION:
        raise _fail(where, "schema_version", f"is {ver!r}; this eagle3 reads version {SCHEMA_VERSION}")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(where, "name", "is missing (a short recipe name)")

    w = d.get("weight")
    if not isinstance(w, dict):
        raise _fail(where, "weight", "is missing (e.g. {format: int4, qscheme: per_channel})")
    fmt = w.get("format")
    if fmt not in WEIGHT_FORMATS:
        raise _fail(where, "weight.format", f"is {fmt!r}; expected one of {', '.join(WEIGHT_FORMATS)}")
    allowed = WEIGHT_FORMATS[fmt]["qschemes"]
    qs = w.get("qscheme", allowed[0])
    if qs not in allowed:
        raise _fail(where, "weight.qscheme", f"is {qs!r}; {fmt} allows {', '.join(allowed)}")
    gs = w.get("group_size")
    if fmt == "int4" and qs == "per_group":
        if gs not in INT4_GROUP_SIZES:
            raise _fail(where, "weight.group_size", f"is {gs!r}; int4 per_group needs one of {INT4_GROUP_SIZES}")
    elif fmt == "mxfp4":
        if gs not in (None, 32):
            raise _fail(where, "weight.group_size", f"is {gs!r}; MXFP4 blocks are 32 wide")
        gs = 32
    elif gs is not None:
        raise _fail(where, "weight.group_size", f"is {gs!r} but {fmt} {qs} has no groups")
    extra = set(w) - {"format", "qscheme", "group_size"}
    if extra:
        raise _fail(where, f"weight.{sorted(extra)[0]}", "is not a weight field (format, qscheme, group_size)")
    weight = WeightSpec(fmt, qs, gs)

    a = d.get("activation") or {"format": "none"}
    if not isinstance(a, dict):
        raise _fail(where, "activation", "must be a mapping like {format: fp8, qscheme: per_token}")
    afmt = a.get("format", "none")
    if afmt not in ACTIVATION_FORMATS:
        raise _fail(where, "activation.format", f"is {afmt!r}; expected one of {', '.join(ACTIVATION_FORMATS)}")
    aqs = a.get("qscheme", ACTIVATION_FORMATS[afmt][0] if ACTIVATION_FORMATS[afmt] else None)
    if afmt != "none" and aqs not in ACTIVATION_FORMATS[afmt]:
        raise _fail(where, "activation.qscheme", f"is {aqs!r}; {afmt} allows {', '.join(ACTIVATION_FORMATS[afmt])}")
    if afmt == "mxfp4" and fmt != "mxfp4":
        raise _fail(where, "activation.format", "mxfp4 activations need mxfp4 weights (OCP MX engines pair them)")
    if set(a) - {"format", "qscheme", "dynamic"} or a.get("dynamic", True) is not True:
        raise _fail(where, "activation", "supports only format, qscheme and dynamic: true (static scales need "
                                         "calibration data, which file-to-file quantization has none of)")
    activation = ActivationSpec(afmt, aqs if afmt != "none" else None)

    if ("scope" in d) == ("scopes" in d):
        raise _fail(where, "scopes", "is missing (give either 'scope' or 'scopes')" if "scope" not in d
                    else "and 'scope' are both given (use one)")
    if "scope" in d:
        scopes = {"default": _scope("default", d["scope"], where, "scope")}
        default_scope = "default"
    else:
        raw = d["scopes"]
        if not isinstance(raw, dict) or not raw:
            raise _fail(where, "scopes", "must be a non-empty mapping of scope name -> scope")
        scopes = {str(k): _scope(str(k), v, where, f"scopes.{k}") for k, v in raw.items()}
        default_scope = d.get("default_scope", next(iter(scopes)))
        if default_scope not in scopes:
            raise _fail(where, "default_scope", f"is {default_scope!r}, not one of {', '.join(scopes)}")

    e = d.get("export") or {}
    if not isinstance(e, dict) or set(e) - {"zero_point"}:
        raise _fail(where, "export", "supports only 'zero_point' (true/false)")
    zp = e.get("zero_point", WEIGHT_FORMATS[fmt]["zero_point"])
    if not isinstance(zp, bool):
        raise _fail(where, "export.zero_point", f"is {zp!r}, expected true or false")
    if zp and fmt not in ("int4", "fp8_int4"):
        raise _fail(where, "export.zero_point", f"applies to int4 and fp8_int4 only, not {fmt}")
    return Recipe(name=name, description=str(d.get("description") or ""), weight=weight, activation=activation,
                  scopes=scopes, default_scope=default_scope, export=ExportOptions(zp), source=where,
                  method=_method(d.get("method", "rtn"), where), raw=d)


def _method(v: Any, where: str) -> str:
    """The recipe's ``method`` (a name; whether eagle3 has it, and whether it can write the recipe's
    format, is checked with the rest of the run's options: eagle3.quantize.methods.get_method)."""
    if not isinstance(v, str) or not v:
        raise _fail(where, "method", f"is {v!r}; expected a method name such as rtn or mse")
    return v
