"""Why a quantized target's accept length moves: the draft's agreement with each target, paired on
one text (docs/recipes.md, "accept length and fidelity").

    .venv/bin/python benchmarks/draft_agreement.py --source SRC --draft DRAFT --targets Q1,Q2
        [--prompts 128] [--max-tokens 96] [--steps 3] [--json agreement.json]

A served accept length (``serve --validate gsm8k``) compares targets on different texts: each
target continues the prompts its own way, so two targets' accept lengths differ by the texts as
much as by the targets (on 24 prompts the spread is several percent). Here every target reads the
*source's* greedy continuation of the same GSM8K 5-shot prompts (teacher forcing, as training does),
and at every continuation position and draft step ``i`` (the draft's chain fed the text's own
tokens) the draft's top-1 is compared with that target's top-1: the same positions for every
target, so the comparison is paired. Printed per target:

- agreement per step (what acceptance is made of) and the source-vs-target mean KLD and top-1 of the
  target's own next-token distribution on the text;
- per pair of targets and step, the positions where only one of them agrees with the draft (a sign
  test's ``z``: |z| > 2 is a difference the text does not explain);
- where a target's top-1 differs from the source's: how often the draft (fed that target's hidden
  states) predicts the target's new token, the source's, or neither. A draft reads the target's
  hidden states only up to its last aux layer, so it can follow a change that starts before that
  layer and not one that starts after it.

Uses the training module's teacher and trainable draft (the same math as the runtime, fp32).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.runtime.interfaces import default_aux_layer_ids  # noqa: E402
from eagle3.runtime.loader import draft_spec, load_target  # noqa: E402
from eagle3.runtime.tokenizer import load_tokenizer  # noqa: E402
from eagle3.train.acceptance import gsm8k_prompts  # noqa: E402
from eagle3.train.draft_module import TrainableDraft, load_trainable  # noqa: E402
from eagle3.train.teacher import Teacher, TeacherStates  # noqa: E402
from eagle3.train.teacher_cache import CachedExample  # noqa: E402
from eagle3.train.trainer import make_batch  # noqa: E402
from eagle3.train.ttt import VocabMap, chain_rows, chain_steps  # noqa: E402

BATCH = 8  # sequences per teacher forward

Rows = list[list[tuple[list[int], list[int]]]]  # per sequence, per step: (draft top-1, target top-1)


@torch.no_grad()
def step_agreement(model: TrainableDraft, vocab: VocabMap | None, teacher: Teacher, ex: CachedExample,
                   prompt_len: int, steps: int) -> list[tuple[list[int], list[int]]]:
    """Per draft step: the draft's top-1 and the target's at each continuation position (the chains
    of ``ttt_loss``, one sequence)."""
    b = make_batch([ex], [prompt_len], steps)
    query, nq = chain_rows(b.first, b.lengths)
    target_top1 = teacher.logits(b.label_hidden[:, : query.shape[1] + steps - 1]).argmax(-1)[0]
    out = []
    for i, post in enumerate(chain_steps(model, b.input_ids, b.aux, query, steps)):
        draft = model.compute_logits(post).argmax(-1)[0]
        if vocab is not None:
            draft = vocab.used[draft]
        n = int(nq[0]) - i
        tgt = target_top1[i: i + n]
        out.append((draft[:n].tolist(), tgt.tolist()))
    return out


def measure(path: Path | None, source: Teacher, ref: list[TeacherStates], aux: tuple[int, ...],
            model: TrainableDraft, vocab: VocabMap | None, plens: list[int],
            steps: int) -> tuple[Rows, dict[str, float]]:
    """One target (None: the source) on the source's texts (``ref``: the source's states of them):
    its per-position rows and its KLD / top-1 against the source."""
    teacher = source if path is None else Teacher(load_target(path), aux)
    rows: Rows = []
    kl, agree, n = 0.0, 0, 0
    for i in range(0, len(ref), BATCH):
        chunk = ref[i: i + BATCH]
        mine = chunk if teacher is source else teacher.states([r.ids for r in chunk])
        for j, (r, m) in enumerate(zip(chunk, mine, strict=True)):
            p = plens[i + j]
            rows.append(step_agreement(model, vocab, teacher, CachedExample(torch.tensor(m.ids), m.aux.float(),
                                                                             m.hidden.float()), p, steps))
            lq = torch.log_softmax(source.logits(r.hidden[p - 1:-1]), -1)
            lp = lq if teacher is source else torch.log_softmax(teacher.logits(m.hidden[p - 1:-1]), -1)
            kl += float((lq.exp() * (lq - lp)).sum())
            agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
            n += lq.shape[0]
    acc = [sum(sum(agrees(r[k])) for r in rows) / max(sum(len(r[k][0]) for r in rows), 1) for k in range(steps)]
    return rows, {"agreement": acc, "kld_mean": kl / max(n, 1), "top1": agree / max(n, 1), "positions": n}


def agrees(step: tuple[list[int], list[int]]) -> list[bool]:
    return [d == t for d, t in zip(*step, strict=True)]


def paired(a: Rows, b: Rows, steps: int) -> list[dict[str, float]]:
    """Per step: positions where only ``a`` / only ``b`` agrees with the draft, and the sign test's z."""
    out = []
    for k in range(steps):
        pairs = [(x, y) for ra, rb in zip(a, b, strict=True)
                 for x, y in zip(agrees(ra[k]), agrees(rb[k]), strict=True)]
        only_a, only_b = sum(x and not y for x, y in pairs), sum(y and not x for x, y in pairs)
        z = (only_a - only_b) / math.sqrt(only_a + only_b) if only_a + only_b else 0.0
        out.append({"only_first": only_a, "only_second": only_b, "z": z})
    return out


