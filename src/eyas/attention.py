"""Draft attention: one path for eval and for every TTT step.

Query n sees keys `lo[n]..hi[n]` of one key sequence (causal within its packed document, or
cache + causal at eval) plus, during TTT, the keys its own position produced at earlier
steps (the "diagonal"), merged by log-sum-exp. The band part runs on FlexAttention with a
block-sparse mask on CUDA; on CPU (where FlexAttention has no backward) it runs an exact
chunked reference of the same band. Scores never exist beyond one (query chunk, band) tile.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import torch
import torch.nn.functional as F

from eyas import fused
from eyas.fused import cuda_compiled

log = logging.getLogger(__name__)

BLOCK = 128  # FlexAttention sparse block size; sequences are padded to a multiple of it


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
        g = hq // hkv  # query heads per kv head
        merged = _DiagMerge.apply(q.view(n, hkv, g, d), diag_k, diag_v,
                                  out.view(n, hkv, g, d), lse.view(n, hkv, g))
        return merged.reshape(n, hq, d)


class _DiagMerge(torch.autograd.Function):
    """The band's output and log-sum-exp merged with the diagonal keys (_merge), with the
    gradients of all five inputs, the LSE's included, from _merge_backward."""

    @staticmethod
    def forward(ctx, q, diag_k, diag_v, out_b, lse):
        # q, out_b (N, hkv, G, d); diag_k, diag_v (S, N, hkv, d); lse (N, hkv, G) fp32
        merged, w_band, w_diag = _merge(q, diag_k, diag_v, out_b, lse)
        ctx.save_for_backward(q, diag_k, diag_v, out_b, merged, w_band, w_diag)
        return merged

    @staticmethod
    def backward(ctx, grad):
        q, diag_k, diag_v, out_b, merged, w_band, w_diag = ctx.saved_tensors
        grad_band, dq, d_diag_k, d_diag_v, d_lse = _merge_backward(
            grad.contiguous(), merged, w_band, w_diag, q, diag_k, diag_v, out_b)
        return dq.to(q.dtype), d_diag_k, d_diag_v, grad_band, d_lse


def _merge(q, diag_k, diag_v, out_b, lse):
    """_merge_diag with the diagonal as TTT stacks it, (S, N, hkv, d): on CUDA one Triton
    kernel (eyas.attention_kernels), else the torch function."""
    if fused.use_kernels(q):
        from eyas import attention_kernels

        return attention_kernels.merge_diag(q, diag_k, diag_v, out_b, lse)
    return _merge_diag(q, diag_k.transpose(0, 1), diag_v.transpose(0, 1), out_b, lse)


def _merge_backward(grad, merged, w_band, w_diag, q, diag_k, diag_v, out_b=None):
    """_merge_diag_backward likewise, the diagonal's gradients in (S, N, hkv, d)."""
    if fused.use_kernels(q):
        from eyas import attention_kernels

        return attention_kernels.merge_diag_backward(grad, merged, w_band, w_diag, q, diag_k,
                                                     diag_v, out_b)
    out = _merge_diag_backward(grad, merged, w_band, w_diag, q, diag_k.transpose(0, 1),
                               diag_v.transpose(0, 1), out_b)
    return (out[0], out[1], out[2].transpose(0, 1), out[3].transpose(0, 1), *out[4:])


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


# ------------------------------------------------------------ one causal document, fast

