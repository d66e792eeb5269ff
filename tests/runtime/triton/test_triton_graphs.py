"""The CUDA-graph path (engine/graphs.py) on the Triton backend, on the CPU through the interpreter
with the eager capturer: the graph's metadata is built once per (query length, bucket) and reused by
every replay, so the Triton plan's chunk list comes from ``AttnMetadata.cache`` (what a real capture
relies on: no host copy while capturing), while positions and block tables are read from the static
buffers each step. Padded replays give the same tokens as eager steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from eagle3.runtime.engine import graphs  # noqa: E402
from eagle3.runtime.engine.llm import LLM  # noqa: E402
from eagle3.runtime.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = [[5, 17, 300], [9, 8, 7, 6, 5], [100, 200]]  # 3 sequences: padded to the bucket of 4


def test_triton_graph_steps_equal_eager_steps(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("on a GPU tests/runtime/test_graphs.py captures real graphs")
    monkeypatch.setattr(graphs, "available", lambda device: True)
    monkeypatch.setattr(graphs, "default_capturer", graphs.EagerCapturer)
    kw = dict(num_speculative_tokens=2, tokenizer=None, backend="triton", dtype="float32", num_blocks=32,
              block_size=4, max_num_seqs=4)
    eager = LLM(tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.5-eagle3", enforce_eager=True, **kw)
    expected = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    llm = LLM(tiny_dir / "kimi-k2.5", tiny_dir / "kimi-k2.5-eagle3", **kw)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    tg, dg = llm.runner.target_graphs, llm.runner.draft_graphs
    assert tg.replays > 0 and tg.failed is None
    assert dg.replays > len(dg.graphs)  # some graph replayed again with a later step's inputs (cached plan)
