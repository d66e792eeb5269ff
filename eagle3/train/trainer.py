"""``eagle3 train-draft``: train an EAGLE-3 / 3.1 draft against any target the runtime loads.

Phases (everything under ``OUT.partial/`` until the end, then renamed to ``OUT`` with a manifest),
each with its own progress bar and ETA:

1. load the target with the runtime (``load_target``) and its tokenizer; the data
   (:mod:`eagle3.train.data`) is lazy: only the examples the steps use are ever built;
2. the initial draft: ``--init-from`` converted to the ``eagle3`` profile by ``eagle3 convert``'s
   own code, or a fresh draft sized after the target (:mod:`eagle3.train.export`), written to
   ``OUT.partial/init``; the reduced vocabulary (``--draft-vocab-size``) from the token
   frequencies of the examples the steps use;
3. teacher: the target's states (and with ``--regenerate`` its own greedy continuation) of the
   examples the steps use, written to disk (:mod:`eagle3.train.teacher_cache`); memory holds one
   step's examples, and a cache from an earlier run is reused;
4. with ``--init-from``, the starting draft's held-out acceptance (the "before");
5. the loop: AdamW, linear warm-up and cosine decay, gradient clipping, training-time test
   (:mod:`eagle3.train.ttt`), each step reading its batch's states from disk; optionally pulled
   back towards the starting weights (``anchor``); a checkpoint every ``checkpoint_every`` steps
   in ``OUT.partial/checkpoint`` (``--resume`` continues from it; batches are a pure function of
   the seed and the step and the states are on disk, so a resumed run takes the same steps as an
   uninterrupted one);
6. the draft in the ``eagle3`` format, its held-out acceptance measured by the runtime (greedy,
   k speculative tokens, plus the same prompts without speculation as the lossless check),
   ``train_report.json`` (with the target's fingerprint) and ``train_loss.png``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import atomic_output, check_output, partial_path, read_json, write_json
from eagle3.errors import UsageError
from eagle3.formats import keys
from eagle3.train import acceptance
from eagle3.train.adapt import PRESET, target_fingerprint
from eagle3.train.data import TrainData, load_data
from eagle3.train.draft_module import TrainableDraft, load_trainable
from eagle3.train.export import fresh_draft_config, provisional_spec, write_draft
from eagle3.train.progress import PhaseBar
from eagle3.train.report import FIGURE_FILE, REPORT_FILE, figure, mean_tail, print_summary
from eagle3.train.teacher import Teacher
from eagle3.train.teacher_cache import CachedExample, Item, TeacherCache, estimated_rows, fill
from eagle3.train.ttt import Batch, VocabMap, chain_rows, ttt_loss

INIT_DIR = "init"
CKPT_DIR = "checkpoint"
CKPT_FILE = "state.pt"
TEACHER_DIR = "teacher"
OPTIONS_FILE = "options.json"  # the options a resumed run must share
BEFORE_FILE = "heldout_before.json"  # the starting draft's acceptance and the plain outputs, for --resume
ARCHS = ("llama", "mla")


@dataclass
class TrainOptions:
    target: Path
    out: Path
    arch: str | None = None  # llama (default) | mla; with --init-from: the init draft's
    eagle31: bool | None = None  # EAGLE-3.1: fc_norm + norm_output
    data: str = "gsm8k"
    dataset: Path | None = None  # gsm8k: directory with train.jsonl + test.jsonl
    regenerate: bool = False
    regen_tokens: int = 128
    draft_vocab_size: int | None = None
    aux_layer_ids: list[int] | None = None  # input-to-layer convention
    ttt_steps: int = 3
    steps: int = 1000
    batch_size: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int | None = None  # default: 5% of --steps
    decay: float = 0.8  # TTT position weight
    max_grad_norm: float = 1.0
    max_len: int = 512
    num_train: int | None = None
    fewshot: int = 0  # gsm8k: solved train problems before each training problem
    context_loss: bool = True  # False: the few-shot exemplars are context only (no loss on them)
    anchor: float = 0.0  # per step, pull the weights back by lr * anchor * (w - w_start)
    freeze: tuple[str, ...] = ()  # parameter name prefixes kept at their starting values
    eval_prompts: int = 8
    eval_tokens: int = 64
    eval_fewshot: int = 5
    eval_k: int = 3
    init_from: Path | None = None
    adapt: bool = False  # the --adapt preset was applied (recorded in the report)
    resume: bool = False
    overwrite: bool = False
    checkpoint_every: int = 100
    teacher_cache: Path | None = None  # default: OUT.partial/teacher
    seed: int = 0
    dtype: str = "bfloat16"  # the target's compute dtype (the draft trains in fp32, is written in bf16)
    device: str = "cpu"
    progress: bool = True

    def fingerprint(self) -> dict[str, Any]:
        """What a resumed run must share with the interrupted one."""
        skip = {"out", "resume", "overwrite", "progress", "checkpoint_every", "eval_tokens",
                "eval_fewshot", "eval_k", "teacher_cache"}
        return {k: str(v) for k, v in dataclasses.asdict(self).items() if k not in skip}


def with_preset(opts: TrainOptions, explicit: set[str]) -> TrainOptions:
    """``--adapt``: the preset's values for every field not in ``explicit`` (set by the user)."""
    if opts.init_from is None:
        raise UsageError("--adapt adapts a trained draft: give it with --init-from DRAFT")
    return dataclasses.replace(opts, adapt=True, **{k: v for k, v in PRESET.items() if k not in explicit})