def causal_attention(q, k, v, diag_k=None, diag_v=None, rows=None, span=None) -> torch.Tensor:
    """`attention` for queries of a single document: query i is key position i (or rows[i])
    and sees keys 0..that position, plus its diagonal keys. The same result, with the band
    on cuDNN's fused attention (CUDA; about twice FlexAttention's rate at 8K-32K tokens on
    an H200, benchmarks/kernels.py) and no block mask to build.

    q (N, hq, d); k, v (M >= N, hkv, d); diag_k, diag_v (S, N, hkv, d) or None. rows (N,)
    ascending positions < span, when the queries are not simply positions 0..N-1: they are
    placed at their positions among span zero queries, and only theirs are returned (the
    zero queries get no gradient, so they change nothing).

    The diagonal merge needs the gradient of the band's log-sum-exp, which fused kernels do
    not take. It is folded into their backward instead: with out = w_band * o_band +
    sum_s w_s v_s, the band's score gradient is P * (dP - D) with dO_band = w_band * dO and
    D = rowsum(dO_band * out), i.e. the kernel's own backward fed the merged `out` in place
    of o_band. The diagonal part is differentiated here by hand. Tested against the
    autograd-through-LSE path (tests/test_ttt.py) on CPU, where a plain-torch band of the
    same algebra stands in for the fused kernel.
    """
    if rows is not None:
        placed = q.new_zeros(span, *q.shape[1:]).index_copy(0, rows, q)
        if diag_k is not None:
            diag_k, diag_v = (x.new_zeros(x.shape[0], span, *x.shape[2:]).index_copy(1, rows, x)
                              for x in (diag_k, diag_v))
        return causal_attention(placed, k, v, diag_k, diag_v).index_select(0, rows)
    n, _, d = q.shape
    if q.device.type == "cuda" and band_kernel(q) is None:
        idx = torch.arange(n, device=q.device)
        return attention(q, k, v, torch.zeros_like(idx), idx, diag_k, diag_v)
    with torch.autocast(q.device.type, enabled=False):
        if k.shape[0] > n:  # a slice only when needed: even a whole one costs backward a copy
            k, v = k[:n], v[:n]
        return _CausalDiag.apply(q, k, v, diag_k, diag_v)


ATTENTION_ENV = "EYAS_ATTENTION"  # auto (default) | fa4 | cudnn
_fa4_module = None  # flash_attn.cute.interface once imported; False when it does not import


def _fa4():
    """FlashAttention-4's interface module (`pip install 'eyas[fa4]'`), or None when it does
    not import (imported once per process; the reason is logged once)."""
    global _fa4_module
    if _fa4_module is None:
        try:
            module = importlib.import_module("flash_attn.cute.interface")
            if not all(hasattr(module, f) for f in ("_flash_attn_fwd", "_flash_attn_bwd")):
                raise ImportError("it lacks _flash_attn_fwd / _flash_attn_bwd (eyas[fa4] pins "
                                  "the version eyas was measured with)")
            _fa4_module = module
        except Exception as e:  # ImportError, or a missing CUDA library / driver inside it
            log.info("FlashAttention-4 not used (%s: %s); cuDNN attention instead",
                     type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            _fa4_module = False
    return _fa4_module or None


def _attention_choice() -> str:
    choice = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "fa4", "cudnn"):
        raise ValueError(f"{ATTENTION_ENV}={choice!r}: expected auto, fa4 or cudnn")
    return choice


def _fa4_failed(band, q, e: Exception) -> bool:
    """Whether a FlashAttention-4 call that raised `e` gives way to cuDNN: under
    EYAS_ATTENTION=auto, for a failure other than running out of memory, where cuDNN takes q.
    FlashAttention-4 is then off for the process (logged once)."""
    global _fa4_module
    if (not isinstance(band, _Fa4Causal) or isinstance(e, torch.OutOfMemoryError)
            or _attention_choice() != "auto" or not _cudnn_fits(q)):
        return False
    log.warning("FlashAttention-4 failed (%s: %s); cuDNN attention from now on (set "
                "%s=cudnn to skip it, or =fa4 to stop on such errors)", type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "", ATTENTION_ENV)
    _fa4_module = False
    return True


def band_kernel(q: torch.Tensor):
    """The fused kernel class for the causal band of CUDA queries q (N, hq, d), or None when
    neither takes them (causal_attention then runs FlexAttention, same result).

    EYAS_ATTENTION chooses: `auto` (default) takes FlashAttention-4 when it is installed and
    takes q, else cuDNN; `fa4` requires FlashAttention-4 (an error says why it cannot run);
    `cudnn` never uses it."""
    choice = _attention_choice()
    if choice != "cudnn":
        why = _fa4_refuses(q)
        if why is None:
            return _Fa4Causal
        if choice == "fa4":
            raise RuntimeError(f"{ATTENTION_ENV}=fa4 but FlashAttention-4 cannot run these "
                               f"queries: {why} (unset {ATTENTION_ENV} to fall back to cuDNN)")
    return _CudnnCausal if _cudnn_fits(q) else None


