"""Draft attention: one path for eval and for every TTT step.

Query n sees keys `lo[n]..hi[n]` of one key sequence (causal within its packed document, or
cache + causal at eval) plus, during TTT, the keys its own position produced at earlier
steps (the "diagonal"), merged by log-sum-exp. The band part runs on FlexAttention with a
block-sparse mask on CUDA; on CPU (where FlexAttention has no backward) it runs an exact
chunked reference of the same band. Scores never exist beyond one (query chunk, band) tile.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from eyas.kernels import fused
from eyas.kernels.band_kernels import CudnnCausal, band_kernel, cudnn_fits, fa4_gives_way
from eyas.kernels.fused import cuda_compiled

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
    kernel (eyas.kernels.attention_kernels), else the torch function."""
    if fused.use_kernels(q):
        from eyas.kernels import attention_kernels

        return attention_kernels.merge_diag(q, diag_k, diag_v, out_b, lse)
    return _merge_diag(q, diag_k.transpose(0, 1), diag_v.transpose(0, 1), out_b, lse)


def _merge_backward(grad, merged, w_band, w_diag, q, diag_k, diag_v, out_b=None):
    """_merge_diag_backward likewise, the diagonal's gradients in (S, N, hkv, d)."""
    if fused.use_kernels(q):
        from eyas.kernels import attention_kernels

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


# torch.compile makes a FlexAttention graph for each layout it meets (dtype, heads, grad or
# not, a fixed then a dynamic length), and past dynamo's limit of 8 per function it runs flex
# eagerly: the unfused implementation, every score in memory (N^2), and an error inside a
# CUDA graph's capture. Eight is soon spent by one process that trains and evaluates several
# models (`pytest -m gpu` on an H100, session 48: the TTT graph tests, run after the other
# GPU tests, failed so); flex's calls get a limit of their own.
FLEX_RECOMPILE_LIMIT = 64


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return _own_recompile_limit(torch.compile(flex_attention), FLEX_RECOMPILE_LIMIT)


def _own_recompile_limit(compiled, limit: int):
    """`compiled` (a torch.compile'd function) called with dynamo's per-function recompile
    limit raised to `limit` (never lowered); inside a compiled caller, the caller's."""
    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") \
        else "cache_size_limit"  # torch < 2.6

    @functools.wraps(compiled)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():
            return compiled(*args, **kwargs)
        with torch._dynamo.config.patch(**{name: max(getattr(torch._dynamo.config, name),
                                                     limit)}):
            return compiled(*args, **kwargs)

    return run


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
    an H200, benchmarks/kernel_ceilings.py) and no block mask to build.

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
    kernel = band_kernel(q) if q.device.type == "cuda" else _ReferenceCausal
    if kernel is None:  # no fused kernel takes q
        idx = torch.arange(n, device=q.device)
        return attention(q, k, v, torch.zeros_like(idx), idx, diag_k, diag_v)
    with torch.autocast(q.device.type, enabled=False):
        if k.shape[0] > n:  # a slice only when needed: even a whole one costs backward a copy
            k, v = k[:n], v[:n]
        return _CausalDiag.apply(q, k, v, diag_k, diag_v, kernel)


def _fallback_band(q, k, v):
    """The band's kernel once FlashAttention-4 has failed: cuDNN where it takes q, else the
    exact reference (FlexAttention needs a block mask this path does not build)."""
    return CudnnCausal(q, k, v) if cudnn_fits(q) else _ReferenceCausal(q, k, v)


def _band_forward(band):
    """(band, its forward's out and LSE), or, where its FlashAttention-4 forward failed and
    gives way, the fallback kernel and its forward's."""
    try:
        return band, *band.forward()
    except Exception as e:
        if not fa4_gives_way(band, e):
            raise
        band = _fallback_band(band.q, band.k, band.v)
        return band, *band.forward()


def _band_backward(band, grad_band, merged):
    """band.backward, or, where its FlashAttention-4 backward failed and gives way, the
    fallback kernel's forward (for its own statistics) and backward."""
    try:
        return band.backward(grad_band, merged)
    except Exception as e:
        if not fa4_gives_way(band, e):
            raise
        band = _fallback_band(band.q, band.k, band.v)
        band.forward()
        return band.backward(grad_band, merged)


class _CausalDiag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, diag_k, diag_v, kernel):
        n, hq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        band, out_b, lse = _band_forward(kernel(q, k, v))  # (N, hq, d), (N, hq) fp32
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
            dq, dk, dv = _band_backward(band, grad, merged)
            return dq, dk, dv, None, None, None
        grad_band, dq_diag, d_diag_k, d_diag_v = _merge_backward(
            grad.view(n, hkv, g, d), merged.view(n, hkv, g, d), w_band, w_diag,
            band.q.view(n, hkv, g, d), diag_k, diag_v)
        dq, dk, dv = _band_backward(band, grad_band.view(n, hq, d), merged)
        dq = _add_in_fp32(dq, dq_diag.view(n, hq, d))
        return dq, dk, dv, d_diag_k, d_diag_v, None


# The diagonal merge as two torch functions: the CPU path and the reference of the Triton
# kernels CUDA runs (eyas.kernels.attention_kernels; compiled, these reached a fraction of the memory
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


class _ReferenceCausal:
    """eyas.kernels.band_kernels' contract in plain torch: exact, chunked over queries. The CPU path,
    and on CUDA the fallback where a failed FlashAttention-4 call has no cuDNN to go to."""

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


# ------------------------------------------------------------ DFlash: band + own block

def block_attention(q, k, v, lo, hi, block_k, block_v, block: int) -> torch.Tensor:
    """DFlash's attention: query n sees keys lo[n]..hi[n] of (k, v) (the target context before
    its block's anchor, inclusive bounds, lo <= hi) and, bidirectionally, all `block` keys of
    its own block in (block_k, block_v), never another block's.

    q (N, hq, d) with N = blocks * block, queries ordered block by block; k, v (M, hkv, d);
    block_k, block_v (N, hkv, d) in q's order. The context band runs through the same kernel
    as `attention` (FlexAttention on CUDA, the chunked reference on CPU) and returns its
    log-sum-exp; the (block x block) scores of each block are small and merged with it.
    Serving (inference mode: a handful of queries over a cache whose length changes at every
    call, which would make compiled FlexAttention recompile) runs the exact reference there
    too. Returns (N, hq, d) in q's dtype.
    """
    with torch.autocast(q.device.type, enabled=False):
        flex = q.device.type == "cuda" and not torch.is_inference_mode_enabled()
        core = _band_flex if flex else _band_reference
        out_c, lse_c = core(q, k, v, lo, hi)  # (N, hq, d), (N, hq) fp32
        n, hq, d = q.shape
        hkv = block_k.shape[1]
        g, nb = hq // hkv, n // block
        qb = q.float().view(nb, block, hkv, g, d)
        kb, vb = (t.float().view(nb, block, hkv, d) for t in (block_k, block_v))
        scores = torch.einsum("nikgd,njkd->nkgij", qb, kb) * d ** -0.5  # (nb, hkv, G, B, B)
        lse_b = scores.logsumexp(-1)  # (nb, hkv, G, B)
        out_b = torch.einsum("nkgij,njkd->nikgd", (scores - lse_b[..., None]).exp(), vb)
        lse_b = lse_b.permute(0, 3, 1, 2).reshape(n, hq)
        lse = torch.logaddexp(lse_c, lse_b)
        out = ((lse_c - lse).exp()[..., None] * out_c.float()
               + (lse_b - lse).exp()[..., None] * out_b.reshape(n, hq, d))
        return out.to(q.dtype)
