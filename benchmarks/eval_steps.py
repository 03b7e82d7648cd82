"""Where a step of `eyas eval`'s batched loop goes (eyas.serve.batched.generate_batch): the
host's time per part of a step (the target's forward, the drafter's proposal, verification
and bookkeeping), the GPU's busy time over the same steps, and the ops that cost most, under
torch.profiler.

    python benchmarks/eval_steps.py --shape qwen2.5-1.5b --batch 64 --k 2 --new-tokens 64 \
        --json benchmarks/results/eval-steps.json

Why: on an H100 `eyas eval` of the real Qwen2.5-Coder-1.5B at batch 64 took ~120 ms per
step with the GPU 5-17 % busy (docs/benchmarks.md, session 39), while on the CPU a step of
the batched loop costs what transformers' own `generate` does. So the host is the limit on a
GPU, and this says which part of it. The target is a random Llama of a served_shape.py shape
(the work per step is the shape's, the weights do not matter) and the draft a random
one-layer EAGLE-3 of 32,000 draft ids; a random draft is rarely accepted, so each step
yields about one token per row and the steps counted are the new tokens. Plain decoding
(no drafter) runs the same way for comparison. `--smoke` runs the tiny shape on the CPU
(tests/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from capture import build_model  # noqa: E402  (a random Llama, built in its dtype)
from served_shape import SHAPES  # noqa: E402

# the parts of a step, each the method that does it (timed as a profiler range)
PARTS = {"target forward": ("BatchTarget", "step"), "target commit": ("BatchTarget", "commit"),
         "draft proposal": ("BatchEagle3Drafter", "propose"),
         "verification": (None, "_accept_greedy")}


def build(shape: str, device: str, dtype: torch.dtype, draft_vocab: int):
    """A random Llama of `shape` and a random one-layer EAGLE-3 draft over it."""
    from eyas.draft.config import DraftConfig
    from eyas.draft.eagle3 import Eagle3Draft
    from eyas.targets.models import inspect_model

    torch.manual_seed(0)
    model = build_model(SHAPES[shape], device, dtype)
    info = inspect_model(model)
    vocab = min(draft_vocab, info.vocab_size)
    cfg = DraftConfig.from_target(info, draft_vocab_size=vocab,
                                  aux_layer_ids=info.default_aux_layer_ids)
    draft = Eagle3Draft(cfg, model.model.embed_tokens)
    used = torch.zeros(info.vocab_size, dtype=torch.bool)
    used[:vocab] = True  # draft id i is target id i
    draft.set_vocab(torch.zeros(vocab, dtype=torch.long), used)
    return model, draft.to(device=device, dtype=dtype).eval()


@contextmanager
def ranges():
    """Each of PARTS' methods inside a profiler range of its part's name."""
    from torch.profiler import record_function

    from eyas.serve import batched

    saved = []
    for name, (cls, method) in PARTS.items():
        owner = getattr(batched, cls) if cls else batched
        original = getattr(owner, method)

        def ranged(*args, _f=original, _name=name, **kwargs):
            with record_function(_name):
                return _f(*args, **kwargs)

        setattr(owner, method, ranged)
        saved.append((owner, method, original))
    try:
        yield
    finally:
        for owner, method, original in saved:
            setattr(owner, method, original)


def run(model, draft, prompts, k: int, new_tokens: int, device: str, sdpa: str) -> dict:
    """One generate_batch over `prompts` (drafter: the EAGLE-3 draft, or none at k = 0)
    under the profiler: per step, wall ms, host ms of each part, GPU busy ms; top ops."""
    from torch.profiler import ProfilerActivity, profile

    from eyas.serve.batched import BatchEagle3Drafter, BatchTarget, generate_batch
    from eyas.serve.speculate import Sampling
    from eyas.targets.sdpa import TARGET_SDPA_ENV

    os.environ[TARGET_SDPA_ENV] = sdpa  # (read by each target forward)
    ids = tuple(draft.cfg.aux_layer_ids) if k else ()
    target = BatchTarget(model, model.model.layers, model.model.norm, ids)

    def decode(n):
        drafter = BatchEagle3Drafter(draft, device) if k else None
        return generate_batch(target, drafter, prompts, k, n, frozenset(), Sampling())

    decode(4)  # warm-up: kernels, allocator
    activities = [ProfilerActivity.CPU] + \
        ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with ranges(), profile(activities=activities) as prof:
        sync()
        start = time.perf_counter()
        out = decode(new_tokens)
        sync()
        wall = time.perf_counter() - start
    steps = max(g.stats.target_forwards for g in out)
    host, gpu_us, top_host, top_gpu = summarize(prof.key_averages(), steps)
    return {"k": k, "sdpa": sdpa, "steps": steps, "tokens": sum(len(g.tokens) for g in out),
            "wall_ms_per_step": round(1e3 * wall / steps, 2),
            "host_ms_per_step": {p: round(host.get(p, 0.0), 2) for p in PARTS},
            "gpu_busy_ms_per_step": round(gpu_us / 1e3 / steps, 2),
            "gpu_busy_fraction": round(gpu_us / 1e6 / wall, 3),
            "top_host_ops_ms_per_step": {e.key: round(e.self_cpu_time_total / 1e3 / steps, 3)
                                         for e in top_host},
            "top_gpu_ops_ms_per_step": {e.key: round(e.self_device_time_total / 1e3 / steps, 3)
                                        for e in top_gpu if e.self_device_time_total > 0}}


def summarize(events, steps: int):
    """Of the profiler's key averages: host ms per step of each part, GPU busy microseconds,
    the ops with the most host self time (15) and GPU self time (10). On a GPU each range of
    PARTS is also a CUDA "user annotation" event of the same key that spans the kernels run
    inside it: not host time, and no GPU work of its own, so it is in neither sum."""
    def on(e, device: str) -> bool:
        return getattr(getattr(e, "device_type", None), "name", "CPU") == device

    def annotation(e) -> bool:
        return e.key in PARTS or getattr(e, "is_user_annotation", False)

    host = {e.key: e.cpu_time_total / 1e3 / steps for e in events
            if e.key in PARTS and on(e, "CPU")}
    gpu_us = sum(e.self_device_time_total for e in events
                 if on(e, "CUDA") and not annotation(e))
    top_host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    top_gpu = sorted((e for e in events if not annotation(e)),
                     key=lambda e: e.self_device_time_total, reverse=True)[:10]
    return host, gpu_us, top_host, top_gpu


def _way(run: dict) -> str:
    """A run's label: plain or eagle3 k=K, and its SDPA setting (torch: before --sdpa)."""
    return (f"eagle3 k={run['k']}" if run["k"] else "plain") + f", sdpa {run.get('sdpa', 'torch')}"


