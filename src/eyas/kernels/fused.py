"""The draft layer's fused elementwise kernels, and `cuda_compiled`, the helper that fuses them.

Each piece is a custom autograd Function whose forward and backward bodies are plain tensor
functions under `cuda_compiled`: one or a few kernels each way on CUDA, eager on CPU (or
everywhere with EYAS_NO_COMPILE=1). Writing the backward by hand also chooses what is saved
for it, which is where most of the memory of a 7-step TTT forward at 64K tokens goes:

    RMSNormFn    saves x and 1/rms, not an fp32 copy of x per norm
    QKVRope      splits the fused q/k/v projection and applies RoPE (backward: RoPE at -pos)
    SwiGLUDown   down_proj(silu(gate) * up), recomputing the (N, I) product in backward
                 (in eyas.kernels.swiglu: its fp8 path needs eyas.kernels.fp8)

eyas.draft.eagle3 builds its decoder layer from these; eyas.draft.loss fuses its soft cross-entropy with
`cuda_compiled` too.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Devices whose elementwise code runs through torch.compile (tests add "cpu" to check that
# the compiled functions trace and agree; EYAS_NO_COMPILE=1 runs everything eagerly).
COMPILE_DEVICES = set() if os.environ.get("EYAS_NO_COMPILE") else {"cuda"}


def use_kernels(x: torch.Tensor) -> bool:
    """Whether work on `x` runs eyas's Triton kernels (fp8_kernels, loss_kernels,
    attention_kernels): on CUDA whenever its elementwise code is compiled (not under
    EYAS_NO_COMPILE=1); elsewhere the torch functions they were checked against run."""
    return x.is_cuda and "cuda" in COMPILE_DEVICES


def cuda_compiled(fn):
    """Run `fn` (tensors in, tensors out, no autograd inside) eagerly, or through
    torch.compile on the devices in COMPILE_DEVICES. Compiled, its casts, elementwise ops
    and row reductions become one or a few kernels instead of one launch and one full
    read/write of memory each. Dim 0 of every argument with 2+ dims is the row dimension:
    marked dynamic, as row counts change at every TTT step (pruning); the other sizes
    (hidden, heads, vocab) stay static so the kernels are specialised for them."""
    compiled, warned = None, False

    @functools.wraps(fn)
    def run(*args):
        nonlocal compiled, warned
        if args[0].device.type not in COMPILE_DEVICES or args[0].numel() == 0:
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, fullgraph=True)
        # detached: inside autograd.Function code requires_grad means nothing, and as a
        # guard it would compile one graph per combination of flags
        args = [a.detach() if torch.is_tensor(a) else a for a in args]
        for a in args:
            if torch.is_tensor(a) and a.dim() >= 2:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        try:
            return compiled(*args)
        except _RECOMPILE_LIMIT:
            # one process running many layouts (a benchmark sweeping shapes and dtypes) can
            # exhaust torch.compile's graphs per function; under fullgraph that is an error.
            # The graphs made so far keep serving their layouts; this one runs eagerly.
            if not warned:
                log.warning("%s: torch.compile's recompile limit is reached; layouts without "
                            "a compiled graph run eagerly (slower, same results)", fn.__name__)
                warned = True
            return fn(*args)

    return run


# what torch.compile raises when a fullgraph function needs more graphs than its limit allows
_RECOMPILE_LIMIT = tuple(getattr(torch._dynamo.exc, name) for name in
                         ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
                         if hasattr(torch._dynamo.exc, name))


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


class RMSNormFn(torch.autograd.Function):
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
        g, flat = grad.reshape(-1, c), x.reshape(-1, c)
        if use_kernels(x) and flat.shape[0] and c <= 8192:  # one pass for both gradients
            from eyas.kernels import norm_kernels

            dx, d_weight = norm_kernels.rms_norm_backward(g.contiguous(), flat.contiguous(),
                                                          weight, rstd)
        else:
            dx, d_weight = _rms_norm_backward(g, flat, weight, rstd)
        return dx.view(x.shape), d_weight, None


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


def _rope_kernel_fits(x: torch.Tensor, inv_freq: torch.Tensor) -> bool:
    """eyas.kernels.rope_kernels takes it: CUDA with kernels on, rows, a power-of-two half head."""
    half = inv_freq.shape[0]
    return use_kernels(x) and x.shape[0] > 0 and half >= 1 and half & (half - 1) == 0


class QKVRope(torch.autograd.Function):
    """qkv (N, (hq + 2 hkv) d) from the fused projection -> q (N, hq, d), k, v (N, hkv, d),
    RoPE on q and k at positions (N, 1): one kernel each way on CUDA (eager autograd: a
    dozen elementwise ops, each a full pass over q or k)."""

    @staticmethod
    def forward(ctx, qkv, positions, inv_freq, scale: float, hq: int, hkv: int):
        ctx.save_for_backward(positions, inv_freq)
        ctx.scale = scale
        if _rope_kernel_fits(qkv, inv_freq):  # Triton: cos/sin once per position
            from eyas.kernels import rope_kernels

            return rope_kernels.rope(qkv, positions, inv_freq, scale, hq, hkv)
        q, k, v = qkv.view(qkv.shape[0], hq + 2 * hkv, -1).split([hq, hkv, hkv], dim=1)
        return _rope(q, k, v, positions, inv_freq, scale)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        positions, inv_freq = ctx.saved_tensors
        if _rope_kernel_fits(dq, inv_freq):
            from eyas.kernels import rope_kernels

            grad = rope_kernels.rope_backward(dq, dk, dv, positions, inv_freq, ctx.scale)
        else:
            grad = _rope_backward(dq, dk, dv, positions, inv_freq, ctx.scale)
        return grad, None, None, None, None, None


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

