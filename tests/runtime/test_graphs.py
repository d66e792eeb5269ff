"""CUDA / HIP graphs (``eagle3/runtime/engine/graphs.py``): bucket choice, padding, static-buffer
copy-in / copy-out, and the whole graph path through ``LLM`` on the CPU with a capturer that runs
the forward eagerly over the static buffers (``torch.cuda.graphs`` cannot run here): padded replays
give the same tokens as eager steps, bit for bit, because the kernels are batch invariant. The real
capture is in the ``gpu`` test at the end (skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.runtime.engine import graphs
from eagle3.runtime.engine.llm import LLM
from eagle3.runtime.engine.model_runner import build_attn_metadata
from eagle3.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
PROMPTS = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 700, 12], [100, 200, 300]]


def test_buckets() -> None:
    assert graphs.capture_sizes(1) == [1]
    assert graphs.capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert graphs.capture_sizes(48) == [1, 2, 4, 8, 16, 32, 64]
    sizes = graphs.capture_sizes(8)
    assert [graphs.bucket_for(b, sizes) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_pad_uniform_step_pads_into_the_pad_block() -> None:
    step = graphs.pad_uniform_step([[3, 4], [7]], starts=[5, 2], q_len=2, bucket=4, width=3, block_size=4,
                                   pad_block=9)
    assert step.positions.tolist() == [5, 6, 2, 3, 0, 0, 0, 0]
    # seq 0: positions 5, 6 in block 4 (slots 17, 18); seq 1: 2, 3 in block 7; padding: slot 36 = 9 * 4
    assert step.slot_mapping.tolist() == [17, 18, 30, 31, 36, 36, 36, 36]
    assert step.block_tables.tolist() == [[3, 4, -1], [7, -1, -1], [9, 9, 9], [9, 9, 9]]
    assert step.context_lens.tolist() == [7, 4, 1, 1]
    # the same positions and slots as the engine's eager metadata for the real rows
    meta = build_attn_metadata([[3, 4], [7]], [5, 2], [2, 2], 4)
    assert torch.equal(step.positions[:4], meta.positions) and torch.equal(step.slot_mapping[:4], meta.slot_mapping)
    with pytest.raises(ValueError, match="no KV block"):
        graphs.pad_uniform_step([[3]], starts=[3], q_len=2, bucket=1, width=3, block_size=4, pad_block=9)
    # blocks past the static width (allocated ahead for drafts) are cut; a context past it is refused
    step = graphs.pad_uniform_step([[1, 2, 3, 4]], starts=[10], q_len=2, bucket=1, width=3, block_size=4, pad_block=9)
    assert step.block_tables.tolist() == [[1, 2, 3]] and step.slot_mapping.tolist() == [14, 15]
    with pytest.raises(ValueError, match="past the static 3 blocks"):
        graphs.pad_uniform_step([[1, 2, 3, 4]], starts=[11], q_len=2, bucket=1, width=3, block_size=4, pad_block=9)


def test_static_buffers_copy_in_and_out() -> None:
    buf = graphs.StaticBuffers(max_tokens=8, max_seqs=4, width=3, device=torch.device("cpu"),
                               extra={"hidden": ((5,), torch.float32)})
    buf.tensors["hidden"].fill_(7.0)  # stale rows of an earlier, larger step
    step = graphs.pad_uniform_step([[3, 4]], starts=[5], q_len=2, bucket=2, width=3, block_size=4, pad_block=9)
    x = torch.randn(2, 5)
    buf.copy_in(step, {"input_ids": torch.tensor([11, 12]), "hidden": x}, num_tokens=2)
    s = buf.tensors
    assert s["input_ids"][:4].tolist() == [11, 12, 0, 0]
    assert torch.equal(s["hidden"][:2], x) and not s["hidden"][2:4].any() and bool((s["hidden"][4:] == 7).all())
    meta = buf.meta(q_len=2, bucket=2, block_size=4)
    assert meta.host_cu == [0, 2, 4] and meta.cu_seqlens_q.tolist() == [0, 2, 4] and meta.cache == {}
    assert meta.positions.data_ptr() == s["positions"].data_ptr() and meta.num_tokens == 4
    out = torch.arange(8.0).view(4, 2)
    got = graphs.copy_out((out, None), 3)
    assert torch.equal(got[0], out[:3]) and got[1] is None and got[0].data_ptr() != out.data_ptr()


@pytest.fixture
def fake_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph path on the CPU: graphs "available", captured by :class:`graphs.EagerCapturer`."""
    monkeypatch.setattr(graphs, "available", lambda device: True)
    monkeypatch.setattr(graphs, "default_capturer", graphs.EagerCapturer)


