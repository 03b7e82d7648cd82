"""The draft model: names, config mappings, forward vs an independent re-implementation of the
reference math (written here from the spec, reading only the state dict), KV cache, loading."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from eyas.config import ConfigError
from eyas.draft.config import DraftConfig, draft_rope_scaling
from eyas.draft.eagle3 import Eagle3Draft, KVCache
from eyas.errors import EyasError
from eyas.draft.formats import to_vllm_config

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
LAYER_NAMES = {"midlayer." + n + ".weight" for n in (
    "input_layernorm", "hidden_norm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
    "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj")}


def small_cfg(**kw) -> DraftConfig:
    base = dict(hidden_size=48, target_hidden_size=40, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=96, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=512, vocab_size=97, draft_vocab_size=61,
                aux_layer_ids=(1, 2, 3))
    base.update(kw)
    return DraftConfig(**base)


def make_draft(cfg: DraftConfig, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg, torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size))
    with torch.no_grad():  # norms away from 1 so a swapped norm cannot go unnoticed
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in name or "layernorm" in name:
                p.uniform_(0.5, 1.5)
    return draft


# ---------------------------------------------------------------- independent reference

def ref_inv_freq(cfg: DraftConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    s = cfg.rope_scaling
    if s is None:
        return inv
    assert s["rope_type"] == "llama3"  # Meta's Llama-3.1 frequency rescaling
    old = s["original_max_position_embeddings"]
    low_wl, high_wl = old / s["low_freq_factor"], old / s["high_freq_factor"]
    out = []
    for f in inv.tolist():
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(f)
        elif wl > low_wl:
            out.append(f / s["factor"])
        else:
            lo, hi = s["low_freq_factor"], s["high_freq_factor"]
            smooth = (old / wl - lo) / (hi - lo)
            out.append((1 - smooth) * f / s["factor"] + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def reference_forward(sd, cfg, embed, ids, aux, pos, hidden=None):
    """One row: ids (T,), aux (T, 3*Ht), pos (T,) -> (logits (T, Vd), pre-norm h (T, H))."""
    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    L = "midlayer."
    if hidden is None:
        if cfg.norm_before_fc:  # vLLM's input_norm: one RMSNorm over all 3*Ht values
            aux = rms(aux, sd["input_norm.weight"])
        if cfg.fc_norm:  # vLLM's fc_norm: one RMSNorm per Ht-wide chunk
            aux = torch.cat([rms(a, sd[f"fc_norm.{i}.weight"])
                             for i, a in enumerate(aux.split(cfg.target_hidden_size, -1))], -1)
        g = aux @ sd["fc.weight"].T  # (T, H)
    else:
        g = hidden
    gn = rms(g, sd[L + "hidden_norm.weight"])
    x = torch.cat([rms(embed[ids], sd[L + "input_layernorm.weight"]), gn], -1)  # (T, 2H)
    residual = gn if cfg.norm_before_residual else g
    t, hq, hkv, d = ids.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = (x @ sd[L + "self_attn.q_proj.weight"].T).view(t, hq, d).transpose(0, 1)  # (hq, T, d)
    k = (x @ sd[L + "self_attn.k_proj.weight"].T).view(t, hkv, d).transpose(0, 1)
    v = (x @ sd[L + "self_attn.v_proj.weight"].T).view(t, hkv, d).transpose(0, 1)
    ang = pos.double()[:, None] * ref_inv_freq(cfg)[None]  # (T, d/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()

    def rot(z):
        half = torch.cat([-z[..., d // 2:], z[..., : d // 2]], -1)
        return z * cos + half * sin

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, hq * d)
    h = residual + o @ sd[L + "self_attn.o_proj.weight"].T
    y = rms(h, sd[L + "post_attention_layernorm.weight"])
    gate = torch.nn.functional.silu(y @ sd[L + "mlp.gate_proj.weight"].T)
    h = h + (gate * (y @ sd[L + "mlp.up_proj.weight"].T)) @ sd[L + "mlp.down_proj.weight"].T
    logits = rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].T
    return logits, h


# ---------------------------------------------------------------- tests

def test_parameter_names_are_the_vllm_export_names():
    draft = make_draft(small_cfg())
    names = set(draft.state_dict())
    assert names == LAYER_NAMES | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    sd = draft.state_dict()
    assert sd["fc.weight"].shape == (48, 3 * 40)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (4 * 16, 2 * 48)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (2 * 16, 2 * 48)
    assert sd["lm_head.weight"].shape == (61, 48)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert "embed_weight" not in names  # the shared target embedding is never saved
    with_norm = make_draft(small_cfg(fc_norm=True)).state_dict()
    assert set(with_norm) - names == {f"fc_norm.{i}.weight" for i in range(3)}
    assert all(with_norm[f"fc_norm.{i}.weight"].shape == (40,) for i in range(3))  # (Ht,) each
    with_norm = make_draft(small_cfg(norm_before_fc=True)).state_dict()
    assert set(with_norm) - names == {"input_norm.weight"}
    assert with_norm["input_norm.weight"].shape == (3 * 40,)  # one norm over concat(aux)
    assert set(make_draft(small_cfg(norm_output=True)).state_dict()) == names  # no weights


@pytest.mark.parametrize("variant", [
    {}, {"norm_before_residual": True}, {"rope_scaling": LLAMA3}, {"fc_norm": True},
    {"norm_output": True, "hidden_size": 64, "target_hidden_size": 64, "num_key_value_heads": 4},
    {"norm_before_fc": True}, {"norm_before_fc": True, "norm_output": True},
    {"fc_norm": True, "norm_output": True, "norm_before_residual": True},
])
def test_forward_matches_reference_math(variant):
    cfg = small_cfg(**variant)
    draft = make_draft(cfg)
    sd = {k: v.double().float() for k, v in draft.state_dict().items()}
    torch.manual_seed(1)
    b, t = 2, 11
    ids = torch.randint(0, cfg.vocab_size, (b, t))
    aux = torch.randn(b, t, 3 * cfg.target_hidden_size)
    pos = torch.stack([torch.arange(t), torch.arange(t) + 37])  # rows at different offsets
    out = draft(ids, aux, pos)
    assert out.logits.shape == (b, t, cfg.draft_vocab_size)
    assert out.hidden.shape == (b, t, cfg.hidden_size)
    for r in range(b):
        logits, h = reference_forward(sd, cfg, draft.embed_weight, ids[r], aux[r], pos[r])
        torch.testing.assert_close(out.logits[r], logits, atol=2e-5, rtol=1e-5)
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        fed = normed * sd["norm.weight"] if cfg.norm_output else h
        torch.testing.assert_close(out.hidden[r], fed, atol=2e-5, rtol=1e-5)
    # a later draft step: hidden given instead of aux
    hid = torch.randn(b, t, cfg.hidden_size)
    out2 = draft(ids, None, pos, hidden=hid)
    logits, _ = reference_forward(sd, cfg, draft.embed_weight, ids[0], None, pos[0], hidden=hid[0])
    torch.testing.assert_close(out2.logits[0], logits, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", [{}, {"norm_before_residual": True, "rope_scaling": LLAMA3},
                                     {"norm_before_fc": True}, {"fc_norm": True}])
def test_gradients_match_reference_math(variant):
    """Every parameter gradient through the forward (fused q/k/v + RoPE, fused gate/up with
    the recomputing SwiGLU, RMSNorm backward) against autograd through the reference."""
    cfg = small_cfg(**variant)
    draft = make_draft(cfg)
    sd = {k: v.detach().clone().requires_grad_(v.is_floating_point())
          for k, v in draft.state_dict().items()}
    torch.manual_seed(3)
    ids, aux = torch.randint(0, cfg.vocab_size, (1, 13)), torch.randn(1, 13, 3 * 40)
    pos = torch.arange(13)[None] + 5
    cot_logits, cot_hidden = torch.randn(13, cfg.draft_vocab_size), torch.randn(13, 48)
    out = draft(ids, aux, pos)
    ((out.logits[0] * cot_logits).sum() + (out.hidden[0] * cot_hidden).sum()).backward()
    logits, h = reference_forward(sd, cfg, draft.embed_weight, ids[0], aux[0], pos[0])
    ((logits * cot_logits).sum() + (h * cot_hidden).sum()).backward()
    for name, p in draft.named_parameters():
        torch.testing.assert_close(p.grad, sd[name].grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("variant", [
    {"norm_before_fc": True, "norm_output": True},  # speculators' EAGLE 3.1 default
    {"fc_norm": True, "norm_output": True},  # the EAGLE 3.1 paper's (vLLM blog, SGLang)
])
def test_eagle31_chained_steps_match_vllm_math(variant):
    """Three draft steps chained as vLLM's proposer chains them. From llama_eagle3.py
    (docs/draft.md, "EAGLE 3.1 variants"): combine_hidden_states = fc(norms(aux)) with
    norm_before_fc one RMSNorm over the (3*Ht,) concatenation and fc_norm one per (Ht,) chunk;
    the model returns (norm(h), norm(h) if norm_output else h); compute_logits reads the
    first, the next step's hidden input is the second, at position + 1."""
    cfg = small_cfg(**variant)
    draft = make_draft(cfg)
    sd = {k: v.double().float() for k, v in draft.state_dict().items()}
    torch.manual_seed(5)
    t = 9
    ids, aux, pos = torch.randint(0, 97, (1, t)), torch.randn(1, t, 3 * 40), torch.arange(t)[None]

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    ours, theirs = None, None  # the hidden input of the next step: eyas's, the reference's
    for step in range(3):
        out = draft(ids, aux, pos + step, hidden=ours)  # aux is read at step 0 only
        logits, h = reference_forward(sd, cfg, draft.embed_weight, ids[0], aux[0], pos[0] + step,
                                      hidden=None if theirs is None else theirs[0])
        theirs = rms(h, sd["norm.weight"])[None]  # norm_output: the post-norm state goes on
        ours = out.hidden
        torch.testing.assert_close(out.logits[0], logits, atol=3e-5, rtol=1e-5)
        torch.testing.assert_close(ours, theirs, atol=3e-5, rtol=1e-5)


