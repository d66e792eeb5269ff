"""The calibration pass: layer by layer through the source, each in-scope MLP solved as soon as its
inputs are known, the results written per layer (:class:`.store.TensorStore`).

Per decoder layer ``l``:

1. read layer ``l`` into the runtime's modules (:class:`.capture.SourceLayers`), run the kept
   hidden states of every calibration token through its attention and post-attention norm: the
   MLP inputs ``x`` [T, H]; in an MoE layer the router's top-k of every token;
2. for each in-scope MLP (the dense MLP, the shared experts, each routed expert in turn with the
   tokens routed to it): read the weights' fp32 source values (the native engine's quantizer
   input, :func:`eagle3.quantize.sources.open_rows`), form the Hessians from those tokens, solve
   (:func:`.mlp.solve_mlp`), write the export tensors to the store, drop the Hessians;
3. the next layer's hidden states: ``h + mlp(x)`` with the source's weights.

``gptaq`` keeps a second stream, the *quantized* model's hidden states: its MLP inputs ``x~`` come
from layers already quantized, its routing is the quantized model's own (what the served model
does), and after the layer is solved its MLP is reloaded with the quantized weights and the
recipe's activation quantization to advance that stream, exactly as the runtime would serve it.

Memory: one decoder layer's weights as the runtime holds them (packed), the hidden states of the
calibration tokens (one or two ``T x H`` streams and the layer's ``x``), and one MLP's Hessians and
factors at a time (for a Kimi-K2.5 expert: ``7168^2`` fp32 = 205 MB for gate/up, 17 MB for down,
plus a transient float64 factorisation of ~0.4-0.8 GB). None of it depends on the number of layers,
and nothing of an MLP outlives its solve but its packed export tensors (held until the layer's file is
written); the allocator's free pages are handed back after every MLP and layer (:mod:`.heap`), so
what one layer freed does not stay resident under the next one's peak.
Each layer prints a progress line with its time.
"""

from __future__ import annotations

import re
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3.errors import UsageError
from eagle3.formats import keys
from eagle3.quantize.calibrate.capture import SourceLayers, TokenStream, routed_tokens
from eagle3.quantize.calibrate.heap import release_freed
from eagle3.quantize.calibrate.methods import CalibConfig, act_qdq
from eagle3.quantize.calibrate.mlp import ROLES, solve_mlp
from eagle3.quantize.calibrate.prompts import CalibrationSet
from eagle3.quantize.calibrate.store import TensorStore
from eagle3.quantize.recipes import Recipe, Scope
from eagle3.quantize.sources import find_modules, inspect_source, open_rows
from eagle3.runtime.kernels.base import ActQuant, Int4Weight, LinearWeight, MXFP4Weight
from eagle3.runtime.kernels.torch_ref.packed import release_scratch
from eagle3.runtime.layers.moe import MoE

# observe(layer index, MLP inputs [T, H] the experts were fitted to, router top-k ids [T, k] or None)
Observer = Callable[[int, torch.Tensor, torch.Tensor | None], None]
PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
MLP_WEIGHT = re.compile(r"\.mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj$")


@dataclass
class LayerReport:
    layer: int
    seconds: float  # wall time
    attention_seconds: float
    solve_seconds: float
    mlps: int = 0  # MLPs with weights in scope
    calibrated: int = 0
    fallback: int = 0  # kept their data-free values (too few tokens)
    tokens_min: int | None = None  # fewest tokens an in-scope MLP saw
    err_rtn: float = float("nan")  # token-weighted mean relative output error, data-free values
    err: float = float("nan")  # ... with the method's values
    smoothed: int = 0
    peak_rss_mb: float = 0.0
    expert_tokens: list[int] | None = None  # MoE layer: calibration tokens routed to each expert
    cpu_seconds: float = 0.0  # CPU time of the process (all threads): a shared machine's wall time is not


@dataclass
class CalibrationResult:
    method: str
    recipe: str
    scope: str
    tokens: int
    sequences: int
    layers: list[LayerReport] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def fallback(self) -> int:
        return sum(r.fallback for r in self.layers)

    @property
    def calibrated(self) -> int:
        return sum(r.calibrated for r in self.layers)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["fallback"], d["calibrated"] = self.fallback, self.calibrated
        return d


def peak_rss_mb() -> float:
    """The process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _act_quant(fmt: str) -> ActQuant:
    return None if fmt == "none" else fmt  # type: ignore[return-value]


def canonical(tensors: dict[str, torch.Tensor], fmt: str, k: int) -> LinearWeight:
    """Export tensors -> the runtime's canonical weight (what its loader makes of them)."""
    if fmt == "fp8_int4":
        return Int4Weight(tensors[keys.WEIGHT], tensors[keys.SCALE_2].float().reshape(-1), None,
                          tensor_scale=tensors[keys.SCALE].float().reshape(()), packing="quark", in_features=k)
    if fmt == "mxfp4":
        return MXFP4Weight(tensors[keys.WEIGHT], tensors[keys.SCALE])
    raise UsageError(f"no runtime weight for format {fmt!r}")


