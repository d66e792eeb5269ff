"""The teacher (eagle3.train.teacher) and the chains' rows of training-time test.

* ``Teacher.generate`` (``--regenerate``: prefill, then one token per forward over the same KV
  cache) yields the runtime's own greedy tokens (``LLM.generate``), and per row the states a plain
  forward over the finished sequence gives;
* step 0 with ``KVChain.query`` (keys of every row, queries of the chains' rows only) and the later
  steps on those rows equal the full computation at those rows, for the Llama and MLA drafts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.convert import convert
from eagle3.runtime.loader import load_target
from eagle3.train.draft_module import KVChain, load_trainable, rows
from eagle3.train.teacher import Teacher


@pytest.fixture(scope="module")
def target(tiny_dir: Path):
    return load_target(tiny_dir / "kimi-k2.5", dtype=torch.float32)


def test_regeneration_is_the_runtime_greedy_continuation(target) -> None:
    from eagle3.runtime.engine.llm import LLM
    from eagle3.runtime.sampling import SamplingParams

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, target.vocab_size, (n,), generator=g).tolist() for n in (7, 19, 33)]
    eos = list(target.spec.eos_token_ids)
    teacher = Teacher(target, (2, 3, 4))
    got = teacher.generate(prompts, 12, eos, max_len=40)
    llm = LLM(target, None, tokenizer=None, num_blocks=32)
    want = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    for p, st, w in zip(prompts, got, want, strict=True):
        assert st.ids[: len(p)] == p
        assert st.ids[len(p):] == list(w.token_ids)[: 40 - len(p)]  # the third prompt stops at max_len 40
        assert st.aux.shape == (len(st.ids), 3 * target.hidden_size) and st.hidden.shape[0] == len(st.ids)
    # the states of the decoded rows are those of one forward over the finished sequences
    again = teacher.states([st.ids for st in got])
    for a, b in zip(got, again, strict=True):
        torch.testing.assert_close(a.aux, b.aux, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.hidden, b.hidden, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["kimi-k2.5-eagle3", "kimi-k2.6-eagle3.1-mla"])
def test_chain_rows_equal_the_full_computation(tiny_dir: Path, tmp_path: Path, target, name: str) -> None:
    draft_dir = tmp_path / "draft"
    convert(tiny_dir / name, draft_dir, engine="eagle3", target=str(tiny_dir / "kimi-k2.5"), progress=False)
    module, _ = load_trainable(draft_dir, target.embed_tokens)
    b, t = 2, 17
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, target.vocab_size, (b, t), generator=g)
    aux = torch.randn(b, t, 3 * target.hidden_size, generator=g)
    query = torch.tensor([[4, 5, 6, 7, 8], [11, 12, 13, 14, 15]])
    positions = torch.arange(t)[None].expand(b, t)
    with torch.no_grad():
        full, part = KVChain(), KVChain(query=query)
        h = module.combine_aux(aux)
        p_full, h_full = module.step(ids, h, positions, full)
        p_part, h_part = module.step(ids, h, positions, part)
        torch.testing.assert_close(p_part, rows(p_full, query), atol=1e-5, rtol=1e-5)
        for i in (1, 2):  # later steps: the full chain at every row vs the chains' rows alone
            tok = torch.randint(0, target.vocab_size, (b, t), generator=g)
            p_full, h_full = module.step(tok, h_full, positions + i, full)
            p_part, h_part = module.step(rows(tok, query), h_part, query + i, part)
            torch.testing.assert_close(p_part, rows(p_full, query), atol=1e-5, rtol=1e-5, msg=f"step {i}")
