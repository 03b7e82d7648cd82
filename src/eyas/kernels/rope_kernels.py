"""A Triton kernel for eyas.kernels.fused.QKVRope on CUDA: RoPE of q and k (and v's copy) from the
fused q/k/v projection, forward and backward, the values of `fused._rope` /
`fused._rope_backward` (fp32 math, precise sine and cosine, rounded once to the input's
dtype).

Compiled from torch ops, the rotation ran at about a sixth of the H200's memory bandwidth
(~4 ms of a TTT-7 iteration at 8K tokens: the cosine and sine were recomputed for every head,
the two halves read once per output half). Here a program takes a block of positions,
computes their cosines and sines once, and rotates every q and k head of those positions
with them, reading each half once.

    forward   qkv (N, (hq + 2 hkv) d) -> q (N, hq, d), k, v (N, hkv, d), contiguous
    backward  dq, dk, dv -> d qkv (N, (hq + 2 hkv) d): the rotation at -positions

tests/test_draft.py (gpu) checks it against the torch functions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_BLOCK_N, _WARPS = 16, 4  # positions per program (not swept)


@triton.jit
def _rotate_heads(src, dst, src_row, dst_row, n, nm, c, s, heads, HALF: tl.constexpr,
                  ROTATE: tl.constexpr):
    """`heads` consecutive heads of width 2 HALF at rows n: rotated by (c, s) or copied."""
    j = tl.arange(0, HALF)[None, :]
    m = nm[:, None]
    for h in range(heads):
        at_src = src + n[:, None] * src_row + h * 2 * HALF + j
        at_dst = dst + n[:, None] * dst_row + h * 2 * HALF + j
        x1 = tl.load(at_src, mask=m, other=0.0)
        x2 = tl.load(at_src + HALF, mask=m, other=0.0)
        if ROTATE:
            a, b = x1.to(tl.float32), x2.to(tl.float32)
            x1, x2 = a * c - b * s, b * c + a * s
        tl.store(at_dst, x1.to(dst.dtype.element_ty), mask=m)
        tl.store(at_dst + HALF, x2.to(dst.dtype.element_ty), mask=m)


@triton.jit
def _rope(sq, sk, sv, dq, dk, dv, pos_ptr, inv_ptr, N, scale, sign,
          sq_row, sk_row, sv_row, dq_row, dk_row, dv_row, hq, hkv,
          HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nm = n < N
    pos = tl.load(pos_ptr + n, mask=nm, other=0.0)  # (BLOCK_N,) fp32
    freqs = (pos * sign)[:, None] * tl.load(inv_ptr + tl.arange(0, HALF))[None, :]
    c = libdevice.cos(freqs) * scale  # as fused._rotate: cos(p f) * scale, sin(p f) * scale
    s = libdevice.sin(freqs) * scale
    _rotate_heads(sq, dq, sq_row, dq_row, n, nm, c, s, hq, HALF, True)
    _rotate_heads(sk, dk, sk_row, dk_row, n, nm, c, s, hkv, HALF, True)
    _rotate_heads(sv, dv, sv_row, dv_row, n, nm, c, s, hkv, HALF, False)


def _launch(src, dst, positions, inv_freq, scale: float, sign: float, hq: int, hkv: int):
    """src, dst: (q, k, v) views with unit stride inside a row; rows of N positions."""
    n = src[0].shape[0]
    half = inv_freq.shape[0]
    pos = positions.reshape(-1).float().contiguous()
    grid = (triton.cdiv(n, _BLOCK_N),)
    _rope[grid](*src, *dst, pos, inv_freq.float().contiguous(), n, float(scale), float(sign),
                *(t.stride(0) for t in src), *(t.stride(0) for t in dst), hq, hkv,
                HALF=half, BLOCK_N=_BLOCK_N, num_warps=_WARPS)


def rope(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
         hq: int, hkv: int):
    """qkv (N, (hq + 2 hkv) d) -> RoPE'd q (N, hq, d), k (N, hkv, d) and v (N, hkv, d)."""
    n = qkv.shape[0]
    d = 2 * inv_freq.shape[0]
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    q = qkv.new_empty(n, hq, d)
    k, v = qkv.new_empty(n, hkv, d), qkv.new_empty(n, hkv, d)
    src = (qkv, qkv[:, hq * d:], qkv[:, (hq + hkv) * d:])
    _launch(src, (q.view(n, -1), k.view(n, -1), v.view(n, -1)), positions, inv_freq, scale,
            1.0, hq, hkv)
    return q, k, v


def rope_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                  positions: torch.Tensor, inv_freq: torch.Tensor, scale: float):
    """Gradients of q, k, v -> the gradient of qkv (N, (hq + 2 hkv) d)."""
    n, hq, d = dq.shape
    hkv = dk.shape[1]
    dq, dk, dv = (t.contiguous().reshape(n, -1) for t in (dq, dk, dv))  # a copy only if needed
    out = dq.new_empty(n, (hq + 2 * hkv) * d)
    dst = (out, out[:, hq * d:], out[:, (hq + hkv) * d:])
    _launch((dq, dk, dv), dst, positions, inv_freq, scale, -1.0, hq, hkv)
    return out
