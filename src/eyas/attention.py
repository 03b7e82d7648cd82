"""Draft attention: one path for eval and for every TTT step.

Query n sees keys `lo[n]..hi[n]` of one key sequence (causal within its packed document, or
cache + causal at eval) plus, during TTT, the keys its own position produced at earlier
steps (the "diagonal"), merged by log-sum-exp. The band part runs on FlexAttention with a
block-sparse mask on CUDA; on CPU (where FlexAttention has no backward) it runs an exact
chunked reference of the same band. Scores never exist beyond one (query chunk, band) tile.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

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
        qg = q.view(n, hkv, hq // hkv, d)  # (N, hkv, G, d): G query heads per kv head
        scores = _DiagScores.apply(qg, diag_k) * d ** -0.5  # (N, hkv, G, S) fp32
        lse = lse.view(n, hkv, hq // hkv)
        top = torch.maximum(lse, scores.amax(-1))  # (N, hkv, G)
        w_band = (lse - top).exp()
        w_diag = (scores - top[..., None]).exp()
        total = w_band + w_diag.sum(-1)
        w_band, w_diag = (w_band / total).to(q.dtype), (w_diag / total[..., None]).to(q.dtype)
        mixed = out.view(n, hkv, hq // hkv, d) * w_band[..., None] + \
            torch.einsum("nkgs,snkd->nkgd", w_diag, diag_v.to(q.dtype))
        return mixed.reshape(n, hq, d)


class _DiagScores(torch.autograd.Function):
    """scores[n,k,g,s] = q[n,k,g,:] . diag_k[s,n,k,:] in fp32, saving the (bf16) inputs for
    backward instead of fp32 copies (at 64K tokens those would be GiBs per step)."""

    @staticmethod
    def forward(ctx, q, diag_k):  # q (N, hkv, G, d); diag_k (S, N, hkv, d)
        ctx.save_for_backward(q, diag_k)
        return torch.einsum("nkgd,snkd->nkgs", q.float(), diag_k.float())

    @staticmethod
    def backward(ctx, grad):  # grad (N, hkv, G, S) fp32
        q, diag_k = ctx.saved_tensors
        grad_q = torch.einsum("nkgs,snkd->nkgd", grad, diag_k.float()).to(q.dtype)
        grad_k = torch.einsum("nkgs,nkgd->snkd", grad, q.float()).to(diag_k.dtype)
        return grad_q, grad_k


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
