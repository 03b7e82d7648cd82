"""Speed of `eyas eval`'s speculative loop on a Llama-3.1-8B-shaped target (random bf16 weights)
with a random EAGLE-3 draft of the matching shape (draft vocab 32000), batch 1.

Random weights make acceptance meaningless, so besides the plain `run_eval` sweep (target,
n-gram, eagle3 at k = 1, 3, 5: tokens/s, lossless check in bf16) it measures what the
hardware allows: an "oracle" run where the EAGLE-3 draft runs at full cost but the proposed
tokens are the target's own continuation (AL = k + 1), i.e. the speedup a perfect draft of this
shape would give here; and micro timings of one target forward of 1 and k+1 tokens and of one
draft proposal of k tokens.

    python benchmarks/eval.py              # H200: ~2-4 minutes
    python benchmarks/eval.py --smoke      # tiny CPU model, seconds

With `--target T --draft D --data PROMPTS` it instead times whole `eyas eval` sweeps on a real
target and draft, one prompt at a time against `--batch-size` prompts at once (issue: the
30-prompt k = 3,6 sweep in <= 30 s), and checks the two reports agree token for token:

    python benchmarks/eval.py --target smol.gguf --draft run/draft --data heldout.jsonl \
        --prompts 30 --new-tokens 96 --k 3,6 --batch-sizes 1,32 --json eval-batched.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import torch
import transformers

from eyas.draft.config import DraftConfig
from eyas.draft.eagle3 import Eagle3Draft
from eyas.evaluate import EvalConfig, Prompt
from eyas.serve.eval_measure import run_eval
from eyas.targets.models import inspect_model, submodule
from eyas.serve.speculate import (Eagle3Drafter, Proposal, Sampling, SpecStats, TargetRunner,
                                  generate_plain, generate_speculative)

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=2048, max_position_embeddings=1024,
            tie_word_embeddings=False)


def build(shape: dict, device: str, dtype: torch.dtype, draft_vocab: int):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
    finally:
        torch.set_default_dtype(previous)
    info = inspect_model(model)
    cfg = DraftConfig.from_target(info, draft_vocab_size=draft_vocab,
                                  aux_layer_ids=info.default_aux_layer_ids)
    draft = Eagle3Draft(cfg, submodule(model, info.embed_path)).to(device=device, dtype=dtype)
    return model, info, draft.eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class OracleDrafter:
    """Pays for a real EAGLE-3 proposal, then proposes the target's own continuation."""

    def __init__(self, inner: Eagle3Drafter):
        self.inner, self.aux_layer_ids, self.full = inner, inner.aux_layer_ids, []

    def begin(self):
        self.inner.begin()

    def propose(self, tokens, new_aux, k, sampling):
        self.inner.propose(tokens, new_aux, k, sampling)
        s = tokens.shape[0]
        return Proposal(self.full[s: s + k])


def oracle(runner, draft, prompts, ks, new_tokens, device) -> dict:
    drafter = OracleDrafter(Eagle3Drafter(draft, device))
    refs = [generate_plain(runner, p.ids, new_tokens + max(ks) + 1, frozenset(), Sampling()).tokens
            for p in prompts]
    out = {}
    for k in ks:
        tokens, seconds, stats = 0, 0.0, SpecStats(k=k)
        for p, ref in zip(prompts, refs):
            drafter.full = p.ids.tolist() + ref
            _sync(device)
            t0 = time.perf_counter()
            gen = generate_speculative(runner, drafter, p.ids, k, new_tokens, frozenset(),
                                       Sampling())
            _sync(device)
            seconds += time.perf_counter() - t0
            tokens += len(gen.tokens)
            stats.merge(gen.stats)
        out[k] = {"tokens_per_s": tokens / seconds, "al": stats.mean_acceptance_length}
    return out


