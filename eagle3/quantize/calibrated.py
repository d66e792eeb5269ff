"""``eagle3 quantize --calibrate``: the calibration pass of a calibrated ``--method`` inside a quantize run.

The calibrated methods (``gptq``, ``gptaq``, ``smooth``, ``smooth+gptq``, ``smooth+gptaq``) choose a
weight's numbers from its inputs on calibration prompts, which exist only while the source runs layer
by layer. So a calibrated run has two passes over the source:

1. the streaming calibration (:class:`eagle3.quantize.calibrate.Calibrator`): one decoder layer at a
   time, every in-scope MLP solved from the tokens that reach it, each layer's export tensors written
   to a store inside ``OUT.partial`` (the run's state directory) as soon as the layer is done, one
   progress line per layer;
2. the file-to-file quantizer, unchanged: it writes the store's tensors for the modules the pass
   solved (:class:`eagle3.quantize.methods.InputStats` ``solved``) and the format's data-free default
   for every other weight, through the same writer, so tensor names, dtypes, shapes and
   ``quantization_config`` are those of ``--method rtn``.

The pass's summary (per layer: MLPs calibrated and kept data-free, the fewest tokens an MLP saw,
relative output error before and after, time, peak RSS) goes into quantization_report.json as
``calibration``. Everything here is checked (flags, the calibration file, its tokens) before anything
is written.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3.errors import UsageError
from eagle3.quantize import methods
from eagle3.quantize.recipes import Recipe, Scope

if TYPE_CHECKING:  # the calibration package loads the runtime's layers: imported when a pass runs
    from eagle3.quantize.calibrate.prompts import CalibrationSet

STORE_DIR = "calibration"  # under the run's state directory (OUT.partial/.eagle3-quantize)
SUMMARY = "calibration.json"  # the finished pass's summary, beside the store: --resume reuses both


@dataclass(frozen=True)
class Calibration:
    """``--calibrate SOURCE --calibrate-samples N --calibrate-tokens T``."""

    source: str  # "gsm8k" (the packaged training split) or a JSONL file
    samples: int | None = None  # None: the calibration package's default (prompts.DEFAULT_SAMPLES)
    max_tokens: int | None = None  # None: prompts.DEFAULT_MAX_TOKENS
    # An MLP is calibrated when at least this many tokens per input channel reach it (None: the
    # calibration package's MIN_TOKENS_PER_INPUT, 1.0; fewer leave its Hessian rank-deficient).
    min_tokens_per_input: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "samples": self.samples, "max_tokens": self.max_tokens,
                "min_tokens_per_input": self.min_tokens_per_input}

    def config(self, method: str) -> Any:
        """The calibration package's :class:`~eagle3.quantize.calibrate.CalibConfig` of ``method``."""
        from eagle3.quantize.calibrate import CalibConfig

        if self.min_tokens_per_input is None:
            return CalibConfig(method=method)
        return CalibConfig(method=method, min_tokens_per_input=self.min_tokens_per_input)


def check_method(meth: methods.Method, calibration: Calibration | None) -> None:
    """A calibrated method needs ``--calibrate``; a data-free one refuses it (one line each)."""
    if methods.is_calibrated(meth) and calibration is None:
        raise UsageError(f"--method {meth.name} is calibrated: give --calibrate gsm8k or --calibrate FILE.jsonl "
                         f"(prompts run through the source), or a data-free --method (rtn, mse)")
    if calibration is not None and not methods.is_calibrated(meth):
        calibrated = ", ".join(n for n in methods.METHODS if methods.is_calibrated(n))
        raise UsageError(f"--calibrate goes with a calibrated --method ({calibrated}); --method {meth.name} is "
                         f"data-free")


def load_set(src_dir: Path, calibration: Calibration) -> CalibrationSet:
    """The calibration token sequences, read and tokenized up front (a bad file fails before any write)."""
    from eagle3.quantize.calibrate.prompts import DEFAULT_MAX_TOKENS, DEFAULT_SAMPLES, GSM8K, load_calibration
    from eagle3.runtime.tokenizer import load_tokenizer

    samples = DEFAULT_SAMPLES if calibration.samples is None else calibration.samples
    tokens = DEFAULT_MAX_TOKENS if calibration.max_tokens is None else calibration.max_tokens
    if calibration.source != GSM8K and not calibration.source.lower().endswith((".jsonl", ".jsonl.gz")):
        raise UsageError(f"--calibrate {calibration.source}: give gsm8k or a FILE.jsonl (one JSON object per line "
                         f"with 'text', 'prompt' (+ 'completion') or 'question' + 'answer')")
    return load_calibration(calibration.source, load_tokenizer(src_dir), samples, tokens)


