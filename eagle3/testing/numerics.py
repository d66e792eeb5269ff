"""Comparing two *different* implementations of the same model honestly.

Two implementations of one model (two kernel backends, TP=1 vs TP=2, eagle3 vs transformers) agree
only up to floating-point rounding, and in bf16 the rounding depends on which vectorised kernels the
CPU picks (AVX2, AVX-512, AMX). Greedy token lists are therefore not a property of the code: two
implementations may part at a near tie. What the math guarantees is:

* logits agree within a tolerance ``tol`` (elementwise, over the same token history), and
* where the reference's top-1 logit leads its top-2 by more than ``2 * tol``, both pick the same
  token (no perturbation within ``tol`` can reorder them).

:func:`assert_greedy_agrees` checks exactly that on two logit tensors; :func:`assert_generations_agree`
applies it to two engines' greedy generations by teacher-forcing the reference's tokens through both
targets (:func:`forced_logits`). Bitwise equality stays where the code guarantees it (speculative vs
plain greedy on one backend and dtype, batch invariance, integer kernels) and is checked with ``==``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from eagle3.runtime import kv_cache
from eagle3.runtime.engine.model_runner import build_attn_metadata
from eagle3.runtime.interfaces import allocate_kv_cache, model_device
from eagle3.runtime.layers.moe import MoE

# Logit tolerances between two implementations of the tiny models (|logits| < 8). bf16: 4 ulps at
# 4..8 (1/32 each); two backends' bf16 logits were seen up to 0.09 apart (torch vs the fake-aiter
# adapter, AVX-512), the rounding of several bf16 layers adding up. fp32: a few hundred ulps, far
# below the tiny models' smallest top-2 margins (about 0.05).
BF16_LOGIT_TOL = 0.125
FP32_LOGIT_TOL = 1e-3
# A token whose k-th and (k+1)-th expert scores (sigmoid gates in [0, 1]) lie closer than this may be
# routed differently by two implementations whose hidden states differ by rounding; its outputs then
# differ by far more than any logit tolerance, and so does everything after it.
BF16_ROUTER_TOL = 0.02
FP32_ROUTER_TOL = 1e-4


def _is_fp32(dtype: torch.dtype | str) -> bool:
    return str(dtype).removeprefix("torch.") in ("float32", "float")


def logit_tol(dtype: torch.dtype | str) -> float:
    """The logit tolerance for a model run in ``dtype``."""
    return FP32_LOGIT_TOL if _is_fp32(dtype) else BF16_LOGIT_TOL


def router_tol(dtype: torch.dtype | str) -> float:
    """The expert-score tolerance for a model run in ``dtype``."""
    return FP32_ROUTER_TOL if _is_fp32(dtype) else BF16_ROUTER_TOL


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` -> ``[...]``: how far the largest logit leads the second largest."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def assert_greedy_agrees(ref_logits: torch.Tensor, got_logits: torch.Tensor, tol: float, what: str = "") -> None:
    """``[L, V]`` logits of two implementations over the same history: within ``tol`` everywhere,
    and the same argmax at every step whose reference margin exceeds ``2 * tol``. The message names
    the step, the difference and the margin that failed."""
    ref, got = ref_logits.float(), got_logits.float()
    assert ref.shape == got.shape, f"{what}: logits shapes differ: {tuple(ref.shape)} vs {tuple(got.shape)}"
    ref, got = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    diff = (ref - got).abs().amax(dim=-1)
    for step in range(ref.shape[0]):
        d = float(diff[step])
        assert d <= tol, f"{what}: step {step}: logits differ by {d:.3g} > tol {tol:.3g}"
    margin = top2_margin(ref)
    a_ref, a_got = ref.argmax(-1), got.argmax(-1)
    for step in range(ref.shape[0]):
        m = float(margin[step])
        if m > 2 * tol:
            assert int(a_ref[step]) == int(a_got[step]), (
                f"{what}: step {step}: argmax {int(a_got[step])} != reference {int(a_ref[step])} although the "
                f"reference margin {m:.3g} > 2 * tol {2 * tol:.3g}")


class RoutingTape:
    """The expert choices of one forward, per MoE layer: recorded from one model and replayed in
    another, so that a comparison of two implementations is not decided by a routing tie (the
    router is shared code; the kernels under test run after it). ``margins`` is, per token, the
    smallest lead of a chosen expert's score over the best one left out, over all layers."""

    def __init__(self) -> None:
        self.routes: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.margins: torch.Tensor | None = None

    @contextmanager
    def record(self, model: object) -> Iterator[None]:
        def hook(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            scores, choice = moe.route_scores(x)
            top = choice.topk(min(moe.top_k + 1, choice.shape[-1]), dim=-1).values
            margin = (top[:, moe.top_k - 1] - top[:, moe.top_k]) if top.shape[-1] > moe.top_k else \
                torch.full(top.shape[:1], float("inf"))
            self.margins = margin if self.margins is None else torch.minimum(self.margins, margin)
            route = MoE.route(moe, x)
            self.routes.append(route)
            return route

        with _patched_routes(model, hook):
            yield

    @contextmanager
    def replay(self, model: object) -> Iterator[None]:
        calls = iter(self.routes)

        def hook(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ids, w = next(calls)
            assert ids.shape[0] == x.shape[0], "replayed routing for a different number of tokens"
            return ids.to(x.device), w.to(x.device)

        with _patched_routes(model, hook):
            yield


class CacheTape:
    """The fp8 KV codes of one forward, recorded from one model and written over another's: fp8
    codes are a step function of the latent (one e4m3 step is 6-12% of a value), so two
    implementations whose latents differ by fp32 rounding store different codes wherever a value
    sits on a rounding boundary, and one such code moves later logits by far more than rounding
    (a perturbation of the latents by 7.6e-6, relative, flipped 2-7 of the tiny target's 92,736
    cached values per teacher-forced pass and moved fp32 logits by up to 0.074). The cache write
    is shared code (``TorchBackend.write_cache``, the fp8 numbers of ``runtime.kv_cache``); the
    replay makes the attention kernels under test read the reference's codes, as
    :class:`RoutingTape` makes the experts the reference's."""

    def __init__(self) -> None:
        self.codes: list[torch.Tensor] = []

    @contextmanager
    def record(self, model: object) -> Iterator[None]:
        def hook(write, cache, slots, values, scale=1.0):  # noqa: ANN001, ANN202 - the backend's signature
            write(cache, slots, values, scale)
            self.codes.append(kv_cache.bits(cache)[slots.to(cache.device, torch.int64)].clone())

        with _patched_writes(model, hook):
            yield

    @contextmanager
    def replay(self, model: object) -> Iterator[None]:
        calls = iter(self.codes)

        def hook(write, cache, slots, values, scale=1.0):  # noqa: ANN001, ANN202
            write(cache, slots, values, scale)  # its own write (the same work), then the reference's codes
            codes = next(calls)
            assert codes.shape[0] == slots.shape[0], "replayed cache codes for a different number of tokens"
            kv_cache.bits(cache)[slots.to(cache.device, torch.int64)] = codes.to(cache.device)

        with _patched_writes(model, hook):
            yield


@contextmanager
def _patched_writes(model: object, hook: object) -> Iterator[None]:
    """``hook(write, ...)`` in place of every fp8 cache write of ``model``'s kernel backends."""
    mods = getattr(model, "modules", lambda: iter(()))()
    backends = {id(be): be for m in mods if (be := getattr(m, "backend", None)) is not None}.values()
    for be in backends:
        write = be.write_cache

        def patched(cache, slots, values, scale=1.0, _write=write):  # noqa: ANN001, ANN202
            if not kv_cache.is_fp8(cache.dtype):
                return _write(cache, slots, values, scale)
            return hook(_write, cache, slots, values, scale)  # type: ignore[operator]

        be.write_cache = patched
    try:
        yield
    finally:
        for be in backends:
            del be.write_cache


@contextmanager
def _patched_routes(model: object, hook: object) -> Iterator[None]:
    mods = [m for m in getattr(model, "modules", lambda: iter(()))() if isinstance(m, MoE)]
    for m in mods:
        m.route = lambda x, _m=m: hook(_m, x)  # type: ignore[method-assign, operator]
    try:
        yield
    finally:
        for m in mods:
            del m.route


@torch.inference_mode()
def forced_logits(target: object, token_ids: Sequence[int], block_size: int = 4) -> torch.Tensor:
    """float32 ``[L, V]``: the target's logits after each of ``token_ids`` (row ``i`` predicts token
    ``i + 1``), from one prefill over a fresh paged KV cache. ``target`` is a runtime TargetModel."""
    n = len(token_ids)
    spec = target.kv_cache_spec()  # type: ignore[attr-defined]
    num_blocks = -(-n // block_size)
    device = model_device(target)
    kv = allocate_kv_cache(spec, target.num_layers, num_blocks, block_size, device)  # type: ignore[attr-defined]
    meta = build_attn_metadata([list(range(num_blocks))], [0], [n], block_size, device)
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64, device=device)
    hidden, _ = target.forward(ids, meta, kv, None)  # type: ignore[attr-defined]
    at = getattr(target, "compute_logits_at", None)  # tensor parallel: the workers need the rows
    rows = torch.arange(n, device=hidden.device)
    logits = at(hidden, rows) if at is not None else target.compute_logits(hidden)  # type: ignore[attr-defined]
    return logits.float().cpu()


def assert_generations_agree(ref_target: object, got_target: object, prompts: Sequence[Sequence[int]],
                             ref_outputs: Sequence[Sequence[int]], got_outputs: Sequence[Sequence[int]],
                             tol: float, what: str = "", router: float | None = None) -> None:
    """Two engines' greedy generations of ``prompts`` agree as far as the math guarantees.

    The reference's tokens are teacher-forced through both targets, the second replaying the
    first's expert routing (:class:`RoutingTape`) and, for an fp8 KV cache, the first's cache codes
    (:class:`CacheTape`): their logits must agree within ``tol``
    (:func:`assert_greedy_agrees`). Both engines' own tokens must equal the teacher-forced argmax up
    to the first near tie: a step whose logit margin is at most ``2 * tol``, or a token so far whose
    routing margin is at most ``router`` (default: :func:`router_tol` of bf16). After a near tie
    rounding may choose either way, and the paths may part.
    """
    router = BF16_ROUTER_TOL if router is None else router
    assert len(ref_outputs) == len(got_outputs) == len(prompts), f"{what}: different numbers of outputs"
    for i, (prompt, ref, got) in enumerate(zip(prompts, ref_outputs, got_outputs, strict=True)):
        ref, got = list(ref), list(got)
        if not ref:
            assert not got, f"{what}: prompt {i}: reference emitted nothing, the other {got}"
            continue
        history = list(prompt) + ref[:-1]
        tape, codes = RoutingTape(), CacheTape()
        with tape.record(ref_target), codes.record(ref_target):
            ref_l = forced_logits(ref_target, history)[len(prompt) - 1:]
        with tape.replay(got_target), codes.replay(got_target):
            got_l = forced_logits(got_target, history)[len(prompt) - 1:]
        assert_greedy_agrees(ref_l, got_l, tol, f"{what}: prompt {i}")
        _assert_tokens_until_near_tie(ref_l, tape.margins, len(prompt), tol, router,
                                      {"reference": ref, "other": got}, f"{what}: prompt {i}")


def assert_tokens_until_near_tie(ref_target: object, prompts: Sequence[Sequence[int]],
                                 ref_outputs: Sequence[Sequence[int]], others: dict[str, Sequence[Sequence[int]]],
                                 tol: float, router: float, what: str = "") -> None:
    """Greedy tokens of engines whose target only the reference's runs in this process (a
    tensor-parallel one, say): the reference's tokens and each of ``others`` equal the reference
    target's teacher-forced argmax up to the first near tie (logit margin at most ``2 * tol``, or
    a routing margin so far at most ``router``), as :func:`assert_generations_agree` holds them."""
    for i, (prompt, ref) in enumerate(zip(prompts, ref_outputs, strict=True)):
        ref = list(ref)
        if not ref:
            continue
        tape = RoutingTape()
        with tape.record(ref_target):
            logits = forced_logits(ref_target, list(prompt) + ref[:-1])[len(prompt) - 1:]
        outputs = {"reference": ref} | {name: list(out[i]) for name, out in others.items()}
        _assert_tokens_until_near_tie(logits, tape.margins, len(prompt), tol, router, outputs, f"{what}: prompt {i}")


def _assert_tokens_until_near_tie(logits: torch.Tensor, route_margins: torch.Tensor | None, prompt_len: int,
                                  tol: float, router: float, outputs: dict[str, list[int]], what: str) -> None:
    """Decode steps and the one prefill round differently too, so the reference's own tokens are
    held to the same rule as the other engine's."""
    forced = logits.argmax(-1).tolist()
    margin = top2_margin(logits)
    if route_margins is None:
        tie_at = [False] * len(forced)
    else:  # step s is decided after tokens 0 .. prompt_len - 1 + s: a routing tie in any of them counts
        ties = (route_margins <= router).cumsum(0) > 0
        tie_at = ties[prompt_len - 1:].tolist()
    for name, toks in outputs.items():
        for step, tok in enumerate(toks[: len(forced)]):
            m = float(margin[step])
            if m <= 2 * tol or tie_at[step]:
                break  # a near tie: rounding may choose either token from here on
            assert tok == forced[step], (
                f"{what}: step {step}: {name} token {tok} != teacher-forced argmax {forced[step]} although the "
                f"margin {m:.3g} > 2 * tol {2 * tol:.3g} and no routing margin so far <= {router:.3g}")
