"""Ceilings for the TTT benchmark: what the GPU does with the draft's matmuls and attention
alone, and where one TTT iteration spends its time.

    python benchmarks/kernel_ceilings.py                  # H200: GEMMs, attention backends, profile
    python benchmarks/kernel_ceilings.py --only gemm --contexts 2048,8192
    python benchmarks/kernel_ceilings.py --profile-context 2048 --trace /tmp/ttt-trace.json

gemm       every matmul of a Llama-3.1-8B-shaped draft step (fc, qkv, o, gate_up, down,
           lm_head) at M = context rows, forward and both backward products, bf16 and fp8
           (torch._scaled_mm, tensor-wise and row-wise scales): TFLOP/s each, and the time the
           whole TTT-7 iteration's matmuls need at that rate (its tokens/s ceiling).
attention  causal attention fwd+bwd (32 query heads, 8 KV heads, head dim 128): eyas's band
           FlexAttention (with the log-sum-exp gradient TTT needs) against SDPA's flash and
           cuDNN backends: TFLOP/s.
profile    one TTT-7 fwd+bwd of eyas (frozen lm_head, all-ones mask) under torch.profiler:
           the kernels by GPU time (from the GPU's records: each kernel once), the GPU's busy
           time against the wall time, and the host time to queue one iteration (host_ms
           close to wall_ms: the CPU, not the GPU, bounds the step). --graph: the iteration
           replayed from a CUDA graph (eyas train --cuda-graph), the GPU's work without the
           gaps of queueing it (host_ms is then the replay's).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

H, HQ, HKV, D, INTER, VD, HT = 4096, 32, 8, 128, 14336, 32000, 4096
# (name, in features, out features, applications per TTT-7 iteration, weight trained)
MATMULS = [("fc", 3 * HT, H, 1, True), ("qkv", 2 * H, (HQ + 2 * HKV) * D, 7, True),
           ("o", HQ * D, H, 7, True), ("gate_up", H, 2 * INTER, 7, True),
           ("down", INTER, H, 7, True), ("lm_head", H, VD, 7, False),
           ("teacher", HT, VD, 1, None)]


def bench(fn, iters: int = 10, warmup: int = 3) -> float:
    """Seconds per call (CUDA events, mean over iters after warmup)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def fp8(x: torch.Tensor, rowwise: bool):
    """x -> (e4m3 copy, fp32 scale): per row (R, 1) or one scalar."""
    amax = x.abs().amax(-1, keepdim=True) if rowwise else x.abs().amax()
    scale = (amax.float().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max)
    return (x / scale).to(torch.float8_e4m3fn), scale


