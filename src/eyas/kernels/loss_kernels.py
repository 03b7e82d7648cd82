"""A Triton kernel for one chunk of eyas.draft.loss's soft cross-entropy on CUDA: the values of
`eyas.draft.loss._soft_ce_chunk` (to float rounding; an fp8 gradient is rounded once, from fp32,
where the torch path rounds through bf16), one program per row, two passes over the row.

    pass 1   running max and exp-sum of the draft logits and of the teacher logits (online
             softmax, per lane, combined at the end), and the logits' argmax; the teacher's
             log-sum-exp can be given instead (TTT computes it once for all steps)
    pass 2   log q = z - lse(z), p = exp(t - lse(t)); the row's loss -sum p log q and the
             gradient q - p, written in the logits' dtype or straight to fp8 (e5m2; every
             entry lies in [-1, 1], so a fixed scale 1 / 57344 needs no amax pass)

Compiled from torch ops the chunk ran at about a third of the memory bandwidth on an H200
(~9.5 ms of a TTT-7 iteration at 8K tokens). tests/test_ttt.py checks the kernel against
the torch function on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK, _WARPS = 2048, 8
E5M2_MAX = torch.finfo(torch.float8_e5m2).max


@triton.jit
def _soft_ce(z_ptr, t_ptr, w_ptr, tlse_ptr, loss_ptr, top_ptr, g_ptr, V, z_stride, t_stride,
             g_scale, WEIGHTED: tl.constexpr, WITH_GRAD: tl.constexpr, TO_FP8: tl.constexpr,
             TEACHER_LSE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    z_row, t_row = z_ptr + row * z_stride, t_ptr + row * t_stride
    m_z = tl.full([BLOCK], float("-inf"), tl.float32)
    m_t = tl.full([BLOCK], float("-inf"), tl.float32)
    s_z = tl.zeros([BLOCK], tl.float32)
    s_t = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):  # pass 1: statistics per lane
        col = start + lanes
        inside = col < V
        z = tl.load(z_row + col, mask=inside, other=float("-inf")).to(tl.float32)
        better = z > best  # strict: each lane keeps its first maximum, as torch.argmax
        best_at = tl.where(better, col, best_at)
        best = tl.where(better, z, best)
        new_z = tl.maximum(m_z, z)
        # a lane whose values so far are all -inf adds nothing (exp(-inf - -inf) is NaN)
        s_z = s_z * tl.exp(tl.where(new_z == float("-inf"), 0.0, m_z - new_z)) + \
            tl.where(inside & (new_z > float("-inf")), tl.exp(z - new_z), 0.0)
        m_z = new_z
        if not TEACHER_LSE:
            t = tl.load(t_row + col, mask=inside, other=float("-inf")).to(tl.float32)
            new_t = tl.maximum(m_t, t)
            s_t = s_t * tl.exp(tl.where(new_t == float("-inf"), 0.0, m_t - new_t)) + \
                tl.where(inside & (new_t > float("-inf")), tl.exp(t - new_t), 0.0)
            m_t = new_t
    top_z = tl.max(m_z, axis=0)
    lse_z = top_z + tl.log(tl.sum(s_z * tl.exp(m_z - top_z), axis=0))
    if TEACHER_LSE:  # given (the teacher's rows serve all TTT steps: computed once)
        lse_t = tl.load(tlse_ptr + row).to(tl.float32)
    else:
        top_t = tl.max(m_t, axis=0)
        lse_t = top_t + tl.log(tl.sum(s_t * tl.exp(m_t - top_t), axis=0))
    top = tl.max(best, axis=0)
    tl.store(top_ptr + row, tl.min(tl.where(best == top, best_at, V), axis=0).to(tl.int64))
    weight = 1.0
    if WEIGHTED:
        weight = tl.load(w_ptr + row).to(tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):  # pass 2: loss and gradient
        col = start + lanes
        inside = col < V
        logq = tl.load(z_row + col, mask=inside, other=0.0).to(tl.float32) - lse_z
        p = tl.exp(tl.load(t_row + col, mask=inside, other=float("-inf")).to(tl.float32)
                   - lse_t)
        acc += tl.where(inside, p * logq, 0.0)
        if WITH_GRAD:
            g = (tl.exp(logq) - p) * weight
            if TO_FP8:  # e5m2's largest value; NaN stays NaN
                g = g / g_scale
                g = tl.where(g != g, g, tl.minimum(tl.maximum(g, -57344.0), 57344.0))
            tl.store(g_ptr + row * V + col, g.to(g_ptr.dtype.element_ty), mask=inside)
    tl.store(loss_ptr + row, -tl.sum(acc, axis=0) * weight)


def soft_ce_chunk(logits: torch.Tensor, teacher: torch.Tensor, with_grad: bool,
                  weight: torch.Tensor | None = None, grad_fp8: bool = False,
                  teacher_lse: torch.Tensor | None = None):
    """logits, teacher (c, Vd) on CUDA, rows contiguous -> (summed soft CE fp32, argmax (c,),
    d loss / d logits (c, Vd) or None, its scale or None). The gradient is in logits' dtype,
    or with `grad_fp8` e5m2 divided by the returned scale (1 / 57344). weight (c,) per-row
    weights in [0, 1] (0 / 1 in TTT; the fp8 scale assumes |gradient| <= 1), multiplied into
    loss and gradient. teacher_lse (c,) fp32: logsumexp of each teacher row, when known
    (pass 1 then reads the draft logits only)."""
    c, v = logits.shape
    dev = logits.device
    losses = torch.empty(c, dtype=torch.float32, device=dev)
    top = torch.empty(c, dtype=torch.long, device=dev)
    g_dtype = torch.float8_e5m2 if grad_fp8 else logits.dtype
    grad = torch.empty(c, v, dtype=g_dtype, device=dev) if with_grad else None
    scale = 1.0 / E5M2_MAX
    if c:
        weight = None if weight is None else weight.contiguous()
        lse = None if teacher_lse is None else teacher_lse.float().contiguous()
        _soft_ce[(c,)](logits, teacher, weight if weight is not None else losses,
                       lse if lse is not None else losses, losses, top,
                       grad if with_grad else losses, v, logits.stride(0), teacher.stride(0),
                       scale, WEIGHTED=weight is not None, WITH_GRAD=with_grad,
                       TO_FP8=grad_fp8, TEACHER_LSE=lse is not None, BLOCK=_BLOCK,
                       num_warps=_WARPS)
    g_scale = torch.full((), scale, dtype=torch.float32, device=dev) if grad_fp8 else None
    return losses.sum(), top, grad, g_scale
