"""EAGLE-3 / 3.1 drafts against an independent float64 reference written here from
the EAGLE-3 draft forward as the engines implement it (tensors read with the safetensors library, not eagle3's loader):
Llama/MHA and MLA attention, fc_norm, norm_before_fc, norm_output, norm_before_residual, d2t,
a draft without its own embedding, speculators configs; over a paged cache for a step-0 prefill
and two chained single-token steps."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle3.checkpoint import CheckpointReader, CheckpointWriter
from eagle3.runtime.interfaces import DraftModel
from eagle3.runtime.loader import load_draft, load_target
from tests.runtime.model_kit import PagedKV, single_thread

_threads = pytest.fixture(scope="module", autouse=True)(single_thread)

# ---------------------------------------------------------------------------------------------
# float64 reference
# ---------------------------------------------------------------------------------------------


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _mscale(f, m):
    return 1.0 if f <= 1 else 0.1 * m * math.log(f) + 1.0


def _yarn(dim: int, base: float, rs: dict):
    """DeepSeek-V3 YaRN rope: ramped YaRN frequencies; returns (inv_freq, cos/sin factor, softmax mscale^2)."""
    f, l0 = rs["factor"], rs["original_max_position_embeddings"]
    corr = [dim * math.log(l0 / (b * 2 * math.pi)) / (2 * math.log(base)) for b in (rs["beta_fast"], rs["beta_slow"])]
    low, high = max(math.floor(corr[0]), 0), min(math.ceil(corr[1]), dim - 1)
    high = high + 0.001 if high == low else high
    i = torch.arange(dim // 2, dtype=torch.float64)
    ramp = ((i - low) / (high - low)).clamp(0, 1)
    extra = base ** (-2 * i / dim)
    inv = extra / f * ramp + extra * (1 - ramp)
    return inv, _mscale(f, rs["mscale"]) / _mscale(f, rs["mscale_all_dim"]), _mscale(f, rs["mscale_all_dim"]) ** 2


def _rotate(x, pos, inv, af, interleaved):
    ang = pos[:, None].double() * inv[None, :]
    c, s = (torch.cos(ang) * af)[:, None, :], (torch.sin(ang) * af)[:, None, :]
    if interleaved:  # rotate the pairs (x[2i], x[2i+1]) in place
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def _causal_attn(q, k, v, scale):
    """q [T, H, d], k [T, H, d], v [T, H, dv]; query t sees keys 0..t."""
    s = torch.einsum("thd,uhd->htu", q, k) * scale
    t = q.shape[0]
    s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("htu,uhd->thd", s.softmax(-1), v)


class RefDraft:
    def __init__(self, d: Path, target_dir: Path):
        cfg = json.loads((d / "config.json").read_text())
        lc = cfg.get("transformer_layer_config", cfg)
        ec = cfg.get("eagle_config") or {}
        self.w = {k: v.double() if v.is_floating_point() else v for k, v in _tensors(d).items()}
        self.pre = "midlayer." if any(k.startswith("midlayer.") for k in self.w) else "layers.0."
        if "embed_tokens.weight" not in self.w:  # the draft reuses the target's embedding
            t = _tensors(target_dir)
            self.w["embed_tokens.weight"] = next(v for k, v in t.items() if k.endswith("model.embed_tokens.weight")).double()
        self.eps = lc["rms_norm_eps"]
        self.fc_norm = bool(cfg.get("fc_norm"))
        self.norm_output = bool(cfg.get("norm_output"))
        self.norm_before_fc = bool(ec.get("norm_before_fc", cfg.get("norm_before_fc", False)))
        self.norm_before_residual = bool(cfg.get("norm_before_residual", False))
        self.mla = "kv_lora_rank" in lc
        self.lc = lc
        rs = dict(lc.get("rope_scaling") or {})
        if self.mla:
            self.inv, self.af, m2 = _yarn(lc["qk_rope_head_dim"], lc["rope_theta"], rs)
            self.scale = (lc["qk_nope_head_dim"] + lc["qk_rope_head_dim"]) ** -0.5 * m2
        else:
            self.inv, self.af, _ = _yarn(lc["head_dim"], lc["rope_theta"], rs)
            self.scale = lc["head_dim"] ** -0.5

    def lin(self, name, x):
        return x @ self.w[name + ".weight"].t()

    def combine(self, aux):
        n = 3  # aux states (the tiny target's hidden size is 128; fc takes 3 x 128)
        a = aux.double()
        if self.norm_before_fc:
            a = _rms(a, self.w["input_norm.weight"], self.eps)
        if self.fc_norm:
            a = torch.cat([_rms(c, self.w[f"fc_norm.{i}.weight"], self.eps) for i, c in enumerate(a.chunk(n, -1))], -1)
        return self.lin("fc", a)

    def attn(self, x, pos):
        p = self.pre + "self_attn."
        t = x.shape[0]
        if self.mla:
            lc = self.lc
            nh, dn, dr, dv, r = (lc["num_attention_heads"], lc["qk_nope_head_dim"], lc["qk_rope_head_dim"],
                                 lc["v_head_dim"], lc["kv_lora_rank"])
            q = self.lin(p + "q_b_proj", _rms(self.lin(p + "q_a_proj", x), self.w[p + "q_a_layernorm.weight"], self.eps))
            q = q.view(t, nh, dn + dr)
            ckv = self.lin(p + "kv_a_proj_with_mqa", x)
            c, kpe = ckv[:, :r], ckv[:, r:]
            kv = self.lin(p + "kv_b_proj", _rms(c, self.w[p + "kv_a_layernorm.weight"], self.eps)).view(t, nh, dn + dv)
            qpe = _rotate(q[..., dn:], pos, self.inv, self.af, True)
            kpe = _rotate(kpe[:, None, :], pos, self.inv, self.af, True).expand(t, nh, dr)
            o = _causal_attn(torch.cat([q[..., :dn], qpe], -1), torch.cat([kv[..., :dn], kpe], -1), kv[..., dn:],
                             self.scale)
            return self.lin(p + "o_proj", o.reshape(t, -1))
        lc = self.lc
        nh, nkv, hd = lc["num_attention_heads"], lc["num_key_value_heads"], lc["head_dim"]
        q = _rotate(self.lin(p + "q_proj", x).view(t, nh, hd), pos, self.inv, self.af, False)
        k = _rotate(self.lin(p + "k_proj", x).view(t, nkv, hd), pos, self.inv, self.af, False)
        v = self.lin(p + "v_proj", x).view(t, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        return self.lin(p + "o_proj", _causal_attn(q, k, v, self.scale).reshape(t, -1))

    def forward(self, ids, hidden, pos):
        """Full causal forward over every position so far -> (logits, next_hidden) per row."""
        p = self.pre
        e = self.w["embed_tokens.weight"][ids]
        hn = _rms(hidden, self.w[p + "hidden_norm.weight"], self.eps)
        x = torch.cat([_rms(e, self.w[p + "input_layernorm.weight"], self.eps), hn], -1)
        res = hn if self.norm_before_residual else hidden
        r1 = res + self.attn(x, pos)
        m = _rms(r1, self.w[p + "post_attention_layernorm.weight"], self.eps)
        out = r1 + self.lin(p + "mlp.down_proj", torch.nn.functional.silu(self.lin(p + "mlp.gate_proj", m))
                            * self.lin(p + "mlp.up_proj", m))
        y = _rms(out, self.w["norm.weight"], self.eps)
        return y @ self.w["lm_head.weight"].t(), (y if self.norm_output else out)

    def to_target(self, d):
        return d + self.w["d2t"][d] if "d2t" in self.w else d


# ---------------------------------------------------------------------------------------------
# variants
# ---------------------------------------------------------------------------------------------


def _variant(src: Path, dst: Path, cfg_edit: dict, extra: dict[str, torch.Tensor] | None = None) -> Path:
    if not extra:
        shutil.copytree(src, dst)
    else:
        dst.mkdir(parents=True)
        r = CheckpointReader(src)
        with CheckpointWriter(dst) as w:
            for n in r.names():
                w.add(n, r.get(n))
            for n, t in extra.items():
                w.add(n, t)
        shutil.copy(src / "config.json", dst / "config.json")
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(cfg_edit)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def drafts(tiny_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafts")
    base = tiny_dir / "kimi-k2.5-eagle3"
    g = torch.Generator().manual_seed(4)
    return {
        "mha": base,
        "d2t-no-embed-output-ids": tiny_dir / "kimi-k2.5-eagle3-d2t",
        "mla-fc_norm-norm_output": tiny_dir / "kimi-k2.6-eagle3.1-mla",
        "speculators": tiny_dir / "speculators-eagle3",
        "norm_before_residual": _variant(base, root / "nbr", {"norm_before_residual": True}),
        "norm_before_fc": _variant(base, root / "nbfc", {"norm_before_fc": True}, {
            "input_norm.weight": (1 + 0.1 * torch.randn(3 * 128, generator=g)).to(torch.bfloat16)}),
        "mla-pre-norm-carry": _variant(tiny_dir / "kimi-k2.6-eagle3.1-mla", root / "mla31", {"norm_output": False}),
    }


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_target(tiny_dir / "kimi-k2.5", dtype=torch.float32)


VARIANTS = ["mha", "d2t-no-embed-output-ids", "mla-fc_norm-norm_output", "speculators", "norm_before_residual",
            "norm_before_fc", "mla-pre-norm-carry"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_draft_matches_float64_reference(tiny_dir, drafts, target, variant: str) -> None:
    path = drafts[variant]
    d = load_draft(path, target)
    assert isinstance(d, DraftModel)
    assert d.aux_layer_ids == (2, 3, 4)  # the d2t draft declares [1, 2, 3] "output of layer k"
    ref = RefDraft(path, tiny_dir / "kimi-k2.5")
    gen = torch.Generator().manual_seed(5)
    t = 9
    aux = torch.randn(t, 3 * 128, generator=gen)
    ids = torch.randint(0, 768, (t,), generator=gen)
    chain = [int(i) for i in torch.randint(0, 768, (2,), generator=gen)]  # tokens of draft steps 1, 2

    # runtime: step 0 over the t context pairs, then two chained one-token steps
    kv = PagedKV(d, num_layers=1, block_size=4)
    x, meta = kv.step({0: ids.tolist()})
    with torch.no_grad():
        g = d.combine_aux(aux)
        y, nxt = d(x, g, meta, kv.caches[0])
        logits = [d.compute_logits(y)]
        for tok in chain:
            x, meta = kv.step({0: [tok]})
            y, nxt = d(x, nxt[-1:], meta, kv.caches[0])
            logits.append(d.compute_logits(y))

    # reference: recompute the whole causal sequence at every step
    r_ids, r_hidden = ids.clone(), ref.combine(aux)
    torch.testing.assert_close(g.double(), r_hidden, rtol=0, atol=1e-4)
    r_logits, r_next = ref.forward(r_ids, r_hidden, torch.arange(t))
    torch.testing.assert_close(logits[0].double(), r_logits, rtol=0, atol=2e-4)
    for s, tok in enumerate(chain):
        r_ids = torch.cat([r_ids, torch.tensor([tok])])
        r_hidden = torch.cat([r_hidden, r_next[-1:]])
        r_logits, r_next = ref.forward(r_ids, r_hidden, torch.arange(t + s + 1))
        torch.testing.assert_close(logits[s + 1][0].double(), r_logits[-1], rtol=0, atol=2e-4)
    assert logits[0].shape[-1] == d.vocab_size == ref.w["lm_head.weight"].shape[0]
    draft_ids = logits[0].argmax(-1)
    assert torch.equal(d.to_target_ids(draft_ids), ref.to_target(draft_ids))
    if "d2t" in ref.w:
        assert d.vocab_size < target.vocab_size and not torch.equal(d.to_target_ids(draft_ids), draft_ids)


@pytest.mark.parametrize("variant", ["mha", "mla-fc_norm-norm_output"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_draft_is_batch_invariant(tiny_dir, drafts, variant: str, dtype: torch.dtype) -> None:
    tgt = load_target(tiny_dir / "kimi-k2.5", dtype=dtype)
    d = load_draft(drafts[variant], tgt)
    gen = torch.Generator().manual_seed(6)
    seqs = {s: torch.randint(0, 768, (n,), generator=gen).tolist() for s, n in (("a", 11), ("b", 6))}
    hid = {s: torch.randn(len(v), 128, generator=gen).to(dtype) for s, v in seqs.items()}
    alone = {}
    for s, toks in seqs.items():
        kv = PagedKV(d, num_layers=1, seed=1)
        x, meta = kv.step({s: toks})
        alone[s] = d(x, hid[s], meta, kv.caches[0])
    kv = PagedKV(d, num_layers=1, seed=2)
    x, meta = kv.step({"a": seqs["a"][:8], "b": seqs["b"][:6]})
    y, nh = d(x, torch.cat([hid["a"][:8], hid["b"][:6]]), meta, kv.caches[0])
    assert torch.equal(y[:8], alone["a"][0][:8]) and torch.equal(nh[8:], alone["b"][1])
    x, meta = kv.step({"a": seqs["a"][8:]})
    y, nh = d(x, hid["a"][8:], meta, kv.caches[0])
    assert torch.equal(y, alone["a"][0][8:]) and torch.equal(nh, alone["a"][1][8:])
    assert torch.equal(d.compute_logits(y), d.compute_logits(alone["a"][0][8:]))


def test_draft_shares_target_embedding_and_checks_widths(tiny_dir, drafts, target, tmp_path) -> None:
    d = load_draft(drafts["d2t-no-embed-output-ids"], target)
    assert d.embed_tokens.data_ptr() == target.embed_tokens.data_ptr()
    shape, _ = d.kv_cache_spec()
    assert shape == (2, 4, 32)
    assert load_draft(drafts["mla-fc_norm-norm_output"], target).kv_cache_spec()[0] == (576,)
    bad = _variant(drafts["mha"], tmp_path / "bad", {"target_hidden_size": 64})
    with pytest.raises(Exception, match="hidden"):
        load_draft(bad, target)
