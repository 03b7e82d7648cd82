"""The DFlash draft model (what vLLM's `DFlashQwen3ForCausalLM` runs, `method: "dflash"`).

A stack of Qwen3-style decoder layers that drafts a whole block in one forward. With target
hidden size H (the draft's too: it reads the target's embedding and its output goes through the
target's lm_head), n target taps, block size B:

    c = hidden_norm(fc(concat(aux_0, ..., aux_{n-1})))      per context token   (n*H -> H)
    per layer, context keys/values:  k_c = rope(k_norm(k_proj(c))), v_c = v_proj(c)
    the block [bonus, MASK, ..., MASK] at positions p..p+B-1, x = embed(block) (target's):
        a = input_layernorm(x)
        q, k, v = rope(q_norm(q_proj(a))), rope(k_norm(k_proj(a))), v_proj(a)
        x = x + o_proj(attend(q -> [k_c, v_c of the context before p] + [k, v of the block]))
        x = x + mlp(post_attention_layernorm(x))
    h = norm(x);  logits = target_lm_head(h)  at slots 1..B-1, slot j predicting position p+j

The context enters every layer only as keys and values (never through the layers themselves),
projected once per token; attention inside the block is bidirectional (docs/dflash.md,
sections 1 and 4). Parameter names equal the exported (and vLLM's) weight names: `fc`,
`hidden_norm`, `layers.{i}.self_attn.{q,k,v,o}_proj`, `layers.{i}.self_attn.{q,k}_norm`,
`layers.{i}.{input,post_attention}_layernorm`, `layers.{i}.mlp.{gate,up,down}_proj`, `norm`.
The target's embedding and lm_head are non-persistent buffers: never saved, never exported.

Attention has one path for training and eval, `eyas.kernels.attention.block_attention`: each
query sees a band of context keys (its document before the anchor in training; the whole
cache at eval) plus its own block.
"""

from __future__ import annotations

import torch
from torch import nn

from eyas.dflash.config import DFlashConfig
from eyas.draft.eagle3 import RMSNorm, rope_inv_freq
from eyas.errors import EyasError
from eyas.kernels.attention import block_attention
from eyas.kernels.swiglu import SwiGLUDown


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
         scale: float) -> torch.Tensor:
    """Neox-style RoPE (vLLM's default for DFlash, `is_neox_style`): x (N, h, d), positions
    (N,) -> (N, h, d), computed in fp32."""
    freqs = positions.float()[:, None] * inv_freq[None]  # (N, d/2)
    cos, sin = (torch.cat([f, f], -1)[:, None] * scale for f in (freqs.cos(), freqs.sin()))
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj, self.o_proj = _linear(h, self.hq * d), _linear(self.hq * d, h)
        self.k_proj, self.v_proj = _linear(h, self.hkv * d), _linear(h, self.hkv * d)
        self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)


class _MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = _linear(h, i), _linear(h, i), _linear(i, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)  # (N, 2I)
        return SwiGLUDown.apply(gate_up, self.down_proj.weight.to(gate_up.dtype))


class DFlashLayer(nn.Module):
    """One Qwen3 decoder layer whose keys/values are the context's followed by the block's."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn, self.mlp = _Attention(cfg), _MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def context_kv(self, c, positions, inv_freq, scale) -> tuple[torch.Tensor, torch.Tensor]:
        """c (M, H) fused context (after hidden_norm), positions (M,) -> k, v (M, hkv, d)."""
        at = self.self_attn
        k = at.k_norm(at.k_proj(c).view(-1, at.hkv, at.d))
        return rope(k, positions, inv_freq, scale), at.v_proj(c).view(-1, at.hkv, at.d)

    def project(self, x, positions, inv_freq, scale):
        """x (N, H) block hidden states, positions (N,) -> q (N, hq, d), k, v (N, hkv, d)."""
        at = self.self_attn
        a = self.input_layernorm(x)
        q = rope(at.q_norm(at.q_proj(a).view(-1, at.hq, at.d)), positions, inv_freq, scale)
        k = rope(at.k_norm(at.k_proj(a).view(-1, at.hkv, at.d)), positions, inv_freq, scale)
        return q, k, at.v_proj(a).view(-1, at.hkv, at.d)

    def finish(self, x, attn_out):
        """x (N, H), attn_out (N, hq, d) -> the layer's output (N, H)."""
        x = x + self.self_attn.o_proj(attn_out.flatten(1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, positions, ctx_k, ctx_v, lo, hi, block: int, inv_freq, scale):
        """x (N, H) block hidden states (N = blocks * block), positions (N,); ctx_k, ctx_v
        (M, hkv, d); query n sees context keys lo[n]..hi[n] and its own block."""
        q, k, v = self.project(x, positions, inv_freq, scale)
        return self.finish(x, block_attention(q, ctx_k, ctx_v, lo, hi, k, v, block))


class DFlashDraft(nn.Module):
    """The DFlash draft; `set_target(embed, lm_head)` hands it the target's frozen pieces."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = _linear(len(cfg.aux_layer_ids) * h, h)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("embed_tokens", None, persistent=False)  # (V, H) target's
        self.register_buffer("lm_head", None, persistent=False)  # (V, H) target's

    def set_target(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        v, h = self.cfg.vocab_size, self.cfg.hidden_size
        for name, w in (("embedding", embed_tokens), ("lm_head", lm_head)):
            if tuple(w.shape) != (v, h):
                raise EyasError(f"the target's {name} is {tuple(w.shape)}, the DFlash draft "
                                f"expects ({v}, {h}): was it trained for another target?")
        self.embed_tokens, self.lm_head = embed_tokens.detach(), lm_head.detach()

    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """aux_hidden (M, n*H) concatenated taps -> fused context (M, H), what vLLM's
        combine_hidden_states (fc) and precompute_and_store_context_kv (hidden_norm) make."""
        return self.hidden_norm(self.fc(aux_hidden))  # autocast (training) or same dtypes

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> list:
        """Per layer (k, v) of the fused context c (M, H) at positions (M,)."""
        return [layer.context_kv(c, positions, self.inv_freq, self.rope_scale)
                for layer in self.layers]

    def forward(self, block_ids, positions, ctx_kv: list, lo, hi,
                block: int | None = None) -> torch.Tensor:
        """block_ids, positions (N,) with N = blocks * block (slot 0 the bonus token, the
        others mask_token_id; block: block_size in training, 1 + k when serving k drafts);
        ctx_kv from `context_kv`; query n sees context keys lo[n]..hi[n]. Returns norm(h)
        (N, H): the lm_head's input."""
        x = self.embed_tokens[block_ids].to(self.fc.weight.dtype)  # (N, H)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, positions, k, v, lo, hi, block or self.cfg.block_size, self.inv_freq,
                      self.rope_scale)
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(N, H) -> (N, V) over the target vocabulary, through the target's lm_head."""
        return h.to(self.lm_head.dtype) @ self.lm_head.t()

    @classmethod
    def from_pretrained(cls, folder, embed_tokens, lm_head, dtype=None) -> DFlashDraft:
        """An exported DFlash folder (`eyas export`, vLLM's format) with the target's pieces."""
        from eyas.dflash.formats import read_dflash_folder

        cfg, state = read_dflash_folder(folder)
        draft = cls(cfg)
        result = draft.load_state_dict(state, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise EyasError(f"{folder}: weights do not match the config (missing "
                            f"{result.missing_keys}, unexpected {result.unexpected_keys})")
        draft.set_target(embed_tokens, lm_head)
        return draft.to(dtype) if dtype is not None else draft
