"""Where the runtime's tensors live when the model is not on the CPU, checked without a GPU: the
``meta`` device stands in for it (tensors with shapes and no values). The first GPU run failed
here: an engine given a loaded CUDA target kept its KV caches and attention metadata on the CPU
(the configured default), the test helper built its metadata on the CPU, and constant lookup tables
were copied to the device on every call (refused while a CUDA graph is captured)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagle3.errors import UsageError
from eagle3.formats import codecs
from eagle3.runtime.engine import graphs
from eagle3.runtime.engine.llm import LLM, _loaded_device
from eagle3.runtime.engine.model_runner import build_attn_metadata, build_tree_attn_metadata
from eagle3.runtime.interfaces import model_device
from eagle3.runtime.kernels.torch_ref import mxfp4_qdq
from eagle3.runtime.loader import load_draft, load_target
from eagle3.runtime.sampling import SamplingBatch, SamplingParams
from eagle3.runtime.spec.tree import DraftTree, depths
from eagle3.runtime.spec.tree_proposer import draft_tree
from eagle3.runtime.spec.tree_rejection import tree_rejection_sample

META = torch.device("meta")


def _tensors(meta) -> dict[str, torch.Tensor]:
    out = {f: getattr(meta, f) for f in ("positions", "cu_seqlens_q", "context_lens", "slot_mapping", "block_tables")}
    if meta.tree is not None:
        out["tree.ancestors"] = meta.tree.ancestors
    return out


def test_metadata_is_built_on_the_requested_device() -> None:
    meta = build_attn_metadata([[3, 4], [7]], [5, 2], [2, 2], 4, META)
    assert {k: t.device for k, t in _tensors(meta).items()} == dict.fromkeys(_tensors(meta), META)
    assert meta.host_cu == [0, 2, 4]  # the host copy a graph's plan reads instead of the device tensor
    par = torch.tensor([[-1, 0, 0]])
    tree = DraftTree(par, torch.tensor([[1, 2, 3]]), depths(par), torch.zeros(1, 3))
    meta = build_tree_attn_metadata([[0, 1]], [4], tree, 4, META)
    assert {k: t.device for k, t in _tensors(meta).items()} == dict.fromkeys(_tensors(meta), META)


@pytest.fixture(scope="module")
def meta_target(tiny_dir: Path):
    return load_target(tiny_dir / "kimi-k2.5", dtype=torch.float32, device="meta")


def test_a_loaded_target_keeps_the_engine_on_its_device(meta_target, tiny_dir: Path) -> None:
    """The models keep their weights as buffers: the device comes from the kernel backend."""
    assert model_device(meta_target) == META
    assert _loaded_device(meta_target, torch.device("cpu"), explicit=False) == META  # the default: the model's
    assert _loaded_device(meta_target, META, explicit=True) == META
    with pytest.raises(UsageError, match="device='cpu', but the target was loaded on 'meta'"):
        LLM(meta_target, None, tokenizer=None, device="cpu", num_blocks=8, block_size=4)


def test_metadata_on_another_device_than_the_model_is_one_line(tiny_dir: Path) -> None:
    cpu = load_target(tiny_dir / "kimi-k2.5", dtype=torch.float32)
    meta = build_attn_metadata([[0]], [0], [2], 4, META)
    kv = [torch.zeros(1, 4, *cpu.kv_cache_spec().shape) for _ in range(cpu.num_layers)]
    with pytest.raises(UsageError, match="metadata .* on meta, the model on cpu"):
        cpu.forward(torch.tensor([1, 2]), meta, kv)


class _HostCopies(TorchDispatchMode):
    """Records every op that takes a CPU tensor of more than one element and returns a tensor on
    another device: a host -> device copy (what a CUDA graph capture refuses)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        res = out if isinstance(out, (tuple, list)) else (out,)
        if any(a.device.type == "cpu" and a.numel() > 1 for a in flat) and any(
                isinstance(r, torch.Tensor) and r.device.type != "cpu" for r in res):
            self.ops.append(str(func))
        return out


def test_lookup_tables_go_to_a_device_once() -> None:
    """MXFP4 activation fake-quantization (the Triton MXFP4 linears and MoE run it per call) and the
    INT4 nibble codecs read constant tables: copied to a device on first use and kept there."""
    assert codecs.on_device(codecs._E8M0_LUT, torch.device("cpu")) is codecs._E8M0_LUT
    x = torch.empty(3, 64, device=META)
    words = torch.empty(2, 4, dtype=torch.int32, device=META)
    mxfp4_qdq(x)  # warm-up: the tables are copied here
    codecs.quark_int4_unpack(words, reorder=True, k=32)
    with _HostCopies() as seen:
        mxfp4_qdq(x)
        codecs.quark_int4_unpack(words, reorder=True, k=32)
        codecs.ct_int4_unpack(words, 32)
    assert seen.ops == []
    assert codecs.on_device(codecs._E8M0_LUT, META) is codecs.on_device(codecs._E8M0_LUT, META)


def test_a_host_tree_is_verified_on_the_logits_device() -> None:
    """The engine keeps a verified tree's structure on the host (scheduler lists, the step's
    attention metadata); the walk runs next to the target's logits. On the first GPU runs every
    tree step failed here ("indices should be either on cpu or on the same device")."""
    par = torch.tensor([[-1, 0, 0, 1, 2]])
    tree = DraftTree(par, torch.tensor([[1, 2, 3, 4, 5]]), depths(par), torch.zeros(1, 5))
    greedy = SamplingBatch.build([SamplingParams(temperature=0.0)], [None])
    res = tree_rejection_sample(torch.empty(1, 5, 16, device=META), tree, greedy)
    assert {t.device for t in (res.token_ids, res.num_accepted, res.node_ids, res.last_node)} == {META}


def test_a_tree_step_is_drafted_and_padded_on_the_models_device(tiny_dir: Path) -> None:
    """Draft-tree steps: the builder, the tree masks and the drafted tree follow the draft's
    device, and a graph step's padded ancestor mask stays there (no host round trip)."""
    target = load_target(tiny_dir / "kimi-k2.5", dtype=torch.float32, device="meta")
    draft = load_draft(tiny_dir / "kimi-k2.5-eagle3", target, device="meta")
    seen: list[torch.Tensor] = []

    def step(ids, hidden, tables, starts, counts, positions, tree):
        seen.extend([ids, hidden, tree.ancestors])
        assert positions.device.type == "cpu"  # RoPE positions: host values, copied with the metadata
        return hidden.clone(), hidden.clone()

    h = draft.hidden_size
    tree = draft_tree(draft, step, torch.tensor([5, 6], device=META), torch.empty(2, h, device=META),
                      torch.empty(2, h, device=META), [7, 9], [[0, 1, 2], [3, 4, 5]], topk=2, steps=3, num_nodes=6)
    assert seen and {t.device for t in seen} == {META}
    assert {t.device for t in (tree.parents, tree.tokens, tree.depth, tree.scores)} == {META}
    n = 4
    step_ = graphs.TreeStep(n, torch.ones(2, n, n, dtype=torch.bool, device=META), torch.arange(4).view(2, 2))
    padded = graphs.pad_uniform_step([[0, 1], [2]], [2, 1], 2, 4, 3, 4, 9, step_)
    assert padded.ancestors is not None and padded.ancestors.device == META
    assert padded.positions.device.type == "cpu"  # copied in with the other host metadata, before a replay