@pytest.fixture(scope="module")
def tiny_target(tiny_dir: Path):
    """The tiny target, loaded once for the module's engines (each loaded its own, two engines a
    test); an engine keeps its KV cache and graphs in its own runner. test_cpu_never_uses_graphs
    keeps an engine that loads the target from its directory."""
    from eagle3.runtime.loader import load_target

    return load_target(tiny_dir / "kimi-k2.5", dtype=torch.float32)


def _llm(tiny_target, tiny_dir: Path, draft: str | None, **kw) -> LLM:
    return LLM(tiny_target, None if draft is None else tiny_dir / draft, num_speculative_tokens=3,
               tokenizer=None, num_blocks=48, block_size=4, max_num_seqs=4, **kw)


def test_padding_rows_do_not_change_real_rows(tiny_target, tiny_dir: Path, fake_graphs: None) -> None:
    """A target forward of 3 sequences x 2 tokens through the graph runner (padded to the bucket of
    4) equals the eager forward of the same 3 sequences, bit for bit, and writes the same KV."""
    llm = _llm(tiny_target, tiny_dir, "kimi-k2.5-eagle3")  # k = 3: graphs for up to 4 query tokens per sequence
    runner = llm.runner
    assert llm.cuda_graphs and runner.target_graphs is not None
    tables, starts, counts = [[0, 1], [2], [3, 4]], [4, 1, 5], [2, 2, 2]
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    hidden, aux = runner.forward_target(ids, tables, starts, counts)
    assert runner.target_graphs.replays == 1
    kv_graph = [c.clone() for c in runner.target_kv]
    for c in runner.target_kv:
        c.zero_()
    meta = runner.meta(tables, starts, counts)
    ref_hidden, ref_aux = llm.target.forward(ids, meta, runner.target_kv, runner.aux_layer_ids)
    assert torch.equal(hidden, ref_hidden) and torch.equal(aux, ref_aux)
    pad = runner.target_graphs.pad_block
    for got, ref in zip(kv_graph, runner.target_kv, strict=True):  # every real block; the pad block differs
        assert torch.equal(got[:pad], ref[:pad])


@pytest.mark.parametrize("draft", [None, "kimi-k2.5-eagle3", "kimi-k2.6-eagle3.1-mla"])
def test_graph_steps_equal_eager_steps(tiny_target, tiny_dir: Path, fake_graphs: None, draft: str | None) -> None:
    eager = _llm(tiny_target, tiny_dir, draft, enforce_eager=True)
    assert not eager.cuda_graphs and eager.runner.target_graphs is None
    expected = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    llm = _llm(tiny_target, tiny_dir, draft)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert llm.runner.target_graphs.replays > 0 and llm.runner.target_graphs.failed is None
    if draft is not None:
        assert llm.runner.draft_graphs.replays > 0
        assert (4, 4) in llm.runner.target_graphs.graphs  # verify (last token + 3 drafts) of 3 sequences
        assert (1, 4) in llm.runner.draft_graphs.graphs  # draft steps 1..k-1 of the 3 sequences (bucket 4)