def _echo(msg: str) -> None:
    print(f"train-draft: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the initial draft
# ---------------------------------------------------------------------------------------------


def _init_weights(model: TrainableDraft, target: Any, target_path: Path, vocab: VocabMap | None, seed: int) -> None:
    """Linear weights ~ N(0, 1/fan_in), norms 1, the embedding and lm_head rows from the target's
    (trainers initialise the draft from the target; the embedding stays frozen)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * mod.weight.shape[1] ** -0.5)
                if mod.bias is not None:
                    mod.bias.zero_()
        model.embed_tokens.weight.copy_(target.embed_tokens.float())
        head = _target_lm_head(target, target_path)
        if head is not None and head.shape[1] == model.lm_head.weight.shape[1]:
            model.lm_head.weight.copy_(head[vocab.used] if vocab is not None else head)


def _target_lm_head(target: Any, path: Path) -> torch.Tensor | None:
    from eagle3.runtime.kernels.base import dequantize
    from eagle3.runtime.loader import WeightReader

    spec = target.spec
    wr = WeightReader(path, spec.quant, torch.float32, torch.device("cpu"))
    name = f"{spec.prefix}lm_head"
    if wr.has(f"{name}.weight") or wr.has(f"{name}.{keys.CT_PACKED}"):
        w, _ = wr.linear(name)
        return dequantize(w, torch.float32)
    return target.embed_tokens.float() if spec.tie_word_embeddings else None


def _fresh_aux_ids(opts: TrainOptions, target: Any) -> tuple[list[int], str]:
    """A new draft's aux layers and why: ``--aux-layer-ids`` as given, else a default that is valid
    for this target's depth (``formats.detect.new_draft_aux_layer_ids``: (2, N//2, N-3) from 7
    layers on, a documented fallback below)."""
    from eagle3.formats.detect import new_draft_aux_layer_ids

    if not opts.aux_layer_ids:
        try:
            ids, rule = new_draft_aux_layer_ids(target.num_layers)
        except ValueError as e:
            raise UsageError(f"{opts.target}: {e}") from None
        return list(ids), f"default {rule}; --aux-layer-ids chooses others"
    ids = list(opts.aux_layer_ids)
    if len(ids) != len(set(ids)) or sorted(ids) != ids or ids[0] < 0 or ids[-1] > target.num_layers:
        raise UsageError(f"--aux-layer-ids {ids}: must be ascending target layer ids in 0..{target.num_layers} "
                         f"(input-to-layer convention)")
    return ids, "given with --aux-layer-ids"


def _convert_init(opts: TrainOptions, init: Path) -> None:
    """``--init-from``: the draft in the eagle3 profile in ``init``; flags that contradict it refused."""
    from eagle3.convert.draft import DraftOptions, convert_draft

    convert_draft(opts.init_from, init, DraftOptions(engine="eagle3", target=str(opts.target),
                                                     aux_layer_ids=opts.aux_layer_ids, aux_convention="input"
                                                     if opts.aux_layer_ids else None, progress=False))
    cfg = read_json(init / "config.json")
    arch = "mla" if cfg.get("kv_lora_rank") is not None else "llama"
    if opts.arch is not None and opts.arch != arch:
        raise UsageError(f"--arch {opts.arch}: --init-from {opts.init_from} is a {arch} draft")
    if opts.eagle31 is not None and opts.eagle31 != bool(cfg.get("fc_norm")):
        raise UsageError(f"--eagle31/--no-eagle31: --init-from {opts.init_from} has fc_norm "
                         f"{str(bool(cfg.get('fc_norm'))).lower()}")
    dv = int(cfg["draft_vocab_size"])
    if opts.draft_vocab_size is not None and opts.draft_vocab_size != dv:
        raise UsageError(f"--draft-vocab-size {opts.draft_vocab_size}: --init-from {opts.init_from} has a "
                         f"draft vocabulary of {dv}")


def _fresh_init(opts: TrainOptions, init: Path, target: Any, aux_ids: list[int], cache: TeacherCache,
                digests: dict[int, str], eos: list[int]) -> None:
    """A new draft sized after the target in ``init``; a reduced vocabulary from the token
    frequencies of the sequences the steps train on (regenerated ones included), read from the
    teacher's files one at a time (a Counter of at most V ids)."""
    vocab_size = target.vocab_size
    dv = opts.draft_vocab_size
    vmap = None
    if dv is not None:
        if not 1 <= dv <= vocab_size:
            raise UsageError(f"--draft-vocab-size {dv}: must be in 1..{vocab_size} (the target vocabulary)")
        if dv < vocab_size:
            counts: Counter[int] = Counter()
            for d in digests.values():
                counts.update(cache.read(d).ids.tolist())
            vmap = VocabMap.from_frequencies([list(counts.elements())], vocab_size, dv, always=eos)
    cfg = fresh_draft_config(opts.target, opts.arch or "llama", bool(opts.eagle31), dv, aux_ids)
    model = TrainableDraft(provisional_spec(cfg))
    _init_weights(model, target, opts.target, vmap, opts.seed)
    tmp = init.with_name(init.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_draft(tmp, cfg, model.state_dict(), vmap.d2t if vmap is not None else None)
    tmp.rename(init)


# ---------------------------------------------------------------------------------------------
# batches, schedule, checkpoints
# ---------------------------------------------------------------------------------------------


def batch_indices(step: int, batch_size: int, n: int, seed: int) -> list[int]:
    """Examples of ``step``: a fresh seeded permutation per epoch (a pure function of the step)."""
    out = []
    perms: dict[int, torch.Tensor] = {}
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch = i // n
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perms[epoch][i % n]))
    return out


