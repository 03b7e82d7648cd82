"""The EAGLE-3 draft model (what vLLM's `llama_eagle3` runs).

Per position, with target hidden size Ht, draft hidden size H, draft vocabulary Vd:

    g = fc(concat(aux_0, aux_1, aux_2))                     (3*Ht -> H, no bias)
    x = concat(input_layernorm(embed(token)), hidden_norm(g))   (2H; q/k/v read all of it)
    h = residual + o_proj(attn(x))        residual = g, or hidden_norm(g) if norm_before_residual
    h = h + mlp(post_attention_layernorm(h))
    layers 1..N-1 (cfg.num_hidden_layers = N), each a Llama pre-norm block on h:
      h = h + o_proj(attn(input_layernorm(h)));  h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))             over Vd; h (pre-norm) feeds the next draft step

EAGLE 3.1 variants, as vLLM's llama_eagle3 runs them (docs/draft.md, "EAGLE 3.1 variants"):
`norm_before_fc` feeds fc input_norm(concat(aux)) (one RMSNorm over all 3*Ht), `fc_norm`
feeds it concat(fc_norm[i](aux_i)) (one RMSNorm per aux state), `norm_output` feeds norm(h)
to the next step instead of h.

Parameter names equal the vLLM export (`fc.weight`, `input_norm.weight`, `fc_norm.{i}.weight`,
`midlayer.*` for layer 0, `layers.{i}.*` for layer i >= 1, `norm.weight`, `lm_head.weight`,
buffers `d2t`, `t2d`). Layers >= 1 have no `hidden_norm` (vLLM builds one there and never uses
it). The target's embedding is shared and frozen: it is a non-persistent buffer, so it is never
saved or exported.

Attention has one path, `eyas.kernels.attention.attention()`: query n sees keys `lo[n]..hi[n]` of
one key sequence (causal within its packed document, or cache + causal at eval) plus, during
TTT, the keys its own position produced at earlier steps (eval's batched drafter,
eyas.serve.batched, runs the layers' pieces over a per-row cache through SDPA with a slot
mask instead: its shapes change at every call). Each layer attends over its own keys: every
draft pass appends to every layer's cache. The training forward,
`eyas.draft.ttt.ttt_forward`, chains the layers' pieces (`fuse`, `project`, `attention`,
`finish`); docs/draft.md has the math and the shift convention.

Speed: a layer's matmuls use `LayerWeights` (cast once per forward, q/k/v and gate/up
concatenated); its elementwise parts (RMSNorm, q/k/v split + RoPE, SwiGLU) are custom
autograd Functions from eyas.kernels.fused, compiled into a few kernels on CUDA, eager on CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from eyas.kernels.attention import attention
from eyas.config import ConfigError, from_dict, to_dict
from eyas.errors import EyasError
from eyas.kernels import fp8 as fp8_mm
from eyas.kernels.fp8 import Fp8Matrix
from eyas.kernels.fused import QKVRope, RMSNormFn
from eyas.kernels.swiglu import SwiGLUDown
from eyas.draft.config import draft_rope_scaling, DraftConfig

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- config

# ----------------------------------------------------------------------------- layers

class RMSNorm(nn.Module):
    """Llama RMSNorm (see eyas.kernels.fused.RMSNormFn)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFn.apply(x, self.weight, self.eps)


def rope_inv_freq(cfg: DraftConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim/2,), cos/sin scale) for the draft's RoPE, scaled types through
    transformers' ROPE_INIT_FUNCTIONS (the same formulas vLLM implements)."""
    if cfg.rope_scaling is None:
        exponent = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
        return 1.0 / (cfg.rope_theta ** exponent), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                     head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                     rope_parameters={"rope_theta": cfg.rope_theta, **cfg.rope_scaling})
    inv_freq, scale = ROPE_INIT_FUNCTIONS[cfg.rope_scaling["rope_type"]](hf, None)
    return inv_freq.float(), float(scale)


# ----------------------------------------------------------------------------- model

@dataclass
class DraftOutput:
    logits: torch.Tensor  # (B, T, Vd)
    hidden: torch.Tensor  # (B, T, H): pre-norm h (post-norm if cfg.norm_output), next step's input