def micro(runner, draft, prompt, ks, device, reps: int) -> dict:
    """ms per target forward of 1 and k+1 tokens after the prompt, and per k-token proposal."""
    drafter = Eagle3Drafter(draft, device)
    out = {}
    with torch.inference_mode():
        for t in sorted({1, *[k + 1 for k in ks]}):
            runner.reset()
            _, aux = runner.forward(prompt, last_only=True, aux=True)
            ids = prompt[:t]
            runner.forward(ids, aux=True)  # warm-up at this length
            runner.rollback(t)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                runner.forward(ids, aux=True)
                runner.rollback(t)
            _sync(device)
            out[f"target_forward_{t}_ms"] = 1e3 * (time.perf_counter() - t0) / reps
        seq = torch.cat([prompt, prompt[:1]])
        for k in ks:
            drafter.begin()
            drafter.propose(seq, aux, k, Sampling())  # step 0 over the prompt
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(reps):  # the same last step again: crop + 1-position step 0 + chain
                drafter.seen = seq.shape[0] - 2  # rewind one position
                drafter.propose(seq, aux[-1:], k, Sampling())
            _sync(device)
            out[f"draft_propose_k{k}_ms"] = 1e3 * (time.perf_counter() - t0) / reps
    return out


def markdown(result: dict) -> str:
    s = result["setup"]
    lines = [f"### eyas eval benchmark ({s['device_name']}, {s['shape']}, {s['dtype']}, "
             f"{s['prompts']} prompts x {s['prompt_len']} tokens, {s['new_tokens']} new tokens, "
             "batch 1)", "", "| method | k | AL | tokens/s | speedup |", "|---|---:|---:|---:|---:|"]
    base = result["sweep"][0]["tokens_per_s"]
    for r in result["sweep"]:
        al = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        lines.append(f"| {r['method']} | {r['k'] or '-'} | {al} | {r['tokens_per_s']:.1f} | "
                     f"x{r['speedup']:.2f} |")
    for k, r in result["oracle"].items():
        lines.append(f"| eagle3 oracle (perfect draft) | {k} | {r['al']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | x{r['tokens_per_s'] / base:.2f} |")
    lines += ["", "micro timings (ms): " + ", ".join(f"{k} {v:.2f}"
                                                    for k, v in result["micro"].items()),
              f"lossless in {s['dtype']}: {result['lossless']} "
              f"({len(result['mismatches'])} differing generations; margins "
              f"{[m['margin'] for m in result['mismatches'][:8]]})"]
    return "\n".join(lines)


SPEED_FIELDS = ("seconds", "tokens_per_s", "speedup")


def batch_sweep(args, ks: tuple[int, ...]) -> dict:
    """Whole `eyas eval` runs at each batch size on the same prompts: wall seconds, tokens/s
    and prompts/s per method, and whether every non-speed field equals batch 1's."""
    import tempfile

    from eyas.evaluate import evaluate

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    runs, reports = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for bs in sizes:
            cfg = EvalConfig(target=args.target, draft=args.draft, data=args.data,
                             out=f"{tmp}/b{bs}", k=ks, max_new_tokens=args.new_tokens,
                             num_prompts=args.prompts, batch_size=bs, dtype=args.dtype,
                             replay=False)
            t0 = time.perf_counter()
            report = evaluate(cfg)
            wall = time.perf_counter() - t0
            reports[bs] = report
            runs.append({
                "batch_size": bs, "wall_s": round(wall, 2),
                "decode_s": round(sum(r.seconds for r in report.results), 2),
                "lossless": report.lossless,
                "methods": [{"method": r.method, "k": r.k, "seconds": r.seconds,
                             "tokens_per_s": r.tokens_per_s,
                             "prompts_per_s": round(report.num_prompts / r.seconds, 3),
                             "speedup": r.speedup, "al": r.mean_acceptance_length}
                            for r in report.results]})
    first = reports[sizes[0]]
    for run in runs:
        other = reports[run["batch_size"]]
        run["same_as_batch_%d" % sizes[0]] = all(
            {f: v for f, v in vars(a).items() if f not in SPEED_FIELDS}
            == {f: v for f, v in vars(b).items() if f not in SPEED_FIELDS}
            for a, b in zip(first.results, other.results, strict=True))
    return {"benchmark": "eval-batched", "target": args.target, "draft": args.draft,
            "data": args.data, "prompts": first.num_prompts, "new_tokens": args.new_tokens,
            "k": list(ks), "dtype": first.dtype, "device": first.device,
            "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else
            platform.processor() or "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d"), "runs": runs}


