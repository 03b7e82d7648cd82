"""FP8 matmuls for training the draft (`eyas train --precision fp8`).

Hopper-class GPUs run fp8 matrix products at about twice their bf16 rate (benchmarks/kernel_ceilings.py
measures 1.2-1.4 PFLOP/s against 0.6-0.8 on an H200 for every matmul of an 8B-shaped draft).
This module gives the draft's linear layers that rate with the standard recipe for fp8
training with dynamic per-tensor scales:

    forward   y  = x W^T      x, W in e4m3 (3 mantissa bits)
    backward  dx = dy W       dy in e5m2 (2 mantissa bits, the range gradients need)
              dW = dy^T x

Each tensor is scaled by its own absolute maximum onto the format's range just before the
product (`quantize`); the product accumulates in fp32 and returns bf16, like a bf16 matmul.
Master weights, optimizer state, norms, attention, softmax and the loss stay as they are in
bf16 training, and so does the teacher (the target's logits). Weights are quantized once per
TTT forward, not once per step (`Fp8Matrix`). A linear saves its input as fp8 for the weight
gradient, half the memory of the bf16 copy it replaces.

Runs wherever `torch._scaled_mm` does: CUDA compute capability 8.9+ (Ada, Hopper, Blackwell)
and CPU (slow, for tests). docs/train.md has the measured effect on loss and acceptance.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eyas.kernels import fused
from eyas.kernels.fused import cuda_compiled

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
_ALIGN = 16  # _scaled_mm: the inner dimension of every product is a multiple of 16


def supported(device: torch.device) -> bool:
    """Whether fp8 products run on `device`: an NVIDIA GPU of compute capability 8.9+, or
    the CPU where this torch has fp8 `_scaled_mm` there (recent versions; slow, for tests).
    ROCm GPUs use other fp8 formats (e4m3fnuz) and are not supported."""
    if device.type == "cpu":
        return _cpu_scaled_mm()
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= (8, 9))


@functools.lru_cache(maxsize=1)
def _cpu_scaled_mm() -> bool:
    a = torch.zeros(16, 16).to(E4M3)
    one = torch.ones(())
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _scale(x: torch.Tensor, fmax: float) -> torch.Tensor:
    """fp32 scalar s with x / s spanning the format's range (s = amax / fmax, never 0). An
    eager reduction: compiled with a dynamic row count, the amax became one slow block."""
    if x.numel() == 0:
        return torch.ones((), device=x.device)
    amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
    return (amax / fmax).clamp(min=1e-30)


@cuda_compiled
def _cast(x, scale, fmax: float, dtype: torch.dtype, transposed: bool):
    """x / scale in the fp8 `dtype` (clamped: rounding must not step past the top), and
    with `transposed` also its transpose (C, R') with R' = R padded to a multiple of 16: the
    operand of the weight-gradient product, written by the same kernel."""
    y = (x.float() / scale).clamp(-fmax, fmax)
    if not transposed:
        return y.to(dtype), None
    pad = -x.shape[0] % _ALIGN  # transposed from the float values: one fused, tiled kernel
    return y.to(dtype), F.pad(y, (0, 0, 0, pad)).t().contiguous().to(dtype)


def quantize(x: torch.Tensor, dtype=E4M3, transposed: bool = False, bound: float | None = None,
             row_major: bool = True, scale: torch.Tensor | None = None):
    """x (R, C) -> (x / s in `dtype`, s, x8^T or None): one scale for the whole tensor; with
    `transposed` also x8^T padded to (C, R'), R' a multiple of 16, the weight-gradient
    operand. bound: a known bound on |x| to scale by instead of its absolute maximum (skips
    a pass over x); scale: s itself, already known (e.g. x's scale from the forward).
    row_major=False: only the transposed copy (the first result is None)."""
    x = x.contiguous()  # the products read it row-major
    fmax = _MAX[dtype]
    if fused.use_kernels(x) and x.numel() > 0:
        from eyas.kernels import fp8_kernels  # Triton: two passes instead of four (its docstring)

        return fp8_kernels.quantize(x, fmax, dtype, _ALIGN, row_major, transposed, bound, scale)
    return _quantize_torch(x, fmax, dtype, transposed, bound, row_major, scale)


def _quantize_torch(x, fmax, dtype, transposed, bound, row_major, scale):
    if scale is not None:
        s = scale.float().reshape(())
    elif bound is None:
        s = _scale(x, fmax)
    else:
        s = torch.full((), max(bound / fmax, 1e-30), dtype=torch.float32, device=x.device)
    y, y_t = _cast(x, s, fmax, dtype, transposed)
    return (y if row_major else None), s, y_t


def quantize_swiglu(gate_up: torch.Tensor, transposed: bool = False, row_major: bool = True,
                    scale: torch.Tensor | None = None):
    """quantize(silu(gate) * up) for gate_up (R, 2I) (e4m3), without writing the (R, I)
    product out on CUDA: the Triton passes compute it from gate_up as they read it (the
    product costs a write and two reads of R x I values otherwise). scale: the product's
    scale when already known (backward recomputes the forward's product)."""
    gate_up = gate_up.contiguous()
    if fused.use_kernels(gate_up) and gate_up.numel() > 0:
        from eyas.kernels import fp8_kernels

        return fp8_kernels.quantize(gate_up, _MAX[E4M3], E4M3, _ALIGN, row_major, transposed,
                                    None, scale, swiglu=True)
    return _quantize_torch(fused._swiglu(gate_up), _MAX[E4M3], E4M3, transposed, None,
                           row_major, scale)


def mm(a8, sa, b8_t, sb, out_dtype):
    """a8 (M, K) row-major, b8_t (K, N) column-major -> (M, N) = (a8 sa) (b8_t sb)."""
    return torch._scaled_mm(a8, b8_t, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


@dataclass
class Fp8Matrix:
    """A weight W (N, K) quantized once for every product of one forward and backward."""

    w: torch.Tensor  # (N, K) e4m3, row-major: y = x W^T reads it column-major as W^T
    w_t: torch.Tensor  # (K, N) e4m3, W^T row-major: dx = dy W reads it column-major as W
    scale: torch.Tensor  # fp32 scalar

    @classmethod
    def of(cls, weight: torch.Tensor) -> Fp8Matrix | None:
        """None when a side of W is not a multiple of 16 (fp8 products need that on CUDA):
        that matrix then stays in bf16."""
        if weight.shape[0] % _ALIGN or weight.shape[1] % _ALIGN:
            return None
        with torch.no_grad():
            w8, s, w8_t = quantize(weight.detach(), transposed=True)
            return cls(w8, w8_t, s)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, packed: Fp8Matrix, out_dtype):
        # x (M, K) any float; weight (N, K): only for its gradient (values come from packed)
        x8, sx, x8_t = quantize(x, transposed=ctx.needs_input_grad[1])
        ctx.save_for_backward(x8_t, sx)  # the fp8 copy the weight gradient reads
        ctx.packed, ctx.out_dtype = packed, out_dtype
        return mm(x8, sx, packed.w.t(), packed.scale, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x8_t, sx = ctx.saved_tensors
        packed = ctx.packed
        g8, sg, g8_t = quantize(grad, E5M2, transposed=ctx.needs_input_grad[1],
                                row_major=ctx.needs_input_grad[0])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = mm(g8, sg, packed.w_t.t(), packed.scale, ctx.out_dtype)
        if ctx.needs_input_grad[1]:
            dw = mm(g8_t, sg, x8_t.t(), sx, ctx.out_dtype)
        return dx, dw, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, packed: Fp8Matrix | None) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T: through fp8 when `packed` (Fp8Matrix.of(weight)) is
    given, else F.linear. The result has x's dtype (bf16 under autocast, fp32 on CPU)."""
    if packed is None:
        return F.linear(x, weight)
    out_dtype = x.dtype
    flat = x.reshape(-1, x.shape[-1])
    y = _Fp8Linear.apply(flat, weight, packed, out_dtype)
    return y.view(*x.shape[:-1], y.shape[-1])