# ---------------------------------------------------------------- several decoder layers

def vllm_forward(sd, cfg, embed, ids, g, pos, past=None):
    """vLLM 0.24.0's llama_eagle3 `LlamaModel.forward` for one row, written here from its
    source in its own form (a layer returns (mlp_out, residual) with the add pending; the
    next layer, or the final norm, adds them in fp32 and casts back, as vLLM's fused
    add + RMSNorm does). ids (T,); g (T, H): fc's output, or the hidden a previous draft step
    returned; pos (T,); past: per layer the (k, v) (hkv, L, d) of earlier positions, or None.
    -> (logits (T, Vd), the hidden handed to the next step (T, H), per layer (k, v) with
    these positions appended)."""
    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def add(a, b):
        return (a.float() + b.float()).to(a.dtype)

    t, hq, hkv, d = ids.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ang = pos.double()[:, None] * ref_inv_freq(cfg)[None]  # (T, d/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()

    def rot(z):  # (heads, T, d)
        return z * cos + torch.cat([-z[..., d // 2:], z[..., : d // 2]], -1) * sin

    def attn(x, p, cached):
        q = rot((x @ sd[p + "self_attn.q_proj.weight"].T).view(t, hq, d).transpose(0, 1))
        k = rot((x @ sd[p + "self_attn.k_proj.weight"].T).view(t, hkv, d).transpose(0, 1))
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(t, hkv, d).transpose(0, 1)
        if cached is not None:  # this layer's own cache: its keys of earlier positions
            k, v = torch.cat([cached[0], k], 1), torch.cat([cached[1], v], 1)
        n = k.shape[1]
        kk, vv = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)
        scores = q @ kk.transpose(1, 2) / math.sqrt(d)  # (hq, T, n)
        future = torch.arange(n)[None] > (n - t + torch.arange(t))[:, None]
        o = (scores.masked_fill(future, float("-inf")).softmax(-1) @ vv)
        return o.transpose(0, 1).reshape(t, hq * d) @ sd[p + "self_attn.o_proj.weight"].T, (k, v)

    def mlp(x, p):
        gate = torch.nn.functional.silu(x @ sd[p + "mlp.gate_proj.weight"].T)
        return (gate * (x @ sd[p + "mlp.up_proj.weight"].T)) @ sd[p + "mlp.down_proj.weight"].T

    kvs, hidden, residual = [], None, None
    for i in range(cfg.num_hidden_layers):
        p = "midlayer." if i == 0 else f"layers.{i}."
        if i == 0:
            embeds = rms(embed[ids], sd[p + "input_layernorm.weight"])
            gn = rms(g, sd[p + "hidden_norm.weight"])
            residual = gn if cfg.norm_before_residual else g
            x = torch.cat([embeds, gn], -1)  # (T, 2H)
        else:
            residual = add(hidden, residual)
            x = rms(residual, sd[p + "input_layernorm.weight"])  # (T, H)
        attn_out, kv = attn(x, p, None if past is None else past[i])
        kvs.append(kv)
        residual = add(attn_out, residual)
        hidden = mlp(rms(residual, sd[p + "post_attention_layernorm.weight"]), p)
    prenorm = add(hidden, residual)
    normed = rms(prenorm, sd["norm.weight"])
    return normed @ sd["lm_head.weight"].T, normed if cfg.norm_output else prenorm, kvs


def test_two_layer_draft_names_and_shapes():
    """Layer 1 is `layers.1.*`: q/k/v read H inputs, no hidden_norm; layer 0 as before."""
    sd = make_draft(small_cfg(num_hidden_layers=2)).state_dict()
    later = {k for k in sd if k.startswith("layers.1.")}
    assert set(sd) - later == set(make_draft(small_cfg()).state_dict())
    assert later == {n.replace("midlayer.", "layers.1.") for n in LAYER_NAMES} - {
        "layers.1.hidden_norm.weight"}
    assert sd["layers.1.self_attn.q_proj.weight"].shape == (4 * 16, 48)
    assert sd["layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 48)
    assert sd["layers.1.mlp.down_proj.weight"].shape == (48, 96)
    assert len(make_draft(small_cfg(num_hidden_layers=3)).new_cache().k) == 3
    with pytest.raises(ConfigError, match="num_hidden_layers must be > 0"):
        small_cfg(num_hidden_layers=0)


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("norm_output", [False, True])
def test_two_layer_draft_runs_as_vllm_does(norm_before_residual, norm_output):
    """A 2-layer draft against vllm_forward: a first pass over 9 positions from the aux
    states, a second pass over them fed the returned hidden at positions + 1, and a chain
    step at one new position fed the last returned hidden, attending over each layer's own
    cache of the first pass."""
    cfg = small_cfg(num_hidden_layers=2, rope_scaling=LLAMA3,
                    norm_before_residual=norm_before_residual, norm_output=norm_output)
    draft = make_draft(cfg)
    sd = {k: v.double().float() for k, v in draft.state_dict().items()}
    embed = draft.embed_weight
    torch.manual_seed(6)
    t = 9
    ids, aux, pos = torch.randint(0, 97, (t,)), torch.randn(t, 3 * 40), torch.arange(t) + 4
    with torch.no_grad():
        cache = draft.new_cache()
        first = draft(ids[None], aux[None], pos[None], cache=cache)
        second = draft(ids[None], None, pos[None] + 1, hidden=first.hidden)
        token = torch.tensor([[17]])
        chained = draft(token, None, pos[None, -1:] + 1, hidden=first.hidden[:, -1:], cache=cache)
    logits, hidden, kvs = vllm_forward(sd, cfg, embed, ids, aux @ sd["fc.weight"].T, pos)
    torch.testing.assert_close(first.logits[0], logits, atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(first.hidden[0], hidden, atol=3e-5, rtol=1e-5)
    logits2, hidden2, _ = vllm_forward(sd, cfg, embed, ids, hidden, pos + 1)
    torch.testing.assert_close(second.logits[0], logits2, atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(second.hidden[0], hidden2, atol=3e-5, rtol=1e-5)
    logits3, hidden3, _ = vllm_forward(sd, cfg, embed, token[0], hidden[-1:], pos[-1:] + 1,
                                       past=kvs)
    assert len(cache) == t + 1 and all(k.shape[1] == t + 1 for k in cache.k)
    torch.testing.assert_close(chained.logits[0], logits3, atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(chained.hidden[0], hidden3, atol=3e-5, rtol=1e-5)
    # the second layer counts: without it the logits are another model's
    one = {k: v for k, v in sd.items() if not k.startswith("layers.1.")}
    alone, _, _ = vllm_forward(one, small_cfg(norm_before_residual=norm_before_residual,
                                              norm_output=norm_output, rope_scaling=LLAMA3),
                               embed, ids, aux @ sd["fc.weight"].T, pos)
    assert not torch.allclose(alone, logits, atol=1e-2)


def test_two_layer_gradients_match_vllm_math():
    """Every parameter gradient of a 3-layer draft (layers 1 and 2 included) against
    autograd through vllm_forward."""
    cfg = small_cfg(num_hidden_layers=3, norm_before_residual=True)
    draft = make_draft(cfg)
    sd = {k: v.detach().clone().requires_grad_(v.is_floating_point())
          for k, v in draft.state_dict().items()}
    torch.manual_seed(8)
    ids, aux, pos = torch.randint(0, 97, (11,)), torch.randn(11, 3 * 40), torch.arange(11) + 2
    cot_logits, cot_hidden = torch.randn(11, cfg.draft_vocab_size), torch.randn(11, 48)
    out = draft(ids[None], aux[None], pos[None])
    ((out.logits[0] * cot_logits).sum() + (out.hidden[0] * cot_hidden).sum()).backward()
    logits, h, _ = vllm_forward(sd, cfg, draft.embed_weight, ids, aux @ sd["fc.weight"].T, pos)
    ((logits * cot_logits).sum() + (h * cot_hidden).sum()).backward()
    assert any(name.startswith("layers.2.") for name, _ in draft.named_parameters())
    for name, p in draft.named_parameters():
        torch.testing.assert_close(p.grad, sd[name].grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_weights_kept_between_no_grad_calls_follow_parameter_updates():
    cfg = small_cfg()
    draft = make_draft(cfg)
    torch.manual_seed(4)
    ids, aux, pos = torch.randint(0, 97, (1, 6)), torch.randn(1, 6, 3 * 40), torch.arange(6)[None]
    with torch.no_grad():
        before = draft(ids, aux, pos).logits
        draft.midlayer.mlp.down_proj.weight.mul_(2)  # as an optimizer step would, in place
        after = draft(ids, aux, pos).logits
    fresh = make_draft(cfg)
    fresh.load_state_dict(draft.state_dict())
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, fresh(ids, aux, pos).logits)


def test_rms_norm_values_and_gradients():
    from eyas.draft.eagle3 import RMSNorm

    norm = RMSNorm(12, 1e-5).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(norm, (x,))  # d/dx
    w = norm.weight.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    ref = w * x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-5)
    out = norm(x)
    cot = torch.randn_like(out)
    (out * cot).sum().backward()
    (ref * cot).sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(norm.weight.grad, w.grad)


def test_kv_cache_equals_one_pass_and_crops():
    cfg = small_cfg(rope_scaling=LLAMA3)
    draft = make_draft(cfg)
    torch.manual_seed(2)
    ids, aux = torch.randint(0, 97, (2, 9)), torch.randn(2, 9, 120)
    pos = torch.arange(9).repeat(2, 1)
    full = draft(ids, aux, pos)
    cache = draft.new_cache()
    first = draft(ids[:, :5], aux[:, :5], pos[:, :5], cache=cache)
    assert len(cache) == 5
    rest = draft(ids[:, 5:], aux[:, 5:], pos[:, 5:], cache=cache)
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], 1), full.logits,
                               atol=1e-5, rtol=1e-5)
    # chain steps one token at a time after cropping back to the first 5 positions
    cache.crop(5)
    assert len(cache) == 5
    step = draft(ids[:, 5:6], None, pos[:, 5:6], hidden=torch.randn(2, 1, 48), cache=cache)
    assert len(cache) == 6 and step.logits.shape == (2, 1, 61)
    assert isinstance(cache, KVCache)


def test_vocab_buffers_and_target_ids():
    cfg = small_cfg()
    draft = make_draft(cfg)
    t2d = torch.zeros(97, dtype=torch.bool)
    chosen = torch.randperm(97)[:61].sort().values
    t2d[chosen] = True
    draft.set_vocab(chosen - torch.arange(61), t2d)
    assert torch.equal(draft.to_target_ids(torch.arange(61)), chosen)
    with pytest.raises(EyasError, match="disagree"):
        draft.set_vocab(torch.zeros(61, dtype=torch.long), t2d)


def test_lm_head_from_target_rows_frozen_or_trained():
    cfg = small_cfg(target_hidden_size=48)
    draft = make_draft(cfg)
    chosen = torch.arange(0, 97, 97 / 61).long()[:61]
    t2d = torch.zeros(97, dtype=torch.bool)
    t2d[chosen] = True
    draft.set_vocab(chosen - torch.arange(61), t2d)
    target = torch.randn(97, 48)
    draft.init_lm_head_from_target(target, freeze=True)
    assert torch.equal(draft.lm_head.weight, target[chosen])
    assert not draft.lm_head.weight.requires_grad
    draft.init_lm_head_from_target(target[chosen], freeze=False)  # already-selected rows
    assert draft.lm_head.weight.requires_grad
    with pytest.raises(EyasError, match="hidden_size == target_hidden_size"):
        make_draft(small_cfg()).init_lm_head_from_target(torch.randn(97, 40), freeze=True)


def test_config_round_trips_and_validates():
    cfg = small_cfg(rope_scaling=LLAMA3, norm_before_residual=True)
    assert DraftConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        small_cfg(num_key_value_heads=3)
    with pytest.raises(ConfigError, match="exceeds"):
        small_cfg(draft_vocab_size=98)
    with pytest.raises(ConfigError, match="silu"):
        small_cfg(hidden_act="gelu")
    with pytest.raises(ConfigError, match="aux_layer_ids"):
        small_cfg(aux_layer_ids=(1, 2))
    eagle31 = small_cfg(norm_before_fc=True, norm_output=True)
    assert DraftConfig.from_dict(json.loads(json.dumps(eagle31.to_dict()))) == eagle31
    with pytest.raises(ConfigError, match="norm_before_fc .* fc_norm .* choose one"):
        small_cfg(norm_before_fc=True, fc_norm=True)


def test_from_target_hf_config_and_rope_normalisation():
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=300, max_position_embeddings=4096,
                     rope_parameters={"rope_theta": 500000.0, **LLAMA3})
    cfg = DraftConfig.from_target(hf, draft_vocab_size=100, aux_layer_ids=(1, 2, 3))
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.head_dim) == (64, 64, 16)
    assert cfg.num_key_value_heads == 2 and cfg.vocab_size == 300 and cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == LLAMA3
    small = DraftConfig.from_target(hf, draft_vocab_size=100, aux_layer_ids=(1, 2, 3),
                                    hidden_size=32, intermediate_size=64)
    assert small.hidden_size == 32 and small.target_hidden_size == 64
    # DeepSeek-style YaRN: mscale keys dropped (vLLM's Llama YaRN ignores them)
    yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert draft_rope_scaling(yarn) == {k: yarn[k] for k in
                                        ("rope_type", "factor", "original_max_position_embeddings",
                                         "beta_fast", "beta_slow")}
    draft = Eagle3Draft(small_cfg(rope_scaling=draft_rope_scaling(yarn),
                                  max_position_embeddings=131072))
    assert draft.rope_scale == pytest.approx(0.1 * math.log(32.0) + 1.0)
    assert draft_rope_scaling({"rope_type": "default", "mrope_section": [1, 2]}) is None


