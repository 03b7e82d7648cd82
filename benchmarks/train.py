"""End-to-end `eyas train` throughput and memory for a Llama-3.1-8B-shaped EAGLE-3 draft
(or SmolLM2-135M's, `--shape smollm2`: the scaling curve's target).

Runs the real `train()` (data loader over memory-mapped capture shards, TTT forward/backward
under bf16 autocast, AdamW on fp32 master weights, eval, checkpoints) on one GPU, on
synthetic inputs written to disk first:
  - a "target" folder holding only what offline training reads: config.json (Llama-3.1-8B
    shapes), tokenizer, and a safetensors file with just embed_tokens and lm_head (random);
  - a capture folder in the documented format (bf16 aux/final states, random), samples of
    512..2048 tokens, and a draft vocab of 32000 ids (target_top1 drawn inside it);
then reports, per --batch-tokens: steady tokens/s (log windows after the first), step time,
peak GPU memory, checkpoint size; and the loader alone (tokens/s with 0 and 2 workers), which
tells whether disk reading keeps up with the GPU.

    python benchmarks/train.py                     # H200: ~3-5 minutes
    python benchmarks/train.py --batch-tokens 8192,16384,32768 --steps 40
    python benchmarks/train.py --batch-tokens 16384 --precision bf16,fp8
    python benchmarks/train.py --smoke             # tiny shapes on CPU, checks the script runs
    python benchmarks/train.py --shape smollm2 --capture-dtype fp8 --workers 0,2,4 --profile
        # the curve's draft: samples of 100-700 tokens (its conversations average ~340-390),
        # each loader-thread count, and torch.profiler's busiest host ops of the first run

Prints a markdown table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

from eyas.draft import data, data_loader, data_plan
from eyas.store.manifest import target_record, write_manifest
from eyas.store.shard_writer import write_part
from eyas.store.shards import part_name, quantize_fp8
from eyas.draft.train_config import TrainConfig
from eyas.train import train

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                tie_word_embeddings=False,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
               max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=False)  # SmolLM2-135M ties them; speed does not care
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=2048, max_position_embeddings=4096,
            tie_word_embeddings=False)


def make_target(folder: Path, shape: dict) -> tuple[Path, dict]:
    """config.json + tokenizer + embed/lm_head-only safetensors; returns (folder, record)."""
    from eyas.targets.tiny import save_tiny_tokenizer

    from eyas.targets.models import load_tokenizer

    config = transformers.LlamaConfig(**shape)
    config.save_pretrained(folder)
    save_tiny_tokenizer(folder)  # only hashed: the ids here are synthetic
    v, h = shape["vocab_size"], shape["hidden_size"]
    g = torch.Generator().manual_seed(0)
    save_file({"model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).bfloat16(),
               "lm_head.weight": (torch.randn(v, h, generator=g) * 0.02).bfloat16()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, target_record(str(folder), config=config, tokenizer=load_tokenizer(str(folder)))


def make_capture(folder: Path, target: dict, shape: dict, *, tokens: int, lengths: tuple,
                 draft_vocab: int, part_tokens: int, dtype: str = "bf16") -> None:
    """A complete capture folder with random states (eyas.store.shards format); dtype fp8
    stores the aux states as `eyas capture --dtype fp8` does (e4m3 with per-token scales)."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    aux = [2, layers // 2, layers - 3]
    rng = np.random.default_rng(0)
    sizes, total = [], 0
    while total < tokens:
        sizes.append(int(rng.integers(*lengths)))
        total += sizes[-1]
    folder.mkdir(parents=True)
    entries, row, part = [], 0, 0
    while row < len(sizes):
        take = []
        while row < len(sizes) and (not take or sum(take) + sizes[row] <= part_tokens):
            take.append(sizes[row])
            row += 1
        n = sum(take)
        g = torch.Generator().manual_seed(part)
        tensors = {
            "aux_hidden": torch.randn(n, 3, h, generator=g).bfloat16(),
            "final_hidden": torch.randn(n, h, generator=g).bfloat16(),
            "target_top1": torch.randint(0, draft_vocab, (n,), generator=g, dtype=torch.int32),
            "input_ids": torch.randint(0, shape["vocab_size"], (n,), generator=g,
                                       dtype=torch.int32),
            "loss_mask": (torch.rand(n, generator=g) < 0.6).to(torch.uint8),
            "sample_offsets": torch.tensor([0, *np.cumsum(take)], dtype=torch.int64),
            "sample_index": torch.arange(row - len(take), row, dtype=torch.int64),
        }
        if dtype == "fp8":
            tensors["aux_hidden"], tensors["aux_scale"] = quantize_fp8(tensors["aux_hidden"])
        entries.append(write_part(folder, part_name(0, 1, part), tensors, {}))
        part += 1
    index = {"format": "eyas-capture-v1", "settings": {}, "num_shards": 1, "shards": {"0": True},
             "complete": True, "rows": len(sizes), "num_samples": len(sizes),
             "num_tokens": total, "num_bytes": sum(e["bytes"] for e in entries),
             "nonfinite": 0, "files": entries}
    (folder / "index.json").write_text(json.dumps(index))
    write_manifest(folder, "capture", {"synthetic": True}, target=target, aux_layer_ids=aux,
                   hidden_size=h, dtype=dtype, split="train")


