"""`eyas capture --backend vllm` against `--backend transformers` on one GPU (issue 32, items 2
and 5): the same prepared rows captured by both, the shards compared sample by sample, and the
speed of each.

    python benchmarks/capture_backends.py --target smol-hf --prepared run/prepared \
        --work /tmp/w/cb --model-dtype fp32 --json capture-backends-smollm2.json
    python benchmarks/capture_backends.py --llama8b --data realdata/heldout.jsonl \
        --tokenizer smol-hf --work /tmp/w/cb8b --model-dtype bf16 --limit 400 \
        --json capture-backends-llama8b.json

Each backend runs as its own `eyas capture` process (so one's GPU memory never meets the
other's), one after the other on the same rows. Per backend: the wall seconds of the whole
command (model load or engine start included) and capture's own tokens/s of its loop (the
shard state's `this_job`, from the first batch to the last part written), bytes per token,
samples set aside and why.

Exactness: per sample the aux states, the final (normed) hidden state and the target's top-1.
Both backends store bf16, so equal within the dtype's rounding means mostly identical values
and the rest one or two bf16 ulps apart: reported as the share of elements identical, the
largest difference relative to the sample's RMS, and the share of tokens whose top-1 agrees
(a near-tie between the target's two best tokens can flip under different kernels: those
tokens' top-2 margins are reported).

`--llama8b` builds a randomly initialised Llama-3.1-8B-shaped target first (speed needs no
trained weights), saved as safetensors with `--tokenizer`'s tokenizer (any; its ids fit the
128 K vocabulary), and prepares `--data` for it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from capture import LLAMA_8B  # noqa: E402  (the 8B shape of the capture benchmark)


def sh(cmd: list[str], log: Path) -> float:
    """Run `cmd`, its output appended to `log`; wall seconds. Fails loudly."""
    start = time.perf_counter()
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        rc = subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT).returncode
    took = time.perf_counter() - start
    print(f"{cmd[3] if len(cmd) > 3 else cmd}: {took:.1f} s (rc {rc})", flush=True)
    if rc:
        raise SystemExit(f"{' '.join(map(str, cmd[:4]))} failed (rc {rc}); see {log}")
    return took


def make_llama8b(out: Path, tokenizer: str, shape: dict = LLAMA_8B) -> None:
    """A random bf16 LlamaForCausalLM of `shape` (Llama-3.1-8B's unless given) with
    `tokenizer`, saved to `out`."""
    import transformers

    if (out / "config.json").is_file():
        return
    config = transformers.LlamaConfig(**shape, torch_dtype="bfloat16")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(out, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
    del model
    torch.cuda.empty_cache()


def capture(backend: str, a, prepared: Path, out: Path, log: Path) -> dict:
    cmd = [sys.executable, "-m", "eyas", "capture", "--target", a.target, "--data", prepared,
           "--out", out, "--split", a.split, "--model-dtype", a.model_dtype,
           "--batch-tokens", a.batch_tokens, "--backend", backend]
    if a.limit:
        cmd += ["--limit", a.limit]
    if backend == "vllm":
        cmd += ["--gpu-memory-utilization", a.gpu_memory_utilization,
                "--tensor-parallel-size", a.tensor_parallel_size]
        if a.max_model_len:
            cmd += ["--max-model-len", a.max_model_len]
        if a.kv_cache_gib:
            cmd += ["--kv-cache-gib", a.kv_cache_gib]
    wall = sh(cmd, log)
    manifest = json.loads((out / "eyas.json").read_text())
    stats = manifest["stats"]
    job = stats.get("this_job", {})
    return {"backend": backend, "wall_s": wall, "samples": stats["samples"],
            "tokens": stats["tokens"], "bytes_per_token": stats["bytes_per_token"],
            "set_aside": stats["nonfinite"], "loop_tokens_per_s": job.get("tokens_per_s"),
            "loop_s": job.get("seconds"), "wall_tokens_per_s": stats["tokens"] / wall,
            "engine": manifest.get("engine")}


def compare(hf: Path, vl: Path, target: str, model_dtype: str, margins: bool) -> dict:
    """Sample by sample: the vLLM capture against the transformers capture."""
    from eyas.store import shards

    def by_row(folder):
        cs = shards.open_capture(folder)
        return cs, {int(cs.sample_index[i]): i for i in range(cs.num_samples)}

    (ch, rh), (cv, rv) = by_row(hf), by_row(vl)
    common = sorted(set(rh) & set(rv))
    acc = {k: {"elements": 0, "identical": 0, "max_rel": 0.0} for k in ("aux_hidden",
                                                                       "final_hidden")}
    per_layer = [0.0] * len(ch.aux_layer_ids)
    tokens = agree = 0
    flips = []  # (row, token) whose top-1 differs
    for row in common:
        h, v = ch.sample(rh[row], dtype=torch.float32), cv.sample(rv[row], dtype=torch.float32)
        assert h["input_ids"].tolist() == v["input_ids"].tolist(), row
        for key in acc:
            diff = (h[key] - v[key]).abs()
            rms = h[key].pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
            acc[key]["elements"] += diff.numel()
            acc[key]["identical"] += int((diff == 0).sum())
            acc[key]["max_rel"] = max(acc[key]["max_rel"], float((diff / rms).max()))
            if key == "aux_hidden":
                for j in range(diff.shape[1]):
                    per_layer[j] = max(per_layer[j], float((diff[:, j] / rms[:, j]).max()))
        same = h["target_top1"] == v["target_top1"]
        tokens += same.numel()
        agree += int(same.sum())
        flips += [(row, int(t)) for t in (~same).nonzero().flatten()[:8]]
    result = {"samples_compared": len(common), "only_transformers": len(set(rh) - set(rv)),
              "only_vllm": len(set(rv) - set(rh)), "tokens": tokens,
              "top1_agreement": agree / max(tokens, 1), "top1_differ": tokens - agree,
              "aux_max_rel_per_layer": dict(zip(map(str, ch.aux_layer_ids), per_layer))}
    for key, s in acc.items():
        result[key] = {"identical_share": s["identical"] / max(s["elements"], 1),
                       "max_abs_over_rms": s["max_rel"]}
    if margins and flips:
        result["flip_margins"] = flip_margins(ch, rh, flips[:64], target, model_dtype)
    return result


def flip_margins(cs, rows: dict, flips: list, target: str, model_dtype: str) -> list[float]:
    """The target's top-1 minus top-2 logit at the tokens whose top-1 differs, from the
    transformers capture's final state and the target's own lm_head."""
    from eyas.serve.vllm_capture import load_head

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[model_dtype]
    _, head, _ = load_head(target, revision=None, trust_remote_code=False,
                           dtype=getattr(torch, dtype), device=device)
    out = []
    with torch.inference_mode():
        for row, t in flips:
            final = cs.sample(rows[row], dtype=getattr(torch, dtype))["final_hidden"][t]
            top = head(final.to(device)[None]).float().topk(2).values[0]
            out.append(round(float(top[0] - top[1]), 5))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target folder (safetensors; vLLM reads no GGUF)")
    p.add_argument("--prepared", help="an `eyas prepare` folder for --target")
    p.add_argument("--llama8b", action="store_true",
                   help="build a random Llama-3.1-8B-shaped target in WORK/llama8b first")
    p.add_argument("--data", help="with --llama8b: the prompts to prepare (jsonl)")
    p.add_argument("--tokenizer", help="with --llama8b: a folder whose tokenizer it gets")
    p.add_argument("--work", required=True)
    p.add_argument("--split", default="all")
    p.add_argument("--limit", type=int, default=0, help="first N rows (0 = all)")
    p.add_argument("--model-dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--batch-tokens", type=int, default=65536)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--kv-cache-gib", type=float, default=0.0,
                   help="vLLM's KV cache size (skips its memory profile: for a shared GPU)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--backends", default="transformers,vllm")
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    prepared = Path(a.prepared) if a.prepared else work / "prepared"
    if a.llama8b:
        a.target = str(work / "llama8b")
        start = time.perf_counter()
        make_llama8b(Path(a.target), a.tokenizer)
        print(f"random 8B target: {time.perf_counter() - start:.0f} s", flush=True)
        if not (prepared / "eyas.json").is_file():
            sh([sys.executable, "-m", "eyas", "prepare", "--target", a.target, "--data", a.data,
                "--out", prepared], log)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "host": platform.node(), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              "target": a.target, "llama8b_random": a.llama8b, "prepared": str(prepared),
              "settings": {k: getattr(a, k) for k in ("split", "limit", "model_dtype",
                                                      "batch_tokens", "gpu_memory_utilization",
                                                      "tensor_parallel_size", "max_model_len",
                                                      "kv_cache_gib")},
              "command": " ".join(sys.argv), "backends": {}}
    try:
        import vllm
        result["vllm"] = vllm.__version__
    except ImportError:
        result["vllm"] = None
    outs = {}
    for backend in a.backends.split(","):
        outs[backend] = work / f"capture-{backend}"
        result["backends"][backend] = capture(backend, a, prepared, outs[backend], log)
        Path(a.json).write_text(json.dumps(result, indent=1))
    if {"transformers", "vllm"} <= set(outs):
        result["vllm_vs_transformers"] = compare(outs["transformers"], outs["vllm"], a.target,
                                                 a.model_dtype, margins=not a.llama8b)
        t, v = result["backends"]["transformers"], result["backends"]["vllm"]
        if t["loop_tokens_per_s"] and v["loop_tokens_per_s"]:
            result["vllm_speedup_loop"] = v["loop_tokens_per_s"] / t["loop_tokens_per_s"]
        result["vllm_speedup_wall"] = t["wall_s"] / v["wall_s"]
    Path(a.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1), flush=True)
    if os.environ.get("CB_KEEP") != "1":  # the 8B captures are GBs: the JSON is what is kept
        import shutil

        for folder in outs.values():
            shutil.rmtree(folder, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
