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
    arch: Annotated[str | None, typer.Option(help="llama|mla draft layer (default llama; with --init-from: its own).")] = None,
    eagle31: Annotated[bool | None, typer.Option("--eagle31/--no-eagle31", help="EAGLE-3.1: fc_norm + norm_output (post-norm hidden fed back).")] = None,
    data: Annotated[str, typer.Option(help="gsm8k, or a FILE.jsonl with \"text\" or \"prompt\"/\"completion\" rows.")] = "gsm8k",
    dataset: Annotated[Path | None, typer.Option(help="gsm8k: directory with train.jsonl + test.jsonl (default: the copy eagle3 ships; hub: the Hub dataset openai/gsm8k).")] = None,
    regenerate: Annotated[bool, typer.Option(help="Train on the target's own greedy continuations of the prompts.")] = False,
    regen_tokens: Annotated[int, typer.Option(help="--regenerate: new tokens per prompt.")] = 128,
    draft_vocab_size: Annotated[int | None, typer.Option(help="Reduced draft vocabulary (d2t/t2d from token frequencies).")] = None,
    aux_layer_ids: Annotated[str | None, typer.Option(help="Target layers feeding the draft, input-to-layer convention, e.g. 2,30,58 (default 2,N//2,N-3).")] = None,
    ttt_steps: Annotated[int, typer.Option(help="Training-time-test steps unrolled per position.")] = 3,
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 1000,
    batch_size: Annotated[int, typer.Option(help="Sequences per step.")] = 8,
    lr: Annotated[float, typer.Option(help="Peak AdamW learning rate (linear warm-up, cosine decay).")] = 1e-3,
    max_len: Annotated[int, typer.Option(help="Tokens per training sequence (longer ones are cut).")] = 512,
    num_train: Annotated[int | None, typer.Option(help="Use the first N training examples.")] = None,
    fewshot: Annotated[int, typer.Option(help="gsm8k: solved train problems before each training problem (serve --validate prompts 5-shot).")] = 0,
    eval_prompts: Annotated[int, typer.Option(help="Held-out prompts for the acceptance measurement.")] = 8,
    eval_tokens: Annotated[int, typer.Option(help="New tokens per held-out prompt.")] = 64,
    eval_fewshot: Annotated[int, typer.Option(help="gsm8k: few-shot exemplars in the held-out prompts.")] = 5,
    init_from: Annotated[Path | None, typer.Option(help="Start from this draft (any format eagle3 reads).")] = None,
    checkpoint_every: Annotated[int, typer.Option(help="Checkpoint into OUT.partial every N steps.")] = 100,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run from its OUT.partial checkpoint.")] = False,
    seed: Annotated[int, typer.Option(help="Seed (initial weights, batch order).")] = 0,
    dtype: Annotated[str, typer.Option(help="Target compute dtype: bfloat16|float16|float32.")] = "bfloat16",
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:1, ...")] = "cpu",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing OUT.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the training report as JSON.")] = False,
) -> None:
    """Train an EAGLE-3 / 3.1 draft against TARGET with the runtime's own target model as teacher.

    Example: eagle3 train-draft ./tiny/kimi-k2.5 ./draft --data gsm8k --dataset ./gsm8k --regenerate --steps 300

    eagle3 train-draft ./Kimi-K2.5 ./draft-mla --arch mla --eagle31 --aux-layer-ids 2,30,58 --draft-vocab-size 32000

    Writes OUT (convertible with eagle3 convert --engine vllm|sglang|atom|speculators), OUT/train_report.json
    (loss curve, held-out acceptance measured by the runtime, lossless check) and OUT/train_loss.png.
    """
    from eagle3.convert import parse_aux_ids
    from eagle3.train import TrainOptions, print_summary
    from eagle3.train import train_draft as run

    opts = TrainOptions(
        target=target, out=out, arch=arch, eagle31=eagle31, data=data, dataset=dataset, regenerate=regenerate,
        regen_tokens=regen_tokens, draft_vocab_size=draft_vocab_size, aux_layer_ids=parse_aux_ids(aux_layer_ids),
        ttt_steps=ttt_steps, steps=steps, batch_size=batch_size, lr=lr, max_len=max_len, num_train=num_train,
        fewshot=fewshot, eval_prompts=eval_prompts, eval_tokens=eval_tokens, eval_fewshot=eval_fewshot, init_from=init_from,
        checkpoint_every=checkpoint_every, resume=resume, seed=seed, dtype=dtype, device=device,
        overwrite=overwrite, progress=not quiet and not json_out and sys.stderr.isatty())
    report = run(opts)
    if json_out:
        print_json(report)
    else:
        print_summary(report)
