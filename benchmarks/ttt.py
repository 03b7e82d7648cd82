"""TTT forward+backward throughput and memory for a Llama-3.1-8B-shaped EAGLE-3 draft.

    python benchmarks/ttt.py                      # H200: contexts 2K..64K, ~8 min
    python benchmarks/ttt.py --contexts 2048,4096 --masks ones --lm-head frozen
    python benchmarks/ttt.py --precision fp8 --modes graph   # the CUDA-graph mode only
    python benchmarks/ttt.py --doc-tokens 1024    # packed 1K-token documents (FlexAttention path)
    python benchmarks/ttt.py --smoke              # tiny shapes on CPU, checks the script runs
    EYAS_NO_COMPILE=1 python benchmarks/ttt.py    # the same code without torch.compile fusion

Each configuration runs `ttt_forward` (7 steps) + backward under bf16 autocast on one
sequence of `context` tokens (batch 1), with fp32 master weights, after --warmup iterations
timed over --iters or more, until --min-seconds (short, host-bound iterations vary), with the
step plan made from the host batch as `eyas train` makes it, and reports tokens/s, peak
memory and MFU (model FLOPs over the bf16 peak, also for fp8). Masks: `ones` (every position
carries a loss) and `60` (alternating prompt / answer spans, ~60% answer tokens: steps >= 1
prune most prompt positions). Precision: `bf16`, or `fp8` (the draft's matmuls in fp8,
eyas.kernels.fp8). lm_head: `frozen` (initialised from the target rows, no weight gradient) or
`trained`. Where it fits (--dense-max; frozen head, bf16 only), a dense-mask TTT runs too, as
peers do it (every step's keys concatenated, an explicit (T, T*(j+1)) mask, materialised
logits): its speed, memory and loss.
Modes (--modes): `eager` makes a pruned plan per batch and queues the kernels one by one, as
`eyas train` does by default; `graph` makes static plans and replays the whole forward +
backward from one CUDA graph (eyas.draft.ttt_graph, `eyas train --cuda-graph`; CUDA only).
Prints a markdown table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from eyas.kernels.band_kernels import ATTENTION_ENV, CudnnCausal, Fa4Causal, band_kernel
from eyas.draft.config import DraftConfig
from eyas.draft.eagle3 import Eagle3Draft
from eyas.kernels.fused import COMPILE_DEVICES
from eyas.draft.ttt import TTTBatch, ttt_forward, ttt_plan
from eyas.draft.ttt_graph import GraphedTTT

H200_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak

LLAMA_8B = dict(hidden_size=4096, target_hidden_size=4096, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=14336, rms_norm_eps=1e-5,
                rope_theta=500000.0, max_position_embeddings=131072, vocab_size=128256,
                draft_vocab_size=32000, aux_layer_ids=(2, 16, 29),
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
TINY = dict(LLAMA_8B, hidden_size=64, target_hidden_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=1000,
            draft_vocab_size=300)


def random_draft(shapes: dict, device, seed: int = 0):
    """(DraftConfig, draft, target lm_head (V, Ht) bf16): random weights and embedding, a
    random draft vocab; speed does not depend on the values."""
    torch.manual_seed(seed)
    cfg = DraftConfig(**shapes)
    embed = (torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02).bfloat16().to(device)
    lm_head = (torch.randn(cfg.vocab_size, cfg.target_hidden_size) * 0.02).bfloat16().to(device)
    draft = Eagle3Draft(cfg, embed).to(device)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]] = True
    draft.set_vocab((t2d.nonzero().squeeze(1) - torch.arange(cfg.draft_vocab_size)).to(device),
                    t2d.to(device))
    return cfg, draft, lm_head


def make_batch(cfg: DraftConfig, t2d: torch.Tensor, context: int, mask: str, device, seed=0,
               doc_tokens: int = 0):
    """One row of `context` tokens: one document, or documents of `doc_tokens` packed."""
    g = torch.Generator().manual_seed(seed)
    ht, v = cfg.target_hidden_size, cfg.vocab_size
    loss_mask = torch.ones(context, dtype=torch.uint8)
    if mask == "60":  # prompt spans of 100-300 tokens, answer spans of 150-450: ~60% answer
        at, answer = 0, False
        while at < context:
            n = int(torch.randint(150, 450, (1,), generator=g)) if answer else \
                int(torch.randint(100, 300, (1,), generator=g))
            loss_mask[at: at + n] = int(answer)
            at, answer = at + n, not answer
    in_vocab = t2d.nonzero().squeeze(1)
    top1 = in_vocab[torch.randint(0, in_vocab.numel(), (context,), generator=g)]
    out_of_vocab = torch.rand(context, generator=g) < 0.03  # a few top-1s outside the draft vocab
    top1[out_of_vocab] = torch.randint(0, v, (int(out_of_vocab.sum()),), generator=g)
    batch = TTTBatch(
        input_ids=torch.randint(0, v, (1, context), generator=g),
        aux_hidden=torch.randn(1, context, 3 * ht, generator=g).bfloat16(),
        final_hidden=torch.randn(1, context, ht, generator=g).bfloat16(),
        target_top1=top1[None].int(), loss_mask=loss_mask[None],
        position_ids=(torch.arange(context) % (doc_tokens or context))[None],
        doc_ids=(torch.arange(context) // (doc_tokens or context))[None])
    return on_device(batch, device)


def on_device(batch: TTTBatch, device) -> TTTBatch:
    return TTTBatch(**{k: x.to(device) for k, x in vars(batch).items()})


def dense_ttt(draft: Eagle3Draft, batch: TTTBatch, lm_head: torch.Tensor, steps: int):
    """The memory-hungry way: concatenate every step's keys, build the (T, T*(j+1)) mask,
    materialise (T, Vd) logits per step. Single unpacked row, no pruning."""
    cfg = draft.cfg
    t = batch.input_ids.shape[1]
    dev = batch.input_ids.device
    ids, pos = batch.input_ids[0], batch.position_ids[0]
    mask = batch.loss_mask[0].bool()
    top1 = batch.target_top1[0].long()
    with torch.no_grad():
        probs = torch.softmax((batch.final_hidden[0] @ lm_head[draft.t2d].T).float(), -1)
    hidden = draft.fuse(batch.aux_hidden[0])
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    eye = torch.eye(t, dtype=torch.bool, device=dev)
    keys, values, total = [], [], 0.0
    n = torch.arange(t, device=dev)
    for j in range(steps):
        q, k, v, res = draft.project(ids[(n + 1 + j).clamp(max=t - 1)], hidden, pos + j)
        keys.append(k)
        values.append(v)
        allowed = torch.cat([causal] + [eye] * j, 1)  # (T, T*(j+1))
        rep = cfg.num_attention_heads // cfg.num_key_value_heads  # GQA by repeating kv heads
        kk, vv = (torch.cat(x).repeat_interleave(rep, 1).transpose(0, 1)[None]
                  for x in (keys, values))  # (1, hq, T*(j+1), d)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk, vv, attn_mask=allowed)
        h = draft.finish(out[0].transpose(0, 1), res)
        logits = draft.lm_head(draft.norm(h)).float()  # (T, Vd)
        valid = (n + 2 + j < t) & mask[(n + 2 + j).clamp(max=t - 1)] & \
            draft.t2d[top1[(n + 1 + j).clamp(max=t - 1)]]
        teach = (n + 1 + j).clamp(max=t - 1)
        ce = -(probs[teach] * torch.log_softmax(logits, -1)).sum(-1)
        total = total + 0.8 ** j * (ce * valid).sum() / valid.sum().clamp(min=1)
        hidden = draft.next_hidden(h)
    return total


def flops(cfg: DraftConfig, context: int, rows: list[int], counted: list[int], trained: bool,
          doc_tokens: int = 0):
    """Model FLOPs of one TTT fwd+bwd (computed rows only; attention assumes the rows of
    step j spread evenly over their documents: each sees ~document/2 keys)."""
    h, hq, hkv, d, i = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                        cfg.head_dim, cfg.intermediate_size)
    layer = 2 * h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i  # weights per token
    total = 2 * context * cfg.target_hidden_size * cfg.draft_vocab_size  # teacher logits
    total += 4 * context * 3 * cfg.target_hidden_size * h  # fc fwd + weight grad (aux is data)
    for j, (n, c) in enumerate(zip(rows, counted)):
        total += 6 * n * layer
        total += (6 if trained else 4) * c * h * cfg.draft_vocab_size
        keys = ((doc_tokens or context) + 1) / 2 + j
        total += 3.5 * 4 * n * hq * d * keys  # flash-style: bwd = 2.5 x fwd
    return total


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters: int, device):
    """(seconds per call, last result) over `iters` calls."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        result = fn()
    _sync(device)
    return (time.perf_counter() - start) / iters, result


