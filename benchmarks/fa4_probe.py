"""FlashAttention-4 (flash_attn.cute) against the cuDNN attention ops eyas calls, kernels
alone: bf16, 32 query / 8 K/V heads, d 128, causal, batch 1 (an 8B draft's attention). The
backward gets a *different* O (a stand-in for eyas's merged output) plus the forward's LSE,
as eyas.kernels.band_kernels does. Prints relative differences and mean ms of forward / backward.

    pip install 'eyas[fa4]'
    python benchmarks/fa4_probe.py 8192 32768     # contexts; results/fa4-probe-h200-session7.txt
"""
import sys
import time

import torch
from flash_attn.cute.interface import _flash_attn_fwd, _flash_attn_bwd

bf, dev = torch.bfloat16, "cuda"
print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), "native dlpack api",
      hasattr(torch.Tensor, "__dlpack_c_exchange_api__"), flush=True)


def ms(fn, reps=10):  # mean ms of reps calls after 2 warm-ups, CUDA events
    for _ in range(2):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def rel(x, y):
    return ((x.float() - y.float()).norm() / y.float().norm()).item()


def probe(n):
    torch.manual_seed(0)
    q = torch.randn(1, n, 32, 128, device=dev, dtype=bf)  # FA4 layout (B, S, H, D) = eyas q[None]
    k, v = (torch.randn(1, n, 8, 128, device=dev, dtype=bf) for _ in range(2))
    t = time.time(); o, lse, *_ = _flash_attn_fwd(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize(); jit_f = time.time() - t
    merged = (0.8 * o.float() + 0.2 * torch.randn_like(o, dtype=torch.float)).to(bf)  # "different O"
    do = torch.randn_like(o)
    t = time.time(); dq, dk, dv = _flash_attn_bwd(q, k, v, merged, do, lse, causal=True)
    torch.cuda.synchronize(); jit_b = time.time() - t
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (1, H, S, D) views, as eyas passes them
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(qt, kt, vt, None, True, 0.0, True, False)
    oc, lc, (cq, ck, mq, mk, seed, off) = res[0], res[1], res[2:8]
    mt, dot = (torch.empty_strided(oc.shape, oc.stride(), dtype=bf, device=dev).copy_(x.transpose(1, 2))
               for x in (merged, do))  # in cuDNN's output layout, as eyas's like_out()
    cud_b = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dot, qt, kt, vt, mt, lc, seed, off, None, cq, ck, mq, mk, 0.0, True)
    gq, gk, gv = cud_b()
    print(f"N={n} jit fwd {jit_f:.1f}s bwd {jit_b:.1f}s | rel err fa4 vs cudnn: out {rel(o, oc.transpose(1, 2)):.1e}"
          f" lse {rel(lse[0], lc.reshape(32, n)):.1e} dq {rel(dq, gq.transpose(1, 2)):.1e}"
          f" dk {rel(dk, gk.transpose(1, 2)):.1e} dv {rel(dv, gv.transpose(1, 2)):.1e}", flush=True)
    f_fa = ms(lambda: _flash_attn_fwd(q, k, v, causal=True, return_lse=True))
    f_cu = ms(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(qt, kt, vt, None, True, 0.0, True, False))
    b_fa = ms(lambda: _flash_attn_bwd(q, k, v, merged, do, lse, causal=True))
    b_det = ms(lambda: _flash_attn_bwd(q, k, v, merged, do, lse, causal=True, deterministic=True))
    b_cu = ms(cud_b)
    print(f"N={n} fwd ms fa4 {f_fa:.2f} cudnn {f_cu:.2f} | bwd ms fa4 {b_fa:.2f} (det {b_det:.2f}) cudnn {b_cu:.2f}"
          f" | peak GiB {torch.cuda.max_memory_allocated() / 2**30:.1f}", flush=True)


for n in [int(a) for a in sys.argv[1:]] or (8192, 32768, 65536):
    probe(n)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
