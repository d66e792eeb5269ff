"""A corpus of malformed inputs for the ``eagle3`` CLI (issue 10).

Each :class:`Case` takes a fresh copy of one tiny model (``eagle3 make-tiny``) and breaks it in one
way: a safetensors header, a config, an index, a manifest, a d2t map, a recipe, an output path or a
side file. The test (``test_corpus.py``) drives the CLI on it with each command of ``Case.commands``
and checks the promise every command makes about bad input (eagle3/errors.py):

* exit code 2;
* stderr is exactly one line, ``error: ...``, naming the file, tensor or field (``Case.expect``);
* no ``OUT``, ``OUT.partial`` or ``OUT.lock`` left behind;
* nothing under the case's directory changed: the source's bytes, its siblings, a pre-existing OUT.

Everything a case creates lives under one directory (``root``), so a byte-level snapshot of
``root`` before and after the run covers the source, its parent, and any output path the command
could have written. Every case runs ``eagle3.cli.main`` in-process, which keeps the corpus fast (a
Python process per run would cost more than the run); cases that can hang (FIFOs) run it in a thread
with a timeout, after which the FIFOs' write ends are opened and closed: a command blocked opening or
reading one then sees end-of-file and returns, and the case fails as a hang.

``python -m tests.robustness.corpus [ID-SUBSTRING ...]`` runs the corpus (or the matching cases)
outside pytest and prints a Markdown report of the failures, grouped by the issue item each case
exercises.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import stat
import struct
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# Which tiny model a case copies, and in which role the commands treat it. "output" is an eagle3
# output directory (the draft converted for vLLM: it carries manifest.json), built once per session.
MODELS: dict[str, tuple[str, str]] = {
    "draft": ("kimi-k2.5-eagle3", "draft"),
    "d2t": ("kimi-k2.5-eagle3-d2t", "draft"),
    "mla": ("kimi-k2.6-eagle3.1-mla", "draft"),
    "target": ("kimi-k2.5", "target"),
    "output": ("draft-vllm", "draft"),
}

CKPT = ("inspect", "convert", "quantize")
WRITE = ("convert", "quantize")
S1 = "model-00001-of-00002.safetensors"  # the draft's first shard: every tensor but lm_head
S2 = "model-00002-of-00002.safetensors"  # the draft's second shard: lm_head.weight only
ONE = "model.safetensors"  # the d2t draft: one file, no index
INDEX = "model.safetensors.index.json"
GSM8K_DIR = "gsm8k"  # serve --validate's two-question data set, written beside the source
HANG_TIMEOUT_S = 30  # a FIFO run that has not exited by then is taken as a hang


# ---------------------------------------------------------------------------------------------
# What a case is
# ---------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    """One case's directories. ``root`` holds everything (snapshotted); ``tdir`` = root/T holds the
    source copy, its siblings and, by default, OUT."""

    root: Path
    src: Path
    role: str
    sources: dict[str, Path]
    out: Path = field(init=False)
    src_arg: str | None = None  # SRC as typed, when it is not str(src)
    recipe: str | None = None  # quantize --recipe (default: the role's built-in recipe)
    extra: dict[str, list[str]] = field(default_factory=dict)  # command -> extra CLI arguments
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out = self.tdir / "out"

    @property
    def tdir(self) -> Path:
        return self.root / "T"

    def copy(self, model: str, name: str) -> Path:
        """A fresh copy of another tiny model next to the source, as ``T/name``."""
        dst = self.tdir / name
        shutil.copytree(self.sources[MODELS[model][0]], dst, symlinks=True)
        return dst

    def also(self, *args: str, on: tuple[str, ...] = WRITE) -> None:
        for c in on:
            self.extra.setdefault(c, []).extend(args)

    def names(self) -> dict[str, str]:
        """Placeholders usable in ``Case.expect``."""
        return {"src": str(self.src), "out": str(self.out), "out_parent": str(self.out.parent),
                "src_arg": self.src_arg or str(self.src), "T": str(self.tdir)}

    def argv(self, command: str) -> list[str]:
        src = self.src_arg or str(self.src)
        extra = self.extra.get(command, [])
        if command in ("inspect", "verify"):
            return [command, src, *extra]
        if command == "convert":
            flags = ["--engine", "vllm"] if self.role == "draft" else ["--text-only"]
            return ["convert", src, str(self.out), *flags, "--quiet", *extra]
        if command == "quantize":
            recipe = self.recipe or ("int4-draft" if self.role == "draft" else "w4a8")
            return ["quantize", src, str(self.out), "--recipe", recipe, "--workers", "1", "--quiet", *extra]
        if command == "serve":
            # --validate: the server stops by itself (a model that got through would answer one
            # question and exit 0 or 1, not hang); a draft is served beside the intact tiny target.
            pair = [src] if self.role == "target" else [str(self.sources[MODELS["target"][0]]), "--draft", src]
            return ["serve", *pair, "--kernel-backend", "torch", "--enforce-eager", "--validate", "gsm8k",
                    "--limit", "1", "--num-fewshot", "0", "--max-tokens", "2", "--no-baseline",
                    "--dataset", str(self.tdir / GSM8K_DIR), *extra]
        if command == "serve-engine":  # the hand-off to another engine (printed only)
            pair = [src] if self.role == "target" else [str(self.sources[MODELS["target"][0]]), "--draft", src]
            return ["serve", *pair, "--engine", "vllm", "--dry-run", *extra]
        raise ValueError(command)


Expect = str | tuple[str, ...]  # a substring, or alternatives of which one must appear


@dataclass(frozen=True)
class Case:
    id: str
    model: str  # a key of MODELS
    commands: tuple[str, ...]
    expect: tuple[Expect, ...]  # what the error line must name; "{src}", "{out}", ... are filled in
    breaks: Callable[[Ctx], None]
    item: str  # the issue-10 item (fix) this case exercises: groups the failure report
    forbid: tuple[str, ...] = ()  # substrings of a misleading message (issue item 14)
    hang: bool = False  # may hang (FIFOs): run with a timeout (run_guarded)
    non_root: bool = False  # permission cases: root reads and writes everything


CASES: list[Case] = []


def case(id: str, model: str, commands: tuple[str, ...], expect: tuple[Expect, ...], item: str,
         **kw: Any) -> Callable[[Callable[[Ctx], None]], Callable[[Ctx], None]]:
    def register(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
        assert all(c.id != id for c in CASES), id
        CASES.append(Case(id, model, commands, expect, fn, item, **kw))
        return fn
    return register


# Issue items, as the failure report groups them.
I_PATHS = "1 output paths (OUT vs inputs, --overwrite)"
I_SIDE = "4 side files (symlinks / non-regular)"
I_FIFO = "11 non-regular files (FIFO / directory)"
I_HDR = "12 strict safetensors headers"
I_TB = "13 one line instead of a traceback"
I_MSG = "14 misleading messages"
I_VAL = "15 quantize validates the model"
I_NAN = "16 non-finite weights"
I_BASE = "baseline (handled today)"


# ---------------------------------------------------------------------------------------------
# Helpers to break files
# ---------------------------------------------------------------------------------------------


def split(path: Path) -> tuple[bytes, bytes]:
    """A safetensors file's (header JSON bytes, data bytes)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8:8 + n], raw[8 + n:]


