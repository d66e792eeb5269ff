"""Sampling parameters and the sampler shared by the target (bonus / recovered tokens) and the
draft (proposals).

Randomness comes from one ``torch.Generator`` per request when the request has a ``seed`` (so
its output does not depend on what else is in the batch) and from the engine's generator
otherwise. Sampling uses the exponential trick, ``argmax(probs / E)`` with ``E ~ Exp(1)``
(nano-vllm, vLLM): one draw per vocabulary entry and no normalisation, so it works on the
unnormalised residual ``max(p - q, 0)`` as well.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from eagle3.errors import UsageError
from eagle3.runtime.logprobs import valid_count

_INT64_MAX = (1 << 63) - 1
# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM names and meanings).

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``stop_token_ids`` end the request like EOS does (the stop token is kept in ``token_ids``).
    ``logprobs=N``: each output token's logprob under the target, with its rank and the ``N`` most
    likely tokens (0: its own only); ``prompt_logprobs=N`` the same for the prompt tokens (None:
    off). Raw logprobs, before temperature / top-k / top-p (:mod:`eagle3.runtime.logprobs`); at most
    ``EngineConfig.max_logprobs``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type and range (UsageError naming the field). Called at
        construction and again by ``LLM.add_request`` (the fields are mutable): a value that
        cannot be sampled with must be refused for its own request before it reaches a step
        shared with other requests (an out-of-int64 ``top_k`` used to fail the whole batch)."""
        def bad(name: str, what: str) -> UsageError:
            return UsageError(f"SamplingParams.{name} must be {what}, got {getattr(self, name)!r}")

        if isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real) \
                or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or not -1 <= self.top_k <= _INT64_MAX:
            raise bad("top_k", f"an integer in [-1, {_INT64_MAX}] (0 or -1: all tokens)")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, numbers.Integral)
                                            or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 (or None)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)
                                      or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise bad("seed", f"an integer in [{_SEED_MIN}, {_SEED_MAX}] (or None)")
        for name in ("logprobs", "prompt_logprobs"):
            if not valid_count(getattr(self, name)):
                raise bad(name, "an integer >= 0 (or None)")
        try:
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        except (TypeError, ValueError) as err:
            raise bad("stop_token_ids", "a list of token ids") from err
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "non-negative token ids")

    @property
    def greedy(self) -> bool:
        # Tiny temperatures are treated as greedy: dividing logits by 1e-6 overflows to inf/nan.
        return self.temperature < 1e-5


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The request's own generator, or None to use the engine's shared one."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (``-inf``) the logits outside each row's top-k and top-p nucleus.

    ``logits`` [N, V] float32, ``top_k`` int64 [N] (<= 0: off), ``top_p`` float32 [N] (1: off).
    top-k first, then top-p over the renormalised survivors, as vLLM and SGLang do. The most
    likely token always survives, so every row keeps at least one token.
    """
    n, v = logits.shape
    k_on = (top_k > 0) & (top_k < v)
    p_on = top_p < 1.0
    if not bool(k_on.any()) and not bool(p_on.any()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(v, device=logits.device).expand(n, v)
    drop = k_on[:, None] & (rank >= top_k[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if bool(p_on.any()):
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop_p = p_on[:, None] & (mass_before >= top_p[:, None])
        drop_p[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


@dataclass
class SamplingBatch:
    """Per-row sampling tensors for ``N`` rows of logits (several rows may share one request)."""

    temperature: torch.Tensor  # float32 [N]; 1.0 on greedy rows (their probs are unused)
    top_k: torch.Tensor  # int64 [N]
    top_p: torch.Tensor  # float32 [N]
    greedy: torch.Tensor  # bool [N]
    generators: list[torch.Generator | None]  # [N]

    @classmethod
    def build(cls, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
              repeats: Sequence[int] | None = None, device: torch.device | str = "cpu") -> SamplingBatch:
        """Rows for each request, request ``i`` repeated ``repeats[i]`` times (default once)."""
        reps = list(repeats) if repeats is not None else [1] * len(params)
        temps, ks, ps, greedy, gens = [], [], [], [], []
        for sp, g, r in zip(params, generators, reps, strict=True):
            temps += [1.0 if sp.greedy else float(sp.temperature)] * r
            ks += [max(int(sp.top_k), 0)] * r
            ps += [float(sp.top_p)] * r
            greedy += [sp.greedy] * r
            gens += [g] * r
        return cls(torch.tensor(temps, dtype=torch.float32, device=device),
                   torch.tensor(ks, dtype=torch.int64, device=device),
                   torch.tensor(ps, dtype=torch.float32, device=device),
                   torch.tensor(greedy, dtype=torch.bool, device=device), gens)

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())


def logits_to_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, then top-k / top-p, then softmax: the distribution a row samples from.

    The same function is applied to the target's logits (p) and the draft's (q), which is what
    keeps stochastic verification exact for the distribution the user asked for."""
    logits = logits.float() / batch.temperature[:, None]
    return apply_top_k_top_p(logits, batch.top_k, batch.top_p).softmax(dim=-1)


def _draw(shape_per_row: tuple[int, ...], generators: Sequence[torch.Generator | None],
          default: torch.Generator | None, device: torch.device, kind: str) -> torch.Tensor:
    """Random numbers, one block of ``shape_per_row`` per row, each from the row's generator.

    Rows without their own generator share one batched draw from ``default``: cheap, and their
    results were never meant to be reproducible per request."""
    n = len(generators)
    out = torch.empty((n, *shape_per_row), dtype=torch.float32, device=device)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        block = torch.empty((len(shared), *shape_per_row), dtype=torch.float32, device=device)
        _fill(block, default, kind)
        out[torch.tensor(shared, device=device)] = block
    for i, g in enumerate(generators):
        if g is not None:
            _fill(out[i], g, kind)
    return out


def _fill(t: torch.Tensor, gen: torch.Generator | None, kind: str) -> None:
    if kind == "uniform":
        t.uniform_(generator=gen)
    else:
        t.exponential_(generator=gen)


def draw_uniform(n_per_row: int, generators: Sequence[torch.Generator | None],
                 default: torch.Generator | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniform [0, 1) floats ``[N, n_per_row]``."""
    return _draw((n_per_row,), generators, default, torch.device(device), "uniform")


def sample_from_weights(weights: torch.Tensor, generators: Sequence[torch.Generator | None],
                        default: torch.Generator | None) -> torch.Tensor:
    """One token per row from the (possibly unnormalised) non-negative ``weights`` [N, V]."""
    e = _draw((weights.shape[-1],), generators, default, weights.device, "exponential")
    # E can be exactly 0 with vanishing probability; clamp so a zero weight never wins by 0/0.
    return (weights / e.clamp_min(1e-20)).argmax(dim=-1)


class Sampler:
    """Samples one token per row: argmax on greedy rows, the filtered distribution otherwise."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """``logits`` float32 [N, V] -> int64 [N]."""
        greedy_ids = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_ids
        probs = logits_to_probs(logits, batch)
        sampled = sample_from_weights(probs, batch.generators, self.generator)
        return torch.where(batch.greedy, greedy_ids, sampled)
