"""eagle3 quantize vs AMD Quark 0.13 file-to-file, on one Kimi-shaped checkpoint, in one run.

    .venv/bin/python benchmarks/quantize.py [--workdir DIR] [--experts 32] [--vocab 32768]
                                            [--recipe mxfp4] [--workers 0] [--repeat 1] [--json out.json]

1. Generates (once, cached in --workdir) a Kimi-K2-Thinking-shaped checkpoint at the real tensor
   shapes: hidden 7168, MLA attention (q_lora 1536, kv_lora 512, 64 heads), layer 0 dense
   (intermediate 18432), layer 1 MoE with --experts routed experts (2048 wide) in Moonshot's
   compressed-tensors INT4 (group 32) plus one bf16 shared expert, embed/lm_head of --vocab rows;
   written with eagle3's CheckpointWriter in 1 GB shards (about 3 GB with the defaults).
2. Runs, each in a fresh process whose whole process tree is sampled for RSS:
   * "read+write": read every tensor and write it back (eagle3's reader/writer), no compute;
   * eagle3 native (`eagle3 quantize`, verification on, as a user runs it);
   * Quark 0.13 ``ModelQuantizer(cfg).direct_quantize_checkpoint(src, out, device="cpu")`` with
     the fixes it needs on CPU (``device="cpu"``, ``QUARK_DISABLE_COMPILE=1``, compressed-tensors
     installed, every module's tensors in one shard); its import time is reported separately.
3. Compares every tensor of the two outputs (bit for bit) and prints throughput (source bytes per
   second), peak RSS and the ratios; ``--json`` writes the same numbers. With ``--repeat N`` all
   runs go N rounds, alternating, and each tool's best wall time counts (this 2-core VM is shared:
   one run can take 1.5x another).

The recipe's modules are quantized by both tools: Quark gets the recipe's exclude globs, which on
this checkpoint select the same modules as the recipe's scope (checked: the tensor names agree).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
H, Q_LORA, KV_LORA, HEADS, NOPE, ROPE, V_DIM = 7168, 1536, 512, 64, 128, 64, 128
DENSE_I, MOE_I = 18432, 2048


# ---------------------------------------------------------------------------------------------
# Checkpoint generation
# ---------------------------------------------------------------------------------------------


def make_checkpoint(d: Path, experts: int, vocab: int) -> None:
    import torch

    from eagle3.checkpoint import CheckpointWriter, write_json
    from eagle3.formats.codecs import ct_int4_quantize

    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        # Filled in 16M-element slices so that generation itself stays lean.
        out = torch.empty(*shape, dtype=torch.bfloat16)
        flat = out.view(-1)
        for i in range(0, flat.numel(), 1 << 24):
            n = min(1 << 24, flat.numel() - i)
            flat[i:i + n] = (torch.randn(n, generator=g) * std).to(torch.bfloat16)
        return out

    tmp = d.with_name(d.name + ".tmp")
    with CheckpointWriter(tmp, max_shard_bytes=10**9) as w:
        w.add("model.embed_tokens.weight", rnd(vocab, H))
        for layer in (0, 1):
            p = f"model.layers.{layer}."
            w.add(p + "input_layernorm.weight", torch.ones(H, dtype=torch.bfloat16))
            w.add(p + "post_attention_layernorm.weight", torch.ones(H, dtype=torch.bfloat16))
            a = p + "self_attn."
            w.add(a + "q_a_proj.weight", rnd(Q_LORA, H))
            w.add(a + "q_a_layernorm.weight", torch.ones(Q_LORA, dtype=torch.bfloat16))
            w.add(a + "q_b_proj.weight", rnd(HEADS * (NOPE + ROPE), Q_LORA))
            w.add(a + "kv_a_proj_with_mqa.weight", rnd(KV_LORA + ROPE, H))
            w.add(a + "kv_a_layernorm.weight", torch.ones(KV_LORA, dtype=torch.bfloat16))
            w.add(a + "kv_b_proj.weight", rnd(HEADS * (NOPE + V_DIM), KV_LORA))
            w.add(a + "o_proj.weight", rnd(H, HEADS * V_DIM))
            if layer == 0:
                for n, shape in (("gate_proj", (DENSE_I, H)), ("up_proj", (DENSE_I, H)), ("down_proj", (H, DENSE_I))):
                    w.add(f"{p}mlp.{n}.weight", rnd(*shape))
                continue
            w.add(p + "mlp.gate.weight", rnd(experts, H))
            w.add(p + "mlp.gate.e_score_correction_bias", torch.zeros(experts, dtype=torch.float32))
            for n, shape in (("gate_proj", (MOE_I, H)), ("up_proj", (MOE_I, H)), ("down_proj", (H, MOE_I))):
                w.add(f"{p}mlp.shared_experts.{n}.weight", rnd(*shape))
            for e in range(experts):
                for n, shape in (("gate_proj", (MOE_I, H)), ("up_proj", (MOE_I, H)), ("down_proj", (H, MOE_I))):
                    packed, scale = ct_int4_quantize(rnd(*shape), 32)
                    m = f"{p}mlp.experts.{e}.{n}."
                    w.add(m + "weight_packed", packed)
                    w.add(m + "weight_scale", scale)
                    w.add(m + "weight_shape", torch.tensor(shape, dtype=torch.int32))
        w.add("model.norm.weight", torch.ones(H, dtype=torch.bfloat16))
        w.add("lm_head.weight", rnd(vocab, H))
    ct = {"config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                        "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                                    "group_size": 32, "num_bits": 4, "observer": "minmax",
                                                    "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                                                    "type": "int"}}},
          "format": "pack-quantized", "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                                 "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
          "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}
    write_json(tmp / "config.json", {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": vocab, "hidden_size": H,
        "intermediate_size": DENSE_I, "moe_intermediate_size": MOE_I, "num_hidden_layers": 2,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
        "v_head_dim": V_DIM, "n_routed_experts": experts, "num_experts_per_tok": min(8, experts),
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.827, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "max_position_embeddings": 262144, "rope_theta": 50000.0, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16", "quantization_config": ct})
    tmp.rename(d)


# ---------------------------------------------------------------------------------------------
# Measured runs
# ---------------------------------------------------------------------------------------------

COPY = """
import sys
from eagle3.checkpoint import CheckpointReader, CheckpointWriter
r = CheckpointReader(sys.argv[1])
for f, names in r.shards().items():
    with CheckpointWriter(sys.argv[2] + "/" + f.name + ".d", max_shard_bytes=1 << 62) as w:
        for n in names:
            w.add(n, r.get(n))
