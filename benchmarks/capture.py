"""Benchmark `eyas capture` on a Llama-3.1-8B-shaped target with random bf16 weights.

Measures, in one run on one GPU:
  1. plain decoder forward (the text model, no hooks, no lm_head): tokens/s;
  2. capture compute: forward + taps + chunked lm_head top-1, results left on the GPU: tokens/s;
  3. capture end to end into local disk with bf16 aux states, then with fp8: tokens/s,
     bytes/token, writer thread busy time;
plus peak GPU memory of each phase. Batches are 8 x 2048 tokens (--batch-tokens 16384).
Prints a markdown table and one JSON line (also written to --json).

    python benchmarks/capture.py                 # H200: ~1-2 minutes
    python benchmarks/capture.py --smoke         # tiny CPU model, seconds
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shutil
import tempfile
import time
from pathlib import Path

import datasets
import torch
import transformers

from eyas.capture import CaptureConfig, capture_loaded, iter_captured_batches
from eyas.models import inspect_model, submodule

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=2048, max_position_embeddings=512,
            tie_word_embeddings=False)


def build_model(shape: dict, device: str, dtype: torch.dtype):
    """A random LlamaForCausalLM built directly on `device` in `dtype` (no checkpoint)."""
    config = transformers.LlamaConfig(**shape)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def random_dataset(samples: int, seq_len: int, vocab: int, seed: int = 0) -> datasets.Dataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (samples, seq_len), generator=g)
    return datasets.Dataset.from_dict({
        "input_ids": ids.tolist(), "loss_mask": torch.ones_like(ids).tolist(),
        "sample_id": [f"bench:{i}" for i in range(samples)], "num_tokens": [seq_len] * samples})


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def bench_forward(model, info, ds, batch: int, device: str, reps: int) -> dict:
    """Plain text-model forward over (batch, seq_len) rows: the floor capture is measured against."""
    text_model = submodule(model, info.text_model_path)
    ids = torch.tensor(ds[:batch]["input_ids"], device=device)          # (B, T)
    with torch.inference_mode():
        text_model(input_ids=ids, use_cache=False)  # warm-up
        _peak_reset(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            text_model(input_ids=ids, use_cache=False)
        _sync(device)
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": reps * ids.numel() / seconds, "seconds": seconds,
            "peak_gpu_gib": _peak_gib(device)}


def bench_compute(model, info, ds, batch_tokens: int, device: str) -> dict:
    """Forward + taps + top-1 (what online training pays), outputs dropped on the GPU."""
    aux = info.default_aux_layer_ids
    next(iter_captured_batches(model, info, ds.select(range(1)), aux, batch_tokens))  # warm-up
    _peak_reset(device)
    t0, tokens = time.perf_counter(), 0
    for b in iter_captured_batches(model, info, ds, aux, batch_tokens, drop_nonfinite=False):
        tokens += b["input_ids"].numel()
    _sync(device)
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": tokens / seconds, "seconds": seconds,
            "peak_gpu_gib": _peak_gib(device)}


def bench_capture(model, info, ds, dtype: str, batch_tokens: int, device: str,
                  out_root: Path) -> dict:
    """`capture_loaded` end to end into a fresh folder on local disk."""
    out = Path(tempfile.mkdtemp(prefix=f"eyas-bench-{dtype}-", dir=out_root))
    cfg = CaptureConfig(target="llama-3.1-8b-shaped-random", data="(in memory)", out=str(out),
                        dtype=dtype, batch_tokens=batch_tokens, file_mb=1024.0)
    _peak_reset(device)
    t0 = time.perf_counter()
    stats = capture_loaded(cfg, model, info, ds, target=None)
    seconds = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return {"tokens_per_s": stats["tokens"] / seconds, "seconds": seconds,
            "bytes_per_token": stats["bytes_per_token"], "bytes": stats["bytes"],
            "writer_busy_s": stats["this_job"]["writer_busy_s"],
            "loop_s": stats["this_job"]["seconds"], "peak_gpu_gib": _peak_gib(device)}


def markdown(result: dict) -> str:
    r, t = result["results"], result["setup"]
    f = r["forward"]["tokens_per_s"]
    lines = [f"### eyas capture benchmark ({t['device_name']}, {t['shape']}, "
             f"{t['samples']} x {t['seq_len']} tokens, batch {t['batch_tokens']} tokens)", "",
             "| phase | tokens/s | vs plain forward | bytes/token | writer busy (s) | peak GPU GiB |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in ("forward", "compute", "capture_bf16", "capture_fp8"):
        x = r[name]
        lines.append(f"| {name} | {x['tokens_per_s']:,.0f} | {x['tokens_per_s'] / f:.2f} | "
                     f"{x.get('bytes_per_token', 0):,.0f} | {x.get('writer_busy_s', 0):.1f} | "
                     f"{'-' if x['peak_gpu_gib'] is None else format(x['peak_gpu_gib'], '.1f')} |")
    per_tok = {k: 1.0 / r[k]["tokens_per_s"] for k in r}  # seconds per token of each phase
    lines += ["", "Time per token relative to the plain forward: taps + top-1 add "
              f"{(per_tok['compute'] - per_tok['forward']) / per_tok['forward']:+.1%}; "
              "the storage path (dtype conversion, device-to-host copy, waiting on the writer) "
              f"adds {(per_tok['capture_bf16'] - per_tok['compute']) / per_tok['forward']:+.1%} "
              f"(bf16) and {(per_tok['capture_fp8'] - per_tok['compute']) / per_tok['forward']:+.1%} "
              "(fp8)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the script)")
    p.add_argument("--samples", type=int, default=32, help="samples of --seq-len tokens")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--reps", type=int, default=4, help="timed plain-forward batches")
    p.add_argument("--out-dir", default=None, help="local disk folder for the captures (tmp)")
    p.add_argument("--json", default=None, help="also write the JSON result here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        device, shape, samples, seq_len, batch_tokens = "cpu", TINY, 8, 64, 256
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: run with --smoke on CPU")
        device, shape = "cuda", LLAMA_8B
        samples, seq_len, batch_tokens = args.samples, args.seq_len, args.batch_tokens
    out_root = Path(args.out_dir or tempfile.gettempdir())
    out_root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = build_model(shape, device, torch.bfloat16)
    info = inspect_model(model)
    ds = random_dataset(samples, seq_len, shape["vocab_size"])
    batch = max(1, batch_tokens // seq_len)
    results = {"forward": bench_forward(model, info, ds, batch, device, args.reps),
               "compute": bench_compute(model, info, ds, batch_tokens, device),
               "capture_bf16": bench_capture(model, info, ds, "bf16", batch_tokens, device, out_root),
               "capture_fp8": bench_capture(model, info, ds, "fp8", batch_tokens, device, out_root)}
    result = {
        "benchmark": "capture",
        "setup": {"device_name": (torch.cuda.get_device_name() if device == "cuda" else
                                  platform.processor() or "cpu"),
                  "shape": "llama-3.1-8b" if shape is LLAMA_8B else "tiny",
                  "samples": samples, "seq_len": seq_len, "batch_tokens": batch_tokens,
                  "aux_layer_ids": list(info.default_aux_layer_ids),
                  "torch": torch.__version__, "transformers": transformers.__version__,
                  "attn_implementation": model.config._attn_implementation},
        "results": results, "total_s": time.perf_counter() - t0}
    print(markdown(result))
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