def write_raw(path: Path, header: bytes, data: bytes, hlen: int | None = None) -> None:
    path.write_bytes(struct.pack("<Q", len(header) if hlen is None else hlen) + header + data)


def pad(header: bytes) -> bytes:
    return header + b" " * (-len(header) % 8)


def edit_header(path: Path, fn: Callable[[dict[str, Any]], None], data: Callable[[bytes], bytes] | None = None) -> None:
    """Rewrite one header entry by entry (order kept); the data bytes stay (or go through ``data``)."""
    h, d = split(path)
    hdr = json.loads(h)
    fn(hdr)
    write_raw(path, pad(json.dumps(hdr, separators=(",", ":")).encode()), data(d) if data else d)


def edit_json(path: Path, fn: Callable[[Any], object]) -> None:
    """``fn`` changes the parsed JSON in place (what it returns is ignored)."""
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj, indent=2))


def edit_tensors(path: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite a shard with safetensors itself after ``fn`` changed its tensors (values, shapes)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    fn(tensors)
    save_file(tensors, str(path), metadata=meta)


def overlap(h: dict[str, Any]) -> None:
    """Point a tensor at the bytes of the one before it (two same-sized norms: sizes stay right)."""
    ents = sorted((e["data_offsets"], k) for k, e in h.items() if k != "__metadata__")
    for ((b0, e0), _), ((b1, e1), name) in zip(ents, ents[1:], strict=False):
        if e1 - b1 == e0 - b0:
            h[name]["data_offsets"] = [b0, e0]
            return
    raise AssertionError("no two adjacent tensors of the same size")


def mkfifo(path: Path) -> None:
    if path.exists():
        path.unlink()
    os.mkfifo(path)


def set_draft_config(key: str, value: Any) -> Callable[[Ctx], None]:
    def fn(ctx: Ctx) -> None:
        edit_json(ctx.src / "config.json", lambda c: c.__setitem__(key, value))
    return fn


def chmod(ctx: Ctx, path: Path, mode: int) -> None:
    old = stat.S_IMODE(path.stat().st_mode)
    path.chmod(mode)
    ctx.cleanups.append(lambda: path.chmod(old))


# ---------------------------------------------------------------------------------------------
# Safetensors headers (the reader every command uses)
# ---------------------------------------------------------------------------------------------


@case("hdr-truncated-5-bytes", "draft", CKPT, (S2,), I_BASE)
def _(ctx: Ctx) -> None:
    (ctx.src / S2).write_bytes((ctx.src / S2).read_bytes()[:5])


@case("hdr-empty-file", "draft", CKPT, (S2,), I_BASE)
def _(ctx: Ctx) -> None:
    (ctx.src / S2).write_bytes(b"")


@case("hdr-length-past-eof", "draft", CKPT, (S2,), I_BASE)
def _(ctx: Ctx) -> None:
    h, d = split(ctx.src / S2)
    write_raw(ctx.src / S2, h, d, hlen=(ctx.src / S2).stat().st_size)


@case("hdr-length-2**63", "draft", CKPT, (S2,), I_BASE)
def _(ctx: Ctx) -> None:
    h, d = split(ctx.src / S2)
    write_raw(ctx.src / S2, h, d, hlen=2**63 + 5)


@case("hdr-zero-length", "draft", CKPT, (S2,), I_BASE)
def _(ctx: Ctx) -> None:
    h, d = split(ctx.src / S2)
    write_raw(ctx.src / S2, b"", h + d)


@case("hdr-not-json", "draft", CKPT, (S2,), I_BASE)
def _(ctx: Ctx) -> None:
    write_raw(ctx.src / S2, pad(b"this is not json"), split(ctx.src / S2)[1])


@case("hdr-not-utf8", "draft", CKPT, (S2,), I_BASE)
def _(ctx: Ctx) -> None:
    write_raw(ctx.src / S2, pad(b'{"\xff\xfe":1}'), split(ctx.src / S2)[1])


@case("hdr-json-array", "draft", CKPT, (S2,), I_BASE)
def _(ctx: Ctx) -> None:
    write_raw(ctx.src / S2, pad(b"[1,2,3]"), split(ctx.src / S2)[1])


@case("hdr-nested-bracket-bomb", "draft", CKPT, (S2,), I_TB)
def _(ctx: Ctx) -> None:
    write_raw(ctx.src / S2, b"[" * 50_000 + b"]" * 50_000, split(ctx.src / S2)[1])


@case("hdr-entry-not-object", "draft", CKPT, (S2, "lm_head.weight"), I_BASE)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S2, lambda h: h.__setitem__("lm_head.weight", 5))


