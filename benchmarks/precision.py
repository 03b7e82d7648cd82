"""Does fp8 training cost acceptance? The demo pipeline trained twice on one GPU, identical
but for `train.precision` (bf16, fp8), then evaluated the same way.

    python benchmarks/precision.py --out-dir /tmp/eyas-precision      # GPU with fp8 (sm89+)

Builds the demo's data and tiny target once (`eyas demo` sizes), then runs `eyas run` for both
precisions side by side (separate work folders, same seed). Prints both eval reports and
writes the acceptance lengths, eval loss and per-step accuracy to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

from eyas.targets.corpus import synthetic_chats
from eyas.demo import SIZES, pretrain_target

PRECISIONS = ("bf16", "fp8")


def pipeline(target: Path, data: Path, work: Path, precision: str, size: dict) -> dict:
    return {
        "target": str(target), "data": str(data), "work_dir": str(work),
        "prepare": {"max_length": 512, "eval_fraction": 0.05, "seed": 0},
        "capture": {"dtype": "bf16", "model_dtype": "fp32", "batch_tokens": size["batch_tokens"]},
        "vocab": {"draft_vocab_size": 512},
        "train": {"max_steps": size["draft_steps"], "batch_tokens": size["batch_tokens"],
                  "lr": 3e-3, "eval_every": 50, "save_every": 50, "seed": 0,
                  "precision": precision},
        "export": {"dtype": "fp32"},
        "eval": {"k": [1, 2, 3, 4, 5], "num_prompts": size["prompts"],
                 "max_new_tokens": size["new_tokens"], "seed": 0},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="/tmp/eyas-precision")
    p.add_argument("--out", default="benchmarks/results/fp8-demo.json")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    (out / "data").mkdir(parents=True, exist_ok=True)
    size = SIZES[False]
    rows = synthetic_chats(size["chats"], seed=0)
    data = out / "data" / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    target = pretrain_target(out / "target", rows, hidden=size["hidden"],
                             layers=size["layers"], steps=size["target_steps"], seed=0)
    procs = []
    for precision in PRECISIONS:
        spec = out / f"pipeline-{precision}.yaml"
        spec.write_text(yaml.safe_dump(
            pipeline(target, data, out / f"work-{precision}", precision, size), sort_keys=False))
        log = open(out / f"{precision}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "eyas", "run", str(spec)],
                                      stdout=log, stderr=subprocess.STDOUT))
    if any(proc.wait() for proc in procs):
        print(f"a pipeline failed; logs in {out}", file=sys.stderr)
        return 1
    result = {}
    for precision in PRECISIONS:
        work = out / f"work-{precision}"
        print(f"## {precision}\n\n" + (work / "eval" / "report.md").read_text())
        report = json.loads((work / "eval" / "report.json").read_text())
        metrics = [json.loads(line) for line in
                   (work / "train" / "metrics.jsonl").read_text().splitlines()]
        last_eval = [m for m in metrics if m.get("kind") == "eval"][-1]
        result[precision] = {
            "mean_acceptance_length": report["mean_acceptance_length"],
            "lossless": report.get("lossless"), "eval_loss": last_eval["loss"],
            "eval_acc": last_eval["acc"],
            "sim_acceptance_length": last_eval["sim_acceptance_length"]}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