@pytest.mark.parametrize("draft", ["kimi-k2.5-eagle3", "kimi-k2.6-eagle3.1-mla"])
def test_tree_steps_replay_graphs_with_the_eager_tokens(tiny_target, tiny_dir: Path, fake_graphs: None, draft: str) -> None:
    """Draft trees (topk 2, 3 steps, 7 nodes): the verify of the trees and the draft's tree steps
    replay graphs keyed by their tree size, every replay with the tree of its step in the static
    buffers, and the tokens are the eager engine's."""
    tree = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=7)
    eager = _llm(tiny_target, tiny_dir, draft, enforce_eager=True, **tree)
    expected = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    llm = _llm(tiny_target, tiny_dir, draft, **tree)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    target, drafts = llm.runner.target_graphs, llm.runner.draft_graphs
    assert target.failed is None and drafts.failed is None
    assert (7, 4, 7) in target.graphs  # the 3 sequences' trees of 7 nodes (bucket 4)
    assert {(2, 4, 2), (2, 4, 4)} <= set(drafts.graphs)  # 2 frontier nodes over regions of 2 and 4 nodes


def test_a_failed_tree_capture_keeps_the_chain_graphs(tiny_target, tiny_dir: Path, fake_graphs: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree step's capture that fails (say, memory for a large tree) sends tree steps to the
    eager path only: decode and chain graphs keep replaying, and the tokens are the eager engine's."""
    nodes = {"last": 0}
    meta = graphs.StaticBuffers.meta

    def spy(self, q_len, bucket, block_size, tree_nodes=0, width=None):
        nodes["last"] = tree_nodes
        return meta(self, q_len, bucket, block_size, tree_nodes, width)

    class TreeRefuses(graphs.EagerCapturer):
        def capture(self, fn):
            if nodes["last"]:
                raise RuntimeError("CUDA out of memory")
            return super().capture(fn)

    monkeypatch.setattr(graphs.StaticBuffers, "meta", spy)
    monkeypatch.setattr(graphs, "default_capturer", TreeRefuses)
    tree = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=7)
    expected = [o.token_ids for o in _llm(tiny_target, tiny_dir, "kimi-k2.5-eagle3", enforce_eager=True, **tree).generate(PROMPTS, GREEDY)]
    llm = _llm(tiny_target, tiny_dir, "kimi-k2.5-eagle3", **tree)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    target = llm.runner.target_graphs
    assert "out of memory" in target.tree_failed and target.failed is None
    assert target.graphs and all(len(key) == 2 for key in target.graphs)  # chain / decode graphs only
    assert target.replays > 0


def test_steps_past_the_context_cap_run_eagerly_with_the_same_tokens(tiny_target, tiny_dir: Path, fake_graphs: None) -> None:
    """``max_seq_len_to_capture``: every graph covers contexts up to the cap (block tables of its
    blocks); the 11-token prompt crosses it mid-generation, and from then on its steps (the whole
    batch's) run eagerly, target and draft. Tokens and logprobs are the eager engine's; the runner
    counts the eager steps."""
    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2)
    draft = "kimi-k2.5-eagle3"
    want = [(o.token_ids, o.logprobs) for o in _llm(tiny_target, tiny_dir, draft, enforce_eager=True).generate(PROMPTS, sp)]
    llm = _llm(tiny_target, tiny_dir, draft, max_seq_len_to_capture=16)
    assert [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, sp)] == want
    stats = llm.runner.graph_stats()
    target, dg = stats["target"], stats["draft"]
    assert target["max_context"] == target["max_context_full_batch"] == 16
    assert {m.block_tables.shape[1] for m in llm.runner.target_graphs.metas.values()} == {4}  # 16 positions, blocks of 4
    assert target["replays"] > 0 and target["eager_over_cap"] > 0 and target["eager"] >= target["eager_over_cap"]
    assert dg["max_context"] == 16 and dg["replays"] > 0 and dg["eager_over_cap"] > 0
    # the default caps of these 4-head models: the longest context a step can have (tiny workspaces)
    r = _llm(tiny_target, tiny_dir, draft).runner
    assert r.target_graphs.max_context == r.target_graphs.context_cap(16) == r.max_model_len + 2 * r.k + 1