@case("hdr-dtype-list", "draft", CKPT, (S2, "lm_head.weight"), I_TB)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S2, lambda h: h["lm_head.weight"].__setitem__("dtype", ["BF16"]))


@case("hdr-unknown-dtype", "draft", CKPT, (S2, "lm_head.weight", "BF17"), I_MSG)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S2, lambda h: h["lm_head.weight"].__setitem__("dtype", "BF17"))


@case("hdr-negative-shape-end-before-begin", "draft", CKPT, (S2, "lm_head.weight"), I_HDR)
def _(ctx: Ctx) -> None:
    # BF16[-1024, 128] "needs" -262144 bytes, and offsets [262144, 0] "hold" exactly that.
    edit_header(ctx.src / S2, lambda h: h["lm_head.weight"].update(shape=[-1024, 128], data_offsets=[262144, 0]))


@case("hdr-float-shape", "draft", CKPT, (S2, "lm_head.weight"), I_HDR)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S2, lambda h: h["lm_head.weight"].__setitem__("shape", [1024.9, 128]))


@case("hdr-bool-shape-entry", "draft", CKPT, (S2, "lm_head.weight"), I_HDR)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S2, lambda h: h["lm_head.weight"].__setitem__("shape", [1024, 128, True]))


@case("hdr-string-shape-entry", "draft", CKPT, (S2, "lm_head.weight"), I_HDR)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S2, lambda h: h["lm_head.weight"].__setitem__("shape", ["1024", 128]))


@case("hdr-shape-product-mismatch", "draft", CKPT, (S2, "lm_head.weight"), I_BASE)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S2, lambda h: h["lm_head.weight"].__setitem__("shape", [1024, 64]))


@case("hdr-offsets-not-a-pair", "draft", CKPT, (S2, "lm_head.weight"), I_BASE)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S2, lambda h: h["lm_head.weight"].__setitem__("data_offsets", [0]))


@case("hdr-negative-offset", "draft", CKPT, (S1, "norm.weight", "offset"), I_MSG)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S1, lambda h: h["norm.weight"].__setitem__("data_offsets", [-256, 0]))


@case("hdr-overlapping-offsets", "draft", CKPT,
      (S1, ("midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight")), I_HDR)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S1, overlap)


@case("hdr-gap-before-first-tensor", "draft", CKPT, (S2,), I_HDR)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S2, lambda h: h["lm_head.weight"].__setitem__("data_offsets", [256, 262144 + 256]),
                data=lambda d: b"\0" * 256 + d)


@case("hdr-trailing-bytes-after-data", "draft", CKPT, (S2,), I_HDR)
def _(ctx: Ctx) -> None:
    with open(ctx.src / S2, "ab") as f:
        f.write(b"\0" * 4096)


@case("hdr-data-past-eof", "draft", CKPT, (S2, "lm_head.weight"), I_BASE)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S2, lambda h: h["lm_head.weight"].update(shape=[1025, 128], data_offsets=[0, 262400]))


@case("hdr-file-truncated", "draft", CKPT, (S2,), I_BASE)
def _(ctx: Ctx) -> None:
    raw = (ctx.src / S2).read_bytes()
    (ctx.src / S2).write_bytes(raw[:-4096])


@case("hdr-duplicate-key", "draft", CKPT, (S1, "norm.weight"), I_HDR)
def _(ctx: Ctx) -> None:
    h, d = split(ctx.src / S1)
    hdr = json.loads(h)
    dup = json.dumps({"norm.weight": hdr["norm.weight"]}, separators=(",", ":"))[1:-1].encode()
    write_raw(ctx.src / S1, pad(h.rstrip()[:-1] + b"," + dup + b"}"), d)


@case("hdr-metadata-not-str-map", "draft", CKPT, (S2, "__metadata__"), I_HDR)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S2, lambda h: h.__setitem__("__metadata__", {"format": 5}))


@case("hdr-metadata-a-list", "draft", CKPT, (S2, "__metadata__"), I_HDR)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S2, lambda h: h.__setitem__("__metadata__", ["pt"]))


# ---------------------------------------------------------------------------------------------
# Things that are not regular files where a file should be
# ---------------------------------------------------------------------------------------------


@case("fifo-as-only-shard", "d2t", CKPT, (ONE,), I_FIFO, hang=True, forbid=("does not exist",))
def _(ctx: Ctx) -> None:
    mkfifo(ctx.src / ONE)


@case("fifo-as-indexed-shard", "draft", ("inspect",), (S2,), I_FIFO, hang=True, forbid=("does not exist",))
def _(ctx: Ctx) -> None:
    mkfifo(ctx.src / S2)