def _fa4_refuses(q: torch.Tensor) -> str | None:
    """Why FlashAttention-4's backward cannot take these queries, or None when it can: half
    precision, head dim a multiple of 8 up to 256, more than one query, an NVIDIA GPU of
    compute capability 9.x or 10.x, and the package installed."""
    n, _, d = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (it takes bfloat16 / float16)"
    if d % 8 or d > 256 or n < 2:
        return f"head dim {d} / {n} queries (it takes head dims 8..256, multiples of 8)"
    if torch.version.hip is not None or torch.cuda.get_device_capability(q.device)[0] not in (9, 10):
        return "not an NVIDIA GPU of compute capability 9.x or 10.x (Hopper, Blackwell)"
    if _fa4() is None:
        return "flash_attn.cute does not import (pip install 'eyas[fa4]')"
    return None


def _cudnn_fits(q: torch.Tensor) -> bool:
    """Whether cuDNN's fused attention takes these queries: half precision, head dim <= 128
    and a multiple of 8, more than one query, an NVIDIA GPU of compute capability 8.0+ with
    cuDNN, and cuDNN attention neither switched off
    (`torch.backends.cuda.enable_cudnn_sdp(False)`) nor excluded by deterministic mode: the
    private op called here skips the checks PyTorch's own dispatch makes. Anything else takes
    the FlexAttention band, which gives the same result."""
    n, _, d = q.shape
    return (q.dtype in (torch.bfloat16, torch.float16) and d <= 128 and d % 8 == 0 and n > 1
            and torch.version.hip is None and torch.backends.cudnn.is_available()
            and torch.backends.cuda.cudnn_sdp_enabled()
            and not torch.are_deterministic_algorithms_enabled()
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


class _CausalDiag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, diag_k, diag_v):
        n, hq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        band = band_kernel(q)(q, k, v) if q.device.type == "cuda" else _ReferenceCausal(q, k, v)
        try:
            out_b, lse = band.forward()  # (N, hq, d), (N, hq) fp32
        except Exception as e:
            if not _fa4_failed(band, q, e):
                raise
            band = _CudnnCausal(q, k, v)
            out_b, lse = band.forward()
        if diag_k is None:
            merged, w_band, w_diag = out_b, None, None
        else:
            merged, w_band, w_diag = _merge(q.view(n, hkv, g, d), diag_k, diag_v,
                                            out_b.view(n, hkv, g, d), lse.view(n, hkv, g))
            merged = merged.view(n, hq, d)
        ctx.band = band
        ctx.save_for_backward(merged, w_band, w_diag, diag_k, diag_v)
        return merged

    @staticmethod
    def backward(ctx, grad):
        merged, w_band, w_diag, diag_k, diag_v = ctx.saved_tensors
        band = ctx.band
        n, hq, d = merged.shape
        hkv = band.hkv
        g = hq // hkv
        if w_band is None:
            dq, dk, dv = band.backward(grad, merged)
            return dq, dk, dv, None, None
        grad_band, dq_diag, d_diag_k, d_diag_v = _merge_backward(
            grad.view(n, hkv, g, d), merged.view(n, hkv, g, d), w_band, w_diag,
            band.q.view(n, hkv, g, d), diag_k, diag_v)
        dq, dk, dv = band.backward(grad_band.view(n, hq, d), merged)
        dq = _add_in_fp32(dq, dq_diag.view(n, hq, d))
        return dq, dk, dv, d_diag_k, d_diag_v


# The diagonal merge as two torch functions: the CPU path and the reference of the Triton
# kernels CUDA runs (eyas.attention_kernels; compiled, these reached a fraction of the memory
# bandwidth, ~10 ms of a TTT-7 iteration at 8K on an H200). Their products contract over
# d = 128 or over S <= 7 keys per query: as einsums under torch.compile they become batched
# GEMMs of 4 x 128 x S tiles on CUDA cores, so compiled they are written as broadcast
# multiply + sum (_contract). Rows (N) come first so only they are a dynamic dimension.
# fp32 throughout.

