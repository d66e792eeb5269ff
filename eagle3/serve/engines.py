"""Launch commands for serving a target + EAGLE-3 draft with vLLM, SGLang or ATOM.

The flags are the ones each engine documents for EAGLE-3:

- vLLM: ``vllm serve TARGET --speculative-config '{"method": "eagle3", "model": DRAFT,
  "num_speculative_tokens": K}' --tensor-parallel-size N [--kv-cache-dtype fp8] [--quantization Q]``
  (docs.vllm.ai, "EAGLE Draft Models").
- SGLang: ``python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3
  --speculative-draft-model-path DRAFT --speculative-num-steps K --speculative-eagle-topk 1
  --speculative-num-draft-tokens K+1 --tp N [--kv-cache-dtype fp8_e4m3] [--quantization Q]``
  (a chain draft: top-k 1, K steps, K + 1 tokens verified per step).
- ATOM: ``python -m atom.entrypoints.openai_server --model TARGET -tp N --kv_cache_dtype fp8
  --method eagle3 --num-speculative-tokens K --draft-model DRAFT`` (ROCm/ATOM
  docs/eagle3_speculative_decoding.md); ATOM's HTTP port flag is ``--server-port`` (``--port`` is
  its internal engine port) and it has no ``--quantization`` flag (it reads config.json).

Across nodes (:func:`node_commands`, ``serve --engine X --nnodes N``): SGLang runs the same launch on
every node with ``--nnodes N --node-rank R --dist-init-addr HOST:PORT`` (node 0 serves HTTP); vLLM
joins the nodes into a Ray cluster first (``ray start --head`` on node 0, ``ray start --address`` on
the others) and then runs ``vllm serve ... --distributed-executor-backend ray`` on node 0 alone.

Draft trees (``--speculative-eagle-topk K > 1``, docs/trees.md "Engines") over an MLA target such as
Kimi-K2.5: only SGLang takes them, with its FA3 or Triton attention backend at page size 1 (its
docs/advanced_features/attention_backend.md, MLA table, "Spec topk>1"; FlashInfer MLA, FlashMLA,
Cutlass MLA and TRTLLM MLA refuse topk > 1, and neither FA3 nor Triton MLA has an FP8 KV cache).
vLLM's tree drafting needs its TREE_ATTN backend (vllm/v1/attention/backends/tree_attn.py, a K/V
paged cache: multi-head attention only) and takes a static ``speculative_token_tree``, so trees are
refused there; ATOM documents EAGLE-3 as a chain only (``--num-speculative-tokens``), refused too.

``--quantization`` is passed to vLLM / SGLang when the target's config names a method they know
(compressed-tensors, quark, fp8), which makes a mismatch an error at load instead of a silent
fallback. Remote code is only allowed with ``trust_remote_code=True``.

Every engine setting comes from the one :class:`~eagle3.runtime.engine.config.EngineConfig` that
``serve`` builds from its flags (no defaults here): k, the tree, tensor parallelism, the KV cache
dtype, the context length and remote code always map; the scheduling and sampling fields map where
the engine has the flag (:data:`_MAPPED`) when they differ from EngineConfig's defaults (else the
engine's own default applies); a non-default field the engine has no flag for, or one that is the
bundled runtime's alone (``--device``, ``--kernel-backend``, ``--kv-cache-memory``,
``--max-seq-len-to-capture``: vLLM's V0 name, removed in vLLM 0.11), is a printed
note, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.errors import UsageError
from eagle3.runtime.engine.config import DTYPE_NAMES, EngineConfig, flag_name

ENGINES = ("vllm", "sglang", "atom")
_MODULES = {"vllm": "vllm", "sglang": "sglang", "atom": "atom"}
# --kv-cache-dtype spelled per engine; None: leave the engine's default.
_KV_DTYPES = {
    "auto": {"vllm": None, "sglang": None, "atom": None},
    "bf16": {"vllm": "auto", "sglang": "bf16", "atom": "bf16"},
    "fp8": {"vllm": "fp8", "sglang": "fp8_e4m3", "atom": "fp8"},
    "fp8_e4m3": {"vllm": "fp8_e4m3", "sglang": "fp8_e4m3", "atom": "fp8"},
    "fp8_e5m2": {"vllm": "fp8_e5m2", "sglang": "fp8_e5m2", "atom": None},
}
_KNOWN_QUANT = ("compressed-tensors", "quark", "fp8")
# SGLang MLA attention backends that verify trees (topk > 1), at page size 1 only; the others refuse it.
SGLANG_TREE_MLA_BACKENDS = ("triton", "fa3")
_SGLANG_CHAIN_ONLY_MLA = ("flashinfer", "flashmla", "cutlass_mla", "trtllm_mla")
# EngineConfig fields passed when they differ from EngineConfig's defaults: field -> {engine: its flag}
# (vLLM's EngineArgs and SGLang's ServerArgs names; a bool is a bare flag). ATOM's documented flags
# cover the fields that always map only.
_MAPPED: dict[str, dict[str, str]] = {
    "dtype": {"vllm": "--dtype", "sglang": "--dtype"},
    "max_num_seqs": {"vllm": "--max-num-seqs", "sglang": "--max-running-requests"},
    "seed": {"vllm": "--seed", "sglang": "--random-seed"},
    "max_logprobs": {"vllm": "--max-logprobs"},
    "enforce_eager": {"vllm": "--enforce-eager", "sglang": "--disable-cuda-graph"},
}
# The bundled runtime's own settings: no engine takes them (their notes say so when they are set).
_RUNTIME_ONLY = ("device", "backend", "kv_cache_memory", "max_seq_len_to_capture")


@dataclass
class LaunchCommand:
    engine: str
    argv: list[str]
    notes: list[str] = field(default_factory=list)

    def shell(self) -> str:
        return shlex.join(self.argv)


def installed(engine: str) -> bool:
    return importlib.util.find_spec(_MODULES[engine]) is not None


def _quant_method(target: Path) -> str | None:
    from eagle3.formats.detect import load_config, quantization_config

    try:
        qc, _ = quantization_config(load_config(target))
    except Exception:  # no/odd config: the engine will say; the command is still printable
        return None
    method = (qc or {}).get("quant_method")
    return str(method) if method else None


def _is_mla(target: str) -> bool:
    """Whether the target uses MLA (``kv_lora_rank`` or a DeepSeek architecture in its config). An
    unreadable config counts as MLA: this project's targets are Kimi-K2.5 (MLA), and refusing a tree
    the engine might take is safer than printing one it will reject after a long load."""
    from eagle3.formats.detect import load_config, text_config

    try:
        cfg = load_config(Path(target))
        tc = text_config(cfg)
    except Exception:
        return True
    archs = [str(a) for a in (cfg.get("architectures") or []) + (tc.get("architectures") or [])]
    return tc.get("kv_lora_rank") is not None or any("Deepseek" in a for a in archs)


@dataclass(frozen=True)
class TreeShape:
    """An EAGLE-2 draft tree in SGLang's knobs: ``topk`` children per expanded node, ``steps`` deep,
    ``draft_tokens`` nodes verified per step (the root included)."""

    topk: int
    steps: int
    draft_tokens: int


def tree_shape(config: EngineConfig) -> TreeShape | None:
    """The tree ``config`` asks for (its own check and default size, the bundled runtime's), within
    what SGLang verifies (at most every drafted node plus the root); None for the chain (topk 1)."""
    tree = config.tree
    if tree is None:
        return None
    topk, n = tree
    steps = int(config.num_speculative_tokens)
    most = topk * steps + 1  # every drafted node plus the root
    if not 2 <= n <= most:
        raise UsageError(f"--speculative-num-draft-tokens must be in 2..{most} (topk * steps + 1) for "
                         f"--speculative-eagle-topk {topk} and {steps} steps, got {n}")
    return TreeShape(topk, steps, n)


def _refuse_tree(engine: str, target: str, tree: TreeShape, kv_cache_dtype: str,
                 attention_backend: str | None) -> None:
    """Raise (one line) when ``engine`` cannot verify ``tree`` over this target."""
    mla = _is_mla(target)
    what = f"--engine {engine}: draft trees (--speculative-eagle-topk {tree.topk})"
    if engine == "vllm":
        if mla:
            raise UsageError(f"{what} need vLLM's tree attention backend (TREE_ATTN, multi-head attention only); "
                             "it has no MLA tree backend and the target is MLA: use --engine sglang or the "
                             "bundled runtime")
        raise UsageError(f"{what}: vLLM takes only a static speculative_token_tree, not a dynamic topk tree; "
                         "use --engine sglang or the bundled runtime")
    if engine == "atom":
        raise UsageError(f"{what} are not supported by ATOM as far as documented (its EAGLE-3 takes "
                         "--num-speculative-tokens, a chain): use --engine sglang or the bundled runtime")
    if not mla:
        return
    if attention_backend is not None and attention_backend not in SGLANG_TREE_MLA_BACKENDS:
        why = "refuses topk > 1" if attention_backend in _SGLANG_CHAIN_ONLY_MLA else "is not one that takes topk > 1"
        raise UsageError(f"{what} over an MLA target: SGLang's {attention_backend} attention backend {why}; "
                         f"use --attention-backend {' or '.join(SGLANG_TREE_MLA_BACKENDS)}")
    if kv_cache_dtype not in ("auto", "bf16"):
        raise UsageError(f"{what} over an MLA target: SGLang's tree-capable MLA backends "
                         f"({', '.join(SGLANG_TREE_MLA_BACKENDS)}) have no FP8 KV cache; drop --kv-cache-dtype "
                         f"{kv_cache_dtype}")


def build_command(engine: str, target: str | Path, draft: str | Path | None, config: EngineConfig, *,
                  host: str = "127.0.0.1", port: int = 8000, quantization: str | None = None,
                  served_model_name: str | None = None, attention_backend: str | None = None) -> LaunchCommand:
    """The engine's launch command for ``target`` (+ ``draft``) with ``config``'s settings; nothing
    is run. A draft tree (``speculative_eagle_topk > 1``) the engine cannot verify over this target
    is refused (UsageError), and so are ``num_speculative_tokens="auto"`` and ``activation_quant="none"``
    (the bundled runtime's)."""
    if engine not in ENGINES:
        raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if config.adaptive:
        raise UsageError("--num-speculative-tokens auto is the bundled runtime's; --engine takes an integer k")
    if config.activation_quant != "auto":
        # a measurement mode of the bundled runtime: an engine quantizes activations as the checkpoint says,
        # and a note would let a weight-only number be read off a full W4A8 / MXFP4 run
        raise UsageError(f"--activation-quant {config.activation_quant} (weight-only emulation) is the bundled "
                         f"runtime's; --engine quantizes activations as the checkpoint's config says")
    if attention_backend is not None and engine != "sglang":
        raise UsageError("--attention-backend goes with --engine sglang")
    target, draft = str(target), (None if draft is None else str(draft))
    tree = tree_shape(config)
    if tree is not None and draft is None:
        raise UsageError("--speculative-eagle-topk > 1 needs --draft")
    kv_cache_dtype, max_model_len = config.kv_cache_dtype, config.max_model_len
    if tree is not None:
        _refuse_tree(engine, target, tree, kv_cache_dtype, attention_backend)
    tensor_parallel_size = config.tensor_parallel_size
    notes: list[str] = []
    quant = quantization
    if quant is None and Path(target).is_dir():
        found = _quant_method(Path(target))
        if found in _KNOWN_QUANT:
            quant = found
        elif found:
            notes.append(f"target quantization {found!r}: left to the engine's auto-detection")
    kv = _KV_DTYPES[kv_cache_dtype][engine]
    if kv_cache_dtype not in ("auto",) and kv is None:
        notes.append(f"{engine} has no KV cache dtype {kv_cache_dtype!r}; using its default")
    k = int(config.num_speculative_tokens)
    if engine == "vllm":
        argv = ["vllm", "serve", target, "--host", host, "--port", str(port),
                "--tensor-parallel-size", str(tensor_parallel_size)]
        if served_model_name:
            argv += ["--served-model-name", served_model_name]
        if draft is not None:
            spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": k}
            argv += ["--speculative-config", json.dumps(spec)]
        if kv:
            argv += ["--kv-cache-dtype", kv]
        if quant:
            argv += ["--quantization", quant]
        if max_model_len:
            argv += ["--max-model-len", str(max_model_len)]
    elif engine == "sglang":
        argv = ["python3", "-m", "sglang.launch_server", "--model-path", target, "--host", host,
                "--port", str(port), "--tp", str(tensor_parallel_size)]
        if served_model_name:
            argv += ["--served-model-name", served_model_name]
        if draft is not None:
            topk, n = (1, k + 1) if tree is None else (tree.topk, tree.draft_tokens)
            argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft,
                     "--speculative-num-steps", str(k), "--speculative-eagle-topk", str(topk),
                     "--speculative-num-draft-tokens", str(n)]
        argv += _sglang_attention(tree, attention_backend, _is_mla(target) if tree is not None else False)
        if kv:
            argv += ["--kv-cache-dtype", kv]
        if quant:
            argv += ["--quantization", quant]
        if max_model_len:
            argv += ["--context-length", str(max_model_len)]
    else:  # atom
        argv = ["python3", "-m", "atom.entrypoints.openai_server", "--model", target, "--host", host,
                "--server-port", str(port), "-tp", str(tensor_parallel_size)]
        if kv:
            argv += ["--kv_cache_dtype", kv]
        if draft is not None:
            argv += ["--method", "eagle3", "--num-speculative-tokens", str(k), "--draft-model", draft]
        if max_model_len:
            argv += ["--max-model-len", str(max_model_len)]
        if served_model_name:
            notes.append("ATOM serves the model under its --model path (no --served-model-name)")
        if quantization:
            notes.append("ATOM reads the quantization from config.json (no --quantization flag)")
    extra, more_notes = _mapped_flags(engine, config)
    argv += extra
    notes += more_notes
    if config.trust_remote_code:
        argv.append("--trust-remote-code")
    elif Path(target).is_dir() and any(Path(target).glob("*.py")):
        notes.append("the target ships Python code; engines that need it require --trust-remote-code")
    return LaunchCommand(engine, argv, notes)


def node_commands(engine: str, target: str | Path, draft: str | Path | None, config: EngineConfig,
                  **kwargs: object) -> list[tuple[int, LaunchCommand]]:
    """The engine's multi-node launch for ``config.nnodes`` machines: (node rank, command) in the order
    they are run (nothing is run). ``config.dist_init_addr``: node 0's ``HOST:PORT`` (SGLang's
    ``--dist-init-addr``; for vLLM the Ray head's address)."""
    nnodes, dist_init_addr = config.nnodes, config.dist_init_addr
    if engine not in ("vllm", "sglang"):
        raise UsageError(f"--engine {engine} --nnodes {nnodes}: multi-node launch commands are known for sglang and "
                         "vllm only")
    if not dist_init_addr:
        raise UsageError(f"--nnodes {nnodes} needs --dist-init-addr HOST:PORT (node 0's address)")
    host, sep, port = dist_init_addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"--dist-init-addr must be HOST:PORT, got {dist_init_addr!r}")
    base = build_command(engine, target, draft, config, **kwargs)  # type: ignore[arg-type]
    if engine == "sglang":
        return [(r, LaunchCommand(engine, [*base.argv, "--nnodes", str(nnodes), "--node-rank", str(r),
                                           "--dist-init-addr", dist_init_addr], list(base.notes) if r == 0 else []))
                for r in range(nnodes)]
    head = [(0, LaunchCommand("ray", ["ray", "start", "--head", "--port", port]))]
    workers = [(r, LaunchCommand("ray", ["ray", "start", "--address", dist_init_addr, "--block"]))
               for r in range(1, nnodes)]
    serve = LaunchCommand(engine, [*base.argv, "--distributed-executor-backend", "ray"],
                          [*base.notes, "vllm serve runs on node 0 once every node has joined the Ray cluster"])
    return [*head, *workers, (0, serve)]