@case("directory-as-indexed-shard", "draft", CKPT, (S2,), I_MSG, forbid=("does not exist",))
def _(ctx: Ctx) -> None:
    (ctx.src / S2).unlink()
    (ctx.src / S2).mkdir()


@case("directory-as-only-shard", "d2t", CKPT, (ONE,), I_FIFO)
def _(ctx: Ctx) -> None:
    (ctx.src / ONE).unlink()
    (ctx.src / ONE).mkdir()


# convert reads a single .safetensors file as SRC (its directory's config): only quantize fails.
@case("src-is-a-safetensors-file", "d2t", ("quantize",), (ONE,), I_TB)
def _(ctx: Ctx) -> None:
    ctx.src_arg = str(ctx.src / ONE)


@case("src-dir-mode-0111", "draft", CKPT, ("{src}",), I_TB, non_root=True)
def _(ctx: Ctx) -> None:
    chmod(ctx, ctx.src, 0o111)


@case("shard-unreadable-mode-000", "draft", CKPT, (S2,), I_TB, non_root=True)
def _(ctx: Ctx) -> None:
    chmod(ctx, ctx.src / S2, 0)


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


@case("config-missing", "draft", CKPT, ("config.json",), I_VAL)
def _(ctx: Ctx) -> None:
    (ctx.src / "config.json").unlink()