def batch_markdown(result: dict) -> str:
    lines = [f"### eyas eval, batch 1 vs batched ({result['device_name']}, {result['dtype']}, "
             f"{result['prompts']} prompts x {result['new_tokens']} new tokens, k = "
             f"{','.join(map(str, result['k']))})", "",
             "| batch | method | k | AL | tokens/s | prompts/s | speedup |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for run in result["runs"]:
        for m in run["methods"]:
            al = "-" if m["al"] is None else f"{m['al']:.3f}"
            lines.append(f"| {run['batch_size']} | {m['method']} | {m['k'] or '-'} | {al} | "
                         f"{m['tokens_per_s']:.1f} | {m['prompts_per_s']:.2f} | "
                         f"x{m['speedup']:.2f} |")
    lines.append("")
    lines += [f"batch {r['batch_size']}: whole eval {r['wall_s']} s (decoding {r['decode_s']} s), "
              f"lossless {r['lossless']}, "
              + ", ".join(f"{k} {v}" for k, v in r.items() if k.startswith("same_as"))
              for r in result["runs"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the script)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--k", default="1,3,5")
    p.add_argument("--reps", type=int, default=20, help="repetitions of each micro timing")
    p.add_argument("--json", default=None, help="also write the JSON result here")
    p.add_argument("--target", default=None, help="a real target: time whole eval sweeps")
    p.add_argument("--draft", default=None, help="with --target: the draft folder")
    p.add_argument("--data", default=None, help="with --target: prompts (eyas eval --data)")
    p.add_argument("--batch-sizes", default="1,32", help="with --target: batch sizes to time")
    p.add_argument("--dtype", default="float32", help="with --target: eyas eval --dtype")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    ks = tuple(int(k) for k in args.k.split(","))
    if args.target:
        result = batch_sweep(args, ks)
        print(batch_markdown(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return result
    if args.smoke:
        device, shape, dtype, draft_vocab = "cpu", TINY, torch.float32, 512
        args.prompts, args.prompt_len, args.new_tokens, args.reps = 2, 32, 16, 3
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: run with --smoke on CPU")
        device, shape, dtype, draft_vocab = "cuda", LLAMA_8B, torch.bfloat16, 32000
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model, info, draft = build(shape, device, dtype, draft_vocab)
    g = torch.Generator().manual_seed(0)
    prompts = [Prompt(f"random:{i}", torch.randint(0, shape["vocab_size"], (args.prompt_len,),
                                                   generator=g)) for i in range(args.prompts)]
    layers, norm = submodule(model, info.layers_path), submodule(model, info.norm_path)
    cfg = EvalConfig(target="random", data="(in memory)", out="(none)", k=ks,
                     max_new_tokens=args.new_tokens, num_prompts=args.prompts)
    report = run_eval(model, layers, norm, draft, prompts, cfg)
    runner = TargetRunner(model, layers, norm, tuple(draft.cfg.aux_layer_ids))
    with torch.inference_mode():
        oracle_result = oracle(runner, draft, prompts, ks, args.new_tokens, device)
    result = {
        "benchmark": "eval",
        "setup": {"device_name": (torch.cuda.get_device_name() if device == "cuda" else
                                  platform.processor() or "cpu"),
                  "shape": "llama-3.1-8b" if shape is LLAMA_8B else "tiny",
                  "dtype": str(dtype).removeprefix("torch."), "prompts": args.prompts,
                  "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "k": list(ks),
                  "torch": torch.__version__, "transformers": transformers.__version__,
                  "attn_implementation": model.config._attn_implementation},
        "sweep": [vars(r) for r in report.results],
        "oracle": oracle_result,
        "micro": micro(runner, draft, prompts[0].ids, ks, device, args.reps),
        "lossless": report.lossless, "mismatches": report.mismatches,
        "total_s": time.perf_counter() - t0}
    runner.close()
    print(markdown(result))
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