def step_groups(steps: int, batch_size: int, n: int, seed: int) -> list[list[int]]:
    """The examples each step uses first (the teacher computes them together, in this order)."""
    seen: set[int] = set()
    groups = []
    for step in range(steps):
        if len(seen) >= n:
            break
        g = [i for i in dict.fromkeys(batch_indices(step, batch_size, n, seed)) if i not in seen]
        seen.update(g)
        if g:
            groups.append(g)
    return groups


def make_batch(examples: list[CachedExample], loss_start: list[int], ttt_steps: int) -> Batch:
    """Right-padded batch; the label rows of each sequence's chains, gathered from its stored hidden."""
    b = len(examples)
    t = max(int(e.ids.shape[0]) for e in examples)
    lengths = torch.tensor([int(e.ids.shape[0]) for e in examples])
    first = torch.tensor([max(s - 2, 0) for s in loss_start])
    tq = chain_rows(first, lengths)[0].shape[1]
    e0 = examples[0]
    ids = torch.zeros(b, t, dtype=torch.int64)
    aux = torch.zeros(b, t, e0.aux.shape[-1], dtype=e0.aux.dtype)
    lab = torch.zeros(b, tq + ttt_steps - 1, e0.hidden.shape[-1], dtype=e0.hidden.dtype)
    for i, e in enumerate(examples):
        n = int(e.ids.shape[0])
        ids[i, :n] = e.ids
        aux[i, :n] = e.aux
        rows = e.hidden[int(first[i]) + 1:][: lab.shape[1]]
        lab[i, : rows.shape[0]] = rows
    return Batch(ids, lengths, aux, first, lab)