class KVCache:
    """Keys/values of earlier positions for eval-time drafting, one pair per decoder layer;
    rows share one length. `forward(..., cache=c)` appends to every layer's in place;
    `crop(n)` drops everything after position n."""

    def __init__(self, layers: int = 1):
        self.k = [None] * layers  # per layer: (B, L, hkv, d)
        self.v = [None] * layers

    def __len__(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[1]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Add k, v (B, T, hkv, d) to layer `layer`'s; returns all of its keys and values."""
        old_k, old_v = self.k[layer], self.v[layer]
        self.k[layer] = k if old_k is None else torch.cat([old_k, k], dim=1)
        self.v[layer] = v if old_v is None else torch.cat([old_v, v], dim=1)
        return self.k[layer], self.v[layer]

    def crop(self, n: int) -> None:
        self.k = [None if k is None else k[:, :n] for k in self.k]
        self.v = [None if v is None else v[:, :n] for v in self.v]


@dataclass
class LayerWeights:
    """One decoder layer's matrices in the dtype its matmuls run in (the autocast dtype, else
    the parameters' own), q/k/v and gate/up concatenated so each group is one matmul (fewer,
    larger kernels). ttt_forward makes them once for all its steps; the parameters, their
    names and their fp32 gradients stay those of the separate nn.Linear modules."""

    qkv: torch.Tensor  # ((hq + 2 hkv) d, 2H); (.., H) for layers >= 1
    o: torch.Tensor  # (H, hq d)
    gate_up: torch.Tensor  # (2I, H)
    down: torch.Tensor  # (H, I)
    # the same matrices quantized for fp8 products (eyas.kernels.fp8), when those are on
    fp8: dict[str, Fp8Matrix | None] = field(default_factory=dict)
    # with layer_weights(split=True): qkv's columns that read the embedding (its first H)
    # and those that read the hidden state, as two matrices (fp8: two fp8 copies, no qkv one)
    qkv_embed: torch.Tensor | None = None  # ((hq + 2 hkv) d, H)
    qkv_hidden: torch.Tensor | None = None  # ((hq + 2 hkv) d, H)


def _matmul_dtype(device_type: str, weight: torch.Tensor) -> torch.dtype:
    """The dtype a matmul with `weight` runs in: autocast's when it is on, else the weight's."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


def _decoder_layer(cfg: DraftConfig, first: bool) -> nn.ModuleDict:
    """A Llama decoder layer's modules. The first reads [embedding, hidden] (2H inputs to
    q/k/v) and has hidden_norm; a later one reads the residual stream (H) and has none."""
    h, hq, hkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkv_in = 2 * h if first else h
    norms = dict(input_layernorm=RMSNorm(h, cfg.rms_norm_eps))
    if first:
        norms["hidden_norm"] = RMSNorm(h, cfg.rms_norm_eps)
    return nn.ModuleDict(dict(
        **norms,
        self_attn=nn.ModuleDict(dict(
            q_proj=_linear(qkv_in, hq * d), k_proj=_linear(qkv_in, hkv * d),
            v_proj=_linear(qkv_in, hkv * d), o_proj=_linear(hq * d, h))),
        post_attention_layernorm=RMSNorm(h, cfg.rms_norm_eps),
        mlp=nn.ModuleDict(dict(gate_proj=_linear(h, cfg.intermediate_size),
                               up_proj=_linear(h, cfg.intermediate_size),
                               down_proj=_linear(cfg.intermediate_size, h))),
    ))


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft: fc over three target aux states + `cfg.num_hidden_layers` Llama-style
    decoder layers, the first reading the token embedding beside the hidden state."""

    def __init__(self, cfg: DraftConfig, embed_tokens: nn.Embedding | torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(3 * cfg.target_hidden_size, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps)
                                         for _ in range(3))
        self.fc = _linear(3 * cfg.target_hidden_size, h)
        self.midlayer = _decoder_layer(cfg, first=True)  # layer 0 (vLLM's layers.0)
        # layers 1..N-1 under the names vLLM loads them by, layers.{i}.* (empty for N = 1)
        self.layers = nn.ModuleDict({str(i): _decoder_layer(cfg, first=False)
                                     for i in range(1, cfg.num_hidden_layers)})
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = _linear(h, cfg.draft_vocab_size)
        # draft id i <-> target id i + d2t[i]; identity on the first Vd ids until set_vocab
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(cfg.vocab_size) < cfg.draft_vocab_size)
        inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("embed_weight", None, persistent=False)
        self._cached_weights = {}  # layer -> (key, LayerWeights) of its last call without grad
        if embed_tokens is not None:
            self.set_embed_tokens(embed_tokens)

    # -- setup --------------------------------------------------------------------------

    def set_embed_tokens(self, embed_tokens: nn.Embedding | torch.Tensor) -> None:
        """Share the target's input embedding (V, H); frozen and never saved."""
        w = embed_tokens.weight if isinstance(embed_tokens, nn.Embedding) else embed_tokens
        if tuple(w.shape) != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise EyasError(f"target embedding is {tuple(w.shape)} but the draft needs "
                            f"({self.cfg.vocab_size}, {self.cfg.hidden_size}): the draft was made "
                            f"for another target; use it with the target it was trained for")
        self.embed_weight = w.detach()

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary (from `eyas vocab`): d2t (Vd,) offsets, t2d (V,) bool."""
        from eyas.store.vocab import check_vocab

        check_vocab(d2t, t2d, self.cfg.vocab_size, self.cfg.draft_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def init_lm_head_from_target(self, target_lm_head_weight: torch.Tensor, freeze: bool) -> None:
        """Start lm_head from the target's output rows of the draft vocab (set_vocab first);
        `freeze` keeps it fixed (leave it out of the optimizer)."""
        w = target_lm_head_weight
        if w.shape[0] == self.cfg.vocab_size:
            w = w[self.t2d.to(w.device)]  # (Vd, Ht)
        if tuple(w.shape) != tuple(self.lm_head.weight.shape):
            raise EyasError(f"target lm_head rows are {tuple(w.shape)} but the draft lm_head is "
                            f"{tuple(self.lm_head.weight.shape)}; initialising from the target "
                            f"needs hidden_size == target_hidden_size")
        with torch.no_grad():
            self.lm_head.weight.copy_(w)
        self.lm_head.weight.requires_grad_(not freeze)

    def new_cache(self) -> KVCache:
        return KVCache(self.cfg.num_hidden_layers)

    def layer(self, i: int) -> nn.ModuleDict:
        """Decoder layer i's modules (`midlayer` for 0, `layers.{i}` after it)."""
        return self.midlayer if i == 0 else self.layers[str(i)]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # -- the layers, in pieces TTT reuses -------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_weight is None:
            raise EyasError("the draft has no token embedding; pass the target's "
                            "embed_tokens to Eagle3Draft(...) or set_embed_tokens()")
        return F.embedding(input_ids, self.embed_weight)

    def fuse(self, aux_hidden: torch.Tensor, fp8: bool = False) -> torch.Tensor:
        """(..., 3*Ht) target aux states (or (..., 3, Ht)) -> g (..., H); `fp8`: the fc
        product in fp8 (eyas.kernels.fp8)."""
        ht = self.cfg.target_hidden_size
        aux = aux_hidden if aux_hidden.shape[-1] == 3 * ht else aux_hidden.flatten(-2)
        if self.cfg.norm_before_fc:
            aux = self.input_norm(aux)  # statistics over all 3*Ht values at once
        if self.cfg.fc_norm:
            parts = aux.chunk(3, dim=-1)  # 3 x (..., Ht)
            aux = torch.cat([norm(p) for norm, p in zip(self.fc_norm, parts)], dim=-1)
        if not torch.is_autocast_enabled(aux.device.type):
            aux = aux.to(self.fc.weight.dtype)  # e.g. bf16 captures into an fp32 draft
        if fp8:
            dtype = _matmul_dtype(aux.device.type, self.fc.weight)
            w = self.fc.weight.to(dtype)
            return fp8_mm.linear(aux.to(dtype), w, Fp8Matrix.of(w))
        return self.fc(aux)

    def layer_weights(self, device_type: str, fp8: bool = False,
                      split: bool = False, layer: int = 0) -> LayerWeights:
        """Decoder layer `layer`'s matrices as its matmuls use them (see LayerWeights), and
        with `fp8` their fp8 copies too; `split` (layer 0 only): also qkv's embedding and
        hidden columns apart (for embed_share and project(add_embed=)). Without grad (drafting
        token by token) they are kept until a parameter changes, rather than concatenated
        again at every call."""
        if split and layer:
            raise ValueError(f"layer_weights(split=True) is for layer 0, whose q/k/v read the "
                             f"embedding; layer {layer}'s read the hidden state alone")
        attn, mlp = self.layer(layer).self_attn, self.layer(layer).mlp
        dtype = _matmul_dtype(device_type, attn.q_proj.weight)
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                   mlp.up_proj, mlp.down_proj)
        key = (dtype, fp8, split,
               *((m.weight.data_ptr(), m.weight._version) for m in linears))
        cached = self._cached_weights.get(layer)
        if not torch.is_grad_enabled() and cached is not None and cached[0] == key:
            return cached[1]
        q, k, v, o, gate, up, down = (m.weight.to(dtype) for m in linears)
        weights = LayerWeights(qkv=torch.cat([q, k, v]), o=o, gate_up=torch.cat([gate, up]),
                               down=down)
        if split:
            h = self.cfg.hidden_size
            weights.qkv_embed, weights.qkv_hidden = weights.qkv[:, :h], weights.qkv[:, h:]
        if fp8:
            names = ("qkv_embed", "qkv_hidden") if split else ("qkv",)
            weights.fp8 = {name: Fp8Matrix.of(getattr(weights, name))
                           for name in (*names, "o", "gate_up", "down")}
        if torch.is_grad_enabled():
            self._cached_weights.clear()
        else:
            self._cached_weights[layer] = (key, weights)
        return weights

    def embed_share(self, input_ids, weights: LayerWeights, dtype: torch.dtype) -> torch.Tensor:
        """input_ids (N,) -> their embedding's share of q/k/v, (N, (hq + 2 hkv) d):
        input_layernorm(embed(ids)) times qkv's embedding columns. q/k/v read the
        concatenation [e, g], so they are this share plus the hidden state's. A TTT step's
        token at a position is some position's own token, so ttt_forward computes the shares
        once and every step adds rows of them (project(add_embed=)) instead of projecting
        the embedding again: 1/7 of that half of the q/k/v matmuls. `weights`: from
        layer_weights(split=True); dtype: the hidden state's."""
        e = self.midlayer.input_layernorm(self.embed(input_ids).to(dtype))  # (N, H)
        return fp8_mm.linear(e, weights.qkv_embed, weights.fp8.get("qkv_embed"))

    def project(self, input_ids, hidden, position_ids, weights: LayerWeights | None = None,
                add_embed=None, layer: int = 0):
        """input_ids (N,), hidden (N, H), position_ids (N,) -> q (N, hq, d) and k, v
        (N, hkv, d) with RoPE applied, and the residual (N, H), of decoder layer `layer`.
        `weights`: from layer_weights(layer=layer), made here when not given. Layer 0 reads
        [input_layernorm(embed(input_ids)), hidden_norm(hidden)]; add_embed: instead of
        input_ids (then None), a function adding the tokens' embedding share (embed_share) to
        the hidden state's share of q/k/v (N, C); weights must then be split. A later layer
        reads input_layernorm(hidden) alone, `hidden` being the previous layer's output h
        (input_ids and add_embed unused), and its residual is `hidden` itself."""
        cfg = self.cfg
        w = self.layer_weights(hidden.device.type, layer=layer) if weights is None else weights
        if layer:
            x = self.layer(layer).input_layernorm(hidden)  # (N, H)
            qkv = fp8_mm.linear(x, w.qkv, w.fp8.get("qkv"))
            q, k, v = QKVRope.apply(qkv, position_ids.float()[:, None], self.inv_freq,
                                    self.rope_scale, cfg.num_attention_heads,
                                    cfg.num_key_value_heads)
            return q, k, v, hidden
        first = self.midlayer
        g = first.hidden_norm(hidden)  # (N, H)
        if add_embed is None:
            if w.qkv_embed is not None and w.fp8 and "qkv" not in w.fp8:
                raise ValueError("project(input_ids) with split fp8 weights would run q/k/v "
                                 "in the matmul dtype; make them with split=False")
            e = first.input_layernorm(self.embed(input_ids).to(g.dtype))  # (N, H)
            x = torch.cat([e, g], dim=-1)  # (N, 2H): embedding first, as vLLM
            qkv = fp8_mm.linear(x, w.qkv, w.fp8.get("qkv"))
        else:
            if w.qkv_hidden is None:
                raise ValueError("project(add_embed=) needs layer_weights(split=True)")
            qkv = add_embed(fp8_mm.linear(g, w.qkv_hidden, w.fp8.get("qkv_hidden")))
        residual = g if cfg.norm_before_residual else hidden
        q, k, v = QKVRope.apply(qkv, position_ids.float()[:, None],
                                 self.inv_freq, self.rope_scale, cfg.num_attention_heads,
                                 cfg.num_key_value_heads)
        return q, k, v, residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor,
               weights: LayerWeights | None = None, layer: int = 0) -> torch.Tensor:
        """attn_out (N, hq, d), residual (N, H) -> decoder layer `layer`'s pre-norm output h
        (N, H): the residual stream the next layer, or the final norm, reads."""
        w = self.layer_weights(residual.device.type, layer=layer) if weights is None else weights
        h = residual + fp8_mm.linear(attn_out.flatten(1), w.o, w.fp8.get("o"))
        x = self.layer(layer).post_attention_layernorm(h)
        gate_up = fp8_mm.linear(x, w.gate_up, w.fp8.get("gate_up"))
        return h + SwiGLUDown.apply(gate_up, w.down, w.fp8.get("down"))

    def next_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """What the next draft step receives as its hidden input."""
        return self.norm(h) if self.cfg.norm_output else h

    # -- eval forward --------------------------------------------------------------------

    def forward(self, input_ids, aux_hidden, position_ids, *, hidden=None,
                cache: KVCache | None = None) -> DraftOutput:
        """input_ids (B, T): the token after each position; aux_hidden (B, T, 3*Ht) target
        states (ignored when `hidden` (B, T, H) from a previous draft step is given);
        position_ids (B, T). Attention is causal within each row, after all of `cache`
        (each layer's appended to in place)."""
        b, t = input_ids.shape
        g = self.fuse(aux_hidden) if hidden is None else hidden  # (B, T, H)
        ids, pos = input_ids.reshape(-1), position_ids.reshape(-1)
        x = g.reshape(b * t, -1)  # (B*T, H): layer 0's hidden input, then the residual stream
        for i in range(self.cfg.num_hidden_layers):
            w = self.layer_weights(x.device.type, layer=i)
            q, k, v, residual = self.project(ids, x, pos, w, layer=i)
            out = self._attend(q, k.view(b, t, *k.shape[1:]), v.view(b, t, *v.shape[1:]),
                               cache, i)
            x = self.finish(out, residual, w, layer=i)
        h = x.view(b, t, -1)  # (B, T, H)
        return DraftOutput(self.lm_head(self.norm(h)), self.next_hidden(h))

    @staticmethod
    def _attend(q, k, v, cache: KVCache | None, layer: int) -> torch.Tensor:
        """q (B*T, hq, d), k, v (B, T, hkv, d) of one layer -> (B*T, hq, d): causal within
        each row, after all of the layer's `cache` (appended to)."""
        b, t = k.shape[:2]
        if cache is not None:
            k, v = cache.append(layer, k, v)  # (B, L, hkv, d)
        keys = k.shape[1]
        # rows flattened into one key sequence; query i of row r sees row r's keys up to itself
        lo = (torch.arange(b, device=q.device) * keys)[:, None].expand(b, t)  # (B, T)
        hi = lo + (keys - t) + torch.arange(t, device=q.device)
        return attention(q, k.flatten(0, 1), v.flatten(0, 1), lo.reshape(-1), hi.reshape(-1))

    # -- loading -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, folder, embed_tokens=None, dtype=None) -> Eagle3Draft:
        """Load an exported draft folder (config.json + *.safetensors, vLLM / SGLang /
        speculators layout, read by eyas.export). `embed_tokens`: the target's embedding,
        unless the folder carries its own `embed_tokens.weight`."""
        from eyas.draft.formats import read_vllm_folder

        cfg, state = read_vllm_folder(folder)
        embedded = state.pop("embed_tokens.weight", None)
        draft = cls(cfg, embed_tokens if embed_tokens is not None else embedded)
        if "d2t" not in state:  # vLLM treats a missing d2t as the identity
            state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        if "t2d" not in state:
            state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            state["t2d"][torch.arange(cfg.draft_vocab_size) + state["d2t"]] = True
        # load_state_dict raises a bare RuntimeError on a shape mismatch: name it first
        want = draft.state_dict()
        for name, t in state.items():
            if name in want and t.shape != want[name].shape:
                raise EyasError(f"{folder}: weight {name!r} has shape {tuple(t.shape)} but "
                                f"config.json implies {tuple(want[name].shape)}; the weights and "
                                f"config.json come from different drafts: re-run `eyas export`")
        result = draft.load_state_dict(state, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise EyasError(f"{folder}: weights do not match the config (missing "
                            f"{result.missing_keys}, unexpected {result.unexpected_keys})")
        return draft.to(dtype) if dtype is not None else draft