def test_each_graph_caps_its_context_by_its_split_workspace(tiny_target, tiny_dir: Path, fake_graphs: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The default caps follow each graph's query tokens: with a budget of two splits' partials for
    one token (the tiny target: 4 heads, latent 512, splits of 64 keys), a one-sequence graph covers
    128 positions and a two-sequence one 64. The 62-token prompt passes 64 while the short one
    still decodes: those steps run eagerly; alone, it replays the one-sequence graph (32 blocks
    wide) past 64. Tokens and logprobs are the eager engine's."""
    from eagle3.runtime import split_kv

    per_split = split_kv.workspace_bytes(1, 1, 4, 512)
    assert split_kv.split_size(4, 512, 64) == 64
    monkeypatch.setattr(split_kv, "GRAPH_WORKSPACE_BUDGET", 2 * per_split)
    prompts = [list(range(3, 65)), [100, 200, 300]]
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (12, 5)]
    want = [(o.token_ids, o.logprobs) for o in _llm(tiny_target, tiny_dir, None, enforce_eager=True).generate(prompts, sps)]
    replayed: list[tuple[int, int]] = []  # (bucket, longest context) of each graph step
    pad = graphs.pad_uniform_step

    def spy(tables, starts, q_len, bucket, *args, **kw):
        replayed.append((bucket, max(starts) + q_len))
        return pad(tables, starts, q_len, bucket, *args, **kw)

    monkeypatch.setattr(graphs, "pad_uniform_step", spy)
    llm = _llm(tiny_target, tiny_dir, None)
    assert [(o.token_ids, o.logprobs) for o in llm.generate(prompts, sps)] == want
    g = llm.runner.target_graphs
    assert (g.context_cap(1), g.context_cap(2), g.context_cap(4)) == (128, 64, 64)
    assert g.stats()["max_context"] == 128 and g.stats()["max_context_full_batch"] == 64
    assert g.metas[(1, 2)].block_tables.shape == (2, 16) and g.metas[(1, 1)].block_tables.shape == (1, 32)
    assert g.over_cap > 0 and max(c for b, c in replayed if b == 2) <= 64  # two sequences past 64: eager
    assert max(c for b, c in replayed if b == 1) > 64  # one sequence past 64: its graph


def test_the_default_cap_keeps_the_split_workspace_small() -> None:
    """Kimi-K2.5's MLA (64 heads, latent 512 + 64: splits of 256 keys) at the engine's defaults (64
    sequences, k = 3): the largest verify graph holds 256 query tokens, and its default cap (1,792
    positions, 7 splits) keeps its split partials at 236 MB; a decode graph of 64 rows gets 7,936
    positions (261 MB), one sequence's decode the whole 256 Ki context (134 MB); a TP-8 shard's 8
    heads (splits of 64 keys) 4,032 at 256 tokens (265 MB). Explicit caps win; nothing passes the
    longest context a step can have."""
    from eagle3.runtime import split_kv
    from eagle3.runtime.engine.config import EngineConfig

    cfg = EngineConfig()
    kimi = type("MLA", (), {"num_heads": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64})()
    tokens = graphs.capture_sizes(cfg.max_num_seqs)[-1] * (cfg.max_k + 1)
    assert tokens == 256 and cfg.max_seq_len_to_capture is None
    cap = graphs.context_cap(262_144, tokens, kimi)
    assert cap == 1792 and cap % split_kv.split_size(64, 512, 64) == 0
    ws = split_kv.graph_workspace_bytes(tokens, cap, 64, 512, 64)
    assert ws == 256 * 7 * 64 * 514 * 4 == 235_798_528 <= split_kv.GRAPH_WORKSPACE_BUDGET
    assert split_kv.graph_workspace_bytes(tokens, cap + 256, 64, 512, 64) > split_kv.GRAPH_WORKSPACE_BUDGET
    assert graphs.context_cap(262_144, 64, kimi) == 7936 and split_kv.graph_workspace_bytes(64, 7936, 64, 512, 64) == 261_062_656
    assert graphs.context_cap(262_144, 1, kimi) == 262_144
    assert split_kv.graph_workspace_bytes(1, 262_144, 64, 512, 64) == 134_742_016
    shard = type("MLA", (), {"num_heads": 8, "kv_lora_rank": 512, "qk_rope_head_dim": 64})()
    assert graphs.context_cap(262_144, tokens, shard) == 4032
    assert split_kv.graph_workspace_bytes(tokens, 4032, 8, 512, 64) == 265_273_344
    # the whole 256 Ki context in a graph: 1,024 splits, 34.5 GB (the kernel would launch serially)
    assert split_kv.graph_workspace_bytes(tokens, 262_144, 64, 512, 64) == 34_493_956_096
    assert graphs.context_cap(262_144, tokens, kimi, explicit=4096) == 4096
    assert graphs.context_cap(1000, tokens, kimi) == 1000 and graphs.context_cap(1000, tokens, None) == 1000
    assert graphs.context_cap(262_144, tokens, None) == 262_144  # no split workspace (a Llama draft)


