"""Pre-train the tiny Kimi-architecture target ``kimi-k2.5-trained`` on the GSM8K train split.

The model is Kimi-K2.5's text stack scaled down in width and depth but with Kimi's real MLA latent
sizes (kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128), noaux_tc sigmoid routing with a shared
expert and a dense first layer (:data:`eagle3.testing.trained.TRAINED_DIMS`), and the tiny
1024-token tokenizer of :mod:`eagle3.testing.tiny`. transformers' ``DeepseekV3ForCausalLM`` is the
trainer. The output is package data: ``eagle3/testing/data/kimi_k25_trained/`` holds the weights
(Moonshot text names ``model.*`` / ``lm_head.weight``, bf16, routed experts already in
compressed-tensors INT4 group-32 form, written by ``eagle3 make-tiny --only kimi-k2.5-trained``)
and ``train_meta.json`` (seed, steps, data hash, loss curve summary, held-out loss).

Training:
* data: every GSM8K train problem as ``"Question: {q}\\nAnswer: {a}\\n\\n"`` (lm-eval's few-shot
  exemplar format), shuffled with the seed and packed into one token stream cut into
  ``--seq-len`` windows, so the model sees several problems per window, as in a 5-shot prompt;
* AdamW, warm-up then cosine decay; fp32 master weights;
* noaux_tc: the router's ``e_score_correction_bias`` gets DeepSeek-V3's auxiliary-loss-free update
  (``bias += u * sign(mean load - load)`` after each step);
* quantization-aware: for the last ``--qat-frac`` of the steps the routed experts run through a
  straight-through INT4 group-32 fake quantizer (:func:`eagle3.formats.codecs.ct_int4_quantize`,
  the codec make-tiny writes with), and the held-out loss is measured with every weight rounded to
  bf16 and the experts dequantized from the INT4 codes, as the runtime sees the checkpoint.

Reproducible: seeded, ``torch.use_deterministic_algorithms``, a fixed thread count (CPU results
can depend on the number of threads). Run (minutes on a 2-core CPU)::

    nice -n 5 python scripts/train_tiny_kimi.py --dataset $GSM8K_DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagle3.formats.codecs import ct_int4_dequantize, ct_int4_quantize  # noqa: E402
from eagle3.testing import tiny, trained  # noqa: E402
from eagle3.validate import gsm8k  # noqa: E402

GROUP = tiny.GROUP_SIZE


def hf_config() -> object:
    """transformers' DeepseekV3Config for the trained target (model_type deepseek_v3)."""
    from transformers import DeepseekV3Config

    c = trained.text_config()
    c = {k: v for k, v in c.items() if k not in ("quantization_config", "architectures", "model_type")}
    return DeepseekV3Config(**c)


def fake_int4(w: torch.Tensor) -> torch.Tensor:
    """bf16(q * scale) of each [out, in] expert matrix, quantized along ``in`` in groups of 32."""
    out = torch.empty_like(w)
    with torch.no_grad():
        for e in range(w.shape[0]):
            wb = w[e].to(torch.bfloat16)
            packed, scale = ct_int4_quantize(wb, GROUP)
            out[e] = ct_int4_dequantize(packed, scale, tuple(wb.shape), dtype=torch.bfloat16).float()
    return out


