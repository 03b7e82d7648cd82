"""The fused kernels that run the causal band of one document on CUDA (attention.causal_attention):
FlashAttention-4 and cuDNN, which of them takes given queries, and when a failing
FlashAttention-4 call gives way.

Both share one contract: `Kernel(q, k, v)` with q (N, hq, d), k, v (N, hkv, d); `forward()`
returns the band's output (N, hq, d) and log-sum-exp (N, hq) fp32; `backward(grad_band,
merged)` returns dq, dk, dv, using `merged` where the kernel's own backward reads its output
(only for D = rowsum(dO * out); see causal_attention for why the merged output goes there).
attention._ReferenceCausal is the same contract in plain torch.

EYAS_ATTENTION chooses: `auto` (default) takes FlashAttention-4 when it is installed
(`pip install 'eyas[fa4]'`) and takes the queries, else cuDNN; `fa4` requires it; `cudnn`
never uses it.
"""

from __future__ import annotations

import importlib
import logging
import os

import torch

from eyas.errors import EyasError

log = logging.getLogger(__name__)

ATTENTION_ENV = "EYAS_ATTENTION"
_fa4_module = None  # flash_attn.cute.interface once imported; False: not importable, or off
_said: set[str] = set()  # reasons FlashAttention-4 was not used, logged once each
_NOT_IMPORTABLE = "flash_attn.cute does not import (pip install 'eyas[fa4]')"
_failed: str | None = None  # why FlashAttention-4 was switched off after a failed call


def attention_choice() -> str:
    """EYAS_ATTENTION's value: auto (unset or empty), fa4 or cudnn; anything else is an error."""
    choice = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "fa4", "cudnn"):
        raise EyasError(f"{ATTENTION_ENV}={choice!r}: expected auto, fa4 or cudnn")
    return choice


