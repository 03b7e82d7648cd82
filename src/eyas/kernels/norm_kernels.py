"""A Triton kernel for the backward of eyas.kernels.fused.RMSNormFn on CUDA: the input's gradient and
the weight's in one pass over the rows, the values of `fused._rms_norm_backward` (fp32 math;
the weight gradient summed in another order).

Compiled from torch ops the backward is two reductions, one per row (the input's gradient)
and one per column (the weight's), each reading the gradient and the input in full: on an
H200 the second ran at about half the memory bandwidth (~2 ms of a TTT-7 iteration at 8K
tokens over 25 norms). Here each program walks a strided share of the rows, writes their
input gradients and keeps its share of the weight gradient in registers; the shares (a few
hundred rows of H floats) are summed at the end.

tests/test_draft.py (gpu) checks it against the torch function.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_PROGRAMS, _WARPS = 264, 4  # 2 per H200 SM (not swept)


@triton.jit
def _rms_norm_bwd(g_ptr, x_ptr, w_ptr, r_ptr, dx_ptr, part_ptr, rows, cols, n_prog,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    cm = c < cols
    w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in range(pid, rows, n_prog):
        at = (c.to(tl.int64) * 0 + r) * cols + c  # int64: rows * cols may pass 2**31
        g = tl.load(g_ptr + at, mask=cm, other=0.0)
        x = tl.load(x_ptr + at, mask=cm, other=0.0)
        rstd = tl.load(r_ptr + r)
        normed = x.to(tl.float32) * rstd
        d_normed = g.to(tl.float32) * w
        dot = tl.sum(d_normed * normed, axis=0) / cols
        tl.store(dx_ptr + at, (rstd * (d_normed - normed * dot)).to(dx_ptr.dtype.element_ty),
                 mask=cm)
        # as the torch function: the normalised input rounded to x's dtype, as the forward
        # output it stands for
        acc += g.to(tl.float32) * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(part_ptr + pid * cols + c, acc, mask=cm)


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor):
    """grad, x (R, C) contiguous; weight (C,); rstd (R, 1) fp32 -> (dx (R, C) in x's dtype,
    d_weight (C,) in weight's dtype)."""
    rows, cols = x.shape
    n_prog = max(1, min(_PROGRAMS, rows))
    dx = torch.empty_like(x)
    parts = torch.empty(n_prog, cols, dtype=torch.float32, device=x.device)
    _rms_norm_bwd[(n_prog,)](grad, x, weight, rstd.float().contiguous(), dx, parts, rows, cols,
                             n_prog, BLOCK=triton.next_power_of_2(cols), num_warps=_WARPS)
    return dx, parts.sum(0).to(weight.dtype)
