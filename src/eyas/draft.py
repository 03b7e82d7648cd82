"""The EAGLE-3 draft model (what vLLM's `llama_eagle3` runs) and its training-time-test forward.

Per position, with target hidden size Ht, draft hidden size H, draft vocabulary Vd:

    g = fc(concat(aux_0, aux_1, aux_2))                     (3*Ht -> H, no bias)
    x = concat(input_layernorm(embed(token)), hidden_norm(g))   (2H; q/k/v read all of it)
    h = residual + o_proj(attn(x))        residual = g, or hidden_norm(g) if norm_before_residual
    h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))             over Vd; h (pre-norm) feeds the next draft step

Parameter names equal the vLLM export (`fc.weight`, `midlayer.*`, `norm.weight`,
`lm_head.weight`, buffers `d2t`, `t2d`). The target's embedding is shared and frozen: it is a
non-persistent buffer, so it is never saved or exported.

Attention has one path, `attention()`: query n sees keys `lo[n]..hi[n]` of one key sequence
(causal within its packed document, or cache + causal at eval) plus, during TTT, the keys
its own position produced at earlier steps (the "diagonal"), merged by log-sum-exp. The
band part runs on FlexAttention with a block-sparse mask on CUDA; on CPU (where
FlexAttention has no backward) it runs an exact chunked reference of the same band.
`ttt_forward` at the end is the training forward; docs/draft.md has the math and the shift
convention.

Speed: the layer's matmuls use `LayerWeights` (cast once per forward, q/k/v and gate/up
concatenated); its elementwise parts (RMSNorm, q/k/v split + RoPE, SwiGLU) are custom
autograd Functions whose bodies `loss.cuda_compiled` fuses on CUDA and runs eagerly on CPU.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from eyas.config import ConfigError, from_dict, to_dict
from eyas.errors import EyasError
from eyas.loss import cuda_compiled, simulated_acceptance_length, soft_cross_entropy

log = logging.getLogger(__name__)

# RoPE scaling types a draft supports, with the keys both transformers and every vLLM
# version read the same way (vLLM's Llama YaRN ignores mscale/mscale_all_dim, so they are
# dropped rather than trained with a scaling the server would not apply).
ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"),
}
BLOCK = 128  # FlexAttention sparse block size; sequences are padded to a multiple of it


def draft_rope_scaling(scaling: dict | None) -> dict | None:
    """The target's rope scaling as the draft uses it: None for plain RoPE (incl. M-RoPE,
    which is plain RoPE on text positions), else `{"rope_type", <ROPE_KEYS>}`."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", "mrope"):
        return None
    if kind not in ROPE_KEYS:
        log.warning("rope scaling %r is not supported for drafts; the draft uses plain RoPE "
                    "(train and serve agree, as the exported config says so)", kind)
        return None
    out = {"rope_type": kind}
    out.update({k: scaling[k] for k in ROPE_KEYS[kind] if scaling.get(k) is not None})
    return out