class FakeQuantSTE(nn.Module):
    """Parametrization: forward sees the INT4-dequantized experts, gradients pass straight through."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + (fake_int4(w) - w).detach()


def load_docs(dataset: Path, split: str) -> list[str]:
    train, test = gsm8k.load_dataset(dataset)
    return [gsm8k.exemplar(d) for d in (train if split == "train" else test)]


def moe_layers(model: nn.Module) -> list[nn.Module]:
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]


@torch.no_grad()
def heldout_loss(model: nn.Module, docs: list[str], tok: object) -> float:
    """Mean next-token loss over the held-out documents, each on its own (no packing)."""
    model.eval()
    total, n = 0.0, 0
    for text in docs:
        ids = torch.tensor([tok.encode(text).ids])
        logits = model(input_ids=ids).logits[0, :-1].float()
        total += nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        n += ids.shape[1] - 1
    model.train()
    return total / n


def runtime_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained weights as the checkpoint holds them: Moonshot text names, bf16, experts INT4."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    inter = trained.TRAINED_DIMS["moe_intermediate_size"]
    for k, v in sd.items():
        if "parametrizations" in k and not k.endswith("original"):
            continue
        k = k.replace("parametrizations.", "").replace(".original", "")
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            base = k.rsplit(".", 1)[0]
            for e in range(v.shape[0]):
                w = v[e].to(torch.bfloat16)
                parts = ({"gate_proj": w[:inter], "up_proj": w[inter:]} if k.endswith("gate_up_proj")
                         else {"down_proj": w})
                for proj, m in parts.items():
                    packed, scale = ct_int4_quantize(m.contiguous(), GROUP)
                    out[f"{base}.{e}.{proj}.weight_packed"] = packed
                    out[f"{base}.{e}.{proj}.weight_scale"] = scale
                    out[f"{base}.{e}.{proj}.weight_shape"] = torch.tensor(list(m.shape), dtype=torch.int32)
        elif k.endswith("e_score_correction_bias"):
            out[k] = v.float()  # fp32 as in Kimi
        else:
            out[k] = v.to(torch.bfloat16)
    return out


def load_runtime_view(model: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """A fp32 copy of ``model`` holding exactly the checkpoint's values (bf16 rounding, INT4 experts)."""
    from transformers import DeepseekV3ForCausalLM

    m = DeepseekV3ForCausalLM(model.config).float()
    inter = trained.TRAINED_DIMS["moe_intermediate_size"]
    sd = {}
    for k, p in m.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            base = k.rsplit(".", 1)[0]
            mats = []
            for e in range(p.shape[0]):
                projs = ("gate_proj", "up_proj") if k.endswith("gate_up_proj") else ("down_proj",)
                mats.append(torch.cat([ct_int4_dequantize(weights[f"{base}.{e}.{pr}.weight_packed"],
                                                          weights[f"{base}.{e}.{pr}.weight_scale"],
                                                          tuple(weights[f"{base}.{e}.{pr}.weight_shape"].tolist()),
                                                          dtype=torch.bfloat16) for pr in projs]))
            sd[k] = torch.stack(mats).float()
        else:
            sd[k] = weights[k].float()
    m.load_state_dict(sd, strict=True)
    del inter
    return m.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", type=Path, default=os.environ.get("GSM8K_DIR"),
                    required=os.environ.get("GSM8K_DIR") is None,
                    help="GSM8K directory with train.jsonl + test.jsonl (default: $GSM8K_DIR)")
    ap.add_argument("--out", type=Path, default=REPO / "eagle3" / "testing" / "data" / trained.DATA_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--long-seq-len", type=int, default=2048,
                    help="window of the final phase (a 5-shot GSM8K prompt + answer is ~1900 tokens)")
    ap.add_argument("--long-frac", type=float, default=0.15, help="fraction of steps at --long-seq-len, batch 1")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--qat-frac", type=float, default=0.15)
    ap.add_argument("--bias-update", type=float, default=1e-3)
    ap.add_argument("--heldout", type=int, default=64, help="GSM8K test problems for the held-out loss")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-minutes", type=float, default=0.0, help="stop early (0: no limit; not reproducible)")
    ap.add_argument("--continue-from", type=Path, default=None,
                    help="package-data directory of an earlier run: start from its weights (bf16, INT4 experts) "
                         "with a fresh optimizer and schedule; its train_meta.json is kept as an earlier stage")
    ap.add_argument("--num-problems", type=int, default=None,
                    help="train on the first N problems of the shuffled train split only (a small set seen for "
                         "many epochs: a model this small then writes fluent GSM8K-style answers, at the cost "
                         "of a higher held-out loss)")
    ap.add_argument("--shuffle-seed", type=int, default=None,
                    help="seed of the window order (default --seed; a continuation stage uses another one so "
                         "that it does not replay the first stage's order)")
    args = ap.parse_args()

    from torch.nn.utils import parametrize
    from transformers import DeepseekV3ForCausalLM

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    tok = tiny.build_tokenizer()
    train_docs = load_docs(args.dataset, "train")
    test_docs = load_docs(args.dataset, "test")[: args.heldout]
    data_hash = hashlib.sha256((args.dataset / "train.jsonl").read_bytes()).hexdigest()
    order = list(range(len(train_docs)))
    rng.shuffle(order)
    if args.num_problems is not None:
        order = order[: args.num_problems]
    stream: list[int] = []
    for i in order:
        stream.extend(tok.encode(train_docs[i]).ids)
    n_win = len(stream) // args.seq_len
    windows = torch.tensor(stream[: n_win * args.seq_len]).view(n_win, args.seq_len)
    n_long = len(stream) // args.long_seq_len
    long_windows = torch.tensor(stream[: n_long * args.long_seq_len]).view(n_long, args.long_seq_len)
    print(f"train tokens {len(stream)}, windows {n_win} x {args.seq_len}; "
          f"{args.steps} steps x {args.batch} = {args.steps * args.batch / n_win:.2f} epochs", flush=True)

    model = DeepseekV3ForCausalLM(hf_config()).float().train()
    earlier: list[dict] = []
    if args.continue_from is not None:
        # Start from exactly what an earlier run shipped (bf16, experts through INT4): the continuation
        # is reproducible from the package data alone, without that run's fp32 master weights.
        from safetensors.torch import load_file

        shipped: dict[str, torch.Tensor] = {}
        for f in sorted(args.continue_from.glob("weights-*.safetensors")):
            shipped.update(load_file(str(f)))
        model = load_runtime_view(model, shipped).train()
        prev = json.loads((args.continue_from / trained.META_FILE).read_text(encoding="utf-8"))
        earlier = prev.pop("stages", [])
        earlier.append(prev)
        print(f"continuing from {args.continue_from} ({prev.get('steps')} earlier steps)", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters {n_params / 1e6:.2f} M", flush=True)

    loads: dict[int, torch.Tensor] = {}

    def hook(idx: int):
        def fn(_mod: nn.Module, _inp: object, out: tuple[torch.Tensor, ...]) -> None:
            loads[idx] = loads.get(idx, 0) + torch.bincount(out[2].flatten(), minlength=_mod.num_experts)
        return fn

    moes = moe_layers(model)
    for i, moe in enumerate(moes):
        moe.gate.register_forward_hook(hook(i))

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    order_seed = args.seed if args.shuffle_seed is None else args.shuffle_seed
    perm = torch.randperm(n_win, generator=torch.Generator().manual_seed(order_seed))
    long_perm = torch.randperm(n_long, generator=torch.Generator().manual_seed(order_seed + 1))
    long_start = int(args.steps * (1 - args.long_frac))
    qat_start = int(args.steps * (1 - args.qat_frac))
    losses: list[float] = []
    t0 = time.time()
    steps_done = 0
    for step in range(args.steps):
        if step == qat_start and args.qat_frac > 0:
            for moe in moes:
                parametrize.register_parametrization(moe.experts, "gate_up_proj", FakeQuantSTE())
                parametrize.register_parametrization(moe.experts, "down_proj", FakeQuantSTE())
            print(f"step {step}: quantization-aware training on (INT4 g32 experts)", flush=True)
        if step < long_start:
            batch = windows[perm[(torch.arange(args.batch) + step * args.batch) % n_win]]
        else:  # long windows, so that positions of a whole 5-shot prompt have been seen
            batch = long_windows[long_perm[(step - long_start) % n_long]].unsqueeze(0)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loads.clear()
        out = model(input_ids=batch, labels=batch)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # DeepSeek-V3 auxiliary-loss-free balancing
            for i, moe in enumerate(moes):
                load = loads[i].float()
                moe.gate.e_score_correction_bias += args.bias_update * torch.sign(load.mean() - load)
        losses.append(out.loss.item())
        steps_done = step + 1
        if step % 20 == 0 or step == args.steps - 1:
            el = time.time() - t0
            print(f"step {step:4d} loss {losses[-1]:.3f} lr {lr_at(step):.2e} {el:6.0f}s", flush=True)
        if args.max_minutes and time.time() - t0 > args.max_minutes * 60:
            print(f"stopping at step {step} (--max-minutes)", flush=True)
            break
    train_s = time.time() - t0

    weights = runtime_weights(model)
    view = load_runtime_view(model, weights)
    # DeepseekV3's own generate check: the greedy continuation of a held-out question
    heldout = heldout_loss(view, test_docs, tok)
    print(f"held-out loss (bf16 weights, INT4 experts) {heldout:.4f} nats/token "
          f"(ppl {math.exp(heldout):.2f}) on {len(test_docs)} GSM8K test problems", flush=True)
    ids = torch.tensor([tok.encode(gsm8k.doc_to_text(gsm8k.Doc(
        "Tom has 3 boxes with 12 apples each. He eats 5 apples. How many apples are left?", ""))).ids])
    with torch.no_grad():
        gen = view.generate(ids, max_new_tokens=60, do_sample=False, pad_token_id=tiny.PAD_ID)
    print("sample:", repr(tok.decode(gen[0, ids.shape[1]:].tolist())), flush=True)

    def window_mean(a: list[float], i: int, w: int = 20) -> float:
        s = a[max(0, i - w + 1): i + 1]
        return sum(s) / len(s)

    meta = {
        "model": "kimi-k2.5-trained",
        "script": "scripts/train_tiny_kimi.py",
        "seed": args.seed,
        "steps": steps_done,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "long_seq_len": args.long_seq_len,
        "long_from_step": long_start,
        "lr": args.lr,
        "warmup": args.warmup,
        "qat_from_step": qat_start if args.qat_frac > 0 else None,
        "threads": args.threads,
        "parameters": n_params,
        "data": {"file": "gsm8k/train.jsonl", "sha256": data_hash, "problems": len(order),
                 "tokens": len(stream), "epochs": steps_done * args.batch / n_win},
        "loss": {"first": losses[0], "final_mean20": window_mean(losses, len(losses) - 1),
                 "curve_mean20": {str(i): round(window_mean(losses, i), 4)
                                  for i in range(0, len(losses), max(1, len(losses) // 20))}},
        "heldout": {"split": "gsm8k test", "problems": len(test_docs), "loss_nats_per_token": heldout,
                    "weights": "bf16, experts INT4 g32 (as the runtime loads them)"},
        "train_seconds": round(train_s, 1),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "shuffle_seed": order_seed,
        "continued_from": None if args.continue_from is None else "the stage before (stages[-1])",
        "stages": earlier,
    }
    trained.write_package_data(args.out, weights, meta)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