def test_tree_step_padding() -> None:
    """A tree step's padding sequences hold a chain of the tree's size before their queries; the
    real rows keep their RoPE positions (root + depth) apart from their cache positions."""
    anc = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    tree = graphs.TreeStep(3, anc, torch.tensor([[4, 5, 5]]))
    step = graphs.pad_uniform_step([[3, 4]], starts=[4], q_len=3, bucket=2, width=3, block_size=4, pad_block=9,
                                   tree=tree)
    assert step.positions.tolist() == [4, 5, 5, 0, 1, 2]
    assert step.slot_mapping.tolist() == [16, 17, 18, 36, 36, 36] and step.context_lens.tolist() == [7, 3]
    assert torch.equal(step.ancestors[0], anc[0]) and torch.equal(step.ancestors[1], torch.ones(3, 3).tril().bool())
    frontier = graphs.TreeStep(4, torch.eye(4, dtype=torch.bool)[None], torch.tensor([[6, 6]]))
    step = graphs.pad_uniform_step([[3, 4, 5]], starts=[7], q_len=2, bucket=2, width=3, block_size=4, pad_block=9,
                                   tree=frontier)
    assert step.positions.tolist() == [6, 6, 2, 3] and step.context_lens.tolist() == [9, 4]  # a padding tree fits


def test_a_failed_capture_runs_eagerly(tiny_target, tiny_dir: Path, fake_graphs: None, monkeypatch: pytest.MonkeyPatch) -> None:
    class Refuses:
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "default_capturer", Refuses)
    eager = _llm(tiny_target, tiny_dir, "kimi-k2.5-eagle3", enforce_eager=True)
    expected = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    llm = _llm(tiny_target, tiny_dir, "kimi-k2.5-eagle3")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    assert "not permitted" in llm.runner.target_graphs.failed and not llm.runner.target_graphs.graphs


def test_cpu_never_uses_graphs(tiny_dir: Path) -> None:
    llm = LLM(tiny_dir / "kimi-k2.5", None, num_speculative_tokens=3, tokenizer=None, dtype="float32",
              num_blocks=48, block_size=4, max_num_seqs=4)
    assert not llm.cuda_graphs and llm.runner.target_graphs is None and llm.kernel_backend == "torch"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("tree", [{}, {"speculative_eagle_topk": 2, "speculative_num_draft_tokens": 7}],
                         ids=["chain", "tree"])