def make_vocab(folder: Path, target: dict, vocab_size: int, draft_vocab: int) -> None:
    folder.mkdir(parents=True)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[:draft_vocab] = True
    save_file({"d2t": torch.zeros(draft_vocab, dtype=torch.int64), "t2d": t2d},
              str(folder / "vocab.safetensors"))
    write_manifest(folder, "vocab", {"synthetic": True}, target=target,
                   draft_vocab_size=draft_vocab, vocab_size=vocab_size, coverage=1.0)


def bench_loader(capture: Path, batch_tokens: int, workers: int, batches: int) -> float:
    """Tokens/s of the training data loader alone (mmap read + packing + collate)."""
    src = data.OfflineSource(capture)
    packing = data_plan.Packing(batch_tokens, 1, False)
    plan = data_plan.epoch_batches(np.arange(len(src.lengths)), src.lengths, packing, seed=0,
                                   epoch=0)
    plan = (plan * (batches // max(1, len(plan)) + 1))[:batches]
    loader = data_loader.loader(src, plan, batch_tokens, torch.bfloat16, num_workers=workers,
                                pin_memory=torch.cuda.is_available())
    t0, tokens = time.perf_counter(), 0
    for mb in loader:
        tokens += int((mb["doc_ids"] >= 0).sum())
    return tokens / (time.perf_counter() - t0)


def bench_train(root: Path, inputs: dict, batch_tokens: int, steps: int, smoke: bool,
                compile_: bool, precision: str = "bf16", workers: int = 2,
                profile: bool = False) -> dict:
    run = root / (f"run-{batch_tokens}-{precision}-w{workers}"
                  f"{'-compiled' if compile_ else ''}")
    log_every = max(1, steps // 5)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    config = TrainConfig(
        data=str(inputs["capture"]), vocab=str(inputs["vocab"]), out=str(run),
        batch_tokens=batch_tokens, max_steps=steps, log_every=log_every, eval_every=steps,
        save_every=steps, eval_fraction=0.01, num_workers=0 if smoke else workers,
        lm_head="target", compile=compile_, resume="never", precision=precision)
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    t0 = time.perf_counter()
    with (torch.profiler.profile(activities=acts) if profile
          else contextlib.nullcontext()) as prof:
        summary = train(config)
    wall = time.perf_counter() - t0
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in rows if r["kind"] == "train"][1:] or \
        [r for r in rows if r["kind"] == "train"]
    ckpt = run / "checkpoints" / f"step-{steps:08d}"
    out = {
        "batch_tokens": batch_tokens, "precision": precision, "compile": compile_,
        "workers": workers, "steps": steps,
        "tokens_per_s": float(np.mean([r["tokens_per_s"] for r in windows])),
        "step_s": float(np.mean([r["tokens"] / r["tokens_per_s"] / log_every for r in windows])),
        "peak_gb": (torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available()
                    else None),
        "checkpoint_gb": sum(f.stat().st_size for f in ckpt.iterdir()) / 2**30,
        "final_loss": summary["train"]["loss"], "wall_s": wall,
    }
    if prof is not None:
        out["profile"] = profile_summary(prof, wall)
    return out


def profile_summary(prof, wall: float, top: int = 25) -> dict:
    """The whole run's busiest host ops (self CPU time) and the GPU's busy share of the wall
    (kernels' self time summed: an upper bound where streams overlap)."""
    events = prof.key_averages()
    dev = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events) / 1e6
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {"wall_s": wall, "gpu_busy_s": dev, "gpu_busy_share": dev / wall if wall else None,
            "host_ops": [{"op": e.key, "calls": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6}
                         for e in rows]}