"""

QUARK = """
import json, os, sys, time
t0 = time.perf_counter()
from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import QConfig, QLayerConfig
from eagle3.quantize.recipes import load_recipe
from eagle3.quantize import quark as q
t1 = time.perf_counter()
recipe = load_recipe(sys.argv[3])
scope = recipe.scope(sys.argv[4] or None)
cfg = QConfig(global_quant_config=QLayerConfig(weight=q.weight_qspec(recipe.weight),
              input_tensors=q.input_qspec(recipe.activation)), exclude=list(scope.exclude))
ModelQuantizer(cfg).direct_quantize_checkpoint(pretrained_model_path=sys.argv[1], save_path=sys.argv[2], device="cpu")
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "quantize_s": t2 - t1}))
"""


def measure(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, float | str]:
    """Run cmd; wall time and peak RSS of its whole process tree (workers included), sampled."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})}, cwd=ROOT)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        try:
            proc = psutil.Process(p.pid)
        except psutil.NoSuchProcess:
            return
        while not stop.is_set():
            try:
                procs = [proc, *proc.children(recursive=True)]
                peak[0] = max(peak[0], sum(x.memory_info().rss for x in procs if x.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.05)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = p.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} failed ({p.returncode}):\n{err[-3000:]}")
    return {"wall_s": wall, "peak_rss_bytes": peak[0], "stdout": out}