def gemm(contexts: list[int]) -> list[dict]:
    rows = []
    for m in contexts:
        total = {"bf16": 0.0, "fp8_tensor": 0.0, "fp8_row": 0.0}
        for name, k, n, uses, trained in MATMULS:
            # the products of one linear: y = x W^T (M,K)x(K,N); dx = dy W (M,N)x(N,K);
            # dW = dy^T x (N,M)x(M,K)
            products = [("fwd", m, k, n)]
            if trained is not None:
                products.append(("dx", m, n, k))
            if trained:
                products.append(("dw", n, m, k))
            for what, a_rows, inner, b_cols in products:
                a = torch.randn(a_rows, inner, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(b_cols, inner, device="cuda", dtype=torch.bfloat16)
                flops = 2 * a_rows * inner * b_cols
                row = {"m": m, "matmul": name, "product": what, "shape": [a_rows, inner, b_cols]}
                sec = bench(lambda: a @ b.t())
                row["bf16_tflops"] = flops / sec / 1e12
                total["bf16"] += uses * sec
                for label, rowwise in (("fp8_tensor", False), ("fp8_row", True)):
                    a8, sa = fp8(a, rowwise)
                    b8, sb = fp8(b, rowwise)
                    sb = sb.t() if rowwise else sb
                    sec8 = bench(lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb,
                                                          out_dtype=torch.bfloat16))
                    row[f"{label}_tflops"] = flops / sec8 / 1e12
                    total[label] += uses * sec8
                rows.append(row)
                del a, b
                print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append({"m": m, "matmul": "TTT-7 iteration (frozen lm_head)",
                     **{f"{k}_ms": 1000 * v for k, v in total.items()},
                     **{f"{k}_tok_s_ceiling": m / v for k, v in total.items()}})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def attention(contexts: list[int]) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from eyas.kernels.attention import _band_flex

    rows = []
    for t in contexts:
        flops = 3.5 * 4 * t * (t + 1) / 2 * HQ * D  # causal fwd + bwd (bwd = 2.5 x fwd)
        q = torch.randn(t, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        lo = torch.zeros(t, dtype=torch.long, device="cuda")
        hi = torch.arange(t, device="cuda")
        row = {"context": t}

        def flex():
            out, lse = _band_flex(q, k, v, lo, hi)
            (out.float().sum() + lse.sum()).backward()

        row["flex_band_lse_tflops"] = flops / bench(flex) / 1e12
        qt, kt, vt = (x.detach().transpose(0, 1)[None].requires_grad_() for x in (q, k, v))
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                              ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def sdpa():
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                   enable_gqa=True).float().sum().backward()
            try:
                row[f"{name}_tflops"] = flops / bench(sdpa) / 1e12
            except RuntimeError as e:  # backend unavailable for these inputs
                row[f"{name}_error"] = str(e).splitlines()[0][:120]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def profile(context: int, trace: str | None, fp8: bool = False, graph: bool = False) -> dict:
    sys.path.insert(0, "benchmarks")
    from ttt import LLAMA_8B, host_time, make_batch, on_device, random_draft

    from eyas.draft.ttt import ttt_forward, ttt_plan
    from eyas.draft.ttt_graph import GraphedTTT

    cfg, draft, lm_head = random_draft(LLAMA_8B, torch.device("cuda"))
    draft.init_lm_head_from_target(lm_head, freeze=True)
    t2d = draft.t2d.cpu()
    host_batch = make_batch(cfg, t2d, context, "ones", "cpu")  # plans from it, as train does
    batch = on_device(host_batch, torch.device("cuda"))
    # graph: the iteration replayed from a CUDA graph (eyas train --cuda-graph), so the
    # profile shows the GPU's work without the gaps of queueing it
    graphed = GraphedTTT(lambda b, p: ttt_forward(draft, b, lm_head, fp8=fp8, plan=p),
                         list(draft.parameters())) if graph else None

    def step():
        draft.zero_grad(set_to_none=True)
        plan = ttt_plan(host_batch, t2d, 7, device="cuda", static=graph)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if graphed is not None:
                graphed(batch, plan)
                return
            out = ttt_forward(draft, batch, lm_head, fp8=fp8, plan=plan)
        out.loss.backward()

    for _ in range(3):
        step()
    wall = bench(step, iters=3, warmup=0)
    host = [host_time(step, torch.device("cuda")) for _ in range(3)]
    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        step()
        torch.cuda.synchronize()
    if trace:
        p.export_chrome_trace(trace)
    kernels = {}  # name -> [ms, launches], from the GPU's own records (each kernel once)
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ms = getattr(e, "device_time_total", None)
            entry = kernels.setdefault(e.name[:90], [0.0, 0])
            entry[0] += (e.cuda_time_total if ms is None else ms) / 1e3
            entry[1] += 1
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {"context": context, "fp8": fp8, "graph": graph, "wall_ms": 1000 * wall,
            "tok_s": context / wall,
            "host_ms": 1000 * min(host), "gpu_busy_ms": sum(v[0] for v in kernels.values()),
            "kernel_launches": sum(v[1] for v in kernels.values()),
            "top": [{"name": k, "calls": n, "ms": ms} for k, (ms, n) in ranked[:40]]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="gemm,attention,profile")
    p.add_argument("--contexts", default="2048,8192,32768")
    p.add_argument("--profile-context", default="2048,8192")
    p.add_argument("--fp8", action="store_true", help="profile with fp8 matmuls")
    p.add_argument("--graph", action="store_true",
                   help="profile the iteration replayed from a CUDA graph (static plan)")
    p.add_argument("--trace", default=None, help="chrome trace of the (last) profiled step")
    p.add_argument("--out", default="benchmarks/results/kernels.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    contexts = [int(c) for c in args.contexts.split(",")]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    parts = args.only.split(",")
    if "gemm" in parts:
        result["gemm"] = gemm(contexts)
    if "attention" in parts:
        result["attention"] = attention(contexts)
    if "profile" in parts:
        result["profile"] = [profile(int(c), args.trace, args.fp8, args.graph)
                             for c in args.profile_context.split(",")]
        for prof_row in result["profile"]:
            print(f"\n## profile {prof_row['context']} fp8={prof_row['fp8']}: wall {prof_row['wall_ms']:.1f} ms, "
                  f"GPU busy {prof_row['gpu_busy_ms']:.1f} ms, "
                  f"{prof_row['kernel_launches']} kernels, {prof_row['tok_s']:,.0f} tok/s")
            for r in prof_row["top"]:
                print(f"{r['ms']:8.2f} ms {r['calls']:5d}x  {r['name']}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