def _contract(eq: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.einsum(eq, a, b) for two operands. Under torch.compile: the operands lined up
    by broadcasting and multiplied, the contracted letters summed (one fused kernel, no
    (N, S, hkv, G, d) product in memory); eagerly einsum itself, which never forms that
    product either."""
    if not torch.compiler.is_compiling():
        return torch.einsum(eq, a, b)
    specs, out = eq.split("->")
    order = list(out) + [c for c in dict.fromkeys(specs.replace(",", "")) if c not in out]

    def lined_up(x, spec):  # x's dims in `order`, size-1 dims for the letters it lacks
        x = x.permute(*sorted(range(len(spec)), key=lambda i: order.index(spec[i])))
        return x[tuple(slice(None) if c in spec else None for c in order)]

    a_spec, b_spec = specs.split(",")
    return (lined_up(a, a_spec) * lined_up(b, b_spec)).sum(tuple(range(len(out), len(order))))


@cuda_compiled
def _merge_diag(q, diag_k, diag_v, out_b, lse):
    """q, out_b (N, hkv, G, d); diag_k, diag_v (N, S, hkv, d); lse (N, hkv, G) fp32 ->
    merged (N, hkv, G, d) in q's dtype, the band's weight (N, hkv, G) and the diagonal keys'
    weights (N, hkv, G, S), fp32: softmax over [band, diagonal keys] through the band's LSE."""
    d = q.shape[-1]
    scores = _contract("nkgd,nskd->nkgs", q.float(), diag_k.float()) * d ** -0.5
    top = torch.maximum(lse, scores.amax(-1))
    w_band, w_diag = (lse - top).exp(), (scores - top[..., None]).exp()
    total = w_band + w_diag.sum(-1)
    w_band, w_diag = w_band / total, w_diag / total[..., None]
    mix = _contract("nkgs,nskd->nkgd", w_diag, diag_v.float())
    return (out_b.float() * w_band[..., None] + mix).to(q.dtype), w_band, w_diag


@cuda_compiled
def _merge_diag_backward(grad, merged, w_band, w_diag, q, diag_k, diag_v, out_b=None):
    """grad, merged, q (N, hkv, G, d); w_band (N, hkv, G), w_diag (N, hkv, G, S) from
    _merge_diag; diag_k, diag_v (N, S, hkv, d) -> the band's output gradient w_band * dO (in
    grad's dtype), the diagonal part of dq (N, hkv, G, d) fp32, d diag_k, d diag_v
    (N, S, hkv, d), and with the band output out_b also the LSE's gradient (N, hkv, G).
    Softmax backward over [band, diagonal keys]: ds = p * (dO . v_s - dO . out)."""
    d = q.shape[-1]
    g = grad.float()
    d_out = (g * merged.float()).sum(-1)  # (N, hkv, G)
    dov = _contract("nkgd,nskd->nkgs", g, diag_v.float())
    ds = w_diag * (dov - d_out[..., None]) * d ** -0.5  # (N, hkv, G, S)
    dq = _contract("nkgs,nskd->nkgd", ds, diag_k.float())
    d_diag_k = _contract("nkgs,nkgd->nskd", ds, q.float())
    d_diag_v = _contract("nkgs,nkgd->nskd", w_diag, g)
    grads = ((g * w_band[..., None]).to(grad.dtype), dq, d_diag_k.to(diag_k.dtype),
             d_diag_v.to(diag_v.dtype))
    if out_b is None:
        return grads
    return (*grads, w_band * ((g * out_b.float()).sum(-1) - d_out))


@cuda_compiled
def _add_in_fp32(a, b):
    """a + b summed in fp32, in a's dtype (one kernel on CUDA rather than three passes)."""
    return (a.float() + b.float()).to(a.dtype)


class _CudnnCausal:
    """Causal attention of q (N, hq, d) over k, v (N, hkv, d) through cuDNN's fused kernels,
    forward returning the log-sum-exp, backward taking the `out` whose rowsum(dO * out) it
    uses (see causal_attention). cuDNN takes fewer K/V heads than query heads (GQA) and sums
    their gradients itself; a cuDNN that refuses them (older versions) gets K/V repeated to
    the query heads and the gradients summed back here."""

    gqa = True  # cleared (for the process) the first time cuDNN refuses GQA

    def __init__(self, q, k, v):
        self.q, self.hkv = q, k.shape[1]
        self.qt = q.transpose(0, 1)[None]  # (1, hq, N, d)
        self.kt, self.vt = (x.transpose(0, 1)[None] for x in (k, v))  # (1, hkv, N, d)

    def forward(self):
        if _CudnnCausal.gqa and self.hkv != self.q.shape[1]:
            try:
                return self._forward()
            except torch.OutOfMemoryError:
                raise  # not a refusal: repeating K/V would need more memory still
            except RuntimeError as e:
                log.warning("cuDNN attention refused %d K/V heads for %d query heads (%s); "
                            "K/V are repeated to the query heads from now on (more memory)",
                            self.hkv, self.q.shape[1], str(e).splitlines()[0][:200])
                _CudnnCausal.gqa = False
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


class _Fa4Causal:
    """_CudnnCausal's contract on FlashAttention-4 (flash_attn.cute; on an H200 its backward
    took 12 % less time than cuDNN's at 8K-32K tokens, docs/benchmarks.md). Its layout
    (1, N, heads, d) is eyas's (N, heads, d) with a batch dimension, so nothing is transposed;
    it takes fewer K/V heads than query heads itself. Its backward reads `out` only for
    rowsum(dO * out), as cuDNN's does, so the merged output goes there. Under
    torch.use_deterministic_algorithms it runs its deterministic backward. A backward that
    fails gives way to cuDNN's (which then runs its own forward first) as `_fa4_failed` says."""

    def __init__(self, q, k, v):
        self.q, self.hkv, self.fa4 = q, k.shape[1], _fa4()
        self.q4, self.k4, self.v4 = (x.contiguous()[None] for x in (q, k, v))

    def forward(self):
        out, lse = self.fa4._flash_attn_fwd(self.q4, self.k4, self.v4, causal=True,
                                            return_lse=True)[:2]
        self.lse = lse  # (1, hq, N) fp32, natural log as cuDNN's
        return out[0], lse[0].t()

    def backward(self, grad_band, merged):
        try:
            dq, dk, dv = self.fa4._flash_attn_bwd(
                self.q4, self.k4, self.v4, merged.contiguous()[None],
                grad_band.contiguous()[None], self.lse, causal=True,
                deterministic=torch.are_deterministic_algorithms_enabled())[:3]
        except Exception as e:
            if not _fa4_failed(self, self.q, e):
                raise
            cudnn = _CudnnCausal(self.q, self.k4[0], self.v4[0])
            cudnn.forward()
            return cudnn.backward(grad_band, merged)
        return dq[0], dk[0], dv[0]


class _ReferenceCausal:
    """The same contract as _CudnnCausal in plain torch (CPU): exact, chunked over queries."""

    def __init__(self, q, k, v, chunk: int = 1024):
        self.q, self.k, self.v, self.hkv, self.chunk = q, k, v, k.shape[1], chunk

    def forward(self):
        n = self.q.shape[0]
        idx = torch.arange(n, device=self.q.device)
        out, self.lse = _band_reference(self.q, self.k, self.v, torch.zeros_like(idx), idx,
                                        self.chunk)
        return out, self.lse

    def backward(self, grad_band, merged):
        q, k, v = self.q, self.k, self.v
        n, hq, d = q.shape
        g = hq // self.hkv
        dev = q.device
        dq = torch.empty(n, self.hkv, g, d, device=dev)
        dk, dv = (torch.zeros(n, self.hkv, d, device=dev) for _ in range(2))
        kf, vf = k.float(), v.float()
        for s in range(0, n, self.chunk):
            e = min(n, s + self.chunk)
            qc = q[s:e].float().view(-1, self.hkv, g, d)
            do = grad_band[s:e].float().view(-1, self.hkv, g, d)
            scores = torch.einsum("ckgd,jkd->ckgj", qc, kf[:e]) * d ** -0.5
            seen = torch.arange(e, device=dev)[None, :] <= \
                torch.arange(s, e, device=dev)[:, None]  # (C, e)
            p = (scores - self.lse[s:e].view(-1, self.hkv, g, 1)).exp() * seen[:, None, None]
            dp = torch.einsum("ckgd,jkd->ckgj", do, vf[:e])
            big_d = (do * merged[s:e].float().view(-1, self.hkv, g, d)).sum(-1, keepdim=True)
            ds = p * (dp - big_d) * d ** -0.5
            dq[s:e] = torch.einsum("ckgj,jkd->ckgd", ds, kf[:e])
            dk[:e] += torch.einsum("ckgj,ckgd->jkd", ds, qc)
            dv[:e] += torch.einsum("ckgj,ckgd->jkd", p, do)
        return dq.view(n, hq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
