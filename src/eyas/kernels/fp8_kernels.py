"""Triton kernels for eyas.kernels.fp8's quantization on CUDA: the same values as `fp8.quantize`'s
portable code, in two passes over the tensor instead of four.

Profiled on an H200 (TTT-7 at 8K tokens, fp8), the portable quantization took ~36 ms of a
~210 ms iteration: an amax reduction, a cast, and a cast to the transposed layout that the
weight-gradient product needs, whose strided writes ran at a fraction of the memory bandwidth.
Here:

    _absmax   pass 1: a few hundred programs, each the |max| of a strided share of x, written
              to its own slot (no atomics, nothing to zero first)
    _cast     pass 2: reduces those partial maxima to the scale (every program does it; they
              are a few KiB in L2), then one (32, 64) tile of x per program, written row-major
              and/or transposed (Triton stages the transposed tile through shared memory so
              both stores are coalesced)

With a known `bound` on |x| (the loss gradient softmax - p lies in [-1, 1]) pass 1 is skipped.
Used by eyas.kernels.fp8 when its elementwise code is compiled (CUDA, EYAS_NO_COMPILE unset);
tests/test_fp8.py checks it against the portable code bit for bit on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Launch shapes, from a sweep on an H200 (.probe-style timing of quantize at 8K-context
# shapes, bf16 in): pass 1 at ~4 TB/s, pass 2 at ~2.6 TB/s writing both layouts (64x128
# tiles with 8 warps: 1.9 TB/s; 128-row tiles: 1.3 TB/s).
_PARTS = 512  # programs of pass 1 at most (and partial maxima pass 2 reduces)
_BLOCK, _ABSMAX_WARPS = 8192, 8  # elements per iteration of a pass-1 program, its warps
_TILE_R, _TILE_C, _CAST_WARPS = 32, 64, 4  # the (rows, columns) tile of a pass-2 program
_SWIGLU_TILE = (4, 1024)  # pass 1 of silu(gate) * up: (rows, columns) per iteration (unswept)


# NaN: tl.maximum / tl.minimum / tl.max return the other operand, so NaN is carried by hand
# (x != x): a NaN anywhere makes the scale NaN and every value NaN, as in the torch code,
# rather than quietly becoming finite.

@triton.jit
def _absmax(x_ptr, part_ptr, n, n_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # int64 loop bounds: n may be close to 2**31
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    nan = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n, n_prog * BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
        nan = nan | (x != x).to(tl.int32)
    tl.store(part_ptr + pid, tl.where(tl.max(nan, axis=0) > 0, float("nan"),
                                      tl.max(acc, axis=0)))


@triton.jit
def _swiglu_tile(gu_ptr, r, c, rows, inter):
    """silu(gate) * up at rows r (R, 1) and columns c (1, C) of gate_up (rows, 2 inter), in
    fp32 and rounded to gate_up's dtype, as the (N, I) tensor the torch code quantizes."""
    inside = (r < rows) & (c < inter)
    at = gu_ptr + r * (2 * inter) + c
    gate = tl.load(at, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(at + inter, mask=inside, other=0.0).to(tl.float32)
    return (gate * tl.sigmoid(gate) * up).to(gu_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _swiglu_absmax(gu_ptr, part_ptr, rows, inter, n_prog, TILE_R: tl.constexpr,
                   TILE_C: tl.constexpr):
    """_absmax of silu(gate) * up, computed from gate_up (never written out)."""
    pid = tl.program_id(0)
    acc = tl.zeros([TILE_R, TILE_C], dtype=tl.float32)
    nan = tl.zeros([TILE_R, TILE_C], dtype=tl.int32)
    for r0 in range(pid * TILE_R, rows, n_prog * TILE_R):
        r = (r0 + tl.arange(0, TILE_R)).to(tl.int64)[:, None]
        for c0 in range(0, inter, TILE_C):
            c = (c0 + tl.arange(0, TILE_C)).to(tl.int64)[None, :]
            y = _swiglu_tile(gu_ptr, r, c, rows, inter)
            acc = tl.maximum(acc, tl.abs(y))
            nan = nan | (y != y).to(tl.int32)
    tl.store(part_ptr + pid, tl.where(tl.max(tl.max(nan, axis=1), axis=0) > 0, float("nan"),
                                      tl.max(tl.max(acc, axis=1), axis=0)))


@triton.jit
def _cast(x_ptr, y_ptr, yt_ptr, part_ptr, scale_ptr, n_part, rows, cols, rows_pad, fmax, bound,
          SCALE: tl.constexpr, PARTS: tl.constexpr, ROW_MAJOR: tl.constexpr,
          TRANSPOSED: tl.constexpr, SWIGLU: tl.constexpr, TILE_R: tl.constexpr,
          TILE_C: tl.constexpr):
    # SCALE: 0 from `bound`, 1 from pass 1's partial maxima, 2 given (part_ptr[0] is s)
    if SCALE == 2:
        scale = tl.load(part_ptr)
    else:
        if SCALE == 1:
            p = tl.arange(0, PARTS)
            parts = tl.load(part_ptr + p, mask=p < n_part, other=0.0)
            amax = tl.where(tl.max((parts != parts).to(tl.int32), axis=0) > 0, float("nan"),
                            tl.max(parts, axis=0))
        else:
            amax = bound
        # as fp8._scale and fp8._cast: s = max(amax / fmax, 1e-30), y = clamp(x / s), IEEE
        # division
        scale = tl.math.div_rn(amax, fmax)
        scale = tl.where(scale != scale, scale, tl.maximum(scale, 1e-30))
    pr, pc = tl.program_id(0), tl.program_id(1)
    if (pr == 0) & (pc == 0):
        tl.store(scale_ptr, scale)
    r = (pr * TILE_R + tl.arange(0, TILE_R)).to(tl.int64)[:, None]  # (TILE_R, 1)
    c = (pc * TILE_C + tl.arange(0, TILE_C)).to(tl.int64)[None, :]  # (1, TILE_C)
    inside = (r < rows) & (c < cols)
    if SWIGLU:  # x_ptr is gate_up (rows, 2 cols); x = silu(gate) * up
        x = _swiglu_tile(x_ptr, r, c, rows, cols)
    else:
        x = tl.load(x_ptr + r * cols + c, mask=inside, other=0.0).to(tl.float32)
    y = tl.math.div_rn(x, scale)
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -fmax), fmax))
    if ROW_MAJOR:
        tl.store(y_ptr + r * cols + c, y.to(y_ptr.dtype.element_ty), mask=inside)
    if TRANSPOSED:  # (cols, rows_pad): the padding rows of x are zeros
        tl.store(yt_ptr + c * rows_pad + r, y.to(yt_ptr.dtype.element_ty),
                 mask=(r < rows_pad) & (c < cols))


