"""``eagle3 train-draft``: train an EAGLE-3 / 3.1 draft against any target the runtime loads.

Steps (everything under ``OUT.partial/`` until the end, then renamed to ``OUT`` with a manifest):

1. load the target with the runtime (``load_target``) and its tokenizer; read the data
   (:mod:`eagle3.train.data`); with ``--regenerate`` replace each completion by the target's own
   greedy continuation of the prompt (the runtime's ``LLM``);
2. the initial draft: ``--init-from`` converted to the ``eagle3`` profile by ``eagle3 convert``'s
   own code, or a fresh draft sized after the target (:mod:`eagle3.train.export`), written to
   ``OUT.partial/init``; the reduced vocabulary (``--draft-vocab-size``) from token frequencies;
3. the teacher signal (:mod:`eagle3.train.teacher`), then the loop: AdamW, linear warm-up and
   cosine decay, gradient clipping, training-time test (:mod:`eagle3.train.ttt`); a checkpoint
   every ``checkpoint_every`` steps in ``OUT.partial/checkpoint`` (``--resume`` continues from it;
   batches are a pure function of the seed and the step, so a resumed run takes the same steps as
   an uninterrupted one);
4. the draft in the ``eagle3`` format, then held-out acceptance measured by the runtime (the
   trained draft with the target, greedy, k speculative tokens, plus the same prompts without
   speculation as the lossless check), ``train_report.json`` and ``train_loss.png``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.checkpoint import atomic_output, check_output, partial_path, read_json, write_json
from eagle3.errors import UsageError
from eagle3.formats import keys
from eagle3.train.data import TrainData, load_data
from eagle3.train.draft_module import TrainableDraft, load_trainable
from eagle3.train.export import fresh_draft_config, provisional_spec, write_draft
from eagle3.train.teacher import Teacher, TeacherStates
from eagle3.train.ttt import Batch, VocabMap, ttt_loss

REPORT_FILE = "train_report.json"
FIGURE_FILE = "train_loss.png"
INIT_DIR = "init"
CKPT_DIR = "checkpoint"
CKPT_FILE = "state.pt"
OPTIONS_FILE = "options.json"  # beside the checkpoint: the options a resumed run must share
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
    eval_prompts: int = 8
    eval_tokens: int = 64
    eval_fewshot: int = 5
    eval_k: int = 3
    init_from: Path | None = None
    resume: bool = False
    overwrite: bool = False
    checkpoint_every: int = 100
    seed: int = 0
    dtype: str = "bfloat16"  # the target's compute dtype (the draft trains in fp32, is written in bf16)
    device: str = "cpu"
    progress: bool = True

    def fingerprint(self) -> dict[str, Any]:
        """What a resumed run must share with the interrupted one."""
        skip = {"out", "resume", "overwrite", "progress", "checkpoint_every", "eval_tokens",
                "eval_fewshot", "eval_k"}
        return {k: str(v) for k, v in dataclasses.asdict(self).items() if k not in skip}


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


def _prepare_init(opts: TrainOptions, init: Path, target: Any, data: TrainData, eos: list[int]) -> None:
    """Write the initial draft (eagle3 profile) into ``init``."""
    if opts.init_from is not None:
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
        return
    from eagle3.runtime.interfaces import default_aux_layer_ids

    vocab_size = target.vocab_size
    ids = list(opts.aux_layer_ids or default_aux_layer_ids(target.num_layers))
    if len(ids) != len(set(ids)) or sorted(ids) != ids or ids[0] < 0 or ids[-1] > target.num_layers:
        raise UsageError(f"--aux-layer-ids {ids}: must be ascending target layer ids in 0..{target.num_layers} "
                         f"(input-to-layer convention)")
    dv = opts.draft_vocab_size
    vmap = None
    if dv is not None:
        if not 1 <= dv <= vocab_size:
            raise UsageError(f"--draft-vocab-size {dv}: must be in 1..{vocab_size} (the target vocabulary)")
        if dv < vocab_size:
            vmap = VocabMap.from_frequencies((e.ids for e in data.train), vocab_size, dv, always=eos)
    cfg = fresh_draft_config(opts.target, opts.arch or "llama", bool(opts.eagle31), dv, ids)
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
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch = i // n
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perm[i % n]))
    return out


def make_batch(seqs: list[list[int]], states: list[TeacherStates]) -> Batch:
    t = max(len(s) for s in seqs)
    b = len(seqs)
    ids = torch.zeros(b, t, dtype=torch.int64)
    aux = torch.zeros(b, t, states[0].aux.shape[-1], dtype=states[0].aux.dtype)
    hid = torch.zeros(b, t, states[0].hidden.shape[-1], dtype=states[0].hidden.dtype)
    for i, (s, st) in enumerate(zip(seqs, states, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        aux[i, : len(s)] = st.aux.cpu()
        hid[i, : len(s)] = st.hidden.cpu()
    return Batch(ids, torch.tensor([len(s) for s in seqs]), aux, hid)


def lr_at(step: int, opts: TrainOptions) -> float:
    warm = opts.warmup_steps if opts.warmup_steps is not None else max(1, opts.steps // 20)
    if step < warm:
        return opts.lr * (step + 1) / warm
    frac = (step - warm) / max(1, opts.steps - warm)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _save_checkpoint(d: Path, step: int, model: TrainableDraft, optim: torch.optim.Optimizer,
                     history: list[dict[str, Any]], opts: TrainOptions) -> None:
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (CKPT_FILE + ".tmp")
    torch.save({"step": step, "model": model.state_dict(), "optim": optim.state_dict(), "history": history,
                "fingerprint": opts.fingerprint()}, tmp)
    os.replace(tmp, d / CKPT_FILE)
    write_json(d / OPTIONS_FILE, opts.fingerprint())


def _check_fingerprint(path: Path, opts: TrainOptions) -> None:
    old = read_json(path) if path.is_file() else {}
    new = opts.fingerprint()
    diff = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if diff:
        raise UsageError(f"--resume: {path.parent} was written with different options ({diff[0]}: "
                         f"{old.get(diff[0])} vs {new.get(diff[0])})")


def _load_checkpoint(path: Path, opts: TrainOptions) -> dict[str, Any]:
    _check_fingerprint(path.with_name(OPTIONS_FILE), opts)
    return torch.load(path, map_location="cpu", weights_only=False)


class _Bar:
    """A rich progress bar over training steps showing the loss (nothing when disabled)."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        self._p = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._p = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn(), transient=False)
        self._p.start()
        self._task = self._p.add_task("train", total=total, completed=done, loss="-")

    def update(self, loss: float) -> None:
        if self._p is not None:
            self._p.update(self._task, advance=1, loss=f"{loss:.4f}")

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()


