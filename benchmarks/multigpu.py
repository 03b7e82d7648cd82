"""Multi-GPU runs on one host: `eyas train` under torchrun and `eyas capture --device-map`.

train (Llama-3.1-8B-shaped draft, synthetic captures from benchmarks/train.py):
  1. one GPU, --grad-accum 2; 2. two GPUs (torchrun --nproc-per-node 2), DDP, --grad-accum 1;
  3. the same with --parallel fsdp; all at the same global batch (2 micro-batches of
  --batch-tokens per optimizer step), so the loss trajectories must agree (reported: the
  largest relative difference of any logged window); tokens/s (steady windows, the first one
  left out), scaling = two-GPU / one-GPU tokens/s, peak GPU memory per rank;
  4. resume: the DDP run's folder is copied, and training continues from its mid-run
  checkpoint on two GPUs; the resumed windows and final weights are compared with the
  uninterrupted run.
capture (a Llama-3.1-70B-shaped target with random bf16 weights, truncated to --layers layers
so a single-GPU reference fits): the real `capture()` with --device-map auto (layers spread
over every GPU by accelerate) and with --device cuda:0; the captured files are compared tensor
by tensor, and both runs' tokens/s and per-GPU peak memory are reported, plus a second one-GPU
run after them (how much of the first run's time was warm-up).

Every run is a fresh process (torchrun or python), as a user would start it.

    python benchmarks/multigpu.py                    # 2 GPUs: train + capture, ~8 minutes
    python benchmarks/multigpu.py --parts train      # or capture
    python benchmarks/multigpu.py --smoke            # CPU: tiny shapes, gloo, checks the script

Prints a markdown table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import LLAMA_8B, TINY, make_capture, make_target, make_vocab  # noqa: E402

LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                 max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False)
# NVLink multicast stays off on shared hosts (see the device notes); children inherit these.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}

TRAIN_RUNNER = """
import json, sys
from eyas.draft.train_config import TrainConfig
from eyas.train import train
train(TrainConfig(**json.loads(sys.argv[1])))
"""
CAPTURE_RUNNER = """
import json, sys, time, torch
from eyas.capture import CaptureConfig, capture
t0 = time.perf_counter()
stats = capture(CaptureConfig(**json.loads(sys.argv[1])))
peaks = [torch.cuda.max_memory_allocated(i) / 2**30 for i in range(torch.cuda.device_count())]
print("RESULT " + json.dumps({"stats": stats, "wall_s": time.perf_counter() - t0,
                              "peak_gib": peaks}))
