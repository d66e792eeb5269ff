"""Speculative-decoding counters read from a server's Prometheus ``/metrics``.

Understood formats (all scraped before and after a run; the run's numbers are the deltas, as
``vllm bench serve`` computes them):

- vLLM and eagle3 (``vllm:`` / ``eagle3:`` prefix): counters ``spec_decode_num_drafts``,
  ``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens`` and
  ``spec_decode_num_accepted_tokens_per_pos{position}``.
- ATOM (``atom:``): ``mtp_draft_tokens``, ``mtp_accepted_tokens`` and ``mtp_decode_steps{accepted_tokens}``
  (decode steps by number of accepted draft tokens, which gives drafts, per-position counts and
  the histogram).
- eagle3 with ``num_speculative_tokens="auto"`` also exports the histogram
  ``eagle3:spec_decode_chosen_k`` (engine steps by the draft length chosen, buckets ``le`` = 0..max);
  its delta is reported as ``chosen_k_histogram`` (steps that chose k = 0, 1, ...).
- eagle3 also exports the info gauge ``eagle3:spec_decode_shape{topk, num_steps, num_draft_tokens}``;
  it is reported as ``shape`` (draft trees: topk > 1; the per-position counters then count the
  verifies accepting each depth).
- SGLang (``sglang:``): only the gauges ``spec_accept_length`` / ``spec_accept_rate`` exist; they
  are reported as read after the run (a server-side window, not this run's delta).

Derived numbers use the vLLM / SGLang definitions: acceptance rate = accepted / draft tokens,
mean acceptance length = 1 + accepted / drafts (bonus token included), per-position rate =
accepted at position i / drafts. For chain drafts the histogram of accepted counts follows from
the per-position counters: ``#(accepted >= j) = per_pos[j - 1]`` and ``#(accepted >= 0) = drafts``.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

COUNTER_PREFIXES = ("eagle3:", "vllm:")


@dataclass
class SpecCounters:
    source: str
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)

    def minus(self, before: SpecCounters | None) -> SpecCounters:
        if before is None or before.source != self.source:
            return self
        k = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        a = self.accepted_per_pos + [0.0] * (k - len(self.accepted_per_pos))
        b = before.accepted_per_pos + [0.0] * (k - len(before.accepted_per_pos))
        return SpecCounters(self.source, self.num_drafts - before.num_drafts,
                            self.num_draft_tokens - before.num_draft_tokens,
                            self.num_accepted_tokens - before.num_accepted_tokens,
                            [x - y for x, y in zip(a, b, strict=True)])

    def summary(self) -> dict[str, Any]:
        d, k = self.num_drafts, len(self.accepted_per_pos)
        at_least = [d, *self.accepted_per_pos, 0.0]  # #(accepted >= j) for j = 0 .. k + 1
        hist = [max(at_least[j] - at_least[j + 1], 0.0) for j in range(k + 1)]
        return {
            "source": self.source,
            "num_drafts": d,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_speculative_tokens": k,
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None,
            "mean_acceptance_length": 1.0 + self.num_accepted_tokens / d if d else None,
            "per_position_acceptance": [n / d for n in self.accepted_per_pos] if d else [None] * k,
            "accepted_per_pos": list(self.accepted_per_pos),
            "accepted_histogram": hist,
            "accepted_distribution": [h / d for h in hist] if d else [None] * (k + 1),
        }


@functools.lru_cache(maxsize=4)
def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The samples of a ``/metrics`` text by name (read only: the result is shared). Memoized per
    text: :func:`spec_delta` reads the counters, the chosen-k histogram and the shape from each
    scrape, and a group's ``after`` is the next group's ``before``, so each text was parsed up to
    five times (a few ms each with prometheus_client's pure-Python parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append((dict(s.labels), float(s.value)))
    return dict(out)  # a missing name reads as absent, not as an empty list inserted into the shared result


def _total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    rows = samples.get(name)
    return None if rows is None else sum(v for _, v in rows)


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The cumulative speculative counters in a ``/metrics`` text, or None if it has none."""
    samples = _samples(text)
    for prefix in COUNTER_PREFIXES:
        drafts = _total(samples, f"{prefix}spec_decode_num_drafts_total")
        if drafts is None:
            continue
        per_pos: dict[int, float] = defaultdict(float)
        for labels, v in samples.get(f"{prefix}spec_decode_num_accepted_tokens_per_pos_total", []):
            per_pos[int(labels.get("position", 0))] += v
        k = max(per_pos) + 1 if per_pos else 0
        return SpecCounters(prefix.rstrip(":"), drafts,
                            _total(samples, f"{prefix}spec_decode_num_draft_tokens_total") or 0.0,
                            _total(samples, f"{prefix}spec_decode_num_accepted_tokens_total") or 0.0,
                            [per_pos[i] for i in range(k)])
    steps = samples.get("atom:mtp_decode_steps_total")
    if steps is not None:
        by_count: dict[int, float] = defaultdict(float)
        for labels, v in steps:
            by_count[int(labels.get("accepted_tokens", 0))] += v
        k = max(by_count) if by_count else 0
        return SpecCounters("atom", sum(by_count.values()),
                            _total(samples, "atom:mtp_draft_tokens_total") or 0.0,
                            _total(samples, "atom:mtp_accepted_tokens_total") or 0.0,
                            [sum(n for j, n in by_count.items() if j > i) for i in range(k)])
    return None