@dataclass
class _MLPSite:
    """One MLP of a layer: its module names per role, which roles are in scope, its runtime module."""

    names: dict[str, str]
    scope: set[str]
    kind: str  # dense | shared | expert
    expert: int | None = None


class Calibrator:
    """Runs the calibration pass of one source checkpoint (module docstring)."""

    def __init__(self, src: str | Path, recipe: Recipe, scope: Scope, cfg: CalibConfig, calib: CalibrationSet,
                 store: TensorStore, dtype: torch.dtype = torch.bfloat16,
                 echo: Callable[[str], None] | None = None, observe: Observer | None = None) -> None:
        fmt = recipe.weight.format
        if fmt not in ("fp8_int4", "mxfp4"):
            raise UsageError(f"recipe {recipe.name!r}: calibrated methods quantize fp8_int4 (W4A8) or mxfp4 "
                             f"weights, not {fmt}")
        self.src = Path(src)
        self.recipe, self.scope, self.cfg, self.calib, self.store = recipe, scope, cfg, calib, store
        self.fmt = fmt
        self.act_fmt = recipe.activation.format
        self.act = act_qdq(self.act_fmt)
        self.echo = echo or (lambda s: print(s, file=sys.stderr, flush=True))
        self.observe = observe
        self.model = SourceLayers(src, dtype)
        self.source_info, self.reader = inspect_source(self.src)
        self.modules = find_modules(self.reader, self.source_info)
        self.in_scope = {m for m in self.modules if scope.matches(m)}
        if not self.in_scope:
            raise UsageError(f"recipe {recipe.name!r} scope {scope.name!r} matches no Linear module of {src}")
        outside = sorted(m for m in self.in_scope if not MLP_WEIGHT.search(m))
        if outside:
            raise UsageError(f"calibrated methods quantize MLP weights (experts, shared experts, dense MLP); "
                             f"scope {scope.name!r} also includes {outside[0]}")
        self.stream = TokenStream(calib.sequences)

    # -- sites -------------------------------------------------------------------------------------
    def _sites(self, i: int, layer: torch.nn.Module) -> list[_MLPSite]:
        p = self.model.prefix(i) + "mlp."
        sites = []

        def site(base: str, kind: str, expert: int | None = None) -> None:
            names = {r: f"{base}{PROJ[r]}" for r in ROLES}
            scope = {r for r, n in names.items() if n in self.in_scope}
            sites.append(_MLPSite(names, scope, kind, expert))

        if isinstance(layer.mlp, MoE):
            if layer.mlp.shared is not None:
                site(p + "shared_experts.", "shared")
            for e in range(layer.mlp.num_experts):
                site(f"{p}experts.{e}.", "expert", e)
        else:
            site(p, "dense")
        return sites

    def _source_values(self, name: str) -> torch.Tensor:
        return open_rows(self.reader, self.modules[name]).full().float()

    # -- the pass ----------------------------------------------------------------------------------
    def run(self) -> CalibrationResult:
        t_start = time.perf_counter()
        cfg = self.cfg
        res = CalibrationResult(cfg.method, self.recipe.name, self.scope.name, self.stream.tokens,
                                len(self.stream.sequences), config={k: str(v) for k, v in asdict(cfg).items()})
        self.echo(f"calibrate: {cfg.method} on {self.recipe.name} ({self.scope.name}), {self.stream.tokens} tokens "
                  f"in {len(self.stream.sequences)} sequences ({self.calib.source}), {self.model.num_layers} layers")
        with torch.no_grad():
            h = self.model.embed(self.stream.ids)
            hq = h.clone() if cfg.needs_quantized_inputs else None
            for i in range(self.model.num_layers):
                rep, h, hq = self._layer(i, h, hq)
                release_freed()  # the layer's weights and MLP inputs (heap.py: why)
                res.layers.append(rep)
                self.echo(_progress_line(rep, self.model.num_layers))
        res.seconds = time.perf_counter() - t_start
        res.peak_rss_mb = peak_rss_mb()
        return res

    def _layer(self, i: int, h: torch.Tensor, hq: torch.Tensor | None
               ) -> tuple[LayerReport, torch.Tensor, torch.Tensor | None]:
        t0, c0 = time.perf_counter(), time.process_time()
        layer = self.model.load(i)
        h_attn = self.model.attention(layer, self.stream, h)
        x = self.model.mlp_input(layer, h_attn)
        xq = hq_attn = None
        if hq is not None:
            hq_attn = self.model.attention(layer, self.stream, hq)
            xq = self.model.mlp_input(layer, hq_attn)
        t_attn = time.perf_counter() - t0
        sites = self._sites(i, layer)
        # Routing: plain GPTQ fits each expert to the tokens the source routes to it; gptaq to the
        # tokens the quantized model routes to it (its inputs from both streams, paired by token).
        ids = self.model.route(layer, xq if xq is not None else x)
        groups = routed_tokens(ids, layer.mlp.num_experts) if ids is not None else None
        rep = LayerReport(i, 0.0, t_attn, 0.0)
        if groups is not None:
            rep.expert_tokens = [int(g.numel()) for g in groups]
        if self.observe is not None:
            self.observe(i, x if xq is None else xq, ids)
        # The runtime's decode buffers grow to the largest tile decoded so far (the first MoE layer's
        # expert tiles: ~64 MB at full width) and would stay through every later layer's solves.
        release_scratch()
        release_freed()
        results: dict[int | str, dict[str, dict[str, torch.Tensor]]] = {}  # gptaq: packed tensors by MLP
        t1 = time.perf_counter()
        num, num_rtn, den = 0.0, 0.0, 0
        for s in sites:
            if not s.scope:
                continue
            tok = groups[s.expert] if (s.kind == "expert" and groups is not None) else None
            xs = x if tok is None else x[tok]
            xqs = None if xq is None else (xq if tok is None else xq[tok])
            w = {r: self._source_values(n) for r, n in s.names.items()}
            r = solve_mlp(w, s.scope, xs, xqs, self.fmt, self.act, self.act, self.cfg)
            if not r.fallback:  # an MLP kept data-free gets the quantizer's data-free default instead
                for role, t in r.tensors.items():
                    self.store.put(s.names[role], t)
            if xq is not None:  # gptaq reloads the layer with these (packed) tensors; nothing else is kept
                results[s.expert if s.kind == "expert" else s.kind] = r.tensors
            rep.mlps += 1
            rep.fallback += int(r.fallback)
            rep.calibrated += int(not r.fallback)
            rep.smoothed += int(r.alpha is not None)
            rep.tokens_min = r.tokens if rep.tokens_min is None else min(rep.tokens_min, r.tokens)
            if r.tokens and r.err == r.err:
                num += r.err * r.tokens
                num_rtn += r.err_rtn * r.tokens
                den += r.tokens
            # Nothing of this MLP outlives it but its packed tensors (a Kimi-K2.5 expert's fp32 values
            # are 176 MB, its layer has 384): free them before the next MLP's solve.
            del w, xs, xqs, r
            release_freed()
        self.store.flush(f"layer-{i:04d}")  # nothing when every MLP of the layer was kept data-free
        rep.solve_seconds = time.perf_counter() - t1
        if den:
            rep.err, rep.err_rtn = num / den, num_rtn / den
        h_next = h_attn + self.model.mlp(layer.mlp, x)
        hq_next = None
        if hq_attn is not None and xq is not None:
            self._load_quantized(layer, sites, results)
            hq_next = hq_attn + self.model.mlp(layer.mlp, xq)
        release_scratch()
        rep.seconds = time.perf_counter() - t0
        rep.cpu_seconds = time.process_time() - c0
        rep.peak_rss_mb = peak_rss_mb()
        del layer
        return rep, h_next, hq_next

    def _weight(self, s: _MLPSite, role: str, tensors: dict[str, dict[str, torch.Tensor]] | None
                ) -> tuple[LinearWeight, ActQuant]:
        name = s.names[role]
        if tensors is not None and role in tensors:
            return canonical(tensors[role], self.fmt, self.modules[name].shape[1]), _act_quant(self.act_fmt)
        return self.model.reader.linear(name)

    def _load_quantized(self, layer: torch.nn.Module, sites: list[_MLPSite],
                        results: dict[int | str, dict[str, dict[str, torch.Tensor]]]) -> None:
        """Reload the layer's MLP weights with their quantized values (the served model's layer)."""
        mlp = layer.mlp
        dt, dev = self.model.dtype, torch.device("cpu")
        for s in sites:
            if s.kind == "expert" or not s.scope:
                continue
            r = results.get(s.kind)
            (g, ag), (u, _), (d, ad) = (self._weight(s, role, r) for role in ROLES)
            target = mlp.shared if s.kind == "shared" else mlp
            target.load(g, u, d, ag, ad, dt, dev)
        experts = [s for s in sites if s.kind == "expert"]
        if experts and isinstance(mlp, MoE):
            ws = {role: [] for role in ROLES}
            acts = set()
            for s in experts:
                r = results.get(s.expert) if s.expert is not None else None
                for role in ROLES:
                    w, a = self._weight(s, role, r)
                    ws[role].append(w)
                    acts.add(a)
            if len(acts) != 1:
                raise UsageError("calibrate: the routed experts of one layer mix activation formats")
            mlp.load_experts(ws["gate"], ws["up"], ws["down"], acts.pop(), dt, dev)


def _progress_line(r: LayerReport, n: int) -> str:
    err = (f", rel. output error {r.err_rtn:.4g} -> {r.err:.4g}" if r.err == r.err else "")
    return (f"layer {r.layer + 1}/{n}: {r.mlps} MLPs in scope ({r.calibrated} calibrated, {r.fallback} kept "
            f"data-free" + (f", {r.smoothed} smoothed" if r.smoothed else "") + f"; fewest tokens {r.tokens_min})"
            f"{err}; {r.seconds:.1f} s (attention {r.attention_seconds:.1f} s, solve {r.solve_seconds:.1f} s; CPU "
            f"{r.cpu_seconds:.1f} s), "
            f"peak RSS {r.peak_rss_mb:.0f} MB")
