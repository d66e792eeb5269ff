"""Long prompts: a prompt spanning more than four attention key tiles, prefilled in several chunks
of different sizes (some sharing the forward with another sequence's decode), must give the very
bits of decoding the same tokens one at a time - for the MLA target (its first three layers) and
the MHA draft, in bf16 and fp32. The chunks take the per-sequence attention schedule
(>= SEQ_PATH_MIN_TOKENS query tokens) or the gathered one (short chunks, decode), so this is also
the cross-check of the two."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3.runtime.kernels.torch_ref import KEY_TILE, SEQ_PATH_MIN_TOKENS
from eagle3.runtime.loader import load_draft, load_target
from tests.runtime.model_kit import PagedKV, single_thread

_threads = pytest.fixture(scope="module", autouse=True)(single_thread)

N = 4 * KEY_TILE + 45  # 301 tokens: five key tiles, the last one partly filled
CHUNKS = [150, 1, 70, 9, 71]  # long (per-sequence), decode, long, short, long: positions 0..300
OTHER = 5  # tokens of a second sequence, one decoded beside each chunk


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 768, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _target(model, kv: PagedKV, batch: dict, aux_ids):
    x, meta = kv.step(batch)
    with torch.no_grad():
        return model(x, meta, kv.caches, aux_ids)


def _draft(model, kv: PagedKV, batch: dict, hidden: torch.Tensor):
    x, meta = kv.step(batch)
    with torch.no_grad():
        return model(x, hidden, meta, kv.caches[0])


LAYERS = 3  # decoder layers of the target cut used here (the tiny target has 7)
AUX_IDS = (1, 2, 3)  # input-to-layer taps: the outputs of the dense layer and of both MoE layers


@pytest.fixture(scope="module")
def three_layer_target(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target's first LAYERS decoder layers: its config with fewer layers, the same weight
    files (the loader reads the layers the config names). The token-by-token reference is one
    forward per prompt token through every layer, so the test's cost is layers x tokens. Cutting
    layers instead of tokens keeps the prompt's geometry (five key tiles, the last partly filled,
    every chunk kind), which is what the test is about. The layers past the third run the very
    attention and MoE code of layers 0-2 (a dense layer, then two MoE layers), so a chunking bug
    shows there already (an off-by-one in the per-sequence schedule's causal tile skipping fails
    this test at three layers); each layer keeps a cache of its own, so confusing the layers'
    caches still shows too."""
    src = tiny_dir / "kimi-k2.5"
    out = tmp_path_factory.mktemp("long_prompt") / "kimi-k2.5-3l"
    out.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] = LAYERS
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def models(request, tiny_dir, three_layer_target):
    tgt = load_target(three_layer_target, dtype=request.param)
    assert tgt.num_layers == LAYERS
    # the draft's own aux ids name layers of the 7-layer target; its test feeds it random aux states
    return tgt, load_draft(tiny_dir / "kimi-k2.5-eagle3", tgt, aux_layer_ids=AUX_IDS)


def test_chunks_are_long_enough() -> None:
    assert sum(CHUNKS) == N and N > 4 * KEY_TILE
    assert sum(c >= SEQ_PATH_MIN_TOKENS for c in CHUNKS) >= 2 and min(CHUNKS) == 1


def test_target_chunked_prefill_equals_token_by_token(models) -> None:
    tgt, _ = models
    toks, other = _tokens(1, N), _tokens(2, OTHER + len(CHUNKS))
    aux_ids = AUX_IDS
    # reference: one token per forward
    kv = PagedKV(tgt, num_blocks=160, block_size=4, seed=3)
    ref = [_target(tgt, kv, {"a": [t]}, aux_ids) for t in toks]
    ref_h = torch.cat([h for h, _ in ref])
    ref_aux = torch.cat([a for _, a in ref])
    ref_logits = tgt.compute_logits(ref_h)
    # chunks of several sizes, each beside a decode step of another sequence (scattered blocks)
    kv = PagedKV(tgt, num_blocks=160, block_size=4, seed=4)
    _target(tgt, kv, {"b": other[:OTHER]}, aux_ids)
    hs, auxs = [], []
    p = 0
    for i, c in enumerate(CHUNKS):
        h, a = _target(tgt, kv, {"b": [other[OTHER + i]], "a": toks[p: p + c]}, aux_ids)
        hs.append(h[1:])
        auxs.append(a[1:])
        p += c
    h = torch.cat(hs)
    assert torch.equal(h, ref_h)
    assert torch.equal(torch.cat(auxs), ref_aux)
    assert torch.equal(tgt.compute_logits(h), ref_logits)
    # and the whole prompt in one forward
    kv = PagedKV(tgt, num_blocks=160, block_size=4, seed=5)
    h, a = _target(tgt, kv, {"a": toks}, aux_ids)
    assert torch.equal(h, ref_h) and torch.equal(a, ref_aux)


def test_draft_chunked_prefill_equals_token_by_token(models) -> None:
    tgt, d = models
    toks = _tokens(6, N)
    hidden = d.combine_aux(torch.randn(N, 3 * tgt.hidden_size, generator=torch.Generator().manual_seed(7))
                           .to(d.dtype))
    kv = PagedKV(d, num_blocks=160, block_size=4, seed=8, num_layers=1)
    ref = [_draft(d, kv, {"a": [t]}, hidden[i: i + 1]) for i, t in enumerate(toks)]
    ref_y = torch.cat([y for y, _ in ref])
    ref_next = torch.cat([n for _, n in ref])
    kv = PagedKV(d, num_blocks=160, block_size=4, seed=9, num_layers=1)
    ys, ns = [], []
    p = 0
    for c in CHUNKS:
        y, n = _draft(d, kv, {"a": toks[p: p + c]}, hidden[p: p + c])
        ys.append(y)
        ns.append(n)
        p += c
    y = torch.cat(ys)
    assert torch.equal(y, ref_y) and torch.equal(torch.cat(ns), ref_next)
    assert torch.equal(d.compute_logits(y), d.compute_logits(ref_y))