def _mapped_flags(engine: str, config: EngineConfig) -> tuple[list[str], list[str]]:
    """The engine's flags for ``config``'s scheduling / sampling fields that differ from EngineConfig's
    defaults (:data:`_MAPPED`), and a note for each set field it has no flag for."""
    argv: list[str] = []
    notes: list[str] = []
    defaults = EngineConfig()
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for name in (*_MAPPED, *_RUNTIME_ONLY):
        value = getattr(config, name)
        if value == getattr(defaults, name):
            continue
        flag = _MAPPED.get(name, {}).get(engine)
        if flag is None:
            why = "the bundled runtime's setting" if name in _RUNTIME_ONLY else f"{engine} has no flag for it"
            notes.append(f"{flag_name(fields[name])} {value}: {why}, not passed (the engine's own default applies)")
        elif isinstance(value, bool):
            argv.append(flag)
        else:
            argv += [flag, DTYPE_NAMES.get(value, str(value)) if name == "dtype" else str(value)]
    return argv, notes


def _sglang_attention(tree: TreeShape | None, backend: str | None, mla: bool) -> list[str]:
    """SGLang's attention flags: a tree over MLA needs a tree-capable backend at page size 1 (Triton
    by default: it runs on NVIDIA and AMD GPUs; fa3 is Hopper only); otherwise only what was asked."""
    if tree is not None and mla:
        return ["--attention-backend", backend or "triton", "--page-size", "1"]
    return [] if backend is None else ["--attention-backend", backend]


def executable_argv(cmd: LaunchCommand) -> list[str]:
    """The argv to execute, in this Python (where the engine was found installed): ``vllm`` from
    PATH or the module form of the same CLI; ``python3 -m ...`` with this interpreter."""
    if not installed(cmd.engine):
        raise UsageError(f"--engine {cmd.engine}: {cmd.engine} is not installed in this Python "
                         f"({sys.executable}); install it, or use --dry-run to print the command")
    if cmd.engine == "vllm":
        if shutil.which("vllm") is None:
            return [sys.executable, "-m", "vllm.entrypoints.cli.main", *cmd.argv[1:]]
        return list(cmd.argv)
    return [sys.executable, *cmd.argv[1:]]


def run(cmd: LaunchCommand) -> int:
    """Run the engine in the foreground; its exit status."""
    argv = executable_argv(cmd)
    try:
        return subprocess.call(argv)
    except KeyboardInterrupt:
        return 130