def run_pass(src_dir: Path, rec: Recipe, scope: Scope, method: str, calibration: Calibration, calib: CalibrationSet,
             state: Path, echo: Callable[[str], None] | None,
             data_free: Callable[[str], methods.InputStats] | None = None,
             ) -> tuple[dict[str, Any], Callable[[str], methods.InputStats]]:
    """The calibration pass into ``state``/calibration (reused when a finished one is there: --resume);
    returns its report section and the quantizer's ``input_stats`` reading the store (a module the pass
    did not solve gets ``data_free(module)``: what the format's data-free default uses, if anything)."""
    from eagle3.checkpoint import read_json, write_json
    from eagle3.quantize.calibrate import Calibrator, TensorStore

    root = state / STORE_DIR
    done = state / SUMMARY
    if done.is_file():
        section = read_json(done)
        (echo or _stderr)(f"calibrate: reusing the finished pass in {root}")
    else:
        store = TensorStore(root)
        result = Calibrator(src_dir, rec, scope, calibration.config(method), calib, store,
                            echo=echo or (lambda _line: None)).run()
        section = summary(result, calib)
        write_json(done, section)
    return section, _store_reader(root, method, data_free)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def summary(result: Any, calib: CalibrationSet) -> dict[str, Any]:
    """The report's ``calibration`` section: totals first, then one entry per decoder layer."""
    layers = [{"layer": r.layer, "mlps": r.mlps, "calibrated": r.calibrated, "kept_data_free": r.fallback,
               "smoothed": r.smoothed, "fewest_tokens": r.tokens_min, "rel_output_error_data_free": _num(r.err_rtn),
               "rel_output_error": _num(r.err), "seconds": round(r.seconds, 3),
               "attention_seconds": round(r.attention_seconds, 3), "solve_seconds": round(r.solve_seconds, 3),
               "cpu_seconds": round(r.cpu_seconds, 3),
               "peak_rss_mb": round(r.peak_rss_mb, 1), "expert_tokens": r.expert_tokens}
              for r in result.layers]
    return {"method": result.method, "source": calib.source, "sequences": result.sequences, "tokens": result.tokens,
            "calibrated": result.calibrated, "kept_data_free": result.fallback, "seconds": round(result.seconds, 3),
            "peak_rss_mb": round(result.peak_rss_mb, 1), "layers": layers, "config": result.config,
            "warning": coverage_warning(result.calibrated, result.fallback)}


def coverage_warning(calibrated: int, kept: int) -> str | None:
    """Said when most MLPs in scope kept their data-free values: at Kimi-K2.5's width (7168 inputs)
    a routed expert needs 7168 routed tokens, which the default 16 x 2048 calibration tokens give to
    none of its 384 experts (top 8: ~680 each), so such a run would change nothing and say so only
    in its counts."""
    if kept == 0 or kept <= calibrated:
        return None
    return (f"{kept} of {calibrated + kept} MLPs saw fewer calibration tokens than they have inputs and kept "
            "their data-free values: raise --calibrate-samples / --calibrate-tokens (or lower "
            "--calibrate-min-tokens) to calibrate them")


def _num(v: float) -> float | None:
    return None if v != v else round(float(v), 6)  # NaN (no MLP in scope) -> null in JSON


def _store_reader(root: Path, method: str, data_free: Callable[[str], methods.InputStats] | None
                  ) -> Callable[[str], methods.InputStats]:
    from eagle3.quantize.calibrate import TensorStore

    store = TensorStore(root)
    lock = threading.Lock()  # the store keeps one layer's file open; quantizer workers share it

    def input_stats(module: str) -> methods.InputStats:
        if module not in store:
            return data_free(module) if data_free is not None else methods.NO_STATS
        with lock:
            tensors = store.get(module)
        return methods.InputStats(solved=tensors, source=f"{module} ({method} calibration)")

    return input_stats


def summary_line(section: dict[str, Any]) -> str:
    """``calibration: gptq on 2048 tokens (gsm8k ...): 28 MLPs calibrated, 0 kept data-free; rel. output
    error 0.0283 -> 0.0105 (last layer); 190 s, peak RSS 616 MB``."""
    errs = [(x["rel_output_error_data_free"], x["rel_output_error"]) for x in section["layers"]
            if x["rel_output_error"] is not None]
    err = f"; rel. output error {errs[-1][0]:.4g} -> {errs[-1][1]:.4g} (last layer)" if errs else ""
    return (f"calibration: {section['method']} on {section['tokens']} tokens in {section['sequences']} sequences "
            f"({section['source']}): {section['calibrated']} MLPs calibrated, {section['kept_data_free']} kept "
            f"data-free{err}; {section['seconds']:.1f} s, peak RSS {section['peak_rss_mb']:.0f} MB"
            + (f"\nwarning: {section['warning']}" if section.get("warning") else ""))