def lr_at(step: int, opts: TrainOptions) -> float:
    warm = opts.warmup_steps if opts.warmup_steps is not None else max(1, opts.steps // 20)
    if step < warm:
        return opts.lr * (step + 1) / warm
    frac = (step - warm) / max(1, opts.steps - warm)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _save_checkpoint(d: Path, step: int, model: TrainableDraft, optim: torch.optim.Optimizer,
                     history: list[dict[str, Any]], opts: TrainOptions, extra: dict[str, Any]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (CKPT_FILE + ".tmp")
    torch.save({"step": step, "model": model.state_dict(), "optim": optim.state_dict(), "history": history,
                "fingerprint": opts.fingerprint(), **extra}, tmp)
    os.replace(tmp, d / CKPT_FILE)


def _check_fingerprint(path: Path, opts: TrainOptions) -> None:
    old = read_json(path) if path.is_file() else {}
    new = opts.fingerprint()
    diff = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if diff:
        raise UsageError(f"--resume: {path.parent} was written with different options ({diff[0]}: "
                         f"{old.get(diff[0])} vs {new.get(diff[0])})")


def _trainable(model: TrainableDraft, freeze: tuple[str, ...]) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters the optimizer moves: all but the embedding (the target's, frozen as SpecForge and
    EAGLE do) and the modules named in ``freeze`` (``fc``, ``lm_head``, ``layers.0.mlp``, ...: a module
    and everything under it); an unknown name is refused."""
    def frozen(n: str) -> bool:
        return any(n == f or n.startswith(f + ".") for f in freeze)

    names = [n for n, _ in model.named_parameters()]
    for f in freeze:
        if not any(n == f or n.startswith(f + ".") for n in names):
            raise UsageError(f"--freeze {f}: no draft module of that name (e.g. fc, lm_head, layers.0.mlp)")
    out = []
    for n, p in model.named_parameters():
        keep = n != keys.DRAFT_EMBED and not frozen(n)
        p.requires_grad_(keep)
        if keep:
            out.append((n, p))
    return out


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


def _check(opts: TrainOptions) -> None:
    if opts.arch is not None and opts.arch not in ARCHS:
        raise UsageError(f"--arch {opts.arch}: expected llama or mla")
    for name, v, lo in (("--steps", opts.steps, 0), ("--ttt-steps", opts.ttt_steps, 1),
                        ("--batch-size", opts.batch_size, 1), ("--checkpoint-every", opts.checkpoint_every, 1),
                        ("--eval-prompts", opts.eval_prompts, 0), ("--eval-tokens", opts.eval_tokens, 1),
                        ("--regen-tokens", opts.regen_tokens, 1)):
        if v < lo:
            raise UsageError(f"{name} must be >= {lo}, got {v}")
    if opts.lr <= 0:
        raise UsageError(f"--lr must be positive, got {opts.lr}")
    if opts.anchor < 0 or opts.anchor * opts.lr >= 1:
        raise UsageError(f"--anchor {opts.anchor}: must be >= 0 with --anchor x --lr below 1")


@dataclass
class _Run:
    """What the phases share."""

    opts: TrainOptions
    tmp: Path
    target: Any
    data: TrainData
    eos: list[int]
    groups: list[list[int]]
    timings: dict[str, float]
    echo: Callable[[str], None]
    loss_start: dict[int, int] = dataclasses.field(default_factory=dict)  # of each example the steps use


def train_draft(opts: TrainOptions, echo: Callable[[str], None] = _echo) -> dict[str, Any]:
    """Train a draft for ``opts.target`` into ``opts.out``; returns the report (also in OUT)."""
    from eagle3.formats.check import require_valid

    _check(opts)
    out = Path(opts.out)
    check_output(out, opts.overwrite)
    for src in (opts.target, opts.init_from):  # the models against their schemas, before any weight is read
        if src is not None:
            require_valid(src)
    tmp = partial_path(out)
    if opts.resume and not (tmp / OPTIONS_FILE).is_file():
        raise UsageError(f"--resume: no checkpoint or teacher states at {tmp} (start without --resume)")
    if opts.resume:
        _check_fingerprint(tmp / OPTIONS_FILE, opts)
    if not opts.resume and tmp.exists():
        shutil.rmtree(tmp)
    torch.manual_seed(opts.seed)
    t_start = time.perf_counter()
    # resume=True keeps OUT.partial (checkpoints, teacher states) when anything fails or is interrupted.
    with atomic_output(out, overwrite=opts.overwrite, resume=True) as tmp:
        write_json(tmp / OPTIONS_FILE, opts.fingerprint())
        run = _load(opts, tmp, echo)
        init = tmp / INIT_DIR
        have_init = opts.resume and (init / "config.json").is_file()
        if not have_init:
            shutil.rmtree(init, ignore_errors=True)
        if opts.init_from is not None and not have_init:
            _convert_init(opts, init)
        if init.is_dir():
            aux_ids = tuple(read_json(init / "config.json")["eagle_aux_hidden_state_layer_ids"])
            aux_rule = "the starting draft's" if opts.init_from is not None else "the resumed run's"
        else:
            fresh, aux_rule = _fresh_aux_ids(opts, run.target)
            aux_ids = tuple(fresh)
        echo(f"aux layers {list(aux_ids)} (input-to-layer ids of a {run.target.num_layers}-layer target): {aux_rule}")
        cache, digests, teacher_counts = _teacher_phase(run, aux_ids)
        if not init.is_dir():
            _fresh_init(opts, init, run.target, list(aux_ids), cache, digests, run.eos)
        model, d2t = load_trainable(init, run.target.embed_tokens)
        model.to(opts.device)
        cfg = read_json(init / "config.json")
        params = _trainable(model, opts.freeze)
        n_params = sum(p.numel() for _, p in params)
        echo(f"draft: {model.spec.attention} EAGLE-{model.spec.eagle_version}, {n_params / 1e6:.2f}M trainable "
             f"parameters, draft vocab {model.spec.draft_vocab_size}, aux layers {list(aux_ids)}")
        before, plain = _before(run, init)
        history = _train_loop(run, model, params, d2t, cache, digests, aux_ids)
        write_draft(tmp, cfg, model.state_dict(), d2t)
        heldout = _heldout(run, tmp, "after" if before else "held-out", plain)
        report = _report(run, model, aux_ids, n_params, history, before, heldout, teacher_counts, digests, cache,
                         time.perf_counter() - t_start)
        report["draft"]["aux_layer_ids_rule"] = aux_rule
        write_json(tmp / REPORT_FILE, report)
        figure(tmp / FIGURE_FILE, history, f"{opts.target.name}: {model.spec.attention} EAGLE-"
                                           f"{model.spec.eagle_version} draft")
        for d in (INIT_DIR, CKPT_DIR, TEACHER_DIR):
            shutil.rmtree(tmp / d, ignore_errors=True)
        for f in (OPTIONS_FILE, BEFORE_FILE):
            (tmp / f).unlink(missing_ok=True)
    return report


def _load(opts: TrainOptions, tmp: Path, echo: Callable[[str], None]) -> _Run:
    from eagle3.runtime.loader import load_target
    from eagle3.runtime.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    target = load_target(opts.target, dtype=_dtype(opts.dtype), device=opts.device)
    tokenizer = load_tokenizer(opts.target)
    data = load_data(opts.data, tokenizer, dataset=opts.dataset, max_len=opts.max_len, num_train=opts.num_train,
                     num_heldout=opts.eval_prompts, num_fewshot=opts.eval_fewshot, fewshot=opts.fewshot,
                     seed=opts.seed, regen_tokens=opts.regen_tokens if opts.regenerate else None,
                     context_loss=opts.context_loss)
    eos = sorted(set(target.spec.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id
                                                    is not None else set()))
    groups = step_groups(opts.steps, opts.batch_size, len(data.train), opts.seed)
    echo(f"data: {data.source}; the {opts.steps} steps use {sum(map(len, groups))} of them")
    return _Run(opts, tmp, target, data, eos, groups, {"load": time.perf_counter() - t0}, echo)


def _teacher_phase(run: _Run, aux_ids: tuple[int, ...]) -> tuple[TeacherCache, dict[int, str], dict[str, int]]:
    """The teacher's states of every example the steps use, on disk (computed or found there)."""
    opts = run.opts
    t0 = time.perf_counter()
    regen = opts.regen_tokens if opts.regenerate else None
    key = {"target": target_fingerprint(opts.target)["sha256"], "dtype": opts.dtype,
           "device": torch.device(opts.device).type, "aux_layer_ids": list(aux_ids), "regen_tokens": regen,
           "max_len": opts.max_len}
    cache = TeacherCache(opts.teacher_cache or run.tmp / TEACHER_DIR, key)

    def item(i: int) -> tuple[Item, int]:
        ex = run.data.train[i]
        return Item(tuple(ex.prompt_ids if regen is not None else ex.ids)), ex.loss_start

    digests, rows = {}, {}
    for g in run.groups:  # one example at a time: only its name, size and loss start are kept
        for i in g:
            it, run.loss_start[i] = item(i)
            digests[i], rows[i] = it.digest(), estimated_rows(it, regen, opts.max_len)
    row_bytes = (len(aux_ids) + 1) * run.target.hidden_size * torch.empty((), dtype=_dtype(opts.dtype)).element_size()
    with PhaseBar("teacher", len(digests), opts.progress) as bar:
        counts = fill(cache, Teacher(run.target, aux_ids), run.groups, digests, rows, lambda i: item(i)[0],
                      regen_tokens=regen, eos=run.eos, max_len=opts.max_len, row_bytes=row_bytes,
                      progress=bar.advance)
    run.timings["teacher"] = time.perf_counter() - t0
    what = "regenerated by the target and " if regen is not None else ""
    run.echo(f"teacher: {counts['computed']} examples {what}computed, {counts['reused']} found in {cache.dir}")
    return cache, digests, counts


def _before(run: _Run, init: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The starting draft's held-out acceptance (``--init-from``) and the plain reference outputs
    (kept in OUT.partial: a resumed run does not measure them again)."""
    opts = run.opts
    if not run.data.heldout:
        return None, None
    saved = run.tmp / BEFORE_FILE
    setting = [len(run.data.heldout), opts.eval_tokens, opts.eval_k, opts.eval_fewshot]
    if opts.resume and saved.is_file():
        d = read_json(saved)
        if d.get("setting") == setting:
            return d["before"], d["plain"]
    t0 = time.perf_counter()
    plain = acceptance.plain_outputs(run.target, run.data.heldout, opts.eval_tokens, opts.progress)
    before = None
    if opts.init_from is not None:
        before = acceptance.measure(run.target, init, run.data.heldout, k=opts.eval_k, max_tokens=opts.eval_tokens,
                                    plain=plain, label="before", progress=opts.progress)
        run.echo(f"held-out acceptance before (k={opts.eval_k}, greedy, {before['num_prompts']} prompts): "
                 f"{acceptance.summary_line(before)}")
    run.timings["heldout"] = time.perf_counter() - t0
    write_json(saved, {"setting": setting, "before": before, "plain": plain})
    return before, plain


def _heldout(run: _Run, draft: Path, label: str, plain: dict[str, Any] | None) -> dict[str, Any] | None:
    opts = run.opts
    if not run.data.heldout:
        return None
    t0 = time.perf_counter()
    h = acceptance.measure(run.target, draft, run.data.heldout, k=opts.eval_k, max_tokens=opts.eval_tokens,
                           plain=plain, label=label, progress=opts.progress)
    run.timings["heldout"] = run.timings.get("heldout", 0.0) + time.perf_counter() - t0
    run.echo(f"held-out acceptance{' after' if label == 'after' else ''} (k={opts.eval_k}, greedy, "
             f"{h['num_prompts']} prompts): {acceptance.summary_line(h)}")
    return h


def _train_loop(run: _Run, model: TrainableDraft, params: list[tuple[str, torch.nn.Parameter]],
                d2t: torch.Tensor | None, cache: TeacherCache, digests: dict[int, str],
                aux_ids: tuple[int, ...]) -> list[dict[str, Any]]:
    opts = run.opts
    vocab = VocabMap.from_d2t(d2t) if d2t is not None else None
    plist = [p for _, p in params]
    start_w = [p.detach().clone() for p in plist] if opts.anchor else []
    optim = torch.optim.AdamW(plist, lr=opts.lr, betas=(0.9, 0.95), weight_decay=opts.weight_decay)
    history: list[dict[str, Any]] = []
    start = 0
    ckpt = run.tmp / CKPT_DIR / CKPT_FILE
    if opts.resume and ckpt.is_file():
        st = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        optim.load_state_dict(st["optim"])
        history, start = list(st["history"]), int(st["step"])
        run.echo(f"resumed at step {start} of {opts.steps} from {ckpt}")
    teacher = Teacher(run.target, aux_ids)
    n = len(run.data.train)
    t0 = time.perf_counter()
    with PhaseBar("train", opts.steps, opts.progress, done=start, fields={"loss": "-"}) as bar:
        for step in range(start, opts.steps):
            idx = batch_indices(step, opts.batch_size, n, opts.seed)
            batch = make_batch([cache.read(digests[i]) for i in idx], [run.loss_start[i] for i in idx],
                               opts.ttt_steps)
            lr = lr_at(step, opts)
            for group in optim.param_groups:
                group["lr"] = lr
            res = ttt_loss(model, teacher, batch, opts.ttt_steps, opts.decay, vocab)
            optim.zero_grad(set_to_none=True)
            res.loss.backward()
            torch.nn.utils.clip_grad_norm_(plist, opts.max_grad_norm)
            optim.step()
            if opts.anchor:  # decoupled from the gradient, as AdamW's weight decay (towards the start)
                with torch.no_grad():
                    for p, w0 in zip(plist, start_w, strict=True):
                        p.sub_(lr * opts.anchor * (p - w0))
            history.append({"step": step + 1, "loss": float(res.loss.detach()), "lr": lr,
                            "step_loss": res.step_loss, "step_acc": res.step_acc})
            bar.advance(1, loss=f"{history[-1]['loss']:.4f}")
            if (step + 1) % opts.checkpoint_every == 0 or step + 1 == opts.steps:
                _save_checkpoint(run.tmp / CKPT_DIR, step + 1, model, optim, history, opts, {})
    run.timings["train"] = time.perf_counter() - t0
    return history


def _report(run: _Run, model: TrainableDraft, aux_ids: tuple[int, ...], n_params: int,
            history: list[dict[str, Any]], before: dict[str, Any] | None, heldout: dict[str, Any] | None,
            teacher_counts: dict[str, int], digests: dict[int, str], cache: TeacherCache,
            total: float) -> dict[str, Any]:
    opts = run.opts
    run.timings["total"] = total
    tokens = sum(cache.rows(d) for d in digests.values())
    change = None
    if before and heldout:
        change = heldout["mean_acceptance_length"] / before["mean_acceptance_length"] - 1
    return {
        "output": str(opts.out),
        "target": str(opts.target),
        "target_fingerprint": target_fingerprint(opts.target),
        "adapted": {"preset": "adapt", "target": target_fingerprint(opts.target), "init_from": str(opts.init_from),
                    "accept_length_before": before["mean_acceptance_length"] if before else None,
                    "accept_length_after": heldout["mean_acceptance_length"] if heldout else None,
                    "relative_change": change} if opts.adapt else None,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()},
        "draft": {"attention": model.spec.attention, "eagle_version": model.spec.eagle_version,
                  "fc_norm": model.spec.fc_norm, "norm_output": model.spec.norm_output,
                  "draft_vocab_size": model.spec.draft_vocab_size, "vocab_size": model.spec.vocab_size,
                  "aux_layer_ids": list(aux_ids), "aux_layer_ids_convention": "input",
                  "trainable_parameters": n_params, "init_from": str(opts.init_from) if opts.init_from else None},
        "data": {"source": run.data.source, "sequences": len(digests), "tokens": tokens,
                 "regenerated": opts.regenerate, "heldout_prompts": len(run.data.heldout),
                 "heldout": f"the first {len(run.data.heldout)} prompts of the held-out split"},
        "teacher": {**teacher_counts, "cache": str(cache.dir)},
        "training": {"steps": opts.steps, "ttt_steps": opts.ttt_steps, "position_weight": opts.decay,
                     "initial_loss": history[0]["loss"] if history else None,
                     "final_loss": mean_tail(history, "loss"),
                     "final_step_acc": mean_tail(history, "step_acc"),
                     "loss": [h["loss"] for h in history],
                     "step_acc": [h["step_acc"] for h in history]},
        "heldout_before": before,
        "heldout": heldout,
        "timings_s": {k: round(v, 3) for k, v in run.timings.items()},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def _dtype(name: str) -> torch.dtype:
    from eagle3.runtime.engine.config import DTYPES, dtype_by_name

    if name not in DTYPES:
        raise UsageError(f"--dtype {name}: expected bfloat16, float16 or float32")
    return dtype_by_name(name)


__all__ = ["TrainOptions", "train_draft", "print_summary", "with_preset", "REPORT_FILE", "FIGURE_FILE"]
