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

``--quantization`` is passed to vLLM / SGLang when the target's config names a method they know
(compressed-tensors, quark, fp8), which makes a mismatch an error at load instead of a silent
fallback. Remote code is only allowed with ``trust_remote_code=True``.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.errors import UsageError

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


def build_command(engine: str, target: str | Path, draft: str | Path | None = None, *,
                  num_speculative_tokens: int = 3, host: str = "127.0.0.1", port: int = 8000,
                  tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto", quantization: str | None = None,
                  trust_remote_code: bool = False, served_model_name: str | None = None,
                  max_model_len: int | None = None) -> LaunchCommand:
    """The engine's launch command for ``target`` (+ ``draft``); nothing is run."""
    if engine not in ENGINES:
        raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if kv_cache_dtype not in _KV_DTYPES:
        raise UsageError(f"--kv-cache-dtype must be one of {', '.join(_KV_DTYPES)}, got {kv_cache_dtype!r}")
    if num_speculative_tokens < 1:
        raise UsageError(f"--num-speculative-tokens must be >= 1, got {num_speculative_tokens}")
    if tensor_parallel_size < 1:
        raise UsageError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    target, draft = str(target), (None if draft is None else str(draft))
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
    k = num_speculative_tokens
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
            argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft,
                     "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                     "--speculative-num-draft-tokens", str(k + 1)]
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
    if trust_remote_code:
        argv.append("--trust-remote-code")
    elif Path(target).is_dir() and any(Path(target).glob("*.py")):
        notes.append("the target ships Python code; engines that need it require --trust-remote-code")
    return LaunchCommand(engine, argv, notes)


def node_commands(engine: str, target: str | Path, draft: str | Path | None = None, *, nnodes: int,
                  dist_init_addr: str, **kwargs: object) -> list[tuple[int, LaunchCommand]]:
    """The engine's multi-node launch for ``nnodes`` machines: (node rank, command) in the order they
    are run (nothing is run). ``dist_init_addr``: node 0's ``HOST:PORT`` (SGLang's
    ``--dist-init-addr``; for vLLM the Ray head's address)."""
    if engine not in ("vllm", "sglang"):
        raise UsageError(f"--engine {engine} --nnodes {nnodes}: multi-node launch commands are known for sglang and "
                         "vllm only")
    host, sep, port = dist_init_addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"--dist-init-addr must be HOST:PORT, got {dist_init_addr!r}")
    base = build_command(engine, target, draft, **kwargs)  # type: ignore[arg-type]
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