def compare(a: Path, b: Path) -> dict[str, object]:
    import torch

    from eagle3.checkpoint import CheckpointReader

    ra, rb = CheckpointReader(a), CheckpointReader(b)
    na, nb = set(ra.names()), set(rb.names())
    diff = []
    for n in sorted(na & nb):
        x, y = ra.get(n), rb.get(n)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.reshape(-1).view(torch.uint8),
                                                                       y.reshape(-1).view(torch.uint8)):
            diff.append(n)
    return {"common_tensors": len(na & nb), "identical": len(na & nb) - len(diff), "different": diff[:10],
            "only_eagle3": sorted(na - nb)[:10], "only_quark": sorted(nb - na)[:10]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "eagle3-bench-quantize")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--recipe", default="mxfp4")
    ap.add_argument("--scope", default="")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--skip-quark", action="store_true", help="eagle3 and read+write only")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of all runs, alternating; best time of each")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    py = sys.executable
    src = args.workdir / f"kimi-slice-e{args.experts}-v{args.vocab}"
    if not src.exists():
        print(f"generating {src} ...", flush=True)
        args.workdir.mkdir(parents=True, exist_ok=True)
        make_checkpoint(src, args.experts, args.vocab)
    from eagle3.checkpoint import CheckpointReader

    reader = CheckpointReader(src)
    src_bytes = reader.total_bytes
    largest_shard = max(f.stat().st_size for f in reader.files)
    runs = args.workdir / "runs"
    import shutil

    shutil.rmtree(runs, ignore_errors=True)
    runs.mkdir()
    env = {"QUARK_DISABLE_COMPILE": "1", "PYTHONPATH": str(ROOT)}

    results: dict[str, dict] = {}
    print(f"source: {src} ({src_bytes / 1e9:.2f} GB, {len(reader.files)} shards, largest {largest_shard / 1e9:.2f} GB); "
          f"{os.cpu_count()} CPUs; best of {args.repeat} alternating rounds", flush=True)
    e3 = [py, "-m", "eagle3.cli", "quantize", str(src), str(runs / "eagle3"), "--recipe", args.recipe,
          "--workers", str(args.workers), "--quiet", "--json"]
    if args.scope:
        e3 += ["--scope", args.scope]

    def keep(name: str, r: dict) -> None:
        """Best (lowest) wall time of the rounds; every round's time is kept in the JSON."""
        walls = [*results.get(name, {}).get("walls_s", []), r["wall_s"]]
        peak = max(r["peak_rss_bytes"], results.get(name, {}).get("peak_rss_bytes", 0))
        if name not in results or r["wall_s"] < results[name]["wall_s"]:
            results[name] = r
        results[name]["walls_s"] = walls
        results[name]["peak_rss_bytes"] = peak  # the highest of the rounds

    # Rounds alternate the runs, so that a slow spell of this shared machine hits every tool alike.
    for _ in range(args.repeat):
        for d in ("copy", "eagle3", "eagle3-nv", "quark"):
            shutil.rmtree(runs / d, ignore_errors=True)
        (runs / "copy").mkdir()
        keep("read+write", measure([py, "-c", COPY, str(src), str(runs / "copy")], env))
        shutil.rmtree(runs / "copy")
        keep("eagle3", measure(e3, env))
        # Quark verifies nothing; the same run without eagle3's verification, for that comparison.
        keep("eagle3 --no-verify", measure([*e3[:5], str(runs / "eagle3-nv"), *e3[6:], "--no-verify"], env))
        shutil.rmtree(runs / "eagle3-nv")
        if not args.skip_quark:
            r = measure([py, "-c", QUARK, str(src), str(runs / "quark"), args.recipe, args.scope], env)
            times = json.loads(r["stdout"].strip().splitlines()[-1])
            r.update(times)
            r["wall_s"] = times["quantize_s"]  # Quark's import (20-40 s) is reported apart
            keep("quark", r)
    for r in results.values():
        r.pop("stdout", None)
        r["throughput_MBps"] = src_bytes / 1e6 / r["wall_s"]
    summary: dict[str, object] = {"source_bytes": src_bytes, "largest_shard_bytes": largest_shard,
                                  "cpus": os.cpu_count(), "recipe": args.recipe, "scope": args.scope or "default",
                                  "experts": args.experts, "vocab": args.vocab, "runs": results}
    if "quark" in results:
        summary["speedup_vs_quark"] = results["quark"]["wall_s"] / results["eagle3"]["wall_s"]
        summary["speedup_vs_quark_no_verify"] = results["quark"]["wall_s"] / results["eagle3 --no-verify"]["wall_s"]
        summary["speedup_vs_quark_incl_import"] = (results["quark"]["wall_s"] + results["quark"]["import_s"]) / \
            results["eagle3"]["wall_s"]
        summary["tensors"] = compare(runs / "eagle3", runs / "quark")
    summary["eagle3_vs_read_write_time"] = results["eagle3"]["wall_s"] / results["read+write"]["wall_s"]
    summary["eagle3_peak_rss_minus_largest_shard_GiB"] = (results["eagle3"]["peak_rss_bytes"] - largest_shard) / 2**30

    gib = 2**30
    print(f"{'run':20s} {'wall s':>8s} {'MB/s':>8s} {'peak RSS GiB':>13s}")
    for name, r in results.items():
        print(f"{name:20s} {r['wall_s']:8.1f} {r['throughput_MBps']:8.1f} {r['peak_rss_bytes'] / gib:13.2f}"
              + (f"   (+ {r['import_s']:.1f} s import)" if "import_s" in r else "")
              + (f"   rounds: {', '.join(f'{w:.1f}' for w in r['walls_s'])}" if len(r["walls_s"]) > 1 else ""))
    if "quark" in results:
        t = summary["tensors"]
        print(f"eagle3 / Quark throughput: {summary['speedup_vs_quark']:.2f}x "
              f"({summary['speedup_vs_quark_incl_import']:.2f}x counting Quark's import, "
              f"{summary['speedup_vs_quark_no_verify']:.2f}x without eagle3's verification); tensors identical: "
              f"{t['identical']}/{t['common_tensors']}" + (f", DIFFERENT: {t['different']}" if t["different"] else ""))
    print(f"eagle3 time / read+write time: {summary['eagle3_vs_read_write_time']:.2f}x; eagle3 peak RSS = largest "
          f"shard + {summary['eagle3_peak_rss_minus_largest_shard_GiB']:.2f} GiB")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