@case("config-not-json", "draft", CKPT, ("config.json",), I_BASE)
def _(ctx: Ctx) -> None:
    (ctx.src / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"],')


@case("config-a-list", "draft", CKPT, ("config.json",), I_BASE)
def _(ctx: Ctx) -> None:
    (ctx.src / "config.json").write_text("[1, 2]")


case("config-unknown-architecture", "draft", CKPT, ("MedusaForCausalLM",), I_VAL)(
    set_draft_config("architectures", ["MedusaForCausalLM"]))
case("config-architectures-a-string", "draft", CKPT, ("architectures",), I_VAL)(
    set_draft_config("architectures", "LlamaForCausalLMEagle3"))
case("config-hidden-size-mismatch", "draft", WRITE, ("hidden_size",), I_VAL)(set_draft_config("hidden_size", 256))
case("config-hidden-size-a-string", "draft", CKPT, ("hidden_size",), I_VAL)(set_draft_config("hidden_size", "128"))
case("config-vocab-size-mismatch", "draft", WRITE, (("vocab_size", "lm_head"),), I_VAL)(
    set_draft_config("vocab_size", 2048))
case("config-num-layers-a-string", "draft", CKPT, ("num_hidden_layers",), I_VAL)(
    set_draft_config("num_hidden_layers", "one"))
case("config-eagle-config-not-object", "draft", CKPT, ("eagle_config",), I_VAL)(set_draft_config("eagle_config", 5))


@case("config-hidden-size-missing", "draft", CKPT, ("hidden_size",), I_VAL)
def _(ctx: Ctx) -> None:
    edit_json(ctx.src / "config.json", lambda c: c.pop("hidden_size"))


def _aux(ids: list[Any]) -> Callable[[Ctx], None]:
    return set_draft_config("eagle_config", {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True})


case("config-aux-ids-not-ints", "draft", CKPT, ("eagle_aux_hidden_state_layer_ids",), I_VAL)(_aux([1, "two", 3]))
case("config-aux-ids-negative", "draft", CKPT, ("eagle_aux_hidden_state_layer_ids",), I_VAL)(_aux([-1, 2, 3]))
case("config-aux-ids-wrong-count", "draft", WRITE, (("eagle_aux_hidden_state_layer_ids", "fc.weight"),), I_VAL)(
    _aux([1, 2]))


@case("config-draft-vocab-size-mismatch", "d2t", WRITE, (("draft_vocab_size", "d2t", "lm_head.weight"),), I_VAL)
def _(ctx: Ctx) -> None:
    edit_json(ctx.src / "config.json", lambda c: c.__setitem__("draft_vocab_size", 300))


@case("target-config-unknown-architecture", "target", CKPT, ("FooForCausalLM",), I_VAL)
def _(ctx: Ctx) -> None:
    edit_json(ctx.src / "config.json", lambda c: c.__setitem__("architectures", ["FooForCausalLM"]))


@case("target-config-vocab-size-mismatch", "target", WRITE, (("vocab_size", "embed_tokens", "lm_head"),), I_VAL)
def _(ctx: Ctx) -> None:
    edit_json(ctx.src / "config.json", lambda c: c["text_config"].__setitem__("vocab_size", 2048))


@case("target-config-hidden-size-mismatch", "target", WRITE, (("hidden_size", "embed_tokens", "lm_head"),),
      I_VAL)
def _(ctx: Ctx) -> None:
    edit_json(ctx.src / "config.json", lambda c: c["text_config"].__setitem__("hidden_size", 256))


@case("mla-config-hidden-size-mismatch", "mla", WRITE, ("hidden_size",), I_VAL)
def _(ctx: Ctx) -> None:
    edit_json(ctx.src / "config.json", lambda c: c.update(hidden_size=256, target_hidden_size=256))


@case("target-shard-truncated", "target", CKPT, ("model-00003-of-00003.safetensors",), I_BASE)
def _(ctx: Ctx) -> None:
    p = ctx.src / "model-00003-of-00003.safetensors"
    p.write_bytes(p.read_bytes()[:-1000])


@case("target-config-text-config-not-object", "target", CKPT, ("text_config",), I_VAL)
def _(ctx: Ctx) -> None:
    edit_json(ctx.src / "config.json", lambda c: c.__setitem__("text_config", 5))


# ---------------------------------------------------------------------------------------------
# Indexes
# ---------------------------------------------------------------------------------------------


@case("index-not-json", "draft", CKPT, (INDEX,), I_BASE)
def _(ctx: Ctx) -> None:
    (ctx.src / INDEX).write_text('{"weight_map": {')


@case("index-weight-map-not-object", "draft", CKPT, (INDEX, "weight_map"), I_BASE)
def _(ctx: Ctx) -> None:
    edit_json(ctx.src / INDEX, lambda i: i.__setitem__("weight_map", [S1, S2]))


@case("index-weight-map-value-5", "draft", CKPT, (INDEX, "fc.weight"), I_TB)
def _(ctx: Ctx) -> None:
    edit_json(ctx.src / INDEX, lambda i: i["weight_map"].__setitem__("fc.weight", 5))


@case("index-names-missing-shard", "draft", CKPT, ("model-00003-of-00003.safetensors",), I_BASE)
def _(ctx: Ctx) -> None:
    edit_json(ctx.src / INDEX, lambda i: i["weight_map"].__setitem__("lm_head.weight", "model-00003-of-00003.safetensors"))


@case("index-names-tensor-not-in-shard", "draft", CKPT, ("ghost.weight",), I_BASE)
def _(ctx: Ctx) -> None:
    edit_json(ctx.src / INDEX, lambda i: i["weight_map"].__setitem__("ghost.weight", S1))


@case("index-tensor-in-two-shards", "draft", CKPT, ("norm.weight",), I_BASE)
def _(ctx: Ctx) -> None:
    # A third shard, listed in the index for norm.weight, which the first shard also holds.
    h, d = split(ctx.src / S1)
    ent = json.loads(h)["norm.weight"]
    b, e = ent["data_offsets"]
    hdr = {"__metadata__": {"format": "pt"}, "norm.weight": {**ent, "data_offsets": [0, e - b]}}
    write_raw(ctx.src / "model-extra.safetensors", pad(json.dumps(hdr).encode()), d[b:e])
    edit_json(ctx.src / INDEX, lambda i: i["weight_map"].__setitem__("norm.weight", "model-extra.safetensors"))


# ---------------------------------------------------------------------------------------------
# Manifests and headers of eagle3 outputs (verify)
# ---------------------------------------------------------------------------------------------


def _edit_manifest(fn: Callable[[Any], Any]) -> Callable[[Ctx], None]:
    def run(ctx: Ctx) -> None:
        edit_json(ctx.src / "manifest.json", fn)
    return run


case("manifest-entry-a-string", "output", ("verify",), ("manifest.json", "config.json"), I_TB)(
    _edit_manifest(lambda m: m["files"].__setitem__("config.json", "41e6aa91")))
case("manifest-no-files-key", "output", ("verify",), ("manifest.json", "files"), I_BASE)(
    _edit_manifest(lambda m: m.pop("files")))
case("manifest-files-a-list", "output", ("verify",), ("manifest.json", "files"), I_BASE)(
    _edit_manifest(lambda m: m.__setitem__("files", list(m["files"]))))
case("manifest-size-a-string", "output", ("verify",), ("config.json", "size"), I_MSG)(
    _edit_manifest(lambda m: m["files"]["config.json"].update(size=str(m["files"]["config.json"]["size"]))))
case("manifest-sha256-not-a-string", "output", ("verify",), ("config.json", "sha256"), I_MSG)(
    _edit_manifest(lambda m: m["files"]["config.json"].update(sha256=5)))


@case("manifest-not-json", "output", ("verify",), ("manifest.json",), I_BASE)
def _(ctx: Ctx) -> None:
    (ctx.src / "manifest.json").write_text('{"files": ')


def rehash(ctx: Ctx, rel: str) -> None:
    """Record a file's new size and sha256 in the output's manifest: only its header can tell."""
    p = ctx.src / rel
    ent = {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "size": p.stat().st_size}
    edit_json(ctx.src / "manifest.json", lambda m: m["files"].__setitem__(rel, ent))


@case("verify-rehashed-negative-shape", "output", ("verify",), (S2, "lm_head.weight"), I_HDR)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S2, lambda h: h["lm_head.weight"].update(shape=[-1024, 128], data_offsets=[262144, 0]))
    rehash(ctx, S2)


@case("verify-rehashed-overlapping-offsets", "output", ("verify",), (S1,), I_HDR)
def _(ctx: Ctx) -> None:
    edit_header(ctx.src / S1, overlap)
    rehash(ctx, S1)


@case("verify-rehashed-truncated-shard", "output", ("verify",), (S2,), I_HDR)
def _(ctx: Ctx) -> None:
    (ctx.src / S2).write_bytes((ctx.src / S2).read_bytes()[:-4096])
    rehash(ctx, S2)


@case("verify-sha256-mismatch", "output", ("verify",), (S2,), I_BASE)
def _(ctx: Ctx) -> None:
    raw = bytearray((ctx.src / S2).read_bytes())
    raw[-1] ^= 0xFF
    (ctx.src / S2).write_bytes(bytes(raw))


# ---------------------------------------------------------------------------------------------
# d2t (draft -> target vocab map) and non-finite weights
# ---------------------------------------------------------------------------------------------


def _d2t(fn: Callable[[Any], Any]) -> Callable[[Ctx], None]:
    def run(ctx: Ctx) -> None:
        edit_tensors(ctx.src / ONE, lambda t: t.__setitem__("d2t", fn(t["d2t"])))
    return run