"""
log = logging.getLogger("multigpu")


def _python(script: Path, args: list[str], nproc: int | None, timeout: float) -> str:
    """Run `script` in a fresh interpreter (under torchrun with `nproc`); returns stdout."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={nproc}"] if nproc else [sys.executable])
    env = {**os.environ, **SAFE_ENV, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    t0 = time.perf_counter()
    proc = subprocess.run([*launcher, str(script), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    log.info("%s (%s procs): rc %d in %.0f s", script.name, nproc or 1, proc.returncode,
             time.perf_counter() - t0)
    if proc.returncode != 0:
        raise RuntimeError(f"{script.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


# ---------------------------------------------------------------------------------------------
# train


def _train_rows(run: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def _final_weights(run: Path, step: int) -> dict:
    from safetensors.torch import load_file

    from eyas.store import checkpoint

    return load_file(str(checkpoint.step_dir(run, step) / "draft.safetensors"))


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def _weights_diff(a: dict, b: dict) -> float:
    """||a - b|| / ||a|| over all floating-point tensors of two checkpoints."""
    keys = [k for k in a if a[k].is_floating_point()]
    diff = sum(float((a[k].double() - b[k].double()).square().sum()) for k in keys)
    return (diff / sum(float(a[k].double().square().sum()) for k in keys)) ** 0.5


def _one_train(root: Path, name: str, base: dict, nproc: int | None, timeout: float,
               start: int = 0, **overrides) -> dict:
    """One training run into root/name; with `start`, resumed from that folder's step-`start`
    checkpoint."""
    from eyas.store import checkpoint
    from eyas.config import to_dict
    from eyas.draft.train_config import TrainConfig

    if start:
        overrides["resume"] = str(checkpoint.step_dir(root / name, start))
    cfg = TrainConfig(**{**base, "out": str(root / name), **overrides})
    script = root / "train_runner.py"
    script.write_text(TRAIN_RUNNER)
    t0 = time.perf_counter()
    _python(script, [json.dumps(to_dict(cfg))], nproc, timeout)
    wall = time.perf_counter() - t0
    rows = _train_rows(Path(cfg.out))
    windows = [r["tokens_per_s"] for r in rows]
    # steady: the median window after the first of this process (which holds start-up; a
    # resumed run's folder also holds the windows logged before the resume); the median
    # also leaves out the window that holds the mid-run checkpoint save
    first = next(i for i, r in enumerate(rows) if r["step"] > start)
    mine = windows[first + 1:] or windows[first:]
    return {"name": name, "ranks": nproc or 1, "grad_accum": cfg.grad_accum,
            "parallel": cfg.parallel, "tokens_per_s": float(np.median(mine)),
            "mean_tokens_per_s": float(np.mean(mine)),
            "window_tokens_per_s": windows, "loss": [r["loss"] for r in rows],
            "grad_norm": [r["grad_norm"] for r in rows], "steps": [r["step"] for r in rows],
            "peak_gpu_gib": rows[-1].get("peak_gpu_gib"), "wall_s": wall}


def bench_train(root: Path, args) -> dict:
    shape, smoke = (TINY, True) if args.smoke else (LLAMA_8B, False)
    draft_vocab = 256 if smoke else 32000
    _, target = make_target(root / "target", shape)
    make_capture(root / "captured", target, shape, tokens=4096 if smoke else args.capture_tokens,
                 lengths=(16, 64) if smoke else (512, 2049), draft_vocab=draft_vocab,
                 part_tokens=1024 if smoke else 16384)
    make_vocab(root / "vocab", target, shape["vocab_size"], draft_vocab)
    steps, half = args.steps, args.steps // 2
    base = dict(data=str(root / "captured"), vocab=str(root / "vocab"),
                batch_tokens=256 if smoke else args.batch_tokens, max_steps=steps,
                log_every=max(1, steps // 8), eval_every=steps, save_every=half,
                eval_fraction=0.01, num_workers=0 if smoke else 2, lm_head="target",
                precision="bf16", resume="never", seed=0, keep_last=4)
    # one GPU: `torchrun --nproc-per-node 1` would do the same; plain python is what users run
    one = _one_train(root, "one", base, None, args.timeout, grad_accum=2)
    runs = [one, _one_train(root, "two-ddp", base, 2, args.timeout, parallel="ddp"),
            _one_train(root, "two-fsdp", base, 2, args.timeout, parallel="fsdp")]
    one_weights = _final_weights(root / "one", steps)
    for r in runs[1:]:
        r["max_rel_loss_diff_vs_one"] = _max_rel(one["loss"], r["loss"])
        r["scaling_vs_one"] = r["tokens_per_s"] / one["tokens_per_s"]
        r["mean_scaling_vs_one"] = r["mean_tokens_per_s"] / one["mean_tokens_per_s"]
        r["weights_rel_diff_vs_one"] = _weights_diff(one_weights,
                                                     _final_weights(root / r["name"], steps))
    # resume the DDP run from its mid-run checkpoint, on two GPUs, into a copy of its folder
    shutil.copytree(root / "two-ddp", root / "two-ddp-resumed")
    resumed = _one_train(root, "two-ddp-resumed", base, 2, args.timeout, start=half,
                         parallel="ddp")
    ddp = runs[1]
    after = [i for i, s in enumerate(ddp["steps"]) if s > half]
    resumed["resumed_from_step"] = half
    resumed["max_rel_loss_diff_vs_uninterrupted"] = _max_rel(
        [ddp["loss"][i] for i in after], [resumed["loss"][i] for i in after])
    resumed["weights_rel_diff_vs_uninterrupted"] = _weights_diff(
        _final_weights(root / "two-ddp", steps), _final_weights(root / "two-ddp-resumed", steps))
    return {"shape": "tiny" if smoke else "llama-3.1-8b", "steps": steps,
            "batch_tokens_per_micro_batch": base["batch_tokens"],
            "global_tokens_per_step": 2 * base["batch_tokens"], "runs": runs + [resumed]}


# ---------------------------------------------------------------------------------------------
# capture


def make_big_target(folder: Path, shape: dict, layers: int) -> Path:
    """A random bf16 Llama with `shape` but `layers` layers, initialised on a GPU when there
    is one (CPU init of ~10B parameters takes minutes), saved like a hub checkpoint."""
    from eyas.targets.tiny import save_tiny_tokenizer

    config = transformers.LlamaConfig(**{**shape, "num_hidden_layers": layers})
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="4GB")
    save_tiny_tokenizer(folder)  # only hashed: the token ids below are random
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return folder


def make_prepared(folder: Path, target_dir: Path, vocab: int, samples: int,
                  lengths: tuple[int, int]) -> Path:
    """A prepared/ folder (docs/architecture.md) of random token rows, 60 % loss-masked."""
    import datasets

    from eyas.store.manifest import target_record, write_manifest
    from eyas.targets.models import load_tokenizer

    rng = np.random.default_rng(0)

    def split(n: int, prefix: str) -> datasets.Dataset:
        sizes = rng.integers(*lengths, size=n)
        return datasets.Dataset.from_dict({
            "input_ids": [rng.integers(0, vocab, size=int(s)).tolist() for s in sizes],
            "loss_mask": [(rng.random(int(s)) < 0.6).astype(int).tolist() for s in sizes],
            "sample_id": [f"{prefix}:{i}" for i in range(n)],
            "num_tokens": [int(s) for s in sizes], "messages_json": ["[]"] * n})

    datasets.DatasetDict({"train": split(samples, "train"), "eval": split(2, "eval")}
                         ).save_to_disk(str(folder / "dataset"))
    target = target_record(str(target_dir), tokenizer=load_tokenizer(str(target_dir)))
    write_manifest(folder, "prepare", {"synthetic": True}, target=target,
                   max_length=lengths[1])
    return folder


def _one_capture(root: Path, name: str, target: Path, prepared: Path, timeout: float,
                 **where) -> dict:
    from eyas.capture import CaptureConfig
    from eyas.config import to_dict

    cfg = CaptureConfig(target=str(target), data=str(prepared), out=str(root / name),
                        batch_tokens=16384, **where)
    script = root / "capture_runner.py"
    script.write_text(CAPTURE_RUNNER)
    out = _python(script, [json.dumps(to_dict(cfg))], None, timeout)
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    stats = result["stats"]
    return {"name": name, **where, "tokens": stats["tokens"],
            "tokens_per_s": stats["tokens"] / stats["this_job"]["loop_s"],
            "end_to_end_tokens_per_s": stats["tokens"] / result["wall_s"],
            "wall_s": result["wall_s"], "peak_gpu_gib": result["peak_gib"]}


def compare_captures(a: Path, b: Path) -> dict:
    """Tensor by tensor over every part file: equal files, and the largest |a - b| otherwise."""
    from safetensors.torch import load_file

    files_a = sorted(p.name for p in a.glob("shard-*.safetensors"))
    files_b = sorted(p.name for p in b.glob("shard-*.safetensors"))
    if files_a != files_b:
        return {"same_files": False, "files_a": len(files_a), "files_b": len(files_b)}
    equal, worst = True, 0.0
    for name in files_a:
        ta, tb = load_file(str(a / name)), load_file(str(b / name))
        for k in ta:
            if not torch.equal(ta[k], tb[k]):
                equal = False
                worst = max(worst, float((ta[k].float() - tb[k].float()).abs().max()))
    return {"same_files": True, "files": len(files_a), "bitwise_equal": equal,
            "max_abs_diff": worst}


def bench_capture(root: Path, args) -> dict:
    smoke = args.smoke
    shape = {**TINY, "vocab_size": 2048} if smoke else LLAMA_70B
    layers = 8 if smoke else args.layers
    target = make_big_target(root / "target70b", shape, layers)
    prepared = make_prepared(root / "prepared", target, shape["vocab_size"],
                             16 if smoke else args.capture_samples,
                             (16, 64) if smoke else (1024, 2049))
    one_gpu = dict(device="cuda:0" if torch.cuda.is_available() else "cpu")
    single = _one_capture(root, "single", target, prepared, args.timeout, **one_gpu)
    split = _one_capture(root, "device-map-auto", target, prepared, args.timeout,
                         device_map="auto")
    result = {"shape": f"{'tiny' if smoke else 'llama-3.1-70b'} truncated to {layers} layers",
              "params_b": sum(f.stat().st_size for f in target.glob("*.safetensors")) / 2e9,
              "runs": [single, split], "compare": compare_captures(root / "single",
                                                                   root / "device-map-auto")}
    for name in ("single", "device-map-auto"):
        shutil.rmtree(root / name, ignore_errors=True)
    # one GPU again, after the split run: the first run's warm-up (page cache, kernels) shows
    # as the difference between the two one-GPU runs (a timing only: --smoke, which checks
    # the script and the comparison, leaves it out)
    if not smoke:
        result["runs"].append(_one_capture(root, "single-again", target, prepared,
                                           args.timeout, **one_gpu))
        shutil.rmtree(root / "single-again", ignore_errors=True)
    return result


# ---------------------------------------------------------------------------------------------
# report


def markdown(result: dict) -> str:
    lines = []
    if "train" in result:
        t = result["train"]
        lines += [f"### eyas train, {t['shape']} draft, {t['global_tokens_per_step']} tokens "
                  f"per optimizer step, {t['steps']} steps", "",
                  "| run | ranks x accum | tokens/s | scaling | max rel. loss diff | "
                  "weights rel. diff | peak GiB per rank |", "|---|---|---|---|---|---|---|"]
        for r in t["runs"]:
            diff = r.get("max_rel_loss_diff_vs_one", r.get("max_rel_loss_diff_vs_uninterrupted"))
            wdiff = r.get("weights_rel_diff_vs_one", r.get("weights_rel_diff_vs_uninterrupted"))
            lines.append(f"| {r['name']} | {r['ranks']} x {r['grad_accum']} | "
                         f"{r['tokens_per_s']:.0f} | {r.get('scaling_vs_one', '-'):.4} | "
                         f"{'-' if diff is None else f'{diff:.2e}'} | "
                         f"{'-' if wdiff is None else f'{wdiff:.2e}'} | {r['peak_gpu_gib']} |")
    if "capture" in result:
        c = result["capture"]
        lines += ["", f"### eyas capture, {c['shape']} ({c['params_b']:.1f}B parameters)", "",
                  "| run | tokens | tokens/s (loop) | tokens/s (incl. load) | peak GiB per GPU |",
                  "|---|---|---|---|---|"]
        for r in c["runs"]:
            lines.append(f"| {r['name']} | {r['tokens']} | {r['tokens_per_s']:.0f} | "
                         f"{r['end_to_end_tokens_per_s']:.0f} | "
                         f"{[round(x, 1) for x in r['peak_gpu_gib']]} |")
        lines += ["", f"captured files compared: {c['compare']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="train,capture", help="comma list of: train, capture")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per training run")
    p.add_argument("--batch-tokens", type=int, default=16384, help="tokens per micro-batch")
    p.add_argument("--capture-tokens", type=int, default=200_000,
                   help="tokens in the synthetic training capture")
    p.add_argument("--layers", type=int, default=10, help="layers of the 70B-shaped target")
    p.add_argument("--capture-samples", type=int, default=96,
                   help="samples (1-2K tokens) captured by each capture run")
    p.add_argument("--timeout", type=float, default=900, help="seconds per child run")
    p.add_argument("--work-dir", default=None, help="where the synthetic folders go (tmp)")
    p.add_argument("--out", default=None, help="JSON results (default benchmarks/results/"
                   "multigpu.json, multigpu-smoke.json with --smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (gloo)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps = 4
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parts = args.parts.split(",")
    if "capture" in parts and importlib.util.find_spec("accelerate") is None:
        raise SystemExit("capture --device-map needs accelerate: pip install 'eyas[multigpu]'")
    result = {"benchmark": "multigpu", "setup": {
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d")}}
    for part, fn in (("train", bench_train), ("capture", bench_capture)):
        if part in parts:
            root = Path(tempfile.mkdtemp(prefix=f"eyas-bench-{part}-", dir=args.work_dir))
            try:
                result[part] = fn(root, args)
            finally:
                shutil.rmtree(root, ignore_errors=True)
    print(markdown(result))
    out = Path(args.out or f"benchmarks/results/multigpu{'-smoke' if args.smoke else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
