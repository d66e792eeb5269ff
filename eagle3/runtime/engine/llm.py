"""The Python API of the runtime: ``LLM(target, draft).generate(prompts, params)``, plus the
incremental ``add_request`` / ``step`` / ``abort`` API that the HTTP server drives.

One engine step (``step()``), as in nano-vllm: schedule -> ``runner.step`` -> ``scheduler.postprocess``.

1. ``Scheduler.schedule`` picks the sequences and their tokens (prefill chunks, decode, last
   token + k drafts) within the token budget, allocating KV blocks (preempting when they run out);
2. ``ModelRunner.step`` runs the target once over all of them, verifies (greedy or rejection
   sampling: each sampling sequence gets its accepted drafts plus one recovered / bonus token),
   and runs the proposer over the positions that commits, proposing the next k tokens;
3. ``Scheduler.postprocess`` commits the tokens with stop checks (the committed length excludes
   rejected drafts; their KV slots are simply overwritten later), counts acceptance, adopts the
   proposals, frees finished sequences' blocks and releases the others' blocks past their
   committed length.

Failure isolation: one request must never fail the others. Requests are checked when they are
added (token ids, every sampling field), so most bad input never reaches a step. What still fails
inside a step is attributed to sequences rather than to the step:

- ``runner.step`` (2) does not change any sequence (it writes KV slots that belong to the
  scheduled sequences and draws random numbers), so when it raises, it is simply run again for
  each sequence alone; the sequences that fail alone are failed (``finish_reason == "error"``),
  the others go on with their own result. A failure that is not any one sequence's (a broken
  model) fails each of them, and the engine stays up for new ones; a transient one (out of memory
  in a large batch) often passes in the smaller runs.
- committing (3) and detokenizing the output are guarded per sequence.

Threading: ``add_request`` and ``abort`` only push onto a queue that ``step()`` drains, so a
server may call them from any thread while one background thread loops on ``step()``. A step's
outputs go to whichever thread called ``step()``; ``generate()`` therefore does not rely on its own
``step()`` calls seeing its results: every step, whoever runs it, files the final outputs of
``generate()``'s requests where ``generate()`` finds them (a server's engine thread stepping the
same LLM would otherwise swallow them and leave ``generate()`` looping forever).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import threading
import weakref
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3.errors import UsageError
from eagle3.runtime import kv_cache
from eagle3.runtime.engine import graphs
from eagle3.runtime.engine.block_manager import BlockManager
from eagle3.runtime.engine.config import EngineConfig, SpecShape
from eagle3.runtime.engine.model_runner import ModelRunner, StepOutput, kv_bytes_per_block
from eagle3.runtime.engine.scheduler import Scheduler, fail
from eagle3.runtime.engine.sequence import ScheduledSeq, Sequence
from eagle3.runtime.interfaces import DraftModel, TargetModel, model_device
from eagle3.runtime.logprobs import TokenLogprob, check_counts
from eagle3.runtime.sampling import SamplingParams, make_generator
from eagle3.runtime.spec.adaptive import AdaptivePolicy, MeasuredCostModel
from eagle3.runtime.spec.stats import SpecStats
from eagle3.runtime.spec.tree import tree_kv_slots
from eagle3.runtime.tokenizer import load_tokenizer

logger = logging.getLogger("eagle3.runtime")

PromptType = str | Seq[int]
_CPU_KV_BYTES = 256 << 20  # default KV budget on CPU: plenty for the tiny and small models
_GPU_KV_FRACTION = 0.8  # of the memory left free after loading
_DEFAULT_MAX_MODEL_LEN = 4096  # when the target does not say


@dataclass
class RequestOutput:
    """A request's state after a step (deltas) or at the end (``generate``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far (a stop token included)
    text: str  # decoded output, special tokens skipped ("" without a tokenizer)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    new_token_ids: list[int] = field(default_factory=list)  # since the previous step() output
    new_text: str = ""
    error: str | None = None  # with finish_reason "error": why this request failed in the engine
    spec_stats: SpecStats | None = None  # this request's acceptance counters (None without draft)
    num_preemptions: int = 0
    arrival_time: float = 0.0  # time.monotonic() clock
    first_token_time: float | None = None
    finished_time: float | None = None
    # With SamplingParams.logprobs (else None): one entry per output token so far (like token_ids),
    # and those of new_token_ids; with prompt_logprobs: one per prompt token, position 0's None
    # first (complete from the first output on). runtime/logprobs.py says what they hold.
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM(SpecShape):
    """Target (+ optional EAGLE-3 draft) with a paged KV cache and continuous batching.

    ``target`` / ``draft`` are checkpoint directories (any format the loader reads) or already
    loaded models (:class:`~eagle3.runtime.interfaces.TargetModel` /
    :class:`~eagle3.runtime.interfaces.DraftModel`); a loaded target runs on the device it was
    loaded on (``device`` may be left out; another one is refused). ``draft=None`` runs plain decoding.
    ``tokenizer`` is ``"auto"`` (AutoTokenizer from the target directory when it has one), a path,
    a tokenizer object, or None (token-id prompts only).
    ``backend``: the kernel backend, ``auto`` (triton on a GPU where triton imports, aiter on ROCm
    where ``import aiter`` works, torch otherwise; docs/kernels.md), ``torch``, ``triton`` or ``aiter``.
    On a GPU the uniform decode / verify / draft steps replay CUDA graphs (engine/graphs.py) unless
    ``enforce_eager=True``; on the CPU every step is eager.
    ``tensor_parallel_size=N > 1`` runs the target on N ranks (:mod:`eagle3.runtime.engine.worker`): this
    process is rank 0 and spawns N-1 worker processes; ``close()`` (or exit) stops them. Only one such
    LLM can run in a process at a time (one torch.distributed group).

    Every engine option is a field of :class:`~eagle3.runtime.engine.config.EngineConfig`, passed
    either as keyword arguments (``LLM(t, d, num_speculative_tokens=4)``) or whole (``config=``).
    """

    def __init__(self, target: str | os.PathLike[str] | TargetModel,
                 draft: str | os.PathLike[str] | DraftModel | None = None, *,
                 config: EngineConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise UsageError(f"pass either config= or engine options ({', '.join(sorted(options))}), not both")
        self.config = config if config is not None else EngineConfig.from_kwargs(**options)
        cfg = self.config
        cfg.check_address()  # ranks on several nodes need node 0's address before anything starts
        self.device = torch.device(cfg.device)
        if _is_model(target):  # a loaded target runs where its weights are (KV caches, metadata too)
            explicit = "device" in options or (config is not None and self.device != torch.device("cpu"))
            self.device = _loaded_device(target, self.device, explicit)
        self.target_path = None if _is_model(target) else Path(target)  # type: ignore[arg-type]
        self.tensor_parallel_size = cfg.tensor_parallel_size
        self._workers: Any = None  # engine.worker.TPWorkers at tensor_parallel_size > 1
        from eagle3.runtime.kernels import resolve_backend_name

        backend = resolve_backend_name(cfg.backend, self.device)  # "auto" -> the device's default, checked
        self.target: TargetModel = self._load_target(target, cfg.torch_dtype(), backend)
        self.kernel_backend: str = getattr(getattr(self.target, "backend", None), "name", backend)
        self.enforce_eager = bool(cfg.enforce_eager)
        try:
            self.draft: DraftModel | None = None if draft is None else self._load_draft(draft)
            # auto: k is chosen per step in 0..max_k; everything sized by k is sized for max_k.
            self.policy = AdaptivePolicy(self.k) if self.config.adaptive and self.draft is not None else None
            self.tokenizer = self._load_tokenizer(cfg.tokenizer, cfg.trust_remote_code)
            self.eos_ids = self._eos_ids()
        except BaseException:
            self.close()
            raise
        self._join_workers()
        self.max_model_len = self.config.max_model_len or int(
            getattr(getattr(self.target, "spec", None), "max_position_embeddings", 0) or _DEFAULT_MAX_MODEL_LEN)

        num_blocks = self._num_blocks()
        # One sequence of max_model_len tokens (+ the draft-step slots) must fit the KV cache, or a
        # request running alone could never finish: refuse an explicit limit that does not fit,
        # and shrink the model's default limit to the cache (vLLM refuses both).
        # KV slots a step may write past a sequence's last token when drafting trees (the tree's
        # nodes, then the draft's tree region after the accepted path; scheduler.slots_needed)
        tree_slots = tree_kv_slots(self.tree[0], self.k, self.tree[1]) if self.tree is not None else 0
        room = num_blocks * self.config.block_size - max(self.k, tree_slots)
        if self.config.max_model_len is not None and self.max_model_len > room:
            raise UsageError(f"max_model_len={self.max_model_len} does not fit the KV cache ({num_blocks} blocks "
                             f"of {self.config.block_size} tokens, {self.k} draft slots); raise num_blocks or "
                             f"kv_cache_memory, or lower max_model_len")
        self.max_model_len = min(self.max_model_len, room)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.config.seed)
        if self._workers is not None:
            self.target.allocate_kv(num_blocks, self.config.block_size)  # the workers' latent caches
        self.block_manager = BlockManager(num_blocks, self.config.block_size)
        # The scheduler, the runner and (through it) the proposer get the config whole: k, the tree,
        # the batch limits and draft sampling are read from it where they are used.
        self.scheduler = Scheduler(self.block_manager, cfg, self.max_model_len, self.eos_ids,
                                   speculating=self.draft is not None, policy=self.policy)
        # CUDA / HIP graphs for the uniform steps (engine/graphs.py): GPU only, not with enforce_eager,
        # not at tensor_parallel_size > 1 (the workers would have to capture alongside).
        self.cuda_graphs = (not self.enforce_eager and self.tensor_parallel_size == 1
                            and graphs.available(self.device))
        self.runner = ModelRunner(self.target, self.draft, cfg, num_blocks, device=self.device,
                                  generator=self.generator, graphs=self.cuda_graphs,
                                  max_model_len=self.max_model_len,
                                  capturer=graphs.default_capturer() if self.cuda_graphs else None,
                                  policy=self.policy)
        if self.policy is not None and isinstance(self.policy.cost, MeasuredCostModel):
            self.runner.profile_costs(self.policy.cost)
        self.num_steps = 0
        self.num_preemptions = 0
        self._ids = itertools.count()
        self._inbox: deque[tuple[str, Any]] = deque()
        self._inbox_lock = threading.Lock()  # makes add_request's duplicate-id check atomic
        self._step_lock = threading.Lock()
        self._seqs: dict[str, Sequence] = {}
        # generate()'s requests, and their final outputs filed by whichever thread stepped them
        self._collect: set[str] = set()
        self._results: dict[str, RequestOutput] = {}

    # -- loading ---------------------------------------------------------------------------
    def _load_target(self, target: Any, dtype: torch.dtype, backend: str) -> TargetModel:
        kv, act = self.config.kv_cache_dtype, self.config.act_override
        if _is_model(target):
            if self.tensor_parallel_size > 1:
                raise UsageError("tensor_parallel_size > 1 needs the target as a checkpoint directory (each rank "
                                 "loads its own shard), not a loaded model")
            _refuse_loaded(act, "target")
            return _check_kv_format(target, kv, "target")
        from eagle3.runtime.loader import load_target

        if self.tensor_parallel_size == 1:
            return load_target(Path(target), dtype=dtype, device=self.device, backend=backend, kv_cache_dtype=kv,
                               act_override=act)
        from eagle3.runtime.engine.worker import TPTarget, TPWorkers
        from eagle3.runtime.parallel import TPGroup, parse_addr

        world, cfg = self.tensor_parallel_size, self.config
        if cfg.node_rank != 0:
            raise UsageError(f"node_rank={cfg.node_rank}: only node 0 runs the engine (the others run their ranks "
                             "headless: eagle3 serve --node-rank)")
        local = world // cfg.nnodes
        if self.device.type == "cuda" and torch.cuda.device_count() < (self.device.index or 0) + local:
            raise UsageError(f"tensor_parallel_size={world} over {cfg.nnodes} node(s) needs {local} GPUs from "
                             f"{self.device} on each; {torch.cuda.device_count()} visible")
        addr = parse_addr(cfg.dist_init_addr) if cfg.dist_init_addr else None
        workers = TPWorkers(world, str(target), {"dtype": dtype, "backend": backend, "kv_cache_dtype": kv,
                                                 "act_override": act}, self.device,
                            nnodes=cfg.nnodes, addr=addr)
        # The driver loads its shard while the workers start and join the group; the workers' own
        # loads overlap the driver's draft and tokenizer loads, waited for in __init__ (_join_workers).
        try:
            self.device = workers.start_driver_rank(self.device)
            model = load_target(Path(target), dtype=dtype, device=self.device, backend=backend,
                                tp=TPGroup(0, world), kv_cache_dtype=kv, act_override=act)
            workers.join_driver_rank()
        except BaseException:
            workers.close()
            raise
        self._workers = workers
        self._finalizer = weakref.finalize(self, workers.close)
        return TPTarget(model, workers)  # type: ignore[return-value]

    def _join_workers(self) -> None:
        """Wait until every tensor-parallel worker has loaded its shard (stops them on failure)."""
        if self._workers is None:
            return
        try:
            self._workers.wait_ready()
        except BaseException:
            self.close()
            raise

    def close(self, rejoin: bool = False) -> None:
        """Stop the tensor-parallel workers (a no-op at tensor_parallel_size 1). Also at exit.
        ``rejoin``: another LLM forms a group at the same address next (other nodes' ranks join it;
        this node's wait for it and join it if it loads the same checkpoint with the same settings,
        which spares their processes' start, else they are stopped then)."""
        if self._workers is not None:
            if rejoin and self._finalizer.alive:
                self._finalizer.detach()
                self._workers.close(rejoin=True)
            else:
                self._finalizer()

    @property
    def broken(self) -> str | None:
        """None while the engine can run steps; else why not (a dead tensor-parallel worker)."""
        w = self._workers
        if w is None:
            return None
        if not w.alive:
            try:
                w.check()
            except Exception as err:  # noqa: BLE001 - the reason is the answer
                return str(err)
            return w.dead or "tensor-parallel workers stopped"
        return None

    def _load_draft(self, draft: Any) -> DraftModel:
        if _is_model(draft):
            _refuse_loaded(self.config.act_override, "draft")
            return _check_kv_format(draft, self.config.kv_cache_dtype, "draft")
        from eagle3.runtime.loader import draft_spec, load_draft, load_lm_head

        head = None
        if self._workers is not None and self.target_path is not None and not draft_spec(draft).own_lm_head:
            # The draft (rank 0 only) needs the whole vocabulary projection; the target's is split.
            t = self.target
            head = load_lm_head(self.target_path, t.dtype, t.backend.device, t.backend.name)
        return load_draft(Path(draft), self.target, lm_head=head, kv_cache_dtype=self.config.kv_cache_dtype,
                          act_override=self.config.act_override)

    def _load_tokenizer(self, tokenizer: Any, trust_remote_code: bool) -> Any:
        if tokenizer is None or not isinstance(tokenizer, (str, os.PathLike)):
            return tokenizer
        if tokenizer == "auto":
            return None if self.target_path is None else load_tokenizer(self.target_path, trust_remote_code)
        tok = load_tokenizer(tokenizer, trust_remote_code)
        if tok is None:
            raise UsageError(f"{tokenizer}: no tokenizer there")
        return tok

    def _eos_ids(self) -> frozenset[int]:
        """EOS ids: generation_config.json, the target spec, the tokenizer."""
        ids: set[int] = set()

        def add(v: Any) -> None:
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(int(x) for x in v)

        if self.target_path is not None:
            add(_generation_config(Path(self.target_path)).get("eos_token_id"))
        spec = getattr(self.target, "spec", None)
        add(getattr(spec, "eos_token_ids", None))
        add(getattr(spec, "eos_token_id", None))
        if self.tokenizer is not None:
            add(getattr(self.tokenizer, "eos_token_id", None))
        return frozenset(ids)

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        per_block = kv_bytes_per_block(self.target, cfg.block_size)
        if self.draft is not None:
            per_block += kv_bytes_per_block(self.draft, cfg.block_size)
        budget = cfg.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * _GPU_KV_FRACTION)
            else:
                budget = _CPU_KV_BYTES
        # Never more than every running sequence at full length needs.
        most = -(-cfg.max_num_seqs * (self.max_model_len + 2 * self.k) // cfg.block_size)
        n = min(budget // per_block, most)
        if n < 1:
            raise UsageError(f"kv_cache_memory={budget} bytes holds no KV block of {per_block} bytes")
        return int(n)

    # -- requests --------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise UsageError("text prompts need a tokenizer; pass token ids or LLM(tokenizer=...)")
            return prompt, list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        ids = [int(t) for t in prompt]
        return None, ids

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (thread-safe); returns its id. It joins at the next ``step()``."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise UsageError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()  # fields may have been changed since construction
        check_counts(params, self.config.max_logprobs)
        text, ids = self._tokenize(prompt)
        vocab = self.target.vocab_size
        if not ids:
            raise UsageError("prompt is empty: need at least one token")
        if any(not 0 <= t < vocab for t in ids):
            raise UsageError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise UsageError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(rid, ids, params, make_generator(params.seed, self.device), max(self.k, 1), prompt=text)
        # Check and queue under one lock: two threads adding the same id must not both pass the
        # check, or step() would have to drop one and its caller would wait for it forever.
        with self._inbox_lock:
            if rid in self._seqs or any(op == "add" and arg.request_id == rid for op, arg in list(self._inbox)):
                raise UsageError(f"request id {rid!r} is already in use")
            self._inbox.append(("add", seq))
        return rid

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe); its blocks are freed at the next ``step()``, which
        reports it once with ``finish_reason == "abort"``."""
        self._inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_unfinished()

    def _drain_inbox(self) -> list[Sequence]:
        aborted = []
        while self._inbox:
            with self._inbox_lock:  # the id check in add_request sees either the inbox or _seqs
                op, arg = self._inbox.popleft()
                if op == "add":
                    self._seqs[arg.request_id] = arg
            if op == "add":
                self.scheduler.add(arg)
            else:
                seq = self.scheduler.abort(arg)
                if seq is not None:
                    aborted.append(seq)
        return aborted

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that produced tokens or finished."""
        with self._step_lock:
            outputs = self._step()
            for o in outputs:
                if o.finished and o.request_id in self._collect:
                    self._results[o.request_id] = o
            return outputs

    def _step(self) -> list[RequestOutput]:
        done = self._drain_inbox()
        out = self.scheduler.schedule()
        if not out:
            for s in done:
                self._seqs.pop(s.request_id, None)
            if self.scheduler.running or self.scheduler.waiting:
                raise RuntimeError("scheduler made no progress with unfinished requests")
            return [self._output(s) for s in done]
        self.num_steps += 1
        self.num_preemptions += len(out.preempted)
        result = self._run_isolated(out.scheduled)
        done += self.scheduler.postprocess(out, result)
        progressed = [it.seq for it in out.scheduled if it.seq.num_returned_tokens < it.seq.num_output_tokens
                      or it.seq.is_finished]
        outputs = [self._output_or_error(s) for s in dict.fromkeys(progressed + done)]
        for o in outputs:
            if o.finished:
                self._seqs.pop(o.request_id, None)
        self.scheduler.release(done + progressed)
        return outputs

    # -- failure isolation (see the module docstring) -----------------------------------------
    def _run_isolated(self, scheduled: list[ScheduledSeq]) -> StepOutput:
        """``runner.step`` over the whole batch; when it raises, once per sequence, failing only
        the sequences that fail alone (a step changes no sequence, so running it again is safe).
        The result has the batch's layout either way."""
        try:
            return self.runner.step(scheduled)
        except Exception as err:
            if len(scheduled) == 1:
                fail(scheduled[0].seq, err)
                return StepOutput.join([None], [1])
            logger.warning("a batched step of %d sequences failed (%s: %s); running each alone to find which",
                           len(scheduled), type(err).__name__, err)
        parts: list[StepOutput | None] = []
        for item in scheduled:
            try:
                parts.append(self.runner.step([item]))
            except Exception as err:
                fail(item.seq, err)
                parts.append(None)
        return StepOutput.join(parts, [1] * len(scheduled))

    def _output_or_error(self, seq: Sequence) -> RequestOutput:
        try:
            return self._output(seq)
        except Exception as err:  # e.g. the tokenizer cannot decode this request's tokens
            if not seq.is_finished:
                fail(seq, err)
            seq.num_returned_tokens = seq.num_output_tokens
            return RequestOutput(
                request_id=seq.request_id, prompt=seq.prompt,
                prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens], token_ids=list(seq.output_token_ids),
                text="", finished=True, finish_reason="error", error=seq.error or f"{type(err).__name__}: {err}",
                arrival_time=seq.arrival_time, finished_time=seq.finished_time)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _new_text(self, seq: Sequence) -> str:
        """Text added by the output tokens since the last call, decoding only a short window
        (a whole-output decode per step would cost O(length) per token). The window starts a
        few tokens back so that tokenizers that merge across token boundaries (byte-level BPE
        pieces of one UTF-8 character, SentencePiece spaces) decode the same as in full."""
        ids = seq.output_token_ids
        before = self._decode(ids[seq.prefix_offset: seq.read_offset])
        after = self._decode(ids[seq.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing printable yet (e.g. half of a UTF-8 character)
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        return after[len(before):]

    def _output(self, seq: Sequence) -> RequestOutput:
        out_ids = seq.output_token_ids
        returned = seq.num_returned_tokens
        new_ids = out_ids[returned:]
        seq.num_returned_tokens = len(out_ids)
        if self.tokenizer is None:
            text = new_text = ""
        elif seq.is_finished:
            # The final text is one exact decode; the last delta is whatever it adds.
            text = self._decode(out_ids)
            new_text = text[len(seq.returned_text):] if text.startswith(seq.returned_text) else ""
        else:
            new_text = self._new_text(seq)
            text = seq.returned_text + new_text
        seq.returned_text += new_text
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=list(out_ids), text=text, finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            new_token_ids=new_ids, new_text=new_text, error=seq.error,
            spec_stats=seq.stats.copy() if self.draft is not None else None, num_preemptions=seq.num_preemptions,
            arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
            finished_time=seq.finished_time,
            logprobs=None if seq.logprobs is None else list(seq.logprobs),
            new_logprobs=None if seq.logprobs is None else seq.logprobs[returned:],
            prompt_logprobs=None if seq.prompt_logprobs is None else list(seq.prompt_logprobs))

    # -- batch API ---------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list (text or token ids); outputs in prompt order."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        plist: list[PromptType] = [prompts] if single else list(prompts)  # type: ignore[list-item]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise UsageError(f"got {len(params)} SamplingParams for {len(plist)} prompts")
        rids: list[str] = []
        try:
            for p, sp in zip(plist, params, strict=True):
                rid = f"req-{next(self._ids)}"
                self._collect.add(rid)  # before the add: another thread may finish it at once
                try:
                    self.add_request(p, sp, request_id=rid)
                except BaseException:
                    self._collect.discard(rid)
                    raise
                rids.append(rid)
            # Step until every result is filed; another thread stepping this LLM (a server's engine
            # thread) may be the one that finishes them, which step() records all the same.
            while not all(r in self._results for r in rids):
                self.step()
            final = [self._results[r] for r in rids]
        finally:
            for r in rids:
                if r not in self._results:
                    self.abort(r)  # an add or a step failed: leave nothing behind in the engine
                self._collect.discard(r)
                self._results.pop(r, None)
        if self.config.log_stats and self.draft is not None:
            print(self.stats_line(), file=sys.stderr)
        return final

    # -- gauges for a server's /metrics ------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + sum(op == "add" for op, _ in list(self._inbox))

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (vLLM's ``kv_cache_usage_perc``)."""
        bm = self.block_manager
        return 1.0 - bm.num_free_blocks / bm.num_blocks

    def kv_cache_info(self) -> dict[str, Any]:
        """What the KV cache holds, for a server's ``/health``: its dtype (``auto`` resolved to what
        the target's cache is stored in), bytes per token (target + draft) and tokens in all / free."""
        bm, bs = self.block_manager, self.config.block_size
        per_block = kv_bytes_per_block(self.target, bs) + (kv_bytes_per_block(self.draft, bs) if self.draft else 0)
        stored = self.target.kv_cache_spec().dtype
        return {"kv_cache_dtype": kv_cache.canonical(self.config.kv_cache_dtype),
                "kv_cache_storage": str(stored).removeprefix("torch."), "kv_bytes_per_token": per_block // bs,
                "kv_tokens_total": int(bm.num_blocks) * bs, "kv_tokens_free": int(bm.num_free_blocks) * bs}

    def stats_line(self) -> str:
        """The acceptance line; with ``num_speculative_tokens="auto"`` also the share of steps that
        chose each k (acceptance counts only the steps that drafted); with draft trees also the
        tree shape (topk K, S steps, N tokens verified) and the share of verifies accepting each
        depth (the acceptance rate counts N - 1 drafted tokens per verify: avg toks/fwd compares)."""
        if self.tree is not None:
            k, n = self.tree
            return f"{self.stats.line()}  tree K/S/N: {k}/{self.k}/{n}  {self.stats.depth_line()}"
        if self.policy is None:
            return self.stats.line()
        return f"{self.stats.line()}  {self.policy.histogram_line()}"

    @property
    def spec_shape(self) -> tuple[int, int, int] | None:
        """(topk, steps, tokens verified per step with the root) when speculating with a fixed shape:
        a chain is (1, k, k + 1); None without a draft or with ``num_speculative_tokens="auto"``."""
        if self.draft is None or self.policy is not None or not self.k:
            return None
        return (1, self.k, self.k + 1) if self.tree is None else (self.tree[0], self.k, self.tree[1])

    @property
    def stats(self) -> SpecStats:
        """Engine-wide acceptance counters (counted once, in :meth:`Scheduler.commit`)."""
        return self.scheduler.stats

    def reset_stats(self) -> None:
        """Start the engine-wide acceptance counters afresh (e.g. after a warm-up)."""
        self.scheduler.stats = SpecStats(self.stats.num_speculative_tokens)


def _generation_config(model_dir: Path) -> dict[str, Any]:
    """``generation_config.json`` of a checkpoint directory as a dict; {} when it is absent or not
    valid JSON (where transformers' GenerationConfig.from_pretrained, used here before, raised the
    OSError that was skipped) or not a JSON object: the EOS ids then come from the spec and the
    tokenizer. Read as plain JSON: importing transformers for this one field cost ~1-2 CPU-s per
    process, and an engine with no tokenizer or one of its own never needs transformers otherwise."""
    try:
        data = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _refuse_loaded(act: str | None, role: str) -> None:
    """``activation_quant`` is applied while the weights load: a model loaded before cannot take it."""
    if act is not None:
        raise UsageError(f"activation_quant={act!r} is applied when the {role} loads: pass the {role} as a checkpoint "
                         f"directory, not a loaded model")


def _is_model(obj: Any) -> bool:
    return not isinstance(obj, (str, os.PathLike))


def _loaded_device(model: Any, configured: torch.device, explicit: bool) -> torch.device:
    """The engine's device for an already loaded target: the model's (the configured default, the
    CPU, would put the KV caches and the attention metadata on another device than the weights).
    One line when a device was asked for explicitly and the model is elsewhere."""
    have = model_device(model)
    same = configured.type == have.type and configured.index in (None, have.index)
    if explicit and not same:
        raise UsageError(f"device={str(configured)!r}, but the target was loaded on {str(have)!r}; pass the same "
                         f"device (or none), or load the target with device={str(configured)!r}")
    return have


def _check_kv_format(model: Any, kv_cache_dtype: str, role: str) -> Any:
    """A model loaded outside the engine must already have the cache format asked for (its fp8
    scales come from its checkpoint, at load): one line when it does not."""
    want = kv_cache.canonical(kv_cache_dtype)
    have = getattr(getattr(model, "kv_format", None), "name", "auto")
    if have != want:
        raise UsageError(f"kv_cache_dtype={kv_cache_dtype!r}, but the {role} was loaded with kv_cache_dtype={have!r}; "
                         f"load it with load_{role}(..., kv_cache_dtype={kv_cache_dtype!r}) or pass its directory")
    return model