def _set(t: Any, i: int, v: int) -> Any:
    t = t.clone()
    t[i] = v
    return t


case("d2t-out-of-range", "d2t", WRITE, ("d2t",), I_VAL)(_d2t(lambda t: _set(t, -1, 2000)))
case("d2t-negative", "d2t", WRITE, ("d2t",), I_VAL)(_d2t(lambda t: _set(t, 0, -5)))
case("d2t-wrong-length", "d2t", WRITE, ("d2t",), I_VAL)(_d2t(lambda t: t[:-1].clone()))
case("d2t-float-dtype", "d2t", WRITE, ("d2t",), I_VAL)(_d2t(lambda t: t.float()))


def _poison(name: str, value: float) -> Callable[[Ctx], None]:
    def run(ctx: Ctx) -> None:
        def fn(t: dict[str, Any]) -> None:
            t[name] = _set(t[name], 0, value)
        edit_tensors(ctx.src / S1, fn)
    return run


case("nan-in-mlp-weight", "draft", WRITE, ("midlayer.mlp.up_proj.weight",), I_NAN)(
    _poison("midlayer.mlp.up_proj.weight", float("nan")))
case("inf-in-attention-weight", "draft", WRITE, ("midlayer.self_attn.o_proj.weight",), I_NAN)(
    _poison("midlayer.self_attn.o_proj.weight", float("inf")))


# ---------------------------------------------------------------------------------------------
# Recipes (quantize --recipe FILE)
# ---------------------------------------------------------------------------------------------


def _recipe(text: str | None, name: str = "bad.yaml") -> Callable[[Ctx], None]:
    def run(ctx: Ctx) -> None:
        p = ctx.tdir / name
        if text is None:
            p.mkdir()
        else:
            p.write_text(text)
        ctx.recipe = str(p)
    return run


def _int4_recipe() -> str:
    return (REPO / "eagle3" / "recipes" / "int4-draft.yaml").read_text()


case("recipe-not-a-mapping", "draft", ("quantize",), ("bad.yaml",), I_BASE)(_recipe("- int4\n- per_channel\n"))
case("recipe-not-yaml", "draft", ("quantize",), ("bad.yaml",), I_BASE)(_recipe("name: [int4\n"))
case("recipe-unknown-key", "draft", ("quantize",), ("bad.yaml", "colour"), I_BASE)(
    _recipe(_int4_recipe() + "colour: red\n"))
case("recipe-bad-qscheme", "draft", ("quantize",), ("bad.yaml", "qscheme"), I_BASE)(
    _recipe(_int4_recipe().replace("qscheme: per_channel", "qscheme: per_galaxy")))
case("recipe-bad-weight-format", "draft", ("quantize",), ("bad.yaml", "weight.format"), I_BASE)(
    _recipe(_int4_recipe().replace("format: int4", "format: int3")))
case("recipe-is-a-directory", "draft", ("quantize",), ("recipe.d",), I_BASE)(_recipe(None, "recipe.d"))


# ---------------------------------------------------------------------------------------------
# Output paths
# ---------------------------------------------------------------------------------------------


def _siblings(ctx: Ctx) -> None:
    (ctx.tdir / "sibling.txt").write_text("a sibling of the source\n")
    ctx.copy("mla", "sibling-model")


@case("out-equals-src-overwrite", "draft", WRITE, ("{src}",), I_PATHS)
def _(ctx: Ctx) -> None:
    ctx.out = ctx.src
    ctx.also("--overwrite")


@case("out-parent-of-src-overwrite", "draft", WRITE, ("{T}",), I_PATHS)
def _(ctx: Ctx) -> None:
    _siblings(ctx)
    ctx.out = ctx.tdir
    ctx.also("--overwrite")


@case("out-inside-src", "draft", WRITE, ("{src}",), I_PATHS)
def _(ctx: Ctx) -> None:
    ctx.out = ctx.src / "converted"


@case("src-symlink-out-equals-real-src-overwrite", "draft", WRITE, (("{src}", "{src_arg}"),), I_PATHS)
def _(ctx: Ctx) -> None:
    (ctx.tdir / "link").symlink_to(ctx.src.name)
    ctx.src_arg = str(ctx.tdir / "link")
    ctx.out = ctx.src
    ctx.also("--overwrite")


@case("out-symlink-to-src-overwrite", "draft", WRITE, (("{src}", "{out}"),), I_PATHS)
def _(ctx: Ctx) -> None:
    (ctx.tdir / "link").symlink_to(ctx.src.name)
    ctx.out = ctx.tdir / "link"
    ctx.also("--overwrite")


@case("out-exists-not-written-by-eagle3-overwrite", "draft", WRITE, ("{out}",), I_PATHS)
def _(ctx: Ctx) -> None:
    ctx.out = ctx.tdir / "precious"
    ctx.out.mkdir()
    (ctx.out / "notes.txt").write_text("years of work\n")
    ctx.also("--overwrite")


@case("out-is-a-regular-file-overwrite", "draft", WRITE, ("{out}",), I_PATHS)
def _(ctx: Ctx) -> None:
    ctx.out = ctx.tdir / "file.txt"
    ctx.out.write_text("not a directory\n")
    ctx.also("--overwrite")


@case("out-equals-target-overwrite", "draft", ("convert",), ("target-model",), I_PATHS)
def _(ctx: Ctx) -> None:
    tgt = ctx.copy("target", "target-model")
    ctx.out = tgt
    ctx.also("--target", str(tgt), "--overwrite", on=("convert",))