def test_real_graphs_equal_eager_on_the_gpu(tiny_dir: Path, backend: str, tree: dict) -> None:
    """On a GPU: real CUDA-graph capture and replay. The torch reference syncs with the host (MoE,
    attention schedule), so its capture fails and it runs eagerly; either way the tokens match."""
    if backend == "triton":
        pytest.importorskip("triton")
    kw = dict(num_speculative_tokens=3, tokenizer=None, dtype="bfloat16", num_blocks=48, block_size=4,
              max_num_seqs=4, device="cuda", backend=backend, **tree)
    eager = LLM(tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.5-eagle3", enforce_eager=True, **kw)
    expected = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    # every request ran to the end (a step that fails drops its requests: the second GPU run's tree
    # verify did, in both engines alike, and the comparison below passed on their first tokens)
    assert [len(t) for t in expected] == [GREEDY.max_tokens] * len(PROMPTS)
    llm = LLM(tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.5-eagle3", **kw)
    assert llm.cuda_graphs
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    if backend == "triton":  # its steps capture: the tokens above came from replays, not a fallback
        for g in (llm.runner.target_graphs, llm.runner.draft_graphs):
            assert g is not None
            assert g.failed is None and g.tree_failed is None and g.replays > 0, (g.failed, g.tree_failed, g.replays)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_the_context_cap_on_the_gpu_keeps_the_split_launch_bits(tiny_dir: Path) -> None:
    """On a GPU, Triton: contexts of 70 .. 110 positions, more than one split of the tiny target's
    64 keys, so graphs run the split launch over their 96-position tables and the steps past the
    cap run it eagerly over the batch's wider tables; the tokens are the eager engine's."""
    pytest.importorskip("triton")
    kw = dict(num_speculative_tokens=3, tokenizer=None, dtype="bfloat16", num_blocks=80, block_size=4,
              max_num_seqs=4, device="cuda", backend="triton")
    prompts, sp = [list(range(3, 73)), [100, 200, 300]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eager = LLM(tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.5-eagle3", enforce_eager=True, **kw)
    expected = [o.token_ids for o in eager.generate(prompts, sp)]
    assert [len(t) for t in expected] == [sp.max_tokens] * len(prompts)
    llm = LLM(tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.5-eagle3", max_seq_len_to_capture=96, **kw)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == expected
    stats = llm.runner.graph_stats()["target"]
    assert stats["replays"] > 0 and stats["eager_over_cap"] > 0, stats


class _AddressOnlyCapturer:
    """Like a CUDA graph, the "replay" keeps no reference to what the captured function closes over
    (the metadata, its cache): only the runner can keep those alive."""

    def capture(self, fn):
        fn()  # the warm-up fills the metadata's cache
        out = fn()
        return lambda: out


def test_a_graph_keeps_the_tensors_it_reads_alive() -> None:
    """A graph reads the tensors its warm-up left in ``AttnMetadata.cache`` (the Triton plan's chunk
    lists) by address on every replay: the runner keeps its metadata, and the CUDA capturer the
    captured function, for as long as the graph. (Freed after the capture, replays on the first GPU
    run read reused memory: an illegal memory access.)"""
    import gc
    import weakref

    made: list[weakref.ref] = []

    def forward(static, meta):
        if "chunks" not in meta.cache:
            meta.cache["chunks"] = torch.arange(4)
            made.append(weakref.ref(meta.cache["chunks"]))
        return (static["input_ids"] * 2,)

    runner = graphs.GraphRunner("t", forward, device=torch.device("cpu"), block_size=4, max_context=8, pad_block=9,
                                max_num_seqs=2, max_q_len=1, capturer=_AddressOnlyCapturer())
    runner.run([[0]], [1], 1, {"input_ids": torch.tensor([5])})
    gc.collect()
    assert len(made) == 1 and made[0]() is not None and runner.metas[(1, 1)].cache["chunks"] is made[0]()

    fn = lambda: (torch.zeros(1),)  # noqa: E731
    ref = weakref.ref(fn)
    captured = graphs.CapturedGraph(type("G", (), {"replay": lambda self: None})(), fn(), fn)
    del fn
    gc.collect()
    assert ref() is not None and captured()[0].shape == (1,)
