"""The trainable draft (eagle3.train.draft_module) equals the runtime's draft run through the
runtime (paged KV cache, step 0 over a context, then chained single-token steps), fp32 logits, on
the same checkpoint: Llama EAGLE-3, Llama with a reduced vocabulary and no embedding (the target's
is taken), MLA EAGLE-3.1 (fc_norm, norm_output)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.convert import convert
from eagle3.runtime.engine.model_runner import build_attn_metadata
from eagle3.runtime.interfaces import allocate_kv_cache
from eagle3.runtime.loader import load_draft, load_target
from eagle3.train.draft_module import KVChain, load_trainable

T = 13  # context tokens of step 0
CHAIN = 3  # draft steps in all (step 0 + 2 chained)


@pytest.fixture(scope="module")
def target(tiny_dir: Path):
    return load_target(tiny_dir / "kimi-k2.5", dtype=torch.float32)


@pytest.mark.parametrize("name", ["kimi-k2.5-eagle3", "kimi-k2.5-eagle3-d2t", "kimi-k2.6-eagle3.1-mla"])
def test_trainable_draft_equals_runtime_draft(tiny_dir: Path, tmp_path: Path, target, name: str) -> None:
    draft_dir = tmp_path / "draft"
    convert(tiny_dir / name, draft_dir, engine="eagle3", target=str(tiny_dir / "kimi-k2.5"), progress=False)
    runtime = load_draft(draft_dir, target)
    module, d2t = load_trainable(draft_dir, target.embed_tokens)
    assert (d2t is not None) == (name == "kimi-k2.5-eagle3-d2t")
    assert module.spec.attention == ("mla" if "mla" in name else "mha")

    ids = torch.randint(0, target.vocab_size, (T + 1,), generator=torch.Generator().manual_seed(1))
    blocks = [[0, 1, 2, 3]]
    meta = build_attn_metadata(blocks, [0], [T], 16)
    with torch.no_grad():
        kv = allocate_kv_cache(target.kv_cache_spec(), target.num_layers, 4, 16)
        _, aux = target.forward(ids[:T], meta, kv, runtime.aux_layer_ids)
        # runtime: step 0 over the context (token p+1 with aux p at position p), then chained steps
        dkv = allocate_kv_cache(runtime.kv_cache_spec(), 1, 4, 16)[0]
        post, nxt = runtime.forward(ids[1:T + 1], runtime.combine_aux(aux), meta, dkv)
        want = [runtime.compute_logits(post)]
        tokens = []
        last_post, last_next = post[-1:], nxt[-1:]
        for i in range(1, CHAIN):
            tok = runtime.to_target_ids(runtime.compute_logits(last_post).argmax(-1))
            tokens.append(int(tok))
            step_meta = build_attn_metadata(blocks, [T - 1 + i], [1], 16)
            last_post, last_next = runtime.forward(tok, last_next, step_meta, dkv)
            want.append(runtime.compute_logits(last_post))

        # trainable: the same, as training-time-test steps (the chain that starts at index T-1)
        chain = KVChain()
        positions = torch.arange(T)[None]
        p, h = module.step(ids[None, 1:T + 1], module.combine_aux(aux[None]), positions, chain)
        got = [module.compute_logits(p)[0]]
        for i in range(1, CHAIN):
            step_ids = torch.zeros(1, T, dtype=torch.int64)
            step_ids[0, -1] = tokens[i - 1]
            p, h = module.step(step_ids, h, positions + i, chain)
            got.append(module.compute_logits(p)[0, -1:])
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert w.shape == g.shape, i
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5, msg=f"{name} step {i}")