def quantize(x: torch.Tensor, fmax: float, dtype: torch.dtype, align: int,
             row_major: bool = True, transposed: bool = False, bound: float | None = None,
             scale: torch.Tensor | None = None, swiglu: bool = False):
    """x (R, C) contiguous on CUDA -> (x / s in `dtype` or None, s fp32 scalar, x^T / s padded
    to (C, R') with R' a multiple of `align`, or None). s = max(amax, or `bound`) / fmax, or
    the given `scale`. swiglu: x is gate_up (R, 2C) and the tensor quantized silu(gate) * up
    (R, C), computed on the fly (not written out)."""
    rows, cols = x.shape
    if swiglu:
        cols //= 2
    rows_pad = rows + (-rows % align)
    dev = x.device
    y = torch.empty(rows, cols, dtype=dtype, device=dev) if row_major else None
    y_t = torch.empty(cols, rows_pad, dtype=dtype, device=dev) if transposed else None
    out_scale = torch.empty((), dtype=torch.float32, device=dev)
    n_part, parts, mode = 1, out_scale, 0  # mode 0: from bound (parts unused)
    if scale is not None:
        parts, mode = scale.float().reshape(1), 2
    elif bound is None:
        mode = 1
        if swiglu:
            n_part = max(1, min(_PARTS, triton.cdiv(rows, _SWIGLU_TILE[0])))
            parts = torch.empty(n_part, dtype=torch.float32, device=dev)
            _swiglu_absmax[(n_part,)](x, parts, rows, cols, n_part, TILE_R=_SWIGLU_TILE[0],
                                      TILE_C=_SWIGLU_TILE[1], num_warps=_ABSMAX_WARPS)
        else:
            n_part = max(1, min(_PARTS, triton.cdiv(x.numel(), _BLOCK)))
            parts = torch.empty(n_part, dtype=torch.float32, device=dev)
            _absmax[(n_part,)](x, parts, x.numel(), n_part, BLOCK=_BLOCK,
                               num_warps=_ABSMAX_WARPS)
    grid = (triton.cdiv(rows_pad if transposed else rows, _TILE_R), triton.cdiv(cols, _TILE_C))
    _cast[grid](x, y if row_major else out_scale, y_t if transposed else out_scale, parts,
                out_scale, n_part, rows, cols, rows_pad, fmax,
                0.0 if bound is None else float(bound), SCALE=mode, PARTS=_PARTS,
                ROW_MAJOR=row_major, TRANSPOSED=transposed, SWIGLU=swiglu, TILE_R=_TILE_R,
                TILE_C=_TILE_C, num_warps=_CAST_WARPS)
    return y, out_scale, y_t
