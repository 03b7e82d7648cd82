"""SwiGLUDown: down_proj(silu(gate) * up) as one autograd Function, in bf16 or fp8.

Apart from eyas.kernels.fused because its fp8 path uses eyas.kernels.fp8, which itself
builds on fused (`cuda_compiled`): fused -> fp8 -> fused was a cycle.
"""

from __future__ import annotations

import torch

from eyas.kernels.fused import _swiglu, _swiglu_backward


class SwiGLUDown(torch.autograd.Function):
    """down_proj(silu(gate) * up) from gate_up (N, 2I) and w_down (H, I), saving gate_up
    only: the (N, I) product is recomputed in backward rather than kept (1.8 GiB per TTT
    step at 64K tokens and I = 14336). `packed`: w_down's eyas.kernels.fp8.Fp8Matrix, or None for
    plain matmuls."""

    @staticmethod
    def forward(ctx, gate_up, w_down, packed=None):
        ctx.packed = packed
        if packed is None:
            ctx.save_for_backward(gate_up, w_down)
            return _swiglu(gate_up) @ w_down.t()  # (N, H)
        from eyas.kernels import fp8
        x8, sx, _ = fp8.quantize_swiglu(gate_up)  # on CUDA the product is never written out
        ctx.save_for_backward(gate_up, w_down, sx)
        return fp8.mm(x8, sx, packed.w.t(), packed.scale, gate_up.dtype)

    @staticmethod
    def backward(ctx, grad):
        gate_up, w_down, *sx = ctx.saved_tensors
        packed = ctx.packed
        if packed is None:
            d_w = grad.t() @ _swiglu(gate_up) if ctx.needs_input_grad[1] else None  # (H, I)
            return _swiglu_backward(grad @ w_down, gate_up), d_w, None
        from eyas.kernels import fp8
        g8, sg, g8_t = fp8.quantize(grad, fp8.E5M2, transposed=ctx.needs_input_grad[1])
        d_act = fp8.mm(g8, sg, packed.w_t.t(), packed.scale, gate_up.dtype)  # (N, I)
        d_w = None
        if ctx.needs_input_grad[1]:  # (H, I); the product recomputed, its scale the forward's
            _, sa, a8_t = fp8.quantize_swiglu(gate_up, transposed=True, row_major=False,
                                              scale=sx[0])
            d_w = fp8.mm(g8_t, sg, a8_t.t(), sa, w_down.dtype)
        return _swiglu_backward(d_act, gate_up), d_w, None