def markdown(result: dict) -> str:
    lines = [f"### eyas train ({result['setup']['shape']}, {result['setup']['device']})", "",
             "| batch tokens | precision | loader threads | compile | tokens/s | step s "
             "| peak GiB | ckpt GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in result["train"]:
        peak = f"{r['peak_gb']:.1f}" if r["peak_gb"] is not None else "-"
        lines.append(f"| {r['batch_tokens']} | {r.get('precision', 'bf16')} | "
                     f"{r.get('workers', 2)} | {r['compile']} "
                     f"| {r['tokens_per_s']:.0f} | "
                     f"{r['step_s']:.3f} | {peak} | {r['checkpoint_gb']:.2f} |")
    for r in result["train"]:
        if "profile" in r:
            p = r["profile"]
            lines += ["", f"profile of batch {r['batch_tokens']}, {r['workers']} loader threads: "
                      f"wall {p['wall_s']:.1f} s, GPU kernels {p['gpu_busy_s']:.1f} s", "",
                      "| host op | calls | self CPU s |", "|---|---:|---:|"]
            lines += [f"| {o['op'][:60]} | {o['calls']} | {o['self_cpu_s']:.2f} |"
                      for o in p["host_ops"]]
    lines += ["", "| loader workers | tokens/s |", "|---|---|"]
    lines += [f"| {w} | {t:.0f} |" for w, t in result["loader"].items()]
    return "\n".join(lines)


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-tokens", default="8192,16384")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--compile", action="store_true", help="also run with torch.compile")
    p.add_argument("--capture-tokens", type=int, default=200_000,
                   help="tokens in the synthetic capture (6.5 GB at 8B shapes per 200k)")
    p.add_argument("--work-dir", default=None, help="where the synthetic folders go (tmp)")
    p.add_argument("--out", default=None, help="JSON results (default "
                   "benchmarks/results/train.json, train-smoke.json with --smoke)")
    p.add_argument("--precision", default="bf16", help="comma list of: bf16, fp8")
    p.add_argument("--no-loader", action="store_true", help="skip the loader-only measurement")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    p.add_argument("--shape", choices=("llama-8b", "smollm2"), default="llama-8b")
    p.add_argument("--capture-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="how the synthetic capture stores the aux states")
    p.add_argument("--workers", default="2", help="comma list of eyas train --num-workers")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler over the first run: busiest host ops, GPU busy time")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    shape = TINY if args.smoke else SMOLLM2 if args.shape == "smollm2" else LLAMA_8B
    draft_vocab = 256 if args.smoke else 32000
    sizes = [int(b) for b in args.batch_tokens.split(",")] if not args.smoke else [256]
    steps = 4 if args.smoke else args.steps
    root = Path(tempfile.mkdtemp(prefix="eyas-bench-train-", dir=args.work_dir))
    try:
        target_dir, target = make_target(root / "target", shape)
        capture = root / "captured"
        make_capture(capture, target, shape, tokens=4096 if args.smoke else args.capture_tokens,
                     lengths=(16, 64) if args.smoke else (100, 701) if args.shape == "smollm2"
                     else (512, 2049), draft_vocab=draft_vocab,
                     part_tokens=1024 if args.smoke else 16384, dtype=args.capture_dtype)
        make_vocab(root / "vocab", target, shape["vocab_size"], draft_vocab)
        inputs = {"capture": capture, "vocab": root / "vocab"}
        precisions = args.precision.split(",")
        workers = [int(w) for w in args.workers.split(",")]
        runs = [bench_train(root, inputs, b, steps, args.smoke, False, prec, w,
                            profile=args.profile and i == 0)
                for i, (b, prec, w) in enumerate((b, prec, w) for b in sizes
                                                 for prec in precisions for w in workers)]
        if args.compile:
            runs += [bench_train(root, inputs, b, steps, args.smoke, True) for b in sizes]
        loader = {} if args.no_loader else {
            w: bench_loader(capture, max(sizes), w, 8 if args.smoke else 40)
            for w in ((0,) if args.smoke else (0, 2))}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"benchmark": "train",
              "setup": {"shape": "tiny" if args.smoke else {"llama-8b": "llama-3.1-8b"}.get(
                  args.shape, args.shape), "capture_dtype": args.capture_dtype,
                        "device": (torch.cuda.get_device_name() if torch.cuda.is_available()
                                   else platform.processor() or "cpu"),
                        "draft_vocab": draft_vocab, "torch": torch.__version__,
                        "transformers": transformers.__version__},
              "train": runs, "loader": loader}
    print(markdown(result))
    out = Path(args.out or f"benchmarks/results/train{'-smoke' if args.smoke else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