# ---------------------------------------------------------------------------------------------
# evaluation and report
# ---------------------------------------------------------------------------------------------


def kv_blocks(prompts: list[list[int]], max_tokens: int, k: int, block_size: int = 16) -> int:
    """KV blocks for every prompt at full length at once: the runtime's default (256 MiB of zeros
    on CPU) costs seconds to allocate, far more than these small runs need."""
    return sum(-(-(len(p) + max_tokens + 2 * k + 1) // block_size) for p in prompts) + 2


def heldout_acceptance(target: Any, draft_dir: Path, prompts: list[list[int]], opts: TrainOptions) -> dict[str, Any]:
    """Acceptance of the draft in ``draft_dir`` measured by the runtime (greedy, k = eval_k), and
    whether speculative output equals plain greedy output on the same prompts."""
    from eagle3.runtime.engine.llm import LLM
    from eagle3.runtime.loader import load_draft
    from eagle3.runtime.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=opts.eval_tokens, ignore_eos=False)
    t0 = time.perf_counter()
    blocks = kv_blocks(prompts, opts.eval_tokens, opts.eval_k)
    spec_llm = LLM(target, load_draft(draft_dir, target), num_speculative_tokens=opts.eval_k, tokenizer=None,
                   num_blocks=blocks)
    spec_out = spec_llm.generate(prompts, params)
    t_spec = time.perf_counter() - t0
    t0 = time.perf_counter()
    plain_out = LLM(target, None, tokenizer=None, num_blocks=blocks).generate(prompts, params)
    t_plain = time.perf_counter() - t0
    stats = spec_llm.stats.as_dict()
    return {**stats, "num_prompts": len(prompts), "max_tokens": opts.eval_tokens,
            "output_tokens": sum(len(o.token_ids) for o in spec_out),
            "lossless": all(a.token_ids == b.token_ids for a, b in zip(spec_out, plain_out, strict=True)),
            "seconds_speculative": round(t_spec, 3), "seconds_plain": round(t_plain, 3)}


def _figure(path: Path, history: list[dict[str, Any]], title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:  # matplotlib ships with eagle3[eval]; the JSON report has the same numbers
        return False
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = [h["step"] for h in history]
    ax[0].plot(steps, [h["loss"] for h in history], lw=1)
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("weighted TTT loss")
    ax[0].set_title(title, fontsize=9)
    k = max((len(h["step_acc"]) for h in history), default=0)
    for i in range(k):
        ax[1].plot(steps, [h["step_acc"][i] if i < len(h["step_acc"]) else float("nan") for h in history], lw=1,
                   label=f"step {i}")
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("top-1 agreement with target")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _mean_tail(history: list[dict[str, Any]], key: str, n: int = 10) -> Any:
    tail = history[-n:]
    if not tail:
        return None
    if key == "loss":
        return sum(h["loss"] for h in tail) / len(tail)
    k = min(len(h[key]) for h in tail)
    return [sum(h[key][i] for h in tail) / len(tail) for i in range(k)]


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


def train_draft(opts: TrainOptions, echo: Callable[[str], None] = _echo) -> dict[str, Any]:
    """Train a draft for ``opts.target`` into ``opts.out``; returns the report (also in OUT)."""
    from eagle3.runtime.loader import load_target
    from eagle3.runtime.tokenizer import load_tokenizer

    _check(opts)
    out = Path(opts.out)
    check_output(out, opts.overwrite)
    from eagle3.formats.check import require_valid

    for src in (opts.target, opts.init_from):  # the models against their schemas, before any weight is read
        if src is not None:
            require_valid(src)
    tmp = partial_path(out)
    ckpt = tmp / CKPT_DIR / CKPT_FILE
    if opts.resume and not ckpt.is_file():
        raise UsageError(f"--resume: no checkpoint at {ckpt} (start without --resume)")
    if opts.resume:
        _check_fingerprint(ckpt.with_name(OPTIONS_FILE), opts)
    if not opts.resume and tmp.exists():
        shutil.rmtree(tmp)
    torch.manual_seed(opts.seed)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    # resume=True keeps OUT.partial (and its checkpoints) when anything fails or is interrupted.
    with atomic_output(out, overwrite=opts.overwrite, resume=True) as tmp:
        t0 = time.perf_counter()
        target = load_target(opts.target, dtype=_dtype(opts.dtype), device=opts.device)
        tokenizer = load_tokenizer(opts.target)
        data = load_data(opts.data, tokenizer, dataset=opts.dataset, max_len=opts.max_len, num_train=opts.num_train,
                         num_heldout=opts.eval_prompts, num_fewshot=opts.eval_fewshot, fewshot=opts.fewshot,
                         seed=opts.seed)
        eos = sorted(set(target.spec.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id
                                                        is not None else set()))
        echo(f"data: {data.source}")
        timings["load"] = time.perf_counter() - t0
        if opts.regenerate:
            t0 = time.perf_counter()
            _regenerate(target, data, opts)
            timings["regenerate"] = time.perf_counter() - t0
            echo(f"regenerated {len(data.train)} completions with the target (greedy, <= {opts.regen_tokens} tokens)")

        init = tmp / INIT_DIR
        if not (opts.resume and (init / "config.json").is_file()):
            shutil.rmtree(init, ignore_errors=True)
            _prepare_init(opts, init, target, data, eos)
        model, d2t = load_trainable(init, target.embed_tokens)
        model.to(opts.device)
        model.embed_tokens.weight.requires_grad_(False)  # the target's table, frozen (SpecForge, EAGLE)
        vocab = VocabMap.from_d2t(d2t) if d2t is not None else None
        aux_ids = tuple(read_json(init / "config.json")["eagle_aux_hidden_state_layer_ids"])
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        echo(f"draft: {model.spec.attention} EAGLE-{model.spec.eagle_version}, {n_params / 1e6:.2f}M trainable "
             f"parameters, draft vocab {model.spec.draft_vocab_size}, aux layers {list(aux_ids)}")

        t0 = time.perf_counter()
        seqs = [e.ids for e in data.train]
        states = Teacher(target, aux_ids).run(seqs)
        timings["teacher"] = time.perf_counter() - t0

        params = [p for p in model.parameters() if p.requires_grad]
        optim = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=opts.weight_decay)
        history: list[dict[str, Any]] = []
        start = 0
        if opts.resume:
            st = _load_checkpoint(ckpt, opts)
            model.load_state_dict(st["model"])
            optim.load_state_dict(st["optim"])
            history, start = list(st["history"]), int(st["step"])
            echo(f"resumed at step {start} of {opts.steps} from {ckpt}")
        teacher = Teacher(target, aux_ids)
        t0 = time.perf_counter()
        bar = _Bar(opts.steps, start, opts.progress)
        try:
            for step in range(start, opts.steps):
                idx = batch_indices(step, opts.batch_size, len(seqs), opts.seed)
                batch = make_batch([seqs[i] for i in idx], [states[i] for i in idx])
                lr = lr_at(step, opts)
                for group in optim.param_groups:
                    group["lr"] = lr
                res = ttt_loss(model, teacher, batch, opts.ttt_steps, opts.decay, vocab)
                optim.zero_grad(set_to_none=True)
                res.loss.backward()
                torch.nn.utils.clip_grad_norm_(params, opts.max_grad_norm)
                optim.step()
                history.append({"step": step + 1, "loss": float(res.loss.detach()), "lr": lr,
                                "step_loss": res.step_loss, "step_acc": res.step_acc})
                bar.update(history[-1]["loss"])
                if (step + 1) % opts.checkpoint_every == 0 or step + 1 == opts.steps:
                    _save_checkpoint(tmp / CKPT_DIR, step + 1, model, optim, history, opts)
        finally:
            bar.close()
        timings["train"] = time.perf_counter() - t0

        cfg = read_json(init / "config.json")
        write_draft(tmp, cfg, model.state_dict(), d2t)
        t0 = time.perf_counter()
        heldout = heldout_acceptance(target, tmp, data.heldout, opts) if data.heldout else None
        timings["heldout"] = time.perf_counter() - t0
        if heldout is not None:
            echo(f"held-out acceptance (k={opts.eval_k}, greedy, {heldout['num_prompts']} prompts): "
                 f"{100 * heldout['acceptance_rate']:.1f}%, mean accept length "
                 f"{heldout['mean_acceptance_length']:.2f}, lossless {heldout['lossless']}")
        timings["total"] = time.perf_counter() - t_start
        report = {
            "output": str(out),
            "target": str(opts.target),
            "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()},
            "draft": {"attention": model.spec.attention, "eagle_version": model.spec.eagle_version,
                      "fc_norm": model.spec.fc_norm, "norm_output": model.spec.norm_output,
                      "draft_vocab_size": model.spec.draft_vocab_size, "vocab_size": model.spec.vocab_size,
                      "aux_layer_ids": list(aux_ids), "aux_layer_ids_convention": "input",
                      "trainable_parameters": n_params, "init_from": str(opts.init_from) if opts.init_from else None},
            "data": {"source": data.source, "sequences": len(seqs), "tokens": sum(len(s) for s in seqs),
                     "regenerated": opts.regenerate, "heldout_prompts": len(data.heldout)},
            "training": {"steps": opts.steps, "ttt_steps": opts.ttt_steps, "position_weight": opts.decay,
                         "initial_loss": history[0]["loss"] if history else None,
                         "final_loss": _mean_tail(history, "loss"),
                         "final_step_acc": _mean_tail(history, "step_acc"),
                         "loss": [h["loss"] for h in history],
                         "step_acc": [h["step_acc"] for h in history]},
            "heldout": heldout,
            "timings_s": {k: round(v, 3) for k, v in timings.items()},
        }
        write_json(tmp / REPORT_FILE, report)
        title = f"{opts.target.name}: {model.spec.attention} EAGLE-{model.spec.eagle_version} draft"
        _figure(tmp / FIGURE_FILE, history, title)
        shutil.rmtree(tmp / INIT_DIR, ignore_errors=True)
        shutil.rmtree(tmp / CKPT_DIR, ignore_errors=True)
    return report


def _regenerate(target: Any, data: TrainData, opts: TrainOptions) -> None:
    from eagle3.runtime.engine.llm import LLM
    from eagle3.runtime.sampling import SamplingParams

    prompts = [e.prompt_ids for e in data.train]
    llm = LLM(target, None, tokenizer=None, num_blocks=kv_blocks(prompts, opts.regen_tokens, 0))
    params = SamplingParams(temperature=0.0, max_tokens=opts.regen_tokens)
    outs = llm.generate(prompts, params)
    for e, o in zip(data.train, outs, strict=True):
        e.ids = (e.prompt_ids + list(o.token_ids))[: opts.max_len]


def _dtype(name: str) -> torch.dtype:
    from eagle3.runtime.engine.config import DTYPES, dtype_by_name

    if name not in DTYPES:
        raise UsageError(f"--dtype {name}: expected bfloat16, float16 or float32")
    return dtype_by_name(name)


def print_summary(report: dict[str, Any]) -> None:
    t = report["training"]
    lines = [f"draft: {report['output']}",
             f"  {report['draft']['attention']} EAGLE-{report['draft']['eagle_version']}, aux layers "
             f"{report['draft']['aux_layer_ids']}, draft vocab {report['draft']['draft_vocab_size']}",
             f"  data: {report['data']['sequences']} sequences, {report['data']['tokens']} tokens"
             + (" (regenerated by the target)" if report["data"]["regenerated"] else ""),
             f"  loss: {t['initial_loss']} -> {t['final_loss']} over {t['steps']} steps" if t["loss"] else
             "  no training steps"]
    h = report.get("heldout")
    if h:
        lines.append(f"  held-out acceptance (k={h['num_speculative_tokens']}): {100 * h['acceptance_rate']:.2f}%, "
                     f"mean accept length {h['mean_acceptance_length']:.2f}, per position "
                     + "/".join(f"{p:.2f}" for p in h["per_position_acceptance"])
                     + f", lossless {'PASS' if h['lossless'] else 'FAIL'}")
    lines.append(f"  report: {Path(report['output']) / REPORT_FILE}")
    print("\n".join(lines))


__all__ = ["TrainOptions", "train_draft", "print_summary", "REPORT_FILE", "FIGURE_FILE"]