def _fa4():
    """FlashAttention-4's interface module, or None when it does not import (imported once
    per process; the reason is logged once: as a warning when the package is there but broken,
    e.g. its compiler against this driver)."""
    global _fa4_module
    if _fa4_module is None:
        try:
            module = importlib.import_module("flash_attn.cute.interface")
            if not all(hasattr(module, f) for f in ("_flash_attn_fwd", "_flash_attn_bwd")):
                raise ImportError("it lacks _flash_attn_fwd / _flash_attn_bwd (eyas[fa4] pins "
                                  "the version eyas was measured with)")
            _fa4_module = module
        except Exception as e:  # ImportError, or a missing CUDA library / driver inside it
            absent = isinstance(e, ModuleNotFoundError) and (e.name or "").startswith("flash_attn")
            log.log(logging.INFO if absent else logging.WARNING,
                    "FlashAttention-4 not used (%s: %s); cuDNN attention instead",
                    type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            _fa4_module = False
    return _fa4_module or None


def band_kernel(q: torch.Tensor):
    """The fused kernel class for the causal band of CUDA queries q (N, hq, d), or None when
    neither takes them (causal_attention then runs FlexAttention, same result). Under `auto`
    why FlashAttention-4 was not taken is logged once per reason; under `fa4` it is an error."""
    choice = attention_choice()
    if choice != "cudnn":
        why = _fa4_refuses(q)
        if why is None:
            if "used" not in _said:
                _said.add("used")
                log.info("causal attention of one-document rows on FlashAttention-4 "
                         "(%s=cudnn for cuDNN's)", ATTENTION_ENV)
            return Fa4Causal
        if choice == "fa4":
            raise EyasError(f"{ATTENTION_ENV}=fa4 but FlashAttention-4 cannot run these "
                            f"queries: {why} (unset {ATTENTION_ENV} to fall back to cuDNN)")
        if why not in _said and why not in (_NOT_IMPORTABLE, _failed):  # logged already
            _said.add(why)
            log.info("FlashAttention-4 not used: %s", why)
    return CudnnCausal if cudnn_fits(q) else None


def describe(heads: int, head_dim: int) -> str:
    """For `eyas doctor`: the kernel the causal band of a one-document row of a bf16 draft with
    these query heads runs on here, and why it is not FlashAttention-4."""
    try:
        choice = attention_choice()
        if not torch.cuda.is_available():
            return "no CUDA GPU here (CPU training runs the exact plain-torch band)"
        q = torch.empty(2, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        kernel = band_kernel(q)
    except EyasError as e:
        return f"error: {e}"
    if kernel is Fa4Causal:
        return f"FlashAttention-4 ({heads} heads x {head_dim})"
    name = "cuDNN" if kernel is CudnnCausal else "FlexAttention"
    if choice == "cudnn":
        return f"{name} ({ATTENTION_ENV}=cudnn)"
    return f"{name}; not FlashAttention-4: {_fa4_refuses(q)}"


def _fa4_refuses(q: torch.Tensor) -> str | None:
    """Why FlashAttention-4's backward cannot take these queries, or None when it can: half
    precision, more than one query, an NVIDIA GPU of compute capability 9.x (head dims 8..256,
    multiples of 8) or 10.x (head dims up to 128, or 256), and the package installed."""
    n, _, d = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (it takes bfloat16 / float16)"
    if d % 8 or d > 256 or n < 2:
        return f"head dim {d} / {n} queries (it takes head dims 8..256, multiples of 8)"
    if torch.version.hip is not None:
        return "not an NVIDIA GPU"
    major = torch.cuda.get_device_capability(q.device)[0]
    if major not in (9, 10):
        return f"compute capability {major}.x (it runs on 9.x and 10.x: Hopper, Blackwell B200)"
    if major == 10 and 128 < d < 256:
        return f"head dim {d} on compute capability 10.x (it takes up to 128, or 256)"
    if _fa4() is None:
        return _failed or _NOT_IMPORTABLE
    return None


def cudnn_fits(q: torch.Tensor) -> bool:
    """Whether cuDNN's fused attention takes these queries: half precision, head dim <= 128
    and a multiple of 8, more than one query, an NVIDIA GPU of compute capability 8.0+ with
    cuDNN, and cuDNN attention neither switched off
    (`torch.backends.cuda.enable_cudnn_sdp(False)`) nor excluded by deterministic mode: the
    private op called here skips the checks PyTorch's own dispatch makes."""
    n, _, d = q.shape
    return (q.dtype in (torch.bfloat16, torch.float16) and d <= 128 and d % 8 == 0 and n > 1
            and torch.version.hip is None and torch.backends.cudnn.is_available()
            and torch.backends.cuda.cudnn_sdp_enabled()
            and not torch.are_deterministic_algorithms_enabled()
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


def fa4_gives_way(band, e: Exception) -> bool:
    """Whether a kernel call that raised `e` is retried on another kernel: a FlashAttention-4
    call under EYAS_ATTENTION=auto that failed other than by running out of memory (a kernel
    that does not compile for this GPU, say). FlashAttention-4 is then off for the process
    (logged once)."""
    global _fa4_module, _failed
    if (not isinstance(band, Fa4Causal) or isinstance(e, torch.OutOfMemoryError)
            or attention_choice() != "auto"):
        return False
    if _fa4_module is not False:
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        _failed = f"it failed in this process ({error})"
        log.warning("FlashAttention-4 failed in this process (%s); cuDNN attention (or "
                    "FlexAttention) from now on (%s=cudnn skips it, =fa4 stops on such "
                    "errors)", error, ATTENTION_ENV)
    _fa4_module = False
    return True


class CudnnCausal:
    """Causal attention of q (N, hq, d) over k, v (N, hkv, d) through cuDNN's fused kernels
    (the module docstring's contract). cuDNN takes fewer K/V heads than query heads (GQA) and
    sums their gradients itself; a cuDNN that refuses them (older versions) gets K/V repeated
    to the query heads and the gradients summed back here."""

    gqa = True  # cleared (for the process) the first time cuDNN refuses GQA

    def __init__(self, q, k, v):
        self.q, self.k, self.v, self.hkv = q, k, v, k.shape[1]
        self.qt = q.transpose(0, 1)[None]  # (1, hq, N, d)
        self.kt, self.vt = (x.transpose(0, 1)[None] for x in (k, v))  # (1, hkv, N, d)

    def forward(self):
        if CudnnCausal.gqa and self.hkv != self.q.shape[1]:
            try:
                return self._forward()
            except torch.OutOfMemoryError:
                raise  # not a refusal: repeating K/V would need more memory still
            except RuntimeError as e:
                log.warning("cuDNN attention refused %d K/V heads for %d query heads (%s); "
                            "K/V are repeated to the query heads from now on (more memory)",
                            self.hkv, self.q.shape[1], str(e).splitlines()[0][:200])
                CudnnCausal.gqa = False
        if self.hkv != self.q.shape[1]:
            g = self.q.shape[1] // self.hkv
            self.kt, self.vt = (x.repeat_interleave(g, dim=1) for x in (self.kt, self.vt))
        return self._forward()

    def _forward(self):
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            self.qt, self.kt, self.vt, None, True, 0.0, True, False)
        out, lse = res[0], res[1]
        # the output's layout only (backward hands the kernel tensors laid out like it): the
        # band output itself is not kept
        self.out_layout = (out.shape, out.stride(), out.dtype, out.device)
        self.lse, self.extra = lse, res[2:8]
        n, hq = self.q.shape[:2]
        return out[0].transpose(0, 1), lse.reshape(hq, n).t().float()

    def backward(self, grad_band, merged):
        cq, ck, mq, mk, seed, offset = self.extra

        def like_out(x):  # (N, hq, d) -> the kernel's output layout (a copy only if it differs)
            shape, stride, dtype, device = self.out_layout
            view = x.transpose(0, 1)[None]
            if view.stride() == stride and view.dtype == dtype:
                return view
            return torch.empty_strided(shape, stride, dtype=dtype, device=device).copy_(view)

        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            like_out(grad_band), self.qt, self.kt, self.vt, like_out(merged), self.lse, seed,
            offset, None, cq, ck, mq, mk, 0.0, True)
        dk, dv = (x[0].transpose(0, 1) for x in (dk, dv))  # (N, heads, d)
        if dk.shape[1] != self.hkv:  # K/V were repeated: sum each group back
            n, heads, d = dk.shape
            dk, dv = (x.view(n, self.hkv, heads // self.hkv, d).sum(2) for x in (dk, dv))
        return dq[0].transpose(0, 1), dk, dv


class Fa4Causal:
    """The same contract on FlashAttention-4 (flash_attn.cute; on an H200 its backward took
    12-15 % less time than cuDNN's at 8K-32K tokens, docs/benchmarks.md). Its layout
    (1, N, heads, d) is eyas's (N, heads, d) with a batch dimension, so nothing is transposed;
    it takes fewer K/V heads than query heads itself. Its backward reads `out` only for
    rowsum(dO * out), as cuDNN's does. Under torch.use_deterministic_algorithms it runs its
    deterministic backward."""

    def __init__(self, q, k, v):
        self.q, self.k, self.v, self.hkv, self.fa4 = q, k, v, k.shape[1], _fa4()
        self.q4, self.k4, self.v4 = (x.contiguous()[None] for x in (q, k, v))

    def forward(self):
        out, lse = self.fa4._flash_attn_fwd(self.q4, self.k4, self.v4, causal=True,
                                            return_lse=True)[:2]
        self.lse = lse  # (1, hq, N) fp32, natural log as cuDNN's
        return out[0], lse[0].t()

    def backward(self, grad_band, merged):
        dq, dk, dv = self.fa4._flash_attn_bwd(
            self.q4, self.k4, self.v4, merged.contiguous()[None], grad_band.contiguous()[None],
            self.lse, causal=True, deterministic=torch.are_deterministic_algorithms_enabled())[:3]
        return dq[0], dk[0], dv[0]
