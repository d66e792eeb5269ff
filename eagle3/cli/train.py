"""``eagle3 train-draft``: train an EAGLE-3 / 3.1 draft against a target."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from eagle3.cli.app import app, print_json


@app.command("train-draft")
def train_draft(
    target: Annotated[Path, typer.Argument(help="Target checkpoint directory (any format the runtime loads).")],
    out: Annotated[Path, typer.Argument(help="Output draft directory (eagle3 format; written to OUT.partial, then renamed).")],
    adapt: Annotated[bool, typer.Option(help="Adapt the --init-from draft to TARGET (a quantized target it will serve beside): the preset in docs/train_draft.md; options given explicitly win.")] = False,
    arch: Annotated[str | None, typer.Option(help="llama|mla draft layer (default llama; with --init-from: its own).")] = None,
    eagle31: Annotated[bool | None, typer.Option("--eagle31/--no-eagle31", help="EAGLE-3.1: fc_norm + norm_output (post-norm hidden fed back).")] = None,
    data: Annotated[str | None, typer.Option(help="gsm8k (default), or a FILE.jsonl with \"text\" or \"prompt\"/\"completion\" rows.")] = None,
    dataset: Annotated[Path | None, typer.Option(help="gsm8k: directory with train.jsonl + test.jsonl (default: the copy eagle3 ships; hub: the Hub dataset openai/gsm8k).")] = None,
    regenerate: Annotated[bool | None, typer.Option("--regenerate/--no-regenerate", help="Train on the target's own greedy continuations of the prompts.")] = None,
    regen_tokens: Annotated[int | None, typer.Option(help="--regenerate: new tokens per prompt (default 128).")] = None,
    draft_vocab_size: Annotated[int | None, typer.Option(help="Reduced draft vocabulary (d2t/t2d from token frequencies).")] = None,
    aux_layer_ids: Annotated[str | None, typer.Option(help="Target layers feeding the draft, input-to-layer convention, e.g. 2,30,58 (default 2,N//2,N-3 for N >= 7 layers, 1,N//2,N-1 for 4-6, 0,1,2 for 2-3; printed).")] = None,
    ttt_steps: Annotated[int, typer.Option(help="Training-time-test steps unrolled per position.")] = 3,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps (default 1000).")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Sequences per step (default 8).")] = None,
    lr: Annotated[float | None, typer.Option(help="Peak AdamW learning rate, linear warm-up, cosine decay (default 1e-3).")] = None,
    anchor: Annotated[float | None, typer.Option(help="Pull the weights back towards the starting draft's by lr x ANCHOR x (w - w_start) per step (default 0).")] = None,
    freeze: Annotated[str | None, typer.Option(help="Comma-separated parameter name prefixes kept fixed, e.g. lm_head,fc.")] = None,
    max_len: Annotated[int | None, typer.Option(help="Tokens per training sequence (default 512; few-shot context is cut first).")] = None,
    num_train: Annotated[int | None, typer.Option(help="Use the first N training examples.")] = None,
    fewshot: Annotated[int | None, typer.Option(help="gsm8k: solved train problems before each training problem (serve --validate prompts 5-shot; default 0).")] = None,
    context_loss: Annotated[bool | None, typer.Option("--context-loss/--no-context-loss", help="--fewshot: also train on the exemplars (default) or only on the problem itself.")] = None,
    eval_prompts: Annotated[int | None, typer.Option(help="Held-out prompts for the acceptance measurement (default 8).")] = None,
    eval_tokens: Annotated[int | None, typer.Option(help="New tokens per held-out prompt (default 64).")] = None,
    eval_fewshot: Annotated[int | None, typer.Option(help="gsm8k: few-shot exemplars in the held-out prompts (default 5).")] = None,
    init_from: Annotated[Path | None, typer.Option(help="Start from this draft (any format eagle3 reads).")] = None,
    checkpoint_every: Annotated[int | None, typer.Option(help="Checkpoint into OUT.partial every N steps (default 100).")] = None,
    teacher_cache: Annotated[Path | None, typer.Option(help="Keep the teacher's states here, reused by later runs on the same target (default: inside OUT.partial).")] = None,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run from OUT.partial (its teacher states and checkpoint).")] = False,
    seed: Annotated[int, typer.Option(help="Seed (initial weights, batch order, few-shot exemplars).")] = 0,
    dtype: Annotated[str, typer.Option(help="Target compute dtype: bfloat16|float16|float32.")] = "bfloat16",
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:1, ...")] = "cpu",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUT.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the training report as JSON.")] = False,
) -> None:
    """Train an EAGLE-3 / 3.1 draft against TARGET with the runtime's own target model as teacher.

    Examples:

    \b
    eagle3 train-draft ./tiny/kimi-k2.5 ./draft --data gsm8k --regenerate --steps 300
    eagle3 train-draft ./Kimi-K2.5 ./draft-mla --arch mla --eagle31 --aux-layer-ids 2,30,58 --draft-vocab-size 32000
    eagle3 train-draft ./Kimi-K2.5-MXFP4 ./draft-mxfp4 --init-from ./kimi-k2.5-eagle3 --adapt

    Writes OUT (convertible with eagle3 convert --engine vllm|sglang|atom|speculators), OUT/train_report.json
    (loss curve, held-out acceptance measured by the runtime before and after, lossless check, the
    target's fingerprint) and OUT/train_loss.png.
    """
    from eagle3.convert import parse_aux_ids
    from eagle3.train import TrainOptions, print_summary, with_preset
    from eagle3.train import train_draft as run

    given = {"data": data, "regenerate": regenerate, "regen_tokens": regen_tokens, "steps": steps,
             "batch_size": batch_size, "lr": lr, "anchor": anchor, "max_len": max_len, "fewshot": fewshot,
             "context_loss": context_loss, "eval_prompts": eval_prompts, "eval_tokens": eval_tokens,
             "eval_fewshot": eval_fewshot, "checkpoint_every": checkpoint_every,
             "freeze": tuple(f.strip() for f in freeze.split(",") if f.strip()) if freeze is not None else None}
    explicit = {k: v for k, v in given.items() if v is not None}
    opts = TrainOptions(
        target=target, out=out, arch=arch, eagle31=eagle31, dataset=dataset, draft_vocab_size=draft_vocab_size,
        aux_layer_ids=parse_aux_ids(aux_layer_ids), ttt_steps=ttt_steps, num_train=num_train, init_from=init_from,
        teacher_cache=teacher_cache, resume=resume, seed=seed, dtype=dtype, device=device, overwrite=overwrite,
        progress=not quiet and not json_out and sys.stderr.isatty(), **explicit)
    if adapt:
        opts = with_preset(opts, set(explicit))
    report = run(opts)
    if json_out:
        print_json(report)
    else:
        print_summary(report)