def test_from_target_model_info(llama_dir):
    from eyas.targets.models import inspect_model, load_config

    info = inspect_model(load_config(str(llama_dir)))
    cfg = DraftConfig.from_target(info, draft_vocab_size=min(32000, info.vocab_size),
                                  aux_layer_ids=info.default_aux_layer_ids)
    assert cfg.hidden_size == info.hidden_size and cfg.vocab_size == info.vocab_size
    assert cfg.head_dim == info.head_dim and cfg.aux_layer_ids == info.default_aux_layer_ids


@pytest.mark.parametrize("prefix", ["midlayer.", "layers.0."])
def test_from_pretrained_loads_vllm_layout(tmp_path, prefix):
    cfg = small_cfg(target_hidden_size=48)
    draft = make_draft(cfg)
    t2d = torch.zeros(97, dtype=torch.bool)
    t2d[torch.arange(0, 61 * 3, 3) % 97] = True
    chosen = t2d.nonzero().squeeze(1)
    draft.set_vocab(chosen - torch.arange(61), t2d)
    (tmp_path / "config.json").write_text(json.dumps(to_vllm_config(cfg)))
    weights = {k.replace("midlayer.", prefix): v for k, v in draft.state_dict().items()
               if k != "t2d"}
    save_file(weights, str(tmp_path / "model.safetensors"))
    loaded = Eagle3Draft.from_pretrained(tmp_path, embed_tokens=draft.embed_weight)
    assert loaded.cfg == cfg and torch.equal(loaded.t2d, t2d)
    ids, aux, pos = torch.randint(0, 97, (1, 6)), torch.randn(1, 6, 144), torch.arange(6)[None]
    torch.testing.assert_close(loaded(ids, aux, pos).logits, draft(ids, aux, pos).logits)
    half = Eagle3Draft.from_pretrained(tmp_path, embed_tokens=draft.embed_weight,
                                       dtype=torch.bfloat16)
    assert half.fc.weight.dtype == torch.bfloat16 and half.d2t.dtype == torch.int64
    with pytest.raises(EyasError, match="no config.json"):
        Eagle3Draft.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "model.safetensors").unlink()
    save_file({k: v for k, v in weights.items() if k != "norm.weight"},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(EyasError, match="norm.weight"):
        Eagle3Draft.from_pretrained(tmp_path, embed_tokens=draft.embed_weight)


def test_embedding_is_required_and_shape_checked():
    draft = Eagle3Draft(small_cfg())
    with pytest.raises(EyasError, match="embed_tokens"):
        draft(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 120), torch.zeros(1, 2).long())
    with pytest.raises(EyasError, match="another target"):
        draft.set_embed_tokens(torch.nn.Embedding(96, 48))