@case("out-equals-src-eagle3-output-overwrite", "output", WRITE, ("{src}",), I_PATHS)
def _(ctx: Ctx) -> None:
    ctx.out = ctx.src  # carries eagle3's manifest, and is still the input
    ctx.also("--overwrite")


@case("out-contains-recipe-overwrite", "draft", ("quantize",), ("{out}",), I_PATHS)
def _(ctx: Ctx) -> None:
    prev = ctx.copy("output", "previous-output")  # an eagle3 output, which holds the recipe file
    (prev / "my-recipe.yaml").write_text(_int4_recipe())
    ctx.recipe = str(prev / "my-recipe.yaml")
    ctx.out = prev
    ctx.also("--overwrite")


@case("out-parent-is-a-file", "draft", WRITE, ("file.txt",), I_TB)
def _(ctx: Ctx) -> None:
    (ctx.tdir / "file.txt").write_text("not a directory\n")
    ctx.out = ctx.tdir / "file.txt" / "out"


@case("out-parent-read-only", "draft", WRITE, ("{out_parent}",), I_TB, non_root=True)
def _(ctx: Ctx) -> None:
    ro = ctx.tdir / "ro"
    ro.mkdir()
    ctx.out = ro / "out"
    chmod(ctx, ro, 0o555)


@case("target-out-parent-of-src-overwrite", "target", ("convert",), ("{T}",), I_PATHS)
def _(ctx: Ctx) -> None:
    _siblings(ctx)
    ctx.out = ctx.tdir
    ctx.also("--overwrite")


# ---------------------------------------------------------------------------------------------
# Side files copied next to the weights
# ---------------------------------------------------------------------------------------------


@case("side-file-symlink-outside-src", "target", WRITE, ("chat_template.jinja",), I_SIDE)
def _(ctx: Ctx) -> None:
    secret = ctx.root / "secret.jinja"
    secret.write_text("{{ 'not part of this model' }}\n")
    (ctx.src / "chat_template.jinja").unlink()
    (ctx.src / "chat_template.jinja").symlink_to(secret)


@case("draft-side-file-symlink-outside-src", "draft", WRITE, ("tokenizer_config.json",), I_SIDE)
def _(ctx: Ctx) -> None:
    secret = ctx.root / "secret.json"
    secret.write_text('{"secret": true}\n')
    (ctx.src / "tokenizer_config.json").symlink_to(secret)


@case("side-file-fifo", "target", ("convert",), ("chat_template.jinja",), I_SIDE, hang=True)
def _(ctx: Ctx) -> None:
    mkfifo(ctx.src / "chat_template.jinja")


# ---------------------------------------------------------------------------------------------
# Running a case and judging the result
# ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    code: int | str  # exit status, or "timeout" / "traceback"
    stderr: str

    def short(self, n: int = 400) -> str:
        s = self.stderr.strip()
        return f"exit {self.code}: " + (s if len(s) <= n else "..." + s[-n:])


def run_in_process(argv: list[str]) -> Outcome:
    from eagle3.cli import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            main(argv)
    except SystemExit as e:
        code = e.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            err.write(f"{code}\n")
            code = 1
        return Outcome(code, err.getvalue())
    except Exception as e:  # what a user would see as a traceback
        where = traceback.extract_tb(e.__traceback__)[-1]
        loc = f"{Path(where.filename).name}:{where.lineno}"
        return Outcome("traceback", err.getvalue() + f"Traceback: {type(e).__name__}: {e} (at {loc})")
    return Outcome(0, err.getvalue())


def _fifos(root: Path) -> list[Path]:
    return [Path(d, n) for d, _, names in os.walk(root) for n in names
            if stat.S_ISFIFO(os.lstat(os.path.join(d, n)).st_mode)]


