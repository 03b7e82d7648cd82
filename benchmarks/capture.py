"""Benchmark `eyas capture` on a Llama-3.1-8B-shaped target with random bf16 weights.

Measures, in one run on one GPU:
  1. plain decoder forward (the text model, no hooks, no lm_head): tokens/s;
  2. capture compute: forward + taps + chunked lm_head top-1, results left on the GPU: tokens/s;
  3. capture end to end into local disk with bf16 aux states, then with fp8: tokens/s,
     bytes/token, how long the forward loop waited on storage, how long the last parts took
     after the last forward, and the writer's time per stage (write into the page cache,
     fsync, sha256, ...);
  4. the disk alone: GB/s writing + fsyncing files from Python (1 stream, and as many as
     --writer-threads), which caps capture at disk GB/s / bytes per token;
  5. the storage path alone (no GPU work): synthetic host batches of the capture shape fed to
     the part writer as fast as it takes them: the tokens/s storage could sustain;
plus peak GPU memory of each phase. Batches are 8 x 2048 tokens (--batch-tokens 16384).
Prints a markdown table and one JSON line (also written to --json).

    python benchmarks/capture.py                 # H200: ~3 minutes, up to ~18 GB of temp files
    python benchmarks/capture.py --smoke         # tiny CPU model, seconds
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path

import datasets
import torch
import transformers

from eyas.capture import CaptureConfig, capture_loaded
from eyas.targets.capture_forward import iter_captured_batches
from eyas.targets.models import inspect_model, submodule
from eyas.store.shard_writer import PartWriter

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
                  out_root: Path, file_mb: float, writer_threads: int) -> dict:
    """`capture_loaded` end to end into a fresh folder on local disk."""
    out = Path(tempfile.mkdtemp(prefix=f"eyas-bench-{dtype}-", dir=out_root))
    cfg = CaptureConfig(target="llama-3.1-8b-shaped-random", data="(in memory)", out=str(out),
                        dtype=dtype, batch_tokens=batch_tokens, file_mb=file_mb,
                        writer_threads=writer_threads)
    _peak_reset(device)
    t0 = time.perf_counter()
    stats = capture_loaded(cfg, model, info, ds, target=None)
    seconds = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    job = stats["this_job"]
    return {"tokens_per_s": stats["tokens"] / seconds, "seconds": seconds,
            "loop_tokens_per_s": stats["tokens"] / job["loop_s"],
            "bytes_per_token": stats["bytes_per_token"], "bytes": stats["bytes"],
            "writer_busy_s": job["writer_busy_s"], "put_wait_s": job["put_wait_s"],
            "stage_s": job["stage_s"],
            "drain_s": job["drain_s"], "loop_s": job["loop_s"], "writer": job["writer"],
            "peak_gpu_gib": _peak_gib(device)}


def bench_disk(out_root: Path, total_bytes: int, streams: int, chunk: int = 64 << 20) -> dict:
    """Write `total_bytes` (split over `streams` files written by as many threads) from one
    reused buffer, fsync each file: what the disk takes, before any capture work."""
    buf = memoryview(torch.randint(0, 255, (chunk,), dtype=torch.uint8).numpy())
    folder = Path(tempfile.mkdtemp(prefix="eyas-bench-disk-", dir=out_root))
    per_stream = max(chunk, total_bytes // streams // chunk * chunk)

    def one(i: int) -> None:
        fd = os.open(folder / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _ in range(per_stream // chunk):
                view = buf
                while view.nbytes:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    shutil.rmtree(folder, ignore_errors=True)
    return {"streams": streams, "bytes": per_stream * streams, "seconds": seconds,
            "gb_per_s": per_stream * streams / seconds / 1e9}


def bench_storage(out_root: Path, hidden: int, batch_tokens: int, batches: int, dtype: str,
                  file_mb: float, writer_threads: int, pinned: bool) -> dict:
    """The storage path alone: `batches` synthetic host batches of the capture's shape and
    dtypes handed to `PartWriter` as fast as it accepts them (no GPU, no forward)."""
    n = batch_tokens
    aux_dtype = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
    host = {"aux_hidden": torch.randn(n, 3, hidden).to(aux_dtype),
            "final_hidden": torch.randn(n, hidden).bfloat16(),
            "target_top1": torch.zeros(n, dtype=torch.int32),
            "input_ids": torch.zeros(n, dtype=torch.int32),
            "loss_mask": torch.ones(n, dtype=torch.uint8),
            "sample_offsets": torch.tensor([0, n], dtype=torch.int64)}
    if dtype == "fp8":
        host["aux_scale"] = torch.ones(n, 3)
    if pinned:
        host = {k: v.pin_memory() for k, v in host.items()}
    folder = Path(tempfile.mkdtemp(prefix=f"eyas-bench-store-{dtype}-", dir=out_root))
    state = {"shard": 0, "num_shards": 1, "parts": [], "nonfinite": 0}
    writer = PartWriter(folder, state, int(file_mb * 2**20), {"dtype": dtype},
                        threads=writer_threads)
    t0 = time.perf_counter()
    for i in range(batches):
        batch = {**host, "sample_index": torch.tensor([i]),
                 "nonfinite": torch.zeros(n, dtype=torch.bool)}
        writer.put(None, batch, [f"bench:{i}"])
    writer.close()
    seconds = time.perf_counter() - t0
    shutil.rmtree(folder, ignore_errors=True)
    return {"tokens_per_s": batches * n / seconds, "seconds": seconds,
            "gb_per_s": writer.bytes_written / seconds / 1e9,
            "bytes_per_token": writer.bytes_written / (batches * n), "files": len(state["parts"]),
            "writer": dict(writer.timings)}


def markdown(result: dict) -> str:
    r, t = result["results"], result["setup"]
    f = r["forward"]["tokens_per_s"]
    lines = [f"### eyas capture benchmark ({t['device_name']}, {t['shape']}, "
             f"{t['samples']} x {t['seq_len']} tokens, batch {t['batch_tokens']} tokens, "
             f"parts {t['file_mb']:g} MiB, {t['writer_threads']} writer threads)", "",
             "| phase | tokens/s | vs plain forward | tokens/s before the drain | bytes/token "
             "| staging D2H (s) | waited on storage (s) | drain (s) | peak GPU GiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("forward", "compute", "capture_bf16", "capture_fp8"):
        x = r[name]
        loop = x.get("loop_tokens_per_s")
        lines.append(f"| {name} | {x['tokens_per_s']:,.0f} | {x['tokens_per_s'] / f:.2f} | "
                     f"{'-' if loop is None else format(loop, ',.0f')} | "
                     f"{x.get('bytes_per_token', 0):,.0f} | {x.get('stage_s', 0):.1f} | "
                     f"{x.get('put_wait_s', 0):.1f} | "
                     f"{x.get('drain_s', 0):.1f} | "
                     f"{'-' if x['peak_gpu_gib'] is None else format(x['peak_gpu_gib'], '.1f')} |")
    per_tok = {k: 1.0 / r[k]["tokens_per_s"] for k in ("forward", "compute", "capture_bf16",
                                                         "capture_fp8")}
    lines += ["", "Time per token relative to the plain forward: taps + top-1 add "
              f"{(per_tok['compute'] - per_tok['forward']) / per_tok['forward']:+.1%}; "
              "the storage path (dtype conversion, device-to-host copy, waiting on the writer) "
              f"adds {(per_tok['capture_bf16'] - per_tok['compute']) / per_tok['forward']:+.1%} "
              f"(bf16) and {(per_tok['capture_fp8'] - per_tok['compute']) / per_tok['forward']:+.1%} "
              "(fp8).", "",
              "Writer stages, seconds summed over parts (threads overlap): "]
    for name in ("capture_bf16", "capture_fp8"):
        stages = ", ".join(f"{k} {v:.2f}" for k, v in r[name]["writer"].items())
        lines.append(f"- {name}: {stages}")
    lines += ["", "| disk / storage path alone | GB/s | tokens/s it allows (bf16 / fp8) | "
              "vs plain forward (bf16 / fp8) |", "|---|---:|---:|---:|"]
    bpt = {d: r[f"storage_{d}"]["bytes_per_token"] for d in ("bf16", "fp8")}  # target shape
    for key, x in r["disk"].items():
        tps = [x["gb_per_s"] * 1e9 / bpt[d] for d in ("bf16", "fp8")]
        lines.append(f"| raw write + fsync, {key} | {x['gb_per_s']:.2f} | {tps[0]:,.0f} / "
                     f"{tps[1]:,.0f} | {tps[0] / f:.2f} / {tps[1] / f:.2f} |")
    for d in ("bf16", "fp8"):
        x = r[f"storage_{d}"]
        lines.append(f"| storage path alone, {d} (`PartWriter`, synthetic batches) | "
                     f"{x['gb_per_s']:.2f} | {x['tokens_per_s']:,.0f} ({d}) | "
                     f"{x['tokens_per_s'] / f:.2f} ({d}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the script)")
    p.add_argument("--samples", type=int, default=256,
                   help="samples of --seq-len tokens (enough batches that the last parts, "
                        "written after the last forward, do not dominate)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--reps", type=int, default=4, help="timed plain-forward batches")
    p.add_argument("--file-mb", type=float, default=1024.0, help="capture part size (MiB)")
    p.add_argument("--writer-threads", type=int, default=3, help="parts written at once")
    p.add_argument("--disk-gib", type=float, default=4.0, help="bytes for the raw disk test")
    p.add_argument("--out-dir", default=None, help="local disk folder for the captures (tmp)")
    p.add_argument("--json", default=None, help="also write the JSON result here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        device, shape, samples, seq_len, batch_tokens = "cpu", TINY, 8, 64, 256
        # the storage-only phases still use Llama-8B rows (hidden 4096), fewer of them
        store_hidden, store_tokens, store_batches, store_mb = 4096, 2048, 8, 128.0
        disk_bytes = 512 << 20
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: run with --smoke on CPU")
        device, shape = "cuda", LLAMA_8B
        samples, seq_len, batch_tokens = args.samples, args.seq_len, args.batch_tokens
        store_hidden, store_tokens, store_mb = shape["hidden_size"], batch_tokens, args.file_mb
        store_batches = max(1, samples * seq_len // batch_tokens)
        disk_bytes = int(args.disk_gib * 2**30)
    out_root = Path(args.out_dir or tempfile.gettempdir())
    out_root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = build_model(shape, device, torch.bfloat16)
    info = inspect_model(model)
    ds = random_dataset(samples, seq_len, shape["vocab_size"])
    batch = max(1, batch_tokens // seq_len)
    io = dict(file_mb=args.file_mb if not args.smoke else 0.25, writer_threads=args.writer_threads)
    results = {"forward": bench_forward(model, info, ds, batch, device, args.reps),
               "compute": bench_compute(model, info, ds, batch_tokens, device),
               "capture_bf16": bench_capture(model, info, ds, "bf16", batch_tokens, device,
                                             out_root, **io),
               "capture_fp8": bench_capture(model, info, ds, "fp8", batch_tokens, device,
                                            out_root, **io),
               "disk": {f"{n} stream{'s' if n > 1 else ''}": bench_disk(out_root, disk_bytes, n)
                        for n in sorted({1, args.writer_threads})}}
    for d in ("bf16", "fp8"):
        results[f"storage_{d}"] = bench_storage(out_root, store_hidden, store_tokens,
                                                store_batches, d, store_mb, args.writer_threads,
                                                pinned=device == "cuda")
    result = {
        "benchmark": "capture",
        "setup": {"device_name": (torch.cuda.get_device_name() if device == "cuda" else
                                  platform.processor() or "cpu"),
                  "shape": "llama-3.1-8b" if shape is LLAMA_8B else "tiny",
                  "samples": samples, "seq_len": seq_len, "batch_tokens": batch_tokens,
                  "file_mb": io["file_mb"], "writer_threads": args.writer_threads,
                  "storage_phase": {"hidden": store_hidden, "batch_tokens": store_tokens,
                                    "batches": store_batches, "file_mb": store_mb},
                  "aux_layer_ids": list(info.default_aux_layer_ids),
                  "torch": torch.__version__, "transformers": transformers.__version__,
                  "attn_implementation": model.config._attn_implementation,
                  "cpu_count": os.cpu_count()},
        "results": results, "total_s": time.perf_counter() - t0}
    print(markdown(result))
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