@pytest.mark.gpu
@pytest.mark.parametrize("n,hq,hkv,d", [(37, 4, 2, 16), (8192, 32, 8, 128)])
def test_triton_rope_matches_the_torch_functions(n, hq, hkv, d):
    """On CUDA QKVRope runs eyas.kernels.rope_kernels: q and k within one bf16 step of the torch
    rotation (fp32 math in both; the kernel may fuse a multiply-add), v copied exactly, and
    the backward (the rotation at -positions into the fused layout) likewise."""
    from eyas.kernels import fused, rope_kernels

    torch.manual_seed(n)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, device="cuda").bfloat16()
    pos = torch.randint(0, 131072, (n, 1), device="cuda").float()
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    got = rope_kernels.rope(qkv, pos, inv, 1.1, hq, hkv)
    ref = fused._rope.__wrapped__(*qkv.view(n, hq + 2 * hkv, d).split([hq, hkv, hkv], 1), pos,
                                  inv, 1.1)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and a.is_contiguous()
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-6)
    assert torch.equal(got[2], ref[2])
    grads = [torch.randn_like(t) for t in ref]
    grads[0] = grads[0].transpose(0, 1).contiguous().transpose(0, 1)  # a strided gradient
    back = rope_kernels.rope_backward(*grads, pos, inv, 1.1)
    ref_back = fused._rope_backward.__wrapped__(*grads, pos, inv, 1.1)
    torch.testing.assert_close(back.float(), ref_back.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", [(37, 64), (8192, 4096), (3000, 5120)])
def test_triton_rms_norm_backward_matches_the_torch_function(rows, cols):
    """On CUDA RMSNormFn's backward runs eyas.kernels.norm_kernels (both gradients in one pass): the
    input's gradient within one bf16 step, the weight's to fp32 summation order."""
    from eyas.kernels import fused, norm_kernels

    torch.manual_seed(rows)
    x = torch.randn(rows, cols, device="cuda").bfloat16()
    w = torch.randn(cols, device="cuda") * 0.5 + 1
    g = torch.randn(rows, cols, device="cuda").bfloat16()
    _, rstd = fused._rms_norm.__wrapped__(x, w, 1e-5)
    dx, dw = norm_kernels.rms_norm_backward(g, x, w, rstd)
    ref_dx, ref_dw = fused._rms_norm_backward.__wrapped__(g, x, w, rstd)
    assert dx.dtype == ref_dx.dtype and dw.dtype == ref_dw.dtype
    torch.testing.assert_close(dx.float(), ref_dx.float(), rtol=2 ** -7, atol=1e-5)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-4, atol=1e-3)