def run_guarded(argv: list[str], root: Path, timeout: float = HANG_TIMEOUT_S) -> Outcome:
    """:func:`run_in_process` in a thread; past ``timeout`` it is a hang: the FIFOs under ``root`` get
    a writer that closes at once, which ends a blocked ``open`` or ``read`` with end-of-file."""
    done: list[Outcome] = []
    worker = threading.Thread(target=lambda: done.append(run_in_process(argv)), daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        for f in _fifos(root):
            with contextlib.suppress(OSError):  # ENXIO: nobody has it open for reading
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(timeout)
        return Outcome("timeout", f"no exit within {timeout:.0f} s (hung on a FIFO; unblocked)")
    return done[0]


def snapshot(root: Path) -> dict[str, Any]:
    """Every path under ``root``: type, mode, and the bytes (files) or target (symlinks). FIFOs are
    never opened. The bytes themselves, not a digest: comparing them is stricter and much cheaper
    than hashing them (a 12 MB target copy was sha256'd twice per case)."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = os.lstat(p)
            mode = f"{stat.S_IMODE(st.st_mode):o}"
            if stat.S_ISLNK(st.st_mode):
                out[str(p.relative_to(root))] = f"symlink -> {os.readlink(p)}"
            elif stat.S_ISDIR(st.st_mode):
                out[str(p.relative_to(root))] = f"dir {mode}"
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    out[str(p.relative_to(root))] = (f"file {mode} {st.st_size}", f.read())
            else:
                out[str(p.relative_to(root))] = f"special {stat.S_IFMT(st.st_mode):o} {mode}"
    return out


def diff(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    lines = [f"removed {k}" for k in sorted(before.keys() - after.keys())]
    lines += [f"added {k}" for k in sorted(after.keys() - before.keys())]
    lines += [f"changed {k}" for k in sorted(before.keys() & after.keys()) if before[k] != after[k]]
    return lines


def prepare(c: Case, root: Path, sources: dict[str, Path], command: str | None = None) -> Ctx:
    """A fresh copy of the case's model under root/T, broken as the case says. For ``verify`` a
    broken copy without a manifest gets one (as if eagle3 had written it: only the model is wrong);
    for ``serve`` a two-question GSM8K data set lies beside it."""
    name, role = MODELS[c.model]
    src = root / "T" / name
    src.parent.mkdir(parents=True)
    shutil.copytree(sources[name], src, symlinks=True)
    ctx = Ctx(root=root, src=src, role=role, sources=sources)
    c.breaks(ctx)
    if command == "verify" and not (src / "manifest.json").exists():
        from eagle3.checkpoint.manifest import write_manifest

        write_manifest(src)
    if command == "serve":
        data = ctx.tdir / GSM8K_DIR
        data.mkdir(exist_ok=True)
        rows = [{"question": f"What is {a} plus {a}?", "answer": f"#### {2 * a}"} for a in (2, 3)]
        for f in ("train.jsonl", "test.jsonl"):
            (data / f).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ctx


def check(c: Case, command: str, ctx: Ctx) -> tuple[Outcome, list[str]]:
    """Run one command on a prepared case; returns the outcome and every broken promise."""
    before = snapshot(ctx.root)
    outs = [ctx.out, ctx.out.with_name(ctx.out.name + ".partial"), ctx.out.with_name(ctx.out.name + ".lock")]
    existed = [os.path.lexists(p) for p in outs]
    argv = ctx.argv(command)
    res = run_guarded(argv, ctx.root) if c.hang else run_in_process(argv)
    problems: list[str] = []
    if res.code != 2:
        problems.append(f"exit code {res.code}, expected 2")
    lines = res.stderr.splitlines()
    if len(lines) != 1 or not lines[0].startswith("error: ") or not res.stderr.endswith("\n"):
        problems.append(f"stderr is {len(lines)} line(s), expected one 'error: ...' line")
    text = res.stderr
    names = ctx.names()
    for want in c.expect:
        alts = (want,) if isinstance(want, str) else want
        alts = tuple(a.format(**names) for a in alts)
        if not any(a in text for a in alts):
            problems.append("error does not name " + " or ".join(repr(a) for a in alts))
    for bad in c.forbid:
        if bad in text:
            problems.append(f"error says {bad!r} (misleading)")
    if command not in ("inspect", "verify"):
        for p, was in zip(outs, existed, strict=True):
            if not was and os.path.lexists(p):
                problems.append(f"left behind: {p.name}")
    changes = diff(before, snapshot(ctx.root))
    if changes:
        problems.append(f"{len(changes)} path(s) under the case dir changed: " + ", ".join(changes[:6])
                        + (" ..." if len(changes) > 6 else ""))
    return res, problems


def params() -> Iterator[tuple[Case, str]]:
    for c in CASES:
        for cmd in c.commands:
            yield c, cmd


def cleanup(ctx: Ctx) -> None:
    for fn in reversed(ctx.cleanups):
        with contextlib.suppress(OSError):
            fn()


def build_sources(base: Path) -> dict[str, Path]:
    """The tiny models (``base / <name>``, as written by make-tiny) plus the eagle3 output
    ``draft-vllm`` (the tiny draft converted for vLLM) that verify and output-path cases copy."""
    from eagle3.convert import convert

    sources = {name: base / name for name, _ in MODELS.values() if name != "draft-vllm"}
    out = base.parent / "robustness-draft-vllm"
    if not (out / "manifest.json").is_file():
        convert(base / "kimi-k2.5-eagle3", out, engine="vllm", progress=False)
    sources["draft-vllm"] = out
    return sources


def main() -> None:
    """Run the corpus outside pytest; print a Markdown failure report grouped by issue item."""
    import tempfile

    from eagle3.testing.tiny import make_tiny

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    skip_root = hasattr(os, "geteuid") and os.geteuid() == 0
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "tiny"
        make_tiny(base, seed=0)
        sources = build_sources(base)
        groups: dict[str, list[str]] = {}
        n = fails = skipped = 0
        only = sys.argv[1:]  # case-id substrings: run only those cases
        for i, (c, cmd) in enumerate(params()):
            if only and not any(o in c.id for o in only):
                continue
            if c.non_root and skip_root:
                skipped += 1
                continue
            n += 1
            root = Path(tmp) / f"case{i}"
            ctx = prepare(c, root, sources, cmd)
            try:
                res, problems = check(c, cmd, ctx)
            finally:
                cleanup(ctx)
            if problems:
                fails += 1
                groups.setdefault(c.item, []).append(
                    f"- `{c.id}` / {cmd}: {'; '.join(problems)}\n  - actual: `{res.short(300)}`")
            print(f"{'FAIL' if problems else 'ok  '} {c.id} {cmd}", file=sys.stderr)
        print(f"# Robustness corpus: {fails} of {n} runs fail ({len(CASES)} cases; {skipped} runs skipped as root)\n")
        for item in sorted(groups, key=lambda s: (not s[0].isdigit(), int(s.split()[0]) if s[0].isdigit() else 0)):
            print(f"## {item}\n")
            print("\n".join(groups[item]) + "\n")


if __name__ == "__main__":
    main()