def markdown(result: dict) -> str:
    lines = [f"`{result['command']}`", "",
             f"{result['device']}, torch {result['torch']}, shape {result['shape']}, batch "
             f"{result['batch']}, prompts of {result['prompt_tokens']} tokens, "
             f"{result['dtype']}", "",
             "| way | steps | wall ms/step | " + " | ".join(f"host {p}" for p in PARTS)
             + " | GPU busy ms/step | GPU busy |",
             "|---|---:|---:|" + "---:|" * len(PARTS) + "---:|---:|"]
    for r in result["runs"]:
        lines.append(f"| {_way(r)} | {r['steps']} | {r['wall_ms_per_step']} | "
                     + " | ".join(str(r["host_ms_per_step"][p]) for p in PARTS)
                     + f" | {r['gpu_busy_ms_per_step']} | {r['gpu_busy_fraction']:.0%} |")
    for r in result["runs"]:
        lines += ["", f"{_way(r)}, host ops by self time (ms per step): "
                  + ", ".join(f"{k} {v}" for k, v in r["top_host_ops_ms_per_step"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--k", default="2", help="EAGLE-3 k values; 0 = plain decoding")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sdpa", default="auto",
                   help="EYAS_TARGET_SDPA values, each a run of every k: auto (cuDNN's "
                        "attention left out of the target's forwards, eyas's default) or torch "
                        "(torch's own choice: cuDNN on Hopper)")
    p.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU, few steps")
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    if a.smoke:
        a.shape, a.batch, a.prompt_tokens, a.new_tokens = "tiny", 4, 12, 6
        a.device, a.dtype = "cpu", "float32"
    dtype = getattr(torch, a.dtype)
    model, draft = build(a.shape, a.device, dtype, 32000)
    g = torch.Generator().manual_seed(1)
    vocab = SHAPES[a.shape]["vocab_size"]
    prompts = [torch.randint(10, vocab, (a.prompt_tokens,), generator=g)
               for _ in range(a.batch)]
    result = {"benchmark": "eval-steps", "command": "python benchmarks/eval_steps.py "
              + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "device": torch.cuda.get_device_name(0) if a.device.startswith("cuda")
              else "CPU", "torch": torch.__version__, "shape": a.shape, "batch": a.batch,
              "prompt_tokens": a.prompt_tokens, "dtype": a.dtype,
              "runs": [run(model, draft, prompts, int(k), a.new_tokens, a.device, sdpa)
                       for sdpa in a.sdpa.split(",") for k in a.k.split(",")]}
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
