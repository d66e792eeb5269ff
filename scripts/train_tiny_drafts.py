"""Train the two drafts shipped for ``kimi-k2.5-trained`` with ``eagle3 train-draft``.

Writes the trained target with ``eagle3 make-tiny --only kimi-k2.5-trained`` into a scratch
directory, runs ``eagle3 train-draft`` once per draft (a Llama EAGLE-3 draft and an MLA EAGLE-3.1
draft, aux layers 1,2,3) on the target's own greedy continuations of GSM8K train prompts, and
copies each result (``config.json`` + ``model.safetensors``, the ``eagle3`` draft format) into
``eagle3/testing/data/<draft dir>/`` with a ``train_meta.json`` recording the exact command, the
loss and the held-out acceptance that train-draft measured with the runtime. ``eagle3 make-tiny
--only kimi-k2.5-trained-eagle3`` (or ``kimi-k2.5-trained-eagle3.1-mla``) then writes them.

The drafts run one after the other by default; ``--parallel`` runs both at once (one thread
each), which is what fits a 2-core machine. The shipped drafts were trained in two stages: first on
0-shot train problems (short contexts, many steps), then, continuing from that draft
(``--continue-shipped``), on 5-shot train prompts, the context lengths ``serve --validate gsm8k``
measures at (one command each, run side by side on the 2-core CPU, one thread each)::

    python scripts/train_tiny_drafts.py --only kimi-k2.5-trained-eagle3 --parallel \
        --num-train 400 --steps 400 --lr 2e-3 --regen-tokens 96
    python scripts/train_tiny_drafts.py --only kimi-k2.5-trained-eagle3.1-mla --parallel \
        --num-train 1200 --steps 1200 --lr 1e-3 --regen-tokens 96
    python scripts/train_tiny_drafts.py --continue-shipped --fewshot 5 --max-len 1800 --parallel \
        --num-train 150 --steps 150 --lr 1e-3 --regen-tokens 96

Each stage's ``train_meta.json`` keeps the one before it under ``"continued_from"``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagle3.testing import tiny, trained  # noqa: E402

# The recipe of each shipped draft is in its train_meta.json ("command", and the earlier stage under
# "continued_from"): all on the target's own greedy continuations (--regenerate --regen-tokens 96).
COMMON = ["--data", "gsm8k", "--aux-layer-ids", ",".join(map(str, trained.AUX_LAYER_IDS)),
          "--quiet", "--json"]
ARCH = {
    "kimi-k2.5-trained-eagle3": ["--arch", "llama"],
    "kimi-k2.5-trained-eagle3.1-mla": ["--arch", "mla", "--eagle31"],
}


def command(target: Path, out: Path, name: str, args: argparse.Namespace, init: Path | None) -> list[str]:
    # --init-from carries the architecture (train-draft refuses an --arch that contradicts it)
    arch = ["--init-from", str(init)] if init is not None else ARCH[name]
    return [sys.executable, "-m", "eagle3.cli", "train-draft", str(target), str(out), *arch, *COMMON,
            "--dataset", str(args.dataset), "--num-train", str(args.num_train), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--lr", str(args.lr), "--max-len", str(args.max_len), "--eval-prompts", str(args.eval_prompts),
            "--eval-tokens", str(args.eval_tokens), "--seed", str(args.seed), "--fewshot", str(args.fewshot),
            *(["--regenerate", "--regen-tokens", str(args.regen_tokens)] if args.regenerate else [])]


def _public(cmd: list[str], name: str, init: Path | None) -> list[str]:
    """The command as run, with the scratch paths replaced by the names make-tiny writes."""
    pub = ["eagle3", cmd[3], trained.NAME, name, *cmd[6:]]
    return [name if init is not None and a == str(init) else a for a in pub]


def ship(name: str, out: Path, cmd: list[str], seconds: float, init: Path | None,
         previous: dict | None) -> dict:
    report = json.loads((out / "train_report.json").read_text(encoding="utf-8"))
    dst = trained.data_path(trained.DRAFTS[name])
    dst.mkdir(parents=True, exist_ok=True)
    for f in trained.DRAFT_FILES:
        shutil.copyfile(out / f, dst / f)
        if (dst / f).stat().st_size > trained.MAX_FILE_BYTES:
            raise SystemExit(f"{dst / f} is over {trained.MAX_FILE_BYTES} bytes")
    training = report.get("training", {})
    meta = {
        "model": name,
        "target": trained.NAME,
        "script": "scripts/train_tiny_drafts.py",
        "command": _public(cmd, name, init),
        "train_seconds": round(seconds, 1),
        "loss": {k: training.get(k) for k in ("initial_loss", "final_loss") if k in training},
        "heldout": report.get("heldout"),
        "draft": report.get("draft"),
        "data": report.get("data"),
        "continued_from": previous,  # the stage this one started from (--continue-shipped), or None
    }
    (dst / trained.META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", type=Path, default=os.environ.get("GSM8K_DIR"),
                    required=os.environ.get("GSM8K_DIR") is None,
                    help="GSM8K directory with train.jsonl + test.jsonl (default: $GSM8K_DIR)")
    ap.add_argument("--only", choices=sorted(trained.DRAFTS), action="append")
    ap.add_argument("--num-train", type=int, default=600)
    ap.add_argument("--regenerate", action=argparse.BooleanOptionalAction, default=True,
                    help="train on the target's own greedy continuations (default) or teacher-forced on GSM8K")
    ap.add_argument("--regen-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--fewshot", type=int, default=0, help="solved train problems before each training problem")
    ap.add_argument("--continue-shipped", action="store_true",
                    help="start from the drafts now shipped (--init-from) instead of random weights")
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--eval-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parallel", action="store_true", help="train the drafts at once, one thread each")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = ap.parse_args()

    names = args.only or list(trained.DRAFTS)
    work = args.work or Path(tempfile.mkdtemp(prefix="eagle3-drafts-"))
    target = work / "tiny" / trained.NAME
    if not target.is_dir():
        tiny.make_tiny(work / "tiny", only=[trained.NAME])
    inits: dict[str, Path | None] = {n: None for n in names}
    previous: dict[str, dict | None] = {n: None for n in names}
    if args.continue_shipped:
        shutil.rmtree(work / "shipped", ignore_errors=True)
        tiny.make_tiny(work / "shipped", only=names)
        for name in names:
            inits[name], previous[name] = work / "shipped" / name, trained.draft_meta(name)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1" if args.parallel else
               os.environ.get("OMP_NUM_THREADS", "2"))
    runs: dict[str, tuple[list[str], subprocess.Popen, float]] = {}
    for name in names:
        out = work / name
        shutil.rmtree(out, ignore_errors=True)
        cmd = command(target, out, name, args, inits[name])
        print("$", " ".join(cmd), flush=True)
        log = open(work / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        runs[name] = (cmd, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), time.time())
        if not args.parallel:
            runs[name][1].wait()
    for name, (cmd, proc, t0) in runs.items():
        if proc.wait() != 0:
            raise SystemExit(f"{name}: train-draft failed, see {work / (name + '.log')}")
        meta = ship(name, work / name, cmd, time.time() - t0, inits[name], previous[name])
        h = meta.get("heldout") or {}
        print(f"{name}: acceptance {h.get('acceptance_rate')}, mean accept length "
              f"{h.get('mean_acceptance_length')}, lossless {h.get('lossless')}", flush=True)


if __name__ == "__main__":
    main()