def parse_sglang_gauges(text: str) -> dict[str, Any] | None:
    samples = _samples(text)
    length = samples.get("sglang:spec_accept_length")
    if length is None:
        return None
    rate = samples.get("sglang:spec_accept_rate") or []
    return {"source": "sglang (server gauges, not a delta over this run)",
            "mean_acceptance_length": sum(v for _, v in length) / len(length),
            "acceptance_rate": sum(v for _, v in rate) / len(rate) if rate else None}


CHOSEN_K = "eagle3:spec_decode_chosen_k"


def parse_chosen_k(text: str) -> list[float] | None:
    """Engine steps per chosen k (0..max) from the cumulative ``le`` buckets, or None."""
    rows = _samples(text).get(CHOSEN_K + "_bucket")
    if not rows:
        return None
    cum = sorted((float(labels["le"]), v) for labels, v in rows if labels.get("le") not in (None, "+Inf"))
    return [v - (cum[i - 1][1] if i else 0.0) for i, (_, v) in enumerate(cum)]


SHAPE = "eagle3:spec_decode_shape"


def parse_shape(text: str) -> dict[str, int] | None:
    """The speculation shape ``{"topk", "num_steps", "num_draft_tokens"}`` from the info gauge, or None."""
    for labels, v in _samples(text).get(SHAPE, []):
        if v:
            try:
                return {key: int(labels[key]) for key in ("topk", "num_steps", "num_draft_tokens")}
            except (KeyError, ValueError):
                return None
    return None


def merge_summaries(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One summary for several runs' summaries (:func:`spec_delta` of each group run one after
    another): counters are summed and the rates derived again. SGLang's gauges are a server-side
    window, not deltas: the last one stands for all."""
    given = [p for p in parts if p is not None]
    if not given:
        return None
    counted = [p for p in given if "num_drafts" in p]
    if not counted:
        return given[-1]
    k = max(len(p.get("accepted_per_pos") or []) for p in counted)
    per_pos = [0.0] * k
    for p in counted:
        for i, v in enumerate(p.get("accepted_per_pos") or []):
            per_pos[i] += v
    total = SpecCounters(counted[0]["source"], sum(p["num_drafts"] for p in counted),
                         sum(p["num_draft_tokens"] for p in counted),
                         sum(p["num_accepted_tokens"] for p in counted), per_pos)
    out = total.summary()
    hists = [p["chosen_k_histogram"] for p in counted if p.get("chosen_k_histogram") is not None]
    if hists:
        width = max(len(h) for h in hists)
        out["chosen_k_histogram"] = [sum(h[i] for h in hists if i < len(h)) for i in range(width)]
    shape = next((p["shape"] for p in counted if p.get("shape")), None)
    if shape is not None:
        out["shape"] = shape
    return out


def scrape(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> str | None:
    """``GET <root>/metrics`` as text, or None when the server has no such endpoint."""
    import httpx

    from eagle3.validate.endpoint import api_root, client_options, headers

    try:
        r = httpx.get(api_root(base_url) + "/metrics", headers=headers(api_key), timeout=timeout,
                      **client_options(base_url))
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def spec_delta(before: str | None, after: str | None) -> dict[str, Any] | None:
    """The run's speculative summary from two scrapes (None if the server exports nothing)."""
    if after is None:
        return None
    now = parse_spec_counters(after)
    if now is not None:
        prev = parse_spec_counters(before) if before is not None else None
        out = now.minus(prev).summary()
        chosen = parse_chosen_k(after)
        if chosen is not None:
            old = (parse_chosen_k(before) if before is not None else None) or [0.0] * len(chosen)
            out["chosen_k_histogram"] = [a - b for a, b in zip(chosen, old + [0.0] * len(chosen), strict=False)]
        shape = parse_shape(after)
        if shape is not None:
            out["shape"] = shape
        return out
    return parse_sglang_gauges(after)
