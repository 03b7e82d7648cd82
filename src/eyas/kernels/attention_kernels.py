"""Triton kernels for the TTT diagonal merge (eyas.kernels.attention._merge_diag and its backward) on
CUDA: the same math, one program per (position, KV head).

The merge mixes the band attention's output with the S <= 7 keys a position produced at
earlier TTT steps, through the band's log-sum-exp. Its products are tiny (G query heads per
KV head x S keys x head dim d), so it is bound by memory traffic; compiled from torch ops it
reached a fraction of the bandwidth (strided reductions over G and S: ~10 ms of a TTT-7
iteration at 8K tokens on an H200). Here each program loads its position's q, band output,
diagonal keys and values once, does the small products in registers and writes each result
once. Shapes: q, out (N, hkv, G, d); diag_k, diag_v (S, N, hkv, d) as stored by TTT; G, S
and d padded to powers of two inside the kernel (masked).

tests/test_ttt.py checks both kernels against the torch functions on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# values per warp of a program's (G, S, d) products: one warp for G = 4 query heads per KV
# head, S <= 8, d = 128 ran 2-3x faster than four (H200 sweep at 8K and 32K positions);
# larger groups get proportionally more warps (not measured)
_PER_WARP = 4096


def _warps(blocks: dict) -> int:
    return max(1, min(8, blocks["GB"] * blocks["SB"] * blocks["DB"] // _PER_WARP))


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


@triton.jit
def _merge_fwd(q_ptr, dk_ptr, dv_ptr, ob_ptr, lse_ptr, out_ptr, wb_ptr, wd_ptr,
               G, S, D, s_stride, scale,
               GB: tl.constexpr, SB: tl.constexpr, DB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (position, KV head) pair: row = n * hkv + k
    g, s, d = tl.arange(0, GB), tl.arange(0, SB), tl.arange(0, DB)
    gm, sm, dm = g < G, s < S, d < D
    gd = row * G * D + g[:, None] * D + d[None, :]  # (GB, DB) into q / out / ob
    # (SB, DB) into the diagonal (S, N * hkv, d)
    sd = s.to(tl.int64)[:, None] * s_stride + row * D + d[None, :]
    q = tl.load(q_ptr + gd, mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    kd = tl.load(dk_ptr + sd, mask=sm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    vd = tl.load(dv_ptr + sd, mask=sm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    ob = tl.load(ob_ptr + gd, mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row * G + g, mask=gm, other=0.0)
    scores = tl.sum(q[:, None, :] * kd[None, :, :], axis=2) * scale  # (GB, SB)
    scores = tl.where(sm[None, :], scores, float("-inf"))
    top = tl.maximum(lse, tl.max(scores, axis=1))
    w_band = tl.exp(lse - top)
    w_diag = tl.exp(scores - top[:, None])
    total = w_band + tl.sum(w_diag, axis=1)
    w_band = w_band / total
    w_diag = w_diag / total[:, None]
    mix = tl.sum(w_diag[:, :, None] * vd[None, :, :], axis=1)  # (GB, DB)
    merged = ob * w_band[:, None] + mix
    tl.store(out_ptr + gd, merged.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])
    tl.store(wb_ptr + row * G + g, w_band, mask=gm)
    tl.store(wd_ptr + row * G * S + g[:, None] * S + s[None, :], w_diag,
             mask=gm[:, None] & sm[None, :])


@triton.jit
def _merge_bwd(grad_ptr, merged_ptr, wb_ptr, wd_ptr, q_ptr, dk_ptr, dv_ptr, ob_ptr,
               gband_ptr, dq_ptr, ddk_ptr, ddv_ptr, dlse_ptr,
               G, S, D, s_stride, scale, WITH_LSE: tl.constexpr,
               GB: tl.constexpr, SB: tl.constexpr, DB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g, s, d = tl.arange(0, GB), tl.arange(0, SB), tl.arange(0, DB)
    gm, sm, dm = g < G, s < S, d < D
    gdm, sdm = gm[:, None] & dm[None, :], sm[:, None] & dm[None, :]
    gd = row * G * D + g[:, None] * D + d[None, :]
    sd = s.to(tl.int64)[:, None] * s_stride + row * D + d[None, :]
    go = tl.load(grad_ptr + gd, mask=gdm, other=0.0).to(tl.float32)  # (GB, DB)
    merged = tl.load(merged_ptr + gd, mask=gdm, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + gd, mask=gdm, other=0.0).to(tl.float32)
    kd = tl.load(dk_ptr + sd, mask=sdm, other=0.0).to(tl.float32)  # (SB, DB)
    vd = tl.load(dv_ptr + sd, mask=sdm, other=0.0).to(tl.float32)
    w_band = tl.load(wb_ptr + row * G + g, mask=gm, other=0.0)
    w_diag = tl.load(wd_ptr + row * G * S + g[:, None] * S + s[None, :],
                     mask=gm[:, None] & sm[None, :], other=0.0)  # (GB, SB)
    d_out = tl.sum(go * merged, axis=1)  # (GB,)
    dov = tl.sum(go[:, None, :] * vd[None, :, :], axis=2)  # (GB, SB)
    ds = w_diag * (dov - d_out[:, None]) * scale
    dq = tl.sum(ds[:, :, None] * kd[None, :, :], axis=1)  # (GB, DB)
    d_dk = tl.sum(ds[:, :, None] * q[:, None, :], axis=0)  # (SB, DB)
    d_dv = tl.sum(w_diag[:, :, None] * go[:, None, :], axis=0)
    tl.store(gband_ptr + gd, (go * w_band[:, None]).to(gband_ptr.dtype.element_ty), mask=gdm)
    tl.store(dq_ptr + gd, dq, mask=gdm)
    tl.store(ddk_ptr + sd, d_dk.to(ddk_ptr.dtype.element_ty), mask=sdm)
    tl.store(ddv_ptr + sd, d_dv.to(ddv_ptr.dtype.element_ty), mask=sdm)
    if WITH_LSE:
        ob = tl.load(ob_ptr + gd, mask=gdm, other=0.0).to(tl.float32)
        tl.store(dlse_ptr + row * G + g, w_band * (tl.sum(go * ob, axis=1) - d_out), mask=gm)


def _sizes(q: torch.Tensor, diag_k: torch.Tensor):
    n, hkv, g, d = q.shape
    return n * hkv, g, diag_k.shape[0], d, dict(GB=_pow2(g), SB=_pow2(diag_k.shape[0]),
                                                 DB=_pow2(d))


def merge_diag(q, diag_k, diag_v, out_b, lse):
    """As eyas.kernels.attention._merge_diag, with the diagonal in TTT's (S, N, hkv, d) layout:
    q, out_b (N, hkv, G, d); lse (N, hkv, G) fp32 -> merged (N, hkv, G, d) in q's dtype,
    w_band (N, hkv, G), w_diag (N, hkv, G, S) fp32."""
    q, out_b, lse = q.contiguous(), out_b.contiguous(), lse.contiguous()
    diag_k, diag_v = diag_k.contiguous(), diag_v.contiguous()
    rows, g, s, d, blocks = _sizes(q, diag_k)
    merged = torch.empty_like(q)
    w_band = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    w_diag = torch.empty(*q.shape[:3], s, dtype=torch.float32, device=q.device)
    _merge_fwd[(rows,)](q, diag_k, diag_v, out_b, lse, merged, w_band, w_diag, g, s, d,
                        rows * d, d ** -0.5, **blocks, num_warps=_warps(blocks))
    return merged, w_band, w_diag


def merge_diag_backward(grad, merged, w_band, w_diag, q, diag_k, diag_v, out_b=None):
    """As eyas.kernels.attention._merge_diag_backward, diagonal in (S, N, hkv, d): -> grad_band (grad's
    dtype), dq (fp32), d diag_k, d diag_v ((S, N, hkv, d), their dtype) and with out_b the
    LSE's gradient (N, hkv, G)."""
    grad, merged, q = grad.contiguous(), merged.contiguous(), q.contiguous()
    diag_k, diag_v = diag_k.contiguous(), diag_v.contiguous()
    rows, g, s, d, blocks = _sizes(q, diag_k)
    grad_band = torch.empty_like(grad)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    d_diag_k, d_diag_v = torch.empty_like(diag_k), torch.empty_like(diag_v)
    with_lse = out_b is not None
    d_lse = torch.empty_like(w_band) if with_lse else w_band
    _merge_bwd[(rows,)](grad, merged, w_band, w_diag, q, diag_k, diag_v,
                        out_b.contiguous() if with_lse else q, grad_band, dq, d_diag_k,
                        d_diag_v, d_lse, g, s, d, rows * d, d ** -0.5, WITH_LSE=with_lse,
                        **blocks, num_warps=_warps(blocks))
    grads = (grad_band, dq, d_diag_k, d_diag_v)
    return (*grads, d_lse) if with_lse else grads