def flips(src: Rows, tgt: Rows, steps: int) -> list[dict[str, int]]:
    """Per step, at the positions where the target's top-1 differs from the source's: the draft
    (fed the target's states) on the target's token, on the source's, or on neither."""
    out = []
    for k in range(steps):
        c = {"changed": 0, "draft_on_target": 0, "draft_on_source": 0}
        for rs, rt in zip(src, tgt, strict=True):
            for draft, s_tok, t_tok in zip(rt[k][0], rs[k][1], rt[k][1], strict=True):
                if s_tok != t_tok:
                    c["changed"] += 1
                    c["draft_on_target"] += draft == t_tok
                    c["draft_on_source"] += draft == s_tok
        out.append(c)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--targets", required=True, help="quantized targets, comma-separated")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer(a.source)
    prompts = gsm8k_prompts(tok, a.prompts)
    src_model = load_target(a.source)
    aux = tuple(draft_spec(a.draft).aux_layer_ids or default_aux_layer_ids(src_model.num_layers))
    source = Teacher(src_model, aux)
    print(f"source's greedy continuations of {a.prompts} prompts ({a.max_tokens} tokens) ...", flush=True)
    texts = [s.ids for s in source.generate(prompts, a.max_tokens, list(src_model.spec.eos_token_ids), 1 << 16)]
    # the source's states from the same one-forward pass as every target's (not the decode's steps)
    ref = [st for i in range(0, len(texts), BATCH) for st in source.states(texts[i: i + BATCH])]
    model, d2t = load_trainable(a.draft)
    model.eval()
    vocab = VocabMap.from_d2t(d2t) if d2t is not None else None
    plens = [len(p) for p in prompts]
    names = ["source", *a.targets.split(",")]
    rows, summary = {}, {}
    for name in names:
        rows[name], summary[name] = measure(None if name == "source" else Path(name), source, ref, aux, model,
                                            vocab, plens, a.steps)
        s = summary[name]
        print(f"{name}: agreement per step {[round(x, 4) for x in s['agreement']]}, KLD {s['kld_mean']:.5f}, "
              f"top-1 {100 * s['top1']:.2f} % ({s['positions']} positions)", flush=True)
    report: dict[str, Any] = {"prompts": a.prompts, "max_tokens": a.max_tokens, "aux_layer_ids": list(aux),
                              "targets": summary, "paired": {}, "changed_top1": {}}
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            report["paired"][f"{x} vs {y}"] = p = paired(rows[x], rows[y], a.steps)
            print(f"{x} vs {y}: only one agrees (first / second, z) per step: "
                  + ", ".join(f"{d['only_first']} / {d['only_second']} ({d['z']:+.1f})" for d in p))
    for name in names[1:]:
        report["changed_top1"][name] = f = flips(rows["source"], rows[name], a.steps)
        print(f"{name}: top-1 changed vs the source (changed: draft on the new token / on the source's) per step: "
              + ", ".join(f"{d['changed']}: {d['draft_on_target']} / {d['draft_on_source']}" for d in f))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
