"""The training data loader alone: tokens/s of `eyas train`'s offline loader (mmap read,
packing, collate) over a synthetic capture of a target's shape, stored in bf16 and in fp8,
with 0, 1 and 2 workers: eyas's reading threads (`eyas.draft.data_loader.Prefetch`) and,
beside them in the same run, torch DataLoader worker processes (the loader before session 25);
`--intra-threads` adds reader threads with other intra-op thread counts.

    python benchmarks/loader.py                    # SmolLM2-135M's shape (hidden 576), CPU
    python benchmarks/loader.py --shape llama-8b --capture-tokens 100000

Each fp8 row is measured twice: `kept` is the loader as eyas train runs it (aux states stay
fp8 through collate and are dequantized where the step runs,
`eyas.draft.data_loader.on_device`: timed with `--device cuda`; with the default
`--device none` on a machine without a GPU the loop stops at the host batch, as the training
process's loop hands it to the GPU) and `host` dequantizes each sample in the worker
(`sample(dequantize=True)`, the loader before session 25). The loader's tokens/s is the
ceiling of eyas train's when the GPU's step is shorter than a batch's loading, as with small
targets (SmolLM2-135M trained at ~138 K tokens/s with the GPU 20-28 % busy and three busy
processes, session 22's lease).

Prints a markdown table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from train import LLAMA_8B, make_capture, make_target  # noqa: E402

from eyas.draft import data, data_loader, data_plan  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
               max_position_embeddings=8192, tie_word_embeddings=True)
SHAPES = {"smollm2-135m": SMOLLM2, "llama-8b": LLAMA_8B}


class HostDequantized(data.OfflineSource):
    """The loader before session 25: each sample's fp8 aux states dequantized in the worker."""

    def fetch(self, ids):
        return [self.capture.sample(i, copy=False) for i in ids]


def process_loader(source, plan, batch_tokens: int, workers: int, pin: bool):
    """The loader before session 25: torch's DataLoader, `workers` worker processes (each
    batch handed over through shared memory), pinned by its pin-memory thread."""
    return torch.utils.data.DataLoader(
        data_loader.MicroBatches(source, plan, batch_tokens, torch.bfloat16, False),
        batch_size=None, shuffle=False, num_workers=workers, pin_memory=pin,
        prefetch_factor=2 if workers else None)


def bench(source, batch_tokens: int, workers: int, batches: int, device,
          processes: bool = False, intra: int | None = None) -> float:
    packing = data_plan.Packing(batch_tokens, 1, False)
    plan = data_plan.epoch_batches(np.arange(len(source.lengths)), source.lengths, packing,
                                   seed=0, epoch=0)
    plan = (plan * (batches // max(1, len(plan)) + 1))[:batches]
    pin = device is not None and device.type == "cuda"
    if processes:
        loader = process_loader(source, plan, batch_tokens, workers, pin)
    elif intra is not None and workers:  # reader threads with `intra` intra-op threads each
        loader = data_loader.Prefetch(data_loader.MicroBatches(source, plan, batch_tokens,
                                                               torch.bfloat16, False),
                                      workers, pin, intra_threads=intra)
    else:
        loader = data_loader.loader(source, plan, batch_tokens, torch.bfloat16,
                                    num_workers=workers, pin_memory=pin, static=False)
    t0, tokens = time.perf_counter(), 0
    for mb in loader:
        if device is not None:
            mb = data_loader.on_device(mb, device)  # what the training step receives
        tokens += int((mb["doc_ids"] >= 0).sum())
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t0)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="smollm2-135m")
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--workers", default="0,1,2")
    p.add_argument("--capture-tokens", type=int, default=150_000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "none",
                   help="where on_device puts each batch, timed with the loader; none: the "
                        "host batch only (cpu: the fp8 dequantization in this process)")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--intra-threads", default="",
                   help="also reader threads with these intra-op threads each (e.g. 1,4), "
                        "beside eyas's default share (data_loader.reader_threads)")
    p.add_argument("--out", default="benchmarks/results/loader-cpu.json")
    a = p.parse_args(argv)
    shape = SHAPES[a.shape]
    device = None if a.device == "none" else torch.device(a.device)
    intra = [int(n) for n in a.intra_threads.split(",") if n]
    root = Path(tempfile.mkdtemp(prefix="eyas-bench-loader-", dir=a.work_dir))
    rows = []
    try:
        _, target = make_target(root / "target", shape)
        for dtype in ("bf16", "fp8"):
            folder = root / dtype
            make_capture(folder, target, shape, tokens=a.capture_tokens, lengths=(128, 700),
                         draft_vocab=32000, part_tokens=16384, dtype=dtype)
            ways = {"kept": data.OfflineSource}
            if dtype == "fp8":
                ways["host"] = HostDequantized
            for way, cls in ways.items():
                for w in (int(x) for x in a.workers.split(",")):
                    kinds = [("threads", None)] + [
                        (f"threads, {n} intra-op each", n) for n in intra] + \
                        [("processes", None)] if w else [("-", None)]
                    for kind, n in kinds:
                        tps = bench(cls(folder), a.batch_tokens, w, a.batches, device,
                                    kind == "processes", n)
                        rows.append({"capture": dtype,
                                     "dequantized": way if dtype == "fp8" else "-",
                                     "workers": w, "kind": kind if kind != "threads" else
                                     f"threads ({data_loader.reader_threads(w)} intra-op each)",
                                     "tokens_per_s": round(tps)})
                        print(rows[-1], flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"benchmark": "loader", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "python benchmarks/loader.py " + " ".join(argv or sys.argv[1:]),
              "shape": a.shape, "batch_tokens": a.batch_tokens, "batches": a.batches,
              "device": a.device, "cpu": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "torch": torch.__version__, "rows": rows}
    lines = [f"`{result['command']}` ({a.shape}, {a.batch_tokens} tokens per batch, "
             f"{os.cpu_count()} cores, on_device to {a.device})", "",
             "| capture | fp8 dequantized | workers | kind | tokens/s |",
             "|---|---|---:|---|---:|"]
    lines += [f"| {r['capture']} | {r['dequantized']} | {r['workers']} | {r['kind']} "
              f"| {r['tokens_per_s']:,} |" for r in rows]
    print("\n".join(lines))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
