"""Prometheus metrics of the server (prometheus-client, one registry per server instance).

Names follow vLLM's with the ``eagle3:`` prefix, so that scrapers written for vLLM work after a
prefix change and ``eagle3 validate`` / ``eagle3 bench`` read both. The speculative counters are
vLLM's exactly (``spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``,
``..._num_accepted_tokens_per_pos{position}``; with draft trees ``position`` i counts the verifies
whose accepted path reached depth i + 1, so it is the per-depth counter). ``spec_decode_shape`` is an
info gauge (value 1) whose labels give the speculation shape: ``topk``, ``num_steps``,
``num_draft_tokens`` (the chain: 1, k, k + 1; absent under ``num_speculative_tokens="auto"``). The
acceptance rate, mean acceptance length and the
accepted-count histogram are derived from them by the reader (see
:mod:`eagle3.validate.metrics_client`).

A registry per instance (not the global default) lets several servers live in one process,
which the tests and ``serve --validate`` (speculative run, then baseline run) rely on.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "eagle3:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The server's instruments. Thread-safe (prometheus-client locks each value)."""

    def __init__(self, model_name: str, num_speculative_tokens: int, adaptive: bool = False,
                 shape: tuple[int, int, int] | None = None) -> None:
        disable_created_metrics()  # no "<name>_created" series (process-wide; vLLM does the same)
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.k = num_speculative_tokens
        self._model = model_name

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=r)

        self.requests = counter("request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.http_errors = counter("request_errors", "Requests answered with an error status.", ("status",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first output token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "(e2e - ttft) / (output tokens - 1), per request.", labels,
                              buckets=_TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in the running batch.", labels,
                             registry=r).labels(model_name)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.", labels,
                             registry=r).labels(model_name)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", labels,
                              registry=r).labels(model_name)
        self.kv_free_blocks = Gauge(PREFIX + "num_free_kv_blocks", "Free KV cache blocks.", labels,
                                    registry=r).labels(model_name)
        self.engine_steps = counter("engine_steps", "Engine steps run.").labels(model_name)
        # Speculative counters exist only with a draft (as in vLLM): their absence tells a reader
        # that the server does not speculate.
        self.spec_per_pos: list[Any] = []
        if num_speculative_tokens:
            self.spec_drafts = counter("spec_decode_num_drafts", "Verifications of >= 1 draft token.").labels(model_name)
            self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.").labels(model_name)
            self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(model_name)
            per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                              "Drafts whose token at this position (trees: depth position + 1) was accepted.",
                              ("position",))
            self.spec_per_pos = [per_pos.labels(model_name, str(i)) for i in range(num_speculative_tokens)]
        if shape is not None and num_speculative_tokens:
            info = Gauge(PREFIX + "spec_decode_shape", "Speculation shape in the labels (value 1): topk "
                         "(1: a chain), num_steps (draft depth), num_draft_tokens (verified per step, root "
                         "included).", labels + ["topk", "num_steps", "num_draft_tokens"], registry=r)
            info.labels(model_name, *(str(x) for x in shape)).set(1)
        self._last_spec: tuple[int, int, int, list[int]] = (0, 0, 0, [0] * num_speculative_tokens)
        # num_speculative_tokens="auto": engine steps by the draft length they chose (0 = plain step).
        self.chosen_k: Any = None
        self._last_chosen: list[int] = [0] * (num_speculative_tokens + 1)
        if adaptive and num_speculative_tokens:
            self.chosen_k = Histogram(PREFIX + "spec_decode_chosen_k",
                                      "Draft tokens chosen per engine step (num_speculative_tokens=auto).", labels,
                                      buckets=tuple(float(k) for k in range(num_speculative_tokens + 1)),
                                      registry=r).labels(model_name)

    # -- engine side (called from the engine thread after each step) ------------------------
    def observe_engine(self, llm: Any) -> None:
        """Bring the counters and gauges up to date with the engine's state."""
        stats = getattr(llm, "stats", None)
        if stats is not None and self.k:
            now = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                   list(stats.accepted_per_pos)[: self.k])
            last = self._last_spec
            if now[0] < last[0]:  # LLM.reset_stats(): start a new baseline, counters never go down
                last = (0, 0, 0, [0] * self.k)
            self.spec_drafts.inc(now[0] - last[0])
            self.spec_draft_tokens.inc(now[1] - last[1])
            self.spec_accepted.inc(now[2] - last[2])
            for c, a, b in zip(self.spec_per_pos, now[3], last[3], strict=False):
                c.inc(max(a - b, 0))
            self._last_spec = now
        policy = getattr(llm, "policy", None)
        if self.chosen_k is not None and policy is not None:
            hist = list(policy.histogram)[: len(self._last_chosen)]
            for k, (a, b) in enumerate(zip(hist, self._last_chosen, strict=False)):
                for _ in range(max(a - b, 0)):
                    self.chosen_k.observe(k)
            self._last_chosen = hist
        self.update_gauges(llm)

    def update_gauges(self, llm: Any) -> None:
        sched = getattr(llm, "scheduler", None)
        if sched is not None:
            self.running.set(len(getattr(sched, "running", ())))
            self.waiting.set(len(getattr(sched, "waiting", ())))
        bm = getattr(llm, "block_manager", None)
        if bm is not None and getattr(bm, "num_blocks", 0):
            free = bm.num_free_blocks
            self.kv_free_blocks.set(free)
            self.kv_usage.set(1.0 - free / bm.num_blocks)

    # -- request side (called from the event loop when a request ends) ----------------------
    def observe_request(self, *, prompt_tokens: int, completion_tokens: int, finish_reason: str | None,
                        ttft: float | None, e2e: float) -> None:
        m = self._model
        self.requests.labels(m, finish_reason or "abort").inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(completion_tokens)
        self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
            if completion_tokens > 1:
                self.tpot.observe((e2e - ttft) / (completion_tokens - 1))

    def observe_error(self, status: int) -> None:
        self.http_errors.labels(self._model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def metrics_for(model_name: str, llm: Any) -> ServerMetrics:
    """The instruments for serving ``llm``: its k (auto: the ceiling), under auto the chosen-k
    histogram, else its speculation shape (chain or tree)."""
    return ServerMetrics(model_name, int(getattr(llm, "k", 0) or 0), getattr(llm, "policy", None) is not None,
                         getattr(llm, "spec_shape", None))
