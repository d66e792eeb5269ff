"""Engine options: one dataclass holding every option the engine is built with, validated once, and
the one declaration of the engine's command-line flags.

``LLM(target, draft, **options)`` builds it from its keyword arguments; ``eagle3 serve`` (``--validate``
and the ``--engine`` hand-off included) and ``eagle3 bench TARGET`` from their flags, which are
generated from these fields (:mod:`eagle3.cli.engine_flags`, the way vLLM's ``EngineArgs`` feeds its
CLI): a field that a user sets carries its flag in ``metadata["flag"]`` (:class:`Flag`: the option
name, its help, the type the command line parses and how a value becomes the field's). Nothing else
declares an engine default: ``LLM`` hands this object whole to the scheduler, the model runner and
the proposer, and ``serve --engine`` maps it onto vLLM / SGLang / ATOM flags (``serve/engines.py``).
Importing this module does not import torch or typer (the CLI builds a config before it loads anything).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eagle3.errors import UsageError
from eagle3.runtime.kv_cache import KV_CACHE_DTYPES
from eagle3.runtime.kv_cache import canonical as canonical_kv_dtype

MAX_SPECULATIVE_TOKENS = 8
MAX_TREE_NODES = 64  # the Triton tree mask's limit (kernels/triton/plan.py)
AUTO = "auto"  # num_speculative_tokens="auto": k chosen per step in 0..max_speculative_tokens
DEFAULT_MAX_SPECULATIVE_TOKENS = 5  # auto's ceiling when max_speculative_tokens is not given
# dtype names the engine (and train-draft) accept -> the torch dtype attribute (torch imported lazily).
DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
               "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}
DTYPES = tuple(DTYPE_NAMES)
BACKENDS = ("auto", "torch", "triton", "aiter")
# What runs in front of a quantized Linear: "auto" = the activation quantization its checkpoint's
# quantization_config names; "none" = activations in the compute dtype (weight-only emulation).
ACTIVATION_QUANTS = ("auto", "none")


@dataclass(frozen=True)
class Flag:
    """An :class:`EngineConfig` field as a command-line option.

    ``type``: what the command line parses (``int``, ``str``, ``bool``, ``int | None``, ...);
    ``parse``: the parsed value -> the field's value (a bad one: one-line UsageError naming the
    flag); ``cli_default``: the default the command line shows when the field's is not of ``type``
    (``"3"`` for the int-or-``auto`` k). ``name``: the option (``--`` + the field's name in dashes
    unless given)."""

    help: str
    type: Any
    name: str = ""
    parse: Callable[[Any], Any] | None = None
    cli_default: Any = None  # None: the field's default


def _flag(default: Any, help: str, type: Any, **kw: Any) -> Any:
    return field(default=default, metadata={"flag": Flag(help, type, **kw)})


def _parse_k(text: str) -> int | str:
    """``--num-speculative-tokens``: an integer or ``auto`` (its range is the config's check)."""
    t = str(text).strip().lower()
    if t != AUTO and not re.fullmatch(r"[0-9]+", t):
        raise UsageError(f"--num-speculative-tokens {text!r}: expected an integer in 1..{MAX_SPECULATIVE_TOKENS} or auto")
    return t if t == AUTO else int(t)


def _parse_backend(name: str) -> str:
    if name not in BACKENDS:
        raise UsageError(f"--kernel-backend {name!r}: expected one of {', '.join(BACKENDS)}")
    return name


def _parse_activation_quant(name: str) -> str:
    if name not in ACTIVATION_QUANTS:
        raise UsageError(f"--activation-quant {name!r}: expected one of {', '.join(ACTIVATION_QUANTS)}")
    return name


def _parse_kv_memory(text: str) -> int:
    from eagle3.units import parse_size

    return parse_size(text, "--kv-cache-memory")


@dataclass
class EngineConfig:
    # -- speculation
    # k draft tokens per target step (ignored without a draft), or "auto": per step the engine picks
    # k in 0..max_speculative_tokens from its measured costs and observed acceptance (spec/adaptive.py)
    num_speculative_tokens: int | str = _flag(
        3, "Draft tokens per step (k), or auto: each step picks k in 0..--max-speculative-tokens from the engine's "
        "measured step times and the observed acceptance.", str, parse=_parse_k, cli_default="3")
    max_speculative_tokens: int | None = _flag(  # auto only: the largest k (default 5)
        None, f"With --num-speculative-tokens auto: the largest k (default {DEFAULT_MAX_SPECULATIVE_TOKENS}).",
        int | None)
    # Draft trees (docs/trees.md; SGLang's names): > 1 drafts an EAGLE-2 tree of depth
    # num_speculative_tokens expanding the best topk nodes by their topk tokens per step, and
    # verifies speculative_num_draft_tokens nodes (root included) per step. 1: the chain.
    speculative_eagle_topk: int = _flag(
        1, "Draft trees (EAGLE-2, docs/trees.md): expand the best K nodes by their top-K draft tokens per step, "
        "--num-speculative-tokens steps deep (1: the chain).", int)
    speculative_num_draft_tokens: int | None = _flag(  # trees only; default min(topk * steps, 63) + 1
        None, "With --speculative-eagle-topk > 1: tree tokens verified per step, the root included "
        f"(default min(K * steps, {MAX_TREE_NODES - 1}) + 1, at most {MAX_TREE_NODES}).", int | None)
    # -- models and devices
    dtype: Any = _flag(  # compute dtype: a name in DTYPES or a torch.dtype
        "bfloat16", "Activation / dense weight dtype: bfloat16|float16|float32.", str)
    device: Any = _flag(  # str or torch.device; rank r of a tensor-parallel group uses index + r
        "cpu", "cpu, cuda, cuda:1, ...", str)
    backend: str = _flag(  # kernel backend (kernels.resolve_backend_name)
        "auto", "Kernel backend of the bundled runtime: auto (triton on a GPU where triton imports, aiter on ROCm "
        "where aiter imports, torch otherwise), torch, triton, aiter.", str, name="--kernel-backend",
        parse=_parse_backend)
    tensor_parallel_size: int = _flag(  # ranks running the target (this process + N-1 workers, engine/worker.py)
        1, "Tensor-parallel ranks: worker processes of the bundled runtime (gloo on CPU, nccl on GPUs), or "
        "passed to --engine.", int)
    # Across nodes: tensor_parallel_size ranks over nnodes machines (tensor_parallel_size / nnodes each);
    # this process is node node_rank's; every rank meets at dist_init_addr "HOST:PORT" (node 0's
    # address: rank 0 hosts the rendezvous store there). One node: a free loopback port by default.
    nnodes: int = _flag(
        1, "Nodes the tensor-parallel ranks span (--tensor-parallel-size / --nnodes on each); node 0 serves, the "
        "others run their ranks headless and exit when node 0 ends.", int)
    node_rank: int = _flag(0, "This node's index in 0..--nnodes - 1.", int)
    dist_init_addr: str | None = _flag(
        None, "HOST:PORT of node 0 where every rank meets (rank 0 hosts the rendezvous store); needed with "
        "--nnodes > 1.", str | None)
    enforce_eager: bool = _flag(  # no CUDA graphs for the uniform steps
        False, "No CUDA/HIP graphs: run every decode / verify / draft step eagerly (graphs are GPU only).", bool)
    # Longest context (cache positions, the step's query tokens included) a graph step covers: a
    # graph's static block tables, MLA split grid and split workspace are sized from it; a step with
    # a longer sequence runs eagerly, with the same tokens (vLLM's V0 max_seq_len_to_capture, removed
    # in vLLM 0.11, so not passed to --engine). None: per graph, the longest whose MLA split workspace
    # at the graph's query tokens fits split_kv.GRAPH_WORKSPACE_BUDGET (graphs.context_cap).
    max_seq_len_to_capture: int | None = _flag(
        None, "Longest context (prompt + generated + drafts) a CUDA/HIP graph step covers, for every graph; a "
        "step with a longer sequence runs eagerly, same tokens (default: per graph, the longest whose MLA split "
        "workspace fits 256 MiB; Kimi-K2.5, 64 heads: 1792 for a verify of 64 sequences x k 3, the whole "
        "context for one sequence).", int | None)
    # Python API only: the command line serves the target directory's tokenizer
    tokenizer: Any = "auto"  # "auto" (the target directory's), a path, a tokenizer object, or None
    trust_remote_code: bool = _flag(
        False, "Allow code shipped with the model (e.g. its tokenizer) to run.", bool)
    # Activation quantization in front of the quantized Linears of the target and the draft: "auto"
    # as each checkpoint's quantization_config says (W4A8: FP8 per token; MXFP4: MXFP4 per 32-block);
    # "none": the activations stay in the compute dtype, so a W4A8 / MXFP4 checkpoint is served with
    # its quantized weights alone. That is the weight-only half of the loss decomposition
    # (docs/recipes.md), not what an engine serving the checkpoint computes: bundled runtime only.
    activation_quant: str = _flag(
        "auto", "auto: quantize activations in front of quantized Linears as the checkpoint's quantization_config "
        "says; none: keep them in the compute dtype (weight-only emulation: the share of a W4A8 / MXFP4 "
        "checkpoint's loss that its weights alone cause; bundled runtime only).", str, parse=_parse_activation_quant)
    # -- KV cache
    # Python API only (block_size, num_blocks): the command line sizes the cache by --kv-cache-memory
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks; None: sized from kv_cache_memory
    kv_cache_memory: int | None = _flag(  # bytes for target + draft caches; None: a default
        None, "KV cache size, e.g. 4GiB (default: 256MiB on CPU, 80% of free GPU memory).", str | None,
        parse=_parse_kv_memory)
    # What the target's latent and the draft's cache are stored in (runtime/kv_cache.py): auto (the
    # model dtype) | bf16 | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2; fp8 with per-tensor scales from
    # the checkpoint's kv-cache scheme, else 1.0 (vLLM's rule); one byte per value.
    kv_cache_dtype: str = _flag(
        "auto", f"KV cache: {' | '.join(KV_CACHE_DTYPES)} (auto: the model dtype; fp8 = fp8_e4m3); fp8 stores one "
        "byte per value with the checkpoint's kv scales (1.0 without), in the bundled runtime and in --engine's "
        "command.", str)
    # -- scheduling
    max_num_seqs: int = _flag(64, "Most sequences in one batch.", int)  # running sequences per step
    # Query tokens per target forward (drafts included). 2048 holds a whole 5-shot GSM8K prompt
    # (~1,600 tokens); measured on the tiny target + draft (8 such prompts, CPU): 512 -> 4.3 s,
    # 1024 -> 3.6 s, 2048 -> 3.4 s, 8192 -> 3.3 s, so larger chunks only lengthen the steps that
    # decoding sequences share with a prefill. Python API only.
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = _flag(  # None: the target's max_position_embeddings
        None, "Context length (default: the model's).", int | None)
    # -- sampling
    # "sample": drafts drawn from q; "greedy": argmax drafts. Python API only (an experiment's knob).
    draft_sampling: str = "sample"
    seed: int = _flag(  # engine generator, used by requests without their own seed
        0, "Seed of the engine's sampling for requests without their own seed (bench: also of its random "
        "prompts).", int)
    log_stats: bool = False  # print the acceptance line after generate() (Python API only)
    max_logprobs: int = _flag(  # most logprobs / prompt_logprobs a request may ask for (vLLM's default)
        20, "Most logprobs / top_logprobs / prompt_logprobs a request may ask for (vLLM's default 20).", int)

    def __post_init__(self) -> None:
        self._check_speculative()
        if isinstance(self.dtype, str) and self.dtype not in DTYPES:
            raise UsageError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise UsageError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        self._check_nodes()
        if self.block_size < 1:
            raise UsageError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise UsageError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_num_seqs < 1:
            raise UsageError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        m = self.max_seq_len_to_capture
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise UsageError(f"max_seq_len_to_capture must be an integer >= 1 (unset: each graph's from its split "
                             f"workspace), got {m!r}")
        if self.max_num_batched_tokens < 1:
            raise UsageError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise UsageError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        canonical_kv_dtype(self.kv_cache_dtype)  # one line when unknown
        if self.activation_quant not in ACTIVATION_QUANTS:
            raise UsageError(f"activation_quant must be one of {', '.join(ACTIVATION_QUANTS)}, got "
                             f"{self.activation_quant!r}")
        if self.draft_sampling not in ("sample", "greedy"):
            raise UsageError(f"draft_sampling must be 'sample' or 'greedy', got {self.draft_sampling!r}")

    def _check_nodes(self) -> None:
        """The multi-node fields; each message names the CLI flag too."""
        n, r, tp = self.nnodes, self.node_rank, self.tensor_parallel_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UsageError(f"nnodes (--nnodes) must be an integer >= 1, got {n!r}")
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n:
            raise UsageError(f"node_rank (--node-rank) must be in 0..{n - 1} for nnodes={n}, got {r!r}")
        if tp % n:
            raise UsageError(f"tensor_parallel_size (--tensor-parallel-size) {tp} does not split over nnodes={n} "
                             "(the same number of ranks on every node)")
        if self.dist_init_addr:
            host, sep, port = str(self.dist_init_addr).rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UsageError(f"dist_init_addr (--dist-init-addr) must be HOST:PORT, got {self.dist_init_addr!r}")

    def check_address(self) -> None:
        """Ranks on several nodes need node 0's address to meet at: checked by whatever starts them
        (``LLM``, a headless node, the CLI), not at construction, so that a layout can be described
        (``serve --plan``) before node 0 is known."""
        if self.nnodes > 1 and not self.dist_init_addr:
            raise UsageError(f"nnodes={self.nnodes} needs dist_init_addr (--dist-init-addr): HOST:PORT, node 0's "
                             "address")

    def _check_speculative(self) -> None:
        k, m = self.num_speculative_tokens, self.max_speculative_tokens
        if k == AUTO:
            if m is not None and (isinstance(m, bool) or not isinstance(m, int)
                                  or not 1 <= m <= MAX_SPECULATIVE_TOKENS):
                raise UsageError(f"max_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {m!r}")
            self._check_tree()
            return
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise UsageError(f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS} or 'auto', "
                             f"got {k!r}")
        if m is not None:
            raise UsageError("max_speculative_tokens goes with num_speculative_tokens='auto'")
        self._check_tree()

    def _check_tree(self) -> None:
        t, n = self.speculative_eagle_topk, self.speculative_num_draft_tokens
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise UsageError(f"speculative_eagle_topk must be an integer >= 1, got {t!r}")
        if t == 1:
            if n is not None and (self.adaptive or n != int(self.num_speculative_tokens) + 1):
                raise UsageError("speculative_num_draft_tokens goes with speculative_eagle_topk > 1 (a chain "
                                 "verifies num_speculative_tokens + 1 tokens)")
            return
        if self.adaptive:
            raise UsageError("speculative_eagle_topk > 1 (draft trees) does not combine with num_speculative_tokens='auto'")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= MAX_TREE_NODES):
            raise UsageError(f"speculative_num_draft_tokens must be an integer in 2..{MAX_TREE_NODES}, got {n!r}")

    @property
    def adaptive(self) -> bool:
        """k chosen per step (``num_speculative_tokens="auto"``)."""
        return self.num_speculative_tokens == AUTO

    @property
    def tree(self) -> tuple[int, int] | None:
        """(topk, tree nodes with the root) when drafting trees, else None."""
        t = self.speculative_eagle_topk
        if t == 1:
            return None
        n = self.speculative_num_draft_tokens or min(t * int(self.num_speculative_tokens), MAX_TREE_NODES - 1) + 1
        return t, n

    @property
    def max_k(self) -> int:
        """The most drafts a step may verify: the static k, or auto's ceiling."""
        if self.adaptive:
            return self.max_speculative_tokens or DEFAULT_MAX_SPECULATIVE_TOKENS
        return int(self.num_speculative_tokens)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """The config from ``LLM``'s keyword arguments; an unknown name is a one-line UsageError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise UsageError(f"unknown engine option(s) {', '.join(unknown)}; the options are {', '.join(sorted(names))}")
        return cls(**kwargs)

    @property
    def act_override(self) -> str | None:
        """What the loader takes for :attr:`activation_quant` (``load_target(act_override=...)``)."""
        return "none" if self.activation_quant == "none" else None

    def torch_dtype(self) -> Any:
        """:attr:`dtype` as a ``torch.dtype``."""
        import torch

        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        return dtype_by_name(self.dtype)


def dtype_by_name(name: str) -> Any:
    """A name of :data:`DTYPES` as a ``torch.dtype``."""
    import torch

    return getattr(torch, DTYPE_NAMES[name])


def engine_flags() -> list[tuple[dataclasses.Field[Any], Flag]]:
    """Every field of :class:`EngineConfig` that is a command-line flag, in declaration order."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(EngineConfig) if "flag" in f.metadata]


def flag_name(f: dataclasses.Field[Any]) -> str:
    """The option of a flag field: ``--kernel-backend`` for ``backend``, else ``--`` + the name in dashes."""
    return f.metadata["flag"].name or "--" + f.name.replace("_", "-")


class SpecShape:
    """``k`` and ``tree`` of an object that holds ``config`` and ``draft`` (the LLM, its ModelRunner):
    read from the one config, never stored beside it; 0 / None without a draft."""

    config: EngineConfig
    draft: Any

    @property
    def k(self) -> int:
        """Draft tokens a step may verify: the config's k (auto: its ceiling); 0 without a draft."""
        return self.config.max_k if self.draft is not None else 0

    @property
    def tree(self) -> tuple[int, int] | None:
        """(topk, tree nodes with the root) when drafting trees (the config's), else None."""
        return self.config.tree if self.draft is not None else None