def _rope_of(target) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a ModelInfo or an HF config (transformers 4 or 5 keys)."""
    params = dict(getattr(target, "rope_parameters", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type
        params = dict(params.get("full_attention") or next(iter(params.values())))
    theta = getattr(target, "rope_theta", None) or params.get("rope_theta") or 10000.0
    scaling = getattr(target, "rope_scaling", None) or \
        {k: v for k, v in params.items() if k != "rope_theta"}
    return float(theta), draft_rope_scaling(scaling)


# ----------------------------------------------------------------------------- config

@dataclass(frozen=True, kw_only=True)
class DraftConfig:
    """Shapes of an EAGLE-3 draft, in Hugging Face spelling. `vocab_size` is the TARGET
    vocabulary; `draft_vocab_size` the draft's. JSON round-trips via to_dict/from_dict."""

    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, int, int]
    norm_before_residual: bool = False
    fc_norm: bool = False  # EAGLE 3.1: RMSNorm on each aux state before fc (not in vLLM)
    norm_output: bool = False  # EAGLE 3.1: feed norm(h) to the next step (not in vLLM)
    hidden_act: str = "silu"

    def __post_init__(self):
        for name in ("hidden_size", "target_hidden_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings", "vocab_size", "draft_vocab_size"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"draft config: {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"draft config: num_attention_heads {self.num_attention_heads} must "
                              f"be a multiple of num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"draft config: head_dim {self.head_dim} must be even for RoPE")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(f"draft config: draft_vocab_size {self.draft_vocab_size} exceeds "
                              f"the target vocab_size {self.vocab_size}; use a smaller one")
        if len(self.aux_layer_ids) != 3:
            raise ConfigError(f"draft config: aux_layer_ids needs 3 layer ids, got "
                              f"{self.aux_layer_ids}")
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if self.hidden_act != "silu":
            raise ConfigError(f"draft config: hidden_act {self.hidden_act!r}: vLLM's Llama MLP "
                              f"only runs 'silu'; set hidden_act='silu'")
        if self.rope_scaling is not None and self.rope_scaling != draft_rope_scaling(
                self.rope_scaling):
            raise ConfigError(f"draft config: rope_scaling {self.rope_scaling} is not in the "
                              f"supported form {{'rope_type': one of {sorted(ROPE_KEYS)}, ...}}; "
                              f"pass it through eyas.draft.draft_rope_scaling")

    @classmethod
    def from_target(cls, target, *, draft_vocab_size: int, aux_layer_ids, **overrides):
        """A draft shaped like the target's text decoder layer. `target` is an
        `eyas.models.ModelInfo` or a (text) HF config; `overrides` set any field."""
        if hasattr(target, "get_text_config"):
            target = target.get_text_config()
        heads = int(target.num_attention_heads)
        theta, scaling = _rope_of(target)
        values = dict(
            hidden_size=int(target.hidden_size), target_hidden_size=int(target.hidden_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(target, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(target, "head_dim", None) or target.hidden_size // heads),
            intermediate_size=int(target.intermediate_size),
            rms_norm_eps=float(getattr(target, "rms_norm_eps", None) or 1e-6),
            rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=int(target.max_position_embeddings),
            vocab_size=int(target.vocab_size), draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=tuple(aux_layer_ids))
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict:
        return to_dict(self)

    @classmethod
    def from_dict(cls, values: dict) -> DraftConfig:
        return from_dict(cls, values)


# ----------------------------------------------------------------------------- layers

@cuda_compiled
def _rms_norm(x, weight, eps: float):
    """x (R, C) -> (weight * x / rms(x) in x's dtype, 1/rms (R, 1) in fp32 or wider):
    statistics in fp32, the scale applied in x's dtype, as vLLM does."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * (xf * rstd).to(x.dtype), rstd


@cuda_compiled
def _rms_norm_backward(grad, x, weight, rstd):
    """(d/dx, d/dweight) of _rms_norm; grad, x (R, C), rstd (R, 1)."""
    acc = rstd.dtype
    normed = x.to(acc) * rstd
    d_normed = grad.to(acc) * weight.to(acc)
    dx = rstd * (d_normed - normed * (d_normed * normed).mean(-1, keepdim=True))
    d_weight = (grad.to(acc) * normed.to(x.dtype).to(acc)).sum(0)
    return dx.to(x.dtype), d_weight.to(weight.dtype)


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm saving x and 1/rms only: autograd through the plain ops would keep an fp32
    copy of x per norm (4 norms x 7 steps x 64K tokens: tens of GiB)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        y, rstd = _rms_norm(x.reshape(-1, x.shape[-1]), weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        c = x.shape[-1]
        dx, d_weight = _rms_norm_backward(grad.reshape(-1, c), x.reshape(-1, c), weight, rstd)
        return dx.view(x.shape), d_weight, None


class RMSNorm(nn.Module):
    """Llama RMSNorm (see _RMSNormFn)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


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


def _rotate(x, positions, inv_freq, scale: float):
    """Rotate-half (NeoX) RoPE: x (N, heads, d) at positions (N, 1) fp32, fp32 math, result
    in x's dtype. At -positions it is the transpose (the backward) of the rotation."""
    freqs = (positions * inv_freq)[:, None, :]  # (N, 1, d/2)
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    x1, x2 = x.float().chunk(2, dim=-1)  # (N, heads, d/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@cuda_compiled
def _rope(q, k, v, positions, inv_freq, scale: float):
    """Views of the fused q/k/v projection -> RoPE'd q, k and v, each contiguous."""
    return _rotate(q, positions, inv_freq, scale), _rotate(k, positions, inv_freq, scale), \
        v.contiguous()


@cuda_compiled
def _rope_backward(dq, dk, dv, positions, inv_freq, scale: float):
    """Gradient of _rope as one (N, (hq + 2 hkv) d) tensor, the fused projection's layout."""
    return torch.cat([_rotate(dq, -positions, inv_freq, scale).flatten(1),
                      _rotate(dk, -positions, inv_freq, scale).flatten(1), dv.flatten(1)], dim=1)


class _QKVRope(torch.autograd.Function):
    """qkv (N, (hq + 2 hkv) d) from the fused projection -> q (N, hq, d), k, v (N, hkv, d),
    RoPE on q and k at positions (N, 1): one kernel each way on CUDA (eager autograd: a
    dozen elementwise ops, each a full pass over q or k)."""

    @staticmethod
    def forward(ctx, qkv, positions, inv_freq, scale: float, hq: int, hkv: int):
        q, k, v = qkv.view(qkv.shape[0], hq + 2 * hkv, -1).split([hq, hkv, hkv], dim=1)
        ctx.save_for_backward(positions, inv_freq)
        ctx.scale = scale
        return _rope(q, k, v, positions, inv_freq, scale)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        positions, inv_freq = ctx.saved_tensors
        return _rope_backward(dq, dk, dv, positions, inv_freq, ctx.scale), \
            None, None, None, None, None


@cuda_compiled
def _swiglu(gate_up):
    """gate_up (N, 2I) -> silu(gate) * up (N, I)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@cuda_compiled
def _swiglu_backward(grad, gate_up):
    """grad (N, I) of silu(gate) * up -> its gradient w.r.t. gate_up (N, 2I)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    grad, sig = grad.float(), torch.sigmoid(gate)
    d_gate = grad * up * sig * (1 + gate * (1 - sig))
    return torch.cat([d_gate, grad * gate * sig], dim=-1).to(gate_up.dtype)


class _SwiGLUDown(torch.autograd.Function):
    """down_proj(silu(gate) * up) from gate_up (N, 2I) and w_down (H, I), saving gate_up
    only: the (N, I) product is recomputed in backward rather than kept (1.8 GiB per TTT
    step at 64K tokens and I = 14336)."""

    @staticmethod
    def forward(ctx, gate_up, w_down):
        ctx.save_for_backward(gate_up, w_down)
        return _swiglu(gate_up) @ w_down.t()  # (N, H)

    @staticmethod
    def backward(ctx, grad):
        gate_up, w_down = ctx.saved_tensors
        d_w = grad.t() @ _swiglu(gate_up) if ctx.needs_input_grad[1] else None  # (H, I)
        return _swiglu_backward(grad @ w_down, gate_up), d_w


# ----------------------------------------------------------------------------- attention

def attention(q, k, v, lo, hi, diag_k=None, diag_v=None) -> torch.Tensor:
    """Softmax attention of each query over a band of keys plus its own "diagonal" keys.

    q (N, hq, d); k, v (M, hkv, d); lo, hi (N,) int64: query n sees keys lo[n]..hi[n]
    (inclusive, lo <= hi). diag_k, diag_v (S, N, hkv, d): S more keys that only query n sees
    (TTT: the keys its position produced at steps 1..j). Returns (N, hq, d) in q's dtype.
    Scores are never materialised beyond one (query chunk, band) tile: the band goes through
    FlexAttention (CUDA) or `_band_reference` (CPU), both returning out and log-sum-exp; the
    S diagonal scores per query are merged with that log-sum-exp.
    """
    with torch.autocast(q.device.type, enabled=False):
        core = _band_flex if q.device.type == "cuda" else _band_reference
        out, lse = core(q, k, v, lo, hi)  # (N, hq, d), (N, hq) fp32
        if diag_k is None:
            return out
        n, hq, d = q.shape
        hkv = k.shape[1]
        qg = q.view(n, hkv, hq // hkv, d)  # (N, hkv, G, d): G query heads per kv head
        scores = _DiagScores.apply(qg, diag_k) * d ** -0.5  # (N, hkv, G, S) fp32
        lse = lse.view(n, hkv, hq // hkv)
        top = torch.maximum(lse, scores.amax(-1))  # (N, hkv, G)
        w_band = (lse - top).exp()
        w_diag = (scores - top[..., None]).exp()
        total = w_band + w_diag.sum(-1)
        w_band, w_diag = (w_band / total).to(q.dtype), (w_diag / total[..., None]).to(q.dtype)
        mixed = out.view(n, hkv, hq // hkv, d) * w_band[..., None] + \
            torch.einsum("nkgs,snkd->nkgd", w_diag, diag_v.to(q.dtype))
        return mixed.reshape(n, hq, d)


class _DiagScores(torch.autograd.Function):
    """scores[n,k,g,s] = q[n,k,g,:] . diag_k[s,n,k,:] in fp32, saving the (bf16) inputs for
    backward instead of fp32 copies (at 64K tokens those would be GiBs per step)."""

    @staticmethod
    def forward(ctx, q, diag_k):  # q (N, hkv, G, d); diag_k (S, N, hkv, d)
        ctx.save_for_backward(q, diag_k)
        return torch.einsum("nkgd,snkd->nkgs", q.float(), diag_k.float())

    @staticmethod
    def backward(ctx, grad):  # grad (N, hkv, G, S) fp32
        q, diag_k = ctx.saved_tensors
        grad_q = torch.einsum("nkgs,snkd->nkgd", grad, diag_k.float()).to(q.dtype)
        grad_k = torch.einsum("nkgs,nkgd->snkd", grad, q.float()).to(diag_k.dtype)
        return grad_q, grad_k


def _band_reference(q, k, v, lo, hi, chunk: int = 1024):
    """Exact band attention in plain torch, `chunk` queries at a time (CPU path)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    outs, lses = [], []
    for s in range(0, n, chunk):
        qc = q[s: s + chunk].float().view(-1, hkv, hq // hkv, d)  # (C, hkv, G, d)
        lo_c, hi_c = lo[s: s + chunk], hi[s: s + chunk]
        a, b = int(lo_c.min()), int(hi_c.max()) + 1  # the keys any query of the chunk sees
        idx = torch.arange(a, b, device=q.device)
        seen = (idx >= lo_c[:, None]) & (idx <= hi_c[:, None])  # (C, K)
        scores = torch.einsum("ckgd,jkd->ckgj", qc, k[a:b].float()) * d ** -0.5  # (C,hkv,G,K)
        scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
        lse = scores.logsumexp(-1)  # (C, hkv, G)
        out = torch.einsum("ckgj,jkd->ckgd", (scores - lse[..., None]).exp(), v[a:b].float())
        outs.append(out.reshape(-1, hq, d))
        lses.append(lse.reshape(-1, hq))
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _band_flex(q, k, v, lo, hi):
    """Band attention through compiled FlexAttention with a block-sparse mask (CUDA path)."""
    from torch.nn.attention import flex_attention as fa

    n, m = q.shape[0], k.shape[0]
    # lengths padded to whole blocks (mask_mod must never index past lo/hi); pad queries see
    # key 0 and are dropped. Copies only when needed: flex saves its inputs for backward.
    pad_n, pad_m = -n % BLOCK, -m % BLOCK
    if pad_n:
        q, lo, hi = F.pad(q, (0, 0, 0, 0, 0, pad_n)), F.pad(lo, (0, pad_n)), F.pad(hi, (0, pad_n))
    if pad_m:
        k, v = F.pad(k, (0, 0, 0, 0, 0, pad_m)), F.pad(v, (0, 0, 0, 0, 0, pad_m))
    mask = band_block_mask(lo, hi, m + pad_m)
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, L, d)
    if hasattr(fa, "AuxRequest"):  # torch >= 2.9
        out, aux = _compiled_flex()(qt, kt, vt, block_mask=mask, enable_gqa=True,
                                    return_aux=fa.AuxRequest(lse=True))
        lse = aux.lse
    else:
        out, lse = _compiled_flex()(qt, kt, vt, block_mask=mask, enable_gqa=True, return_lse=True)
    return out[0].transpose(0, 1)[:n], lse[0].transpose(0, 1)[:n].float()


def band_block_mask(lo: torch.Tensor, hi: torch.Tensor, kv_len: int):
    """FlexAttention BlockMask for "query i sees keys lo[i]..hi[i]", built from per-block
    bounds in O(blocks^2) memory (create_block_mask would materialise every (q, kv) pair).
    A block is full when every query of it sees every key of it (mask_mod skipped), partial
    when some pair may be visible. len(lo) and kv_len are multiples of BLOCK."""
    from torch.nn.attention.flex_attention import BlockMask

    nq, nk = lo.shape[0] // BLOCK, kv_len // BLOCK
    lo_b, hi_b = lo.view(nq, BLOCK), hi.view(nq, BLOCK)
    start = torch.arange(nk, device=lo.device) * BLOCK  # (nk,) first key of each kv block
    end = start + BLOCK - 1
    full = (lo_b.amax(1)[:, None] <= start) & (end <= hi_b.amin(1)[:, None])  # (nq, nk)
    partial = (lo_b.amin(1)[:, None] <= end) & (start <= hi_b.amax(1)[:, None]) & ~full

    def listed(blocks):  # (nq, nk) bool -> counts (1,1,nq), kv block ids listed first
        order = torch.argsort((~blocks).to(torch.int8), dim=1, stable=True)
        return blocks.sum(1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= lo[q_idx]) & (kv_idx <= hi[q_idx])

    return BlockMask.from_kv_blocks(*listed(partial), *listed(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(lo.shape[0], kv_len))


# ----------------------------------------------------------------------------- model

@dataclass
class DraftOutput:
    logits: torch.Tensor  # (B, T, Vd)
    hidden: torch.Tensor  # (B, T, H): pre-norm h (post-norm if cfg.norm_output), next step's input


class KVCache:
    """Keys/values of earlier positions for eval-time drafting; rows share one length.
    `forward(..., cache=c)` appends in place; `crop(n)` drops everything after position n."""

    def __init__(self):
        self.k = self.v = None  # (B, L, hkv, d) each

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)

    def crop(self, n: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :n], self.v[:, :n]


@dataclass
class LayerWeights:
    """The decoder layer's matrices in the dtype its matmuls run in (the autocast dtype, else
    the parameters' own), q/k/v and gate/up concatenated so each group is one matmul (fewer,
    larger kernels). ttt_forward makes them once for all its steps; the parameters, their
    names and their fp32 gradients stay those of the separate nn.Linear modules."""

    qkv: torch.Tensor  # ((hq + 2 hkv) d, 2H)
    o: torch.Tensor  # (H, hq d)
    gate_up: torch.Tensor  # (2I, H)
    down: torch.Tensor  # (H, I)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft: fc over three target aux states + one Llama-style decoder layer."""

    def __init__(self, cfg: DraftConfig, embed_tokens: nn.Embedding | torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        h, hq, hkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        d = cfg.head_dim
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps)
                                         for _ in range(3))
        self.fc = _linear(3 * cfg.target_hidden_size, h)
        self.midlayer = nn.ModuleDict(dict(
            input_layernorm=RMSNorm(h, cfg.rms_norm_eps),
            hidden_norm=RMSNorm(h, cfg.rms_norm_eps),
            self_attn=nn.ModuleDict(dict(
                q_proj=_linear(2 * h, hq * d), k_proj=_linear(2 * h, hkv * d),
                v_proj=_linear(2 * h, hkv * d), o_proj=_linear(hq * d, h))),
            post_attention_layernorm=RMSNorm(h, cfg.rms_norm_eps),
            mlp=nn.ModuleDict(dict(gate_proj=_linear(h, cfg.intermediate_size),
                                   up_proj=_linear(h, cfg.intermediate_size),
                                   down_proj=_linear(cfg.intermediate_size, h))),
        ))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = _linear(h, cfg.draft_vocab_size)
        # draft id i <-> target id i + d2t[i]; identity on the first Vd ids until set_vocab
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(cfg.vocab_size) < cfg.draft_vocab_size)
        inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("embed_weight", None, persistent=False)
        self._cached_weights = None  # (key, LayerWeights) of the last call without grad
        if embed_tokens is not None:
            self.set_embed_tokens(embed_tokens)

    # -- setup --------------------------------------------------------------------------

    def set_embed_tokens(self, embed_tokens: nn.Embedding | torch.Tensor) -> None:
        """Share the target's input embedding (V, H); frozen and never saved."""
        w = embed_tokens.weight if isinstance(embed_tokens, nn.Embedding) else embed_tokens
        if tuple(w.shape) != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise EyasError(f"target embedding is {tuple(w.shape)} but the draft needs "
                            f"({self.cfg.vocab_size}, {self.cfg.hidden_size}); the draft config "
                            f"was made for another target")
        self.embed_weight = w.detach()

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary (from `eyas vocab`): d2t (Vd,) offsets, t2d (V,) bool."""
        from eyas.vocab import check_vocab

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
        return KVCache()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # -- the layer, in pieces TTT reuses --------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_weight is None:
            raise EyasError("the draft has no token embedding; pass the target's "
                            "embed_tokens to Eagle3Draft(...) or set_embed_tokens()")
        return F.embedding(input_ids, self.embed_weight)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """(..., 3*Ht) target aux states (or (..., 3, Ht)) -> g (..., H)."""
        ht = self.cfg.target_hidden_size
        aux = aux_hidden if aux_hidden.shape[-1] == 3 * ht else aux_hidden.flatten(-2)
        if self.cfg.fc_norm:
            parts = aux.chunk(3, dim=-1)  # 3 x (..., Ht)
            aux = torch.cat([norm(p) for norm, p in zip(self.fc_norm, parts)], dim=-1)
        if not torch.is_autocast_enabled(aux.device.type):
            aux = aux.to(self.fc.weight.dtype)  # e.g. bf16 captures into an fp32 draft
        return self.fc(aux)

    def layer_weights(self, device_type: str) -> LayerWeights:
        """The layer's matrices as its matmuls use them (see LayerWeights). Without grad
        (drafting token by token) they are kept until a parameter changes, rather than
        concatenated again at every call."""
        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) \
            else attn.q_proj.weight.dtype
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                   mlp.up_proj, mlp.down_proj)
        key = (dtype, *((m.weight.data_ptr(), m.weight._version) for m in linears))
        cached = self._cached_weights
        if not torch.is_grad_enabled() and cached is not None and cached[0] == key:
            return cached[1]
        q, k, v, o, gate, up, down = (m.weight.to(dtype) for m in linears)
        weights = LayerWeights(qkv=torch.cat([q, k, v]), o=o, gate_up=torch.cat([gate, up]),
                               down=down)
        self._cached_weights = None if torch.is_grad_enabled() else (key, weights)
        return weights

    def project(self, input_ids, hidden, position_ids, weights: LayerWeights | None = None):
        """input_ids (N,), hidden (N, H), position_ids (N,) -> q (N, hq, d) and k, v
        (N, hkv, d) with RoPE applied, and the residual (N, H). `weights`: from
        layer_weights(), made here when not given."""
        layer, cfg = self.midlayer, self.cfg
        w = self.layer_weights(hidden.device.type) if weights is None else weights
        g = layer.hidden_norm(hidden)  # (N, H)
        e = layer.input_layernorm(self.embed(input_ids).to(g.dtype))  # (N, H)
        x = torch.cat([e, g], dim=-1)  # (N, 2H): embedding first, as vLLM
        residual = g if cfg.norm_before_residual else hidden
        q, k, v = _QKVRope.apply(F.linear(x, w.qkv), position_ids.float()[:, None],
                                 self.inv_freq, self.rope_scale, cfg.num_attention_heads,
                                 cfg.num_key_value_heads)
        return q, k, v, residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor,
               weights: LayerWeights | None = None) -> torch.Tensor:
        """attn_out (N, hq, d), residual (N, H) -> pre-norm h (N, H)."""
        w = self.layer_weights(residual.device.type) if weights is None else weights
        h = residual + F.linear(attn_out.flatten(1), w.o)
        x = self.midlayer.post_attention_layernorm(h)
        return h + _SwiGLUDown.apply(F.linear(x, w.gate_up), w.down)

    def next_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """What the next draft step receives as its hidden input."""
        return self.norm(h) if self.cfg.norm_output else h

    # -- eval forward --------------------------------------------------------------------

    def forward(self, input_ids, aux_hidden, position_ids, *, hidden=None,
                cache: KVCache | None = None) -> DraftOutput:
        """input_ids (B, T): the token after each position; aux_hidden (B, T, 3*Ht) target
        states (ignored when `hidden` (B, T, H) from a previous draft step is given);
        position_ids (B, T). Attention is causal within each row, after all of `cache`
        (appended to in place)."""
        b, t = input_ids.shape
        g = self.fuse(aux_hidden) if hidden is None else hidden  # (B, T, H)
        w = self.layer_weights(g.device.type)
        q, k, v, residual = self.project(input_ids.reshape(-1), g.reshape(b * t, -1),
                                         position_ids.reshape(-1), w)
        k, v = k.view(b, t, *k.shape[1:]), v.view(b, t, *v.shape[1:])  # (B, T, hkv, d)
        if cache is not None:
            cache.append(k, v)
            k, v = cache.k, cache.v  # (B, L, hkv, d)
        keys = k.shape[1]
        # rows flattened into one key sequence; query i of row r sees row r's keys up to itself
        lo = (torch.arange(b, device=q.device) * keys)[:, None].expand(b, t)  # (B, T)
        hi = lo + (keys - t) + torch.arange(t, device=q.device)
        out = attention(q, k.flatten(0, 1), v.flatten(0, 1), lo.reshape(-1), hi.reshape(-1))
        h = self.finish(out, residual, w).view(b, t, -1)  # (B, T, H)
        return DraftOutput(self.lm_head(self.norm(h)), self.next_hidden(h))

    # -- loading -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, folder, embed_tokens=None, dtype=None) -> Eagle3Draft:
        """Load an exported draft folder (config.json + *.safetensors, vLLM / SGLang /
        speculators layout, read by eyas.export). `embed_tokens`: the target's embedding,
        unless the folder carries its own `embed_tokens.weight`."""
        from eyas.export import read_vllm_folder

        cfg, state = read_vllm_folder(folder)
        embedded = state.pop("embed_tokens.weight", None)
        draft = cls(cfg, embed_tokens if embed_tokens is not None else embedded)
        if "d2t" not in state:  # vLLM treats a missing d2t as the identity
            state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        if "t2d" not in state:
            state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            state["t2d"][torch.arange(cfg.draft_vocab_size) + state["d2t"]] = True
        result = draft.load_state_dict(state, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise EyasError(f"{folder}: weights do not match the config (missing "
                            f"{result.missing_keys}, unexpected {result.unexpected_keys})")
        return draft.to(dtype) if dtype is not None else draft


# ----------------------------------------------------------------------------- TTT

@dataclass
class TTTBatch:
    """A packed micro-batch (see eyas.data.collate). Every tensor is (B, T) unless noted."""

    input_ids: torch.Tensor  # long
    aux_hidden: torch.Tensor  # (B, T, 3*Ht) any float dtype
    final_hidden: torch.Tensor  # (B, T, Ht): target hidden after its final norm
    target_top1: torch.Tensor  # target argmax at t = its prediction of token t+1
    loss_mask: torch.Tensor  # 1 where token t is one the target generated (assistant)
    position_ids: torch.Tensor  # reset to 0 at each packed document
    doc_ids: torch.Tensor  # packed document id; -1 = padding


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar: sum_j step_weight**j * mean loss of step j
    # (S,) differentiable loss summed (not averaged) over step j's positions: train divides
    # by counts over the whole optimizer step, so accumulation and ranks do not change it
    step_loss_sum: torch.Tensor
    step_loss: torch.Tensor  # (S,) detached mean loss per step
    step_acc: torch.Tensor  # (S,) top-1 agreement with the target per step
    step_count: torch.Tensor  # (S,) positions that carried a loss per step
    step_rows: list[int]  # positions computed per step (after pruning)

    @property
    def sim_acceptance_length(self) -> float:
        return simulated_acceptance_length(self.step_acc)


def _segments(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) doc ids -> flat (N,) index of the first and of the last token of each token's
    document (a run of equal ids within a row)."""
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = first.reshape(-1)
    last = torch.ones_like(first)
    last[:-1] = first[1:]
    idx = torch.arange(first.shape[0], device=doc_ids.device)
    start = torch.where(first, idx, 0).cummax(0).values
    end = torch.where(last, idx, idx.shape[0]).flip(0).cummin(0).values.flip(0)
    return start, end


def ttt_positions(batch: TTTBatch, t2d: torch.Tensor, steps: int) -> torch.Tensor:
    """(S, N) bool: does position n carry a loss at step j? Step j at n predicts token
    n+2+j from the teacher at n+1+j; it counts when that token is an assistant token of
    the same document and the target's top-1 there is in the draft vocab."""
    top1 = batch.target_top1.reshape(-1).long()
    mask = batch.loss_mask.reshape(-1).bool()
    doc = batch.doc_ids.reshape(-1)
    _, end = _segments(batch.doc_ids)
    n = torch.arange(top1.shape[0], device=top1.device)
    last = top1.shape[0] - 1
    in_vocab = t2d.to(top1.device)[top1]  # (N,)
    rows = []
    for j in range(steps):
        pred, teach = n + 2 + j, n + 1 + j
        rows.append((pred <= end) & (doc >= 0) & mask[pred.clamp(max=last)]
                    & in_vocab[teach.clamp(max=last)])
    return torch.stack(rows)


def ttt_forward(draft: Eagle3Draft, batch: TTTBatch, target_lm_head: torch.Tensor, *,
                steps: int = 7, step_weight: float = 0.8, vocab_chunk: int = 4096,
                prune: bool = True) -> TTTOutput:
    """Training-time test: `steps` chained draft passes over a packed batch, one loss.

    target_lm_head: (V, Ht) or its draft-vocab rows (Vd, Ht). vocab_chunk: rows per chunk of
    the (rows, Vd) vocab projections. prune: from step 1 on, compute only positions that
    still carry a loss at this or a later step (exact: a position's chain reads only its own
    earlier steps and the step-0 keys).
    """
    dev = batch.input_ids.device
    # 1. Flatten the packed rows into one token stream of N positions.
    ids = batch.input_ids.reshape(-1).long()
    pos = batch.position_ids.reshape(-1).long()
    top1 = batch.target_top1.reshape(-1).long()
    n_all = ids.shape[0]
    seg_start, seg_end = _segments(batch.doc_ids)
    # 2. Which (step, position) pairs carry a loss; which positions each step computes (all
    #    at step 0: its keys serve every later step). The row counts fix every shape, so
    #    they reach the host once, here, rather than through a sync at every step.
    valid = ttt_positions(batch, draft.t2d, steps)  # (S, N)
    keep = valid.flip(0).cummax(0).values.flip(0) if prune else torch.ones_like(valid)
    keep[0] = True
    both = torch.cat([keep, valid])  # (2S, N)
    cols = both.nonzero()[:, 1].contiguous().split(both.sum(1).tolist())  # each row's positions
    rank = keep.cumsum(1) - 1  # (S, N): where a kept position sits among its step's rows
    # 3. Teacher logits over the draft vocab, once for all positions (no grad).
    teacher = _teacher_logits(draft, batch.final_hidden.reshape(n_all, -1), target_lm_head)
    draft_id = torch.cumsum(draft.t2d.long(), 0) - 1  # target id -> draft id (where t2d)
    weights = draft.layer_weights(dev.type)  # cast and fused once for all steps
    head = draft.lm_head.weight
    if not head.requires_grad:  # frozen: cast once too
        head = head.to(weights.qkv.dtype)
    sums, correct, rows_per_step = [], [], []
    # 4. Step 0: fused target states + the next token, causal within each document.
    rows = cols[0]
    hidden = draft.fuse(batch.aux_hidden).reshape(n_all, -1)  # (N, H)
    diag_k, diag_v = [], []  # keys/values of steps 1..j at the kept positions
    k0 = v0 = None
    for j in range(steps):
        if cols[j].numel() == 0:  # nothing left to predict
            break
        if j > 0:  # 5. Step j: own hidden of step j-1, keep only positions still needed
            sel = rank[j - 1][cols[j]]  # indices into the previous step's rows
            rows, hidden = cols[j], hidden[sel]
            diag_k, diag_v = [t[sel] for t in diag_k], [t[sel] for t in diag_v]
        token = ids[torch.minimum(rows + 1 + j, seg_end[rows])]  # (n,) ground-truth token
        q, k, v, residual = draft.project(token, hidden, pos[rows] + j, weights)
        if j == 0:
            k0, v0 = k, v
            out = attention(q, k0, v0, seg_start, rows)
        else:
            diag_k.append(k)
            diag_v.append(v)
            out = attention(q, k0, v0, seg_start[rows], rows,
                            torch.stack(diag_k), torch.stack(diag_v))
        h = draft.finish(out, residual, weights)  # (n, H) pre-norm
        # 6. Loss of step j: soft CE against the teacher at rows+1+j, where valid.
        here = rank[j][cols[steps + j]]  # indices into this step's rows
        teach = rows[here] + 1 + j
        loss_sum, pred = soft_cross_entropy(draft.norm(h[here]), head, teacher, rows=teach,
                                            chunk=vocab_chunk)
        sums.append(loss_sum)
        correct.append((pred == draft_id[top1[teach]]).sum())
        rows_per_step.append(rows.numel())
        hidden = draft.next_hidden(h)
    # 7. Weighted sum of per-step means; steps never reached (nothing left to predict) are 0.
    return _ttt_output(sums, correct, valid.sum(1), rows_per_step, step_weight)


@torch.no_grad()
def _teacher_logits(draft: Eagle3Draft, final: torch.Tensor, lm_head: torch.Tensor):
    """final (N, Ht) target states after its final norm; lm_head (V, Ht) or its draft rows
    (Vd, Ht) -> (N, Vd) target logits restricted to the draft vocab."""
    cfg = draft.cfg
    selected = lm_head.shape[0] == cfg.draft_vocab_size and cfg.draft_vocab_size != cfg.vocab_size
    # the t2d rows, found through d2t: a boolean index would wait for the GPU
    rows = draft.to_target_ids(torch.arange(cfg.draft_vocab_size, device=lm_head.device))
    w = lm_head if selected else lm_head.index_select(0, rows)  # (Vd, Ht)
    if not torch.is_autocast_enabled(final.device.type):
        final = final.to(w.dtype)
    return F.linear(final, w)


def _ttt_output(sums, correct, step_count, rows, step_weight: float) -> TTTOutput:
    """step_count (S,): counted positions per step, 0 for the steps never reached."""
    steps, done = step_count.shape[0], len(sums)
    missing = sums[0].new_zeros(steps - done)
    step_loss_sum = torch.cat([torch.stack(sums), missing])
    per_position = step_count.clamp(min=1)
    loss = (step_weight ** torch.arange(steps, device=step_count.device) * step_loss_sum
            / per_position).sum()
    step_correct = torch.cat([torch.stack(correct), missing.long()])
    return TTTOutput(loss, step_loss_sum, step_loss_sum.detach() / per_position,
                     step_correct.float() / per_position.float(), step_count,
                     rows + [0] * (steps - done))