def host_time(step, device) -> float:
    """Seconds until step() returns, started on an idle GPU (then waits for it): the host
    queueing one iteration."""
    _sync(device)
    start = time.perf_counter()
    step()
    took = time.perf_counter() - start
    _sync(device)
    return took


def run_one(draft, lm_head, cfg, context, mask, trained, fp8, args, device,
            mode: str = "eager") -> dict:
    draft.init_lm_head_from_target(lm_head, freeze=not trained)
    t2d = draft.t2d.cpu()
    # the batch as the data loader hands it over, on the host: each iteration makes its
    # plan there, as `eyas train` does (ttt_plan), so no GPU sync starts the forward
    host = make_batch(cfg, t2d, context, mask, "cpu", doc_tokens=args.doc_tokens)
    batch = on_device(host, device)
    row = {"context": context, "mask": mask, "lm_head": "trained" if trained else "frozen",
           "precision": "fp8" if fp8 else "bf16", "doc_tokens": args.doc_tokens or context,
           "mode": mode}
    graphed = None if mode == "eager" else GraphedTTT(
        lambda b, p: ttt_forward(draft, b, lm_head, steps=args.steps, fp8=fp8, plan=p,
                                vocab_chunk=args.vocab_chunk),
        list(draft.parameters()))

    def step():
        draft.zero_grad(set_to_none=True)
        # graph: a static plan (no pruning; shapes fixed by the batch's), one capture
        plan = ttt_plan(host, t2d, args.steps, device=device, static=graphed is not None)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            if graphed is not None:
                return graphed(batch, plan)
            out = ttt_forward(draft, batch, lm_head, steps=args.steps, fp8=fp8, plan=plan,
                              vocab_chunk=args.vocab_chunk)
        out.loss.backward()
        return out

    try:
        if device.type == "cuda":  # from the start: a graph allocates while it is captured
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.warmup):
            step()
        # short iterations are bound by the host and noisy: time at least --min-seconds
        first, _ = timed(step, 1, device)
        iters = max(args.iters, min(50, math.ceil(args.min_seconds / first)))
        sec, out = timed(step, iters, device)
        row["iters"] = iters
        row.update(ms=1000 * sec, tok_s=context / sec, loss=float(out.loss),
                   rows=out.step_rows, counted=out.step_count.tolist(),
                   sim_al=out.sim_acceptance_length)
        row["tflops"] = flops(cfg, context, out.step_rows, row["counted"], trained,
                              args.doc_tokens) / sec / 1e12
        row["mfu"] = row["tflops"] * 1e12 / args.peak_flops
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        # the time until step() returns, the GPU idle at its start: the host queueing one
        # iteration. Near ms/iter the cell was host-bound (a stalled host, or too little work)
        row["host_ms"] = 1000 * min(host_time(step, device) for _ in range(2))
    except torch.OutOfMemoryError:
        row["error"] = "OOM"
    if graphed is not None:
        row["captures"] = graphed.captures
    out = graphed = None
    draft.zero_grad(set_to_none=True)
    # the dense reference once per (context, mask): it does not depend on the lm_head setting
    # (the dense reference knows one document only)
    if context <= args.dense_max and "error" not in row and not trained and not fp8 \
            and not args.doc_tokens and mode == "eager":
        row.update(dense_run(draft, batch, lm_head, args, device))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def dense_run(draft, batch, lm_head, args, device) -> dict:
    def step():
        draft.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = dense_ttt(draft, batch, lm_head, args.steps)
        loss.backward()
        return loss

    try:
        step()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sec, loss = timed(step, 1, device)
        out = {"dense_tok_s": batch.input_ids.shape[1] / sec, "dense_loss": float(loss)}
        if device.type == "cuda":
            out["dense_peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        return out
    except torch.OutOfMemoryError:
        return {"dense_error": "OOM"}
    finally:
        draft.zero_grad(set_to_none=True)


def table(rows: list[dict]) -> str:
    head = ("| context | mask | lm_head | matmuls | mode | tok/s | ms/iter | peak GiB | TFLOP/s "
            "| MFU | rows/step | dense tok/s | dense GiB | loss (dense) |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['mask']} | {r['lm_head']} | {r['precision']} "
                         f"| {r['mode']} | {r['error']} |" + " |" * 9)
            continue
        dense = r.get("dense_error") or (f"{r['dense_tok_s']:,.0f}" if "dense_tok_s" in r else "-")
        lines.append(
            f"| {r['context']} | {r['mask']} | {r['lm_head']} | {r['precision']} | {r['mode']} "
            f"| {r['tok_s']:,.0f} | {r['ms']:.1f} "
            f"| {r.get('peak_gib', float('nan')):.1f} | {r['tflops']:.0f} | {100 * r['mfu']:.1f}% "
            f"| {'/'.join(str(x) for x in r['rows'])} | {dense} "
            f"| {r.get('dense_peak_gib', float('nan')):.1f} "
            f"| {r['loss']:.4f} ({r.get('dense_loss', float('nan')):.4f}) |")
    return "\n".join(lines)


def kernel_name(cfg, device) -> str:
    """The kernel the causal band of a bf16 document runs on now: fa4, cudnn, flex, or
    reference (CPU)."""
    if device.type != "cuda":
        return "reference"
    probe = torch.empty(2, cfg.num_attention_heads, cfg.head_dim, device=device,
                        dtype=torch.bfloat16)
    return {Fa4Causal: "fa4", CudnnCausal: "cudnn", None: "flex"}[band_kernel(probe)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="2048,4096,8192,16384,32768,65536")
    p.add_argument("--masks", default="ones,60", help="comma list of: ones, 60")
    p.add_argument("--lm-head", default="frozen,trained", help="comma list of: frozen, trained")
    p.add_argument("--precision", default="bf16,fp8",
                   help="comma list of: bf16 (autocast), fp8 (the draft's matmuls in fp8)")
    p.add_argument("--doc-tokens", type=int, default=0,
                   help="pack documents of this many tokens into each sequence, as `eyas "
                        "train` packs samples (0 = one document: the issue's benchmark)")
    p.add_argument("--modes", default="eager,graph",
                   help="comma list of: eager (plans pruned per batch, as eyas train runs by "
                        "default), graph (static plans, the iteration replayed from a CUDA "
                        "graph: eyas train --cuda-graph); CUDA only")
    p.add_argument("--cudnn-gqa", choices=("on", "off"), default="on",
                   help="off: cuDNN attention gets K/V repeated to the query heads instead of "
                        "its own GQA (more memory; measured slower on an H200, docs/benchmarks.md)")
    p.add_argument("--attention", choices=("auto", "fa4", "cudnn"),
                   help="the causal band's kernel (sets EYAS_ATTENTION; default: as set, else "
                        "auto = FlashAttention-4 when installed (pip install 'eyas[fa4]'), "
                        "else cuDNN)")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--vocab-chunk", type=int, default=4096,
                   help="rows per chunk of the lm_head + soft cross-entropy (ttt_forward's "
                        "vocab_chunk)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=3, help="timed iterations, at least")
    p.add_argument("--min-seconds", type=float, default=2.0,
                   help="time more iterations (up to 50) until they take this long")
    p.add_argument("--dense-max", type=int, default=8192,
                   help="run the dense-mask reference up to this context")
    p.add_argument("--peak-flops", type=float, default=H200_BF16_FLOPS)
    p.add_argument("--out", default="benchmarks/results/ttt.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    args = p.parse_args(argv)
    if args.smoke:
        device, shapes = torch.device("cpu"), TINY
        if args.contexts == p.get_default("contexts"):
            args.contexts = "64,200"
        args.steps, args.warmup, args.iters, args.min_seconds = min(args.steps, 3), 1, 1, 0.0
        args.modes = "eager"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device; use --smoke for the CPU check", file=sys.stderr)
            return 2
        device, shapes = torch.device("cuda"), LLAMA_8B
    if args.cudnn_gqa == "off":
        CudnnCausal.gqa = False
    if args.attention:
        os.environ[ATTENTION_ENV] = args.attention
    cfg, draft, lm_head = random_draft(shapes, device)
    attention_kernel = kernel_name(cfg, device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    meta = {"device": name, "compiled": sorted(COMPILE_DEVICES),
            "torch": torch.__version__, "steps": args.steps, "config": cfg.to_dict(),
            "peak_flops": args.peak_flops, "smoke": args.smoke, "cudnn_gqa": args.cudnn_gqa,
            "attention": attention_kernel}
    print(f"{name}, torch {torch.__version__}, attention {attention_kernel}", file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for mask in args.masks.split(","):
            for head in args.lm_head.split(","):
                for precision, mode in itertools.product(args.precision.split(","),
                                                         args.modes.split(",")):
                    row = run_one(draft, lm_head, cfg, context, mask, head == "trained",
                                  precision == "fp8", args, device, mode)
                    row["attention"] = kernel_name(cfg, device)  # after a failed FA4: cudnn
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    if row.get("host_ms", 0.0) > 0.8 * row.get("ms", float("inf")):
                        print(f"note: host-bound: {row['host_ms']:.1f} ms to queue an "
                              f"iteration that took {row['ms']:.1f} ms", file=sys.stderr)
                    # after every row: a run cut short keeps what it measured
                    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(table(rows))
    print(f"\nwrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
