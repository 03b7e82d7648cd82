"""The table of a recipe ablation from the files a lease brought back: per variant its
training's replayed chain AL on the capture's eval split (in-distribution, every k <= its
TTT steps) and, where they ran, `eyas eval`'s measured AL with 95 % intervals.

    python benchmarks/ablation_table.py benchmarks/results/ablation-h200 \
        --baseline eagle3.1-lr3e-4-pipeline --out benchmarks/results/ablation-h200.json

The folder holds `<variant>-metrics.jsonl` (eyas train's metrics) and `<variant>-eval-<split>.json`
(`eyas eval`'s report.json; split indist or heldout). Rows compare each variant with
--baseline at the same training step (the last eval every run reached), so a run that stopped
early (its crash log beside it) is still compared where it got to.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _evals(path: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["chain"]["acceptance_length"] for r in rows if r.get("kind") == "eval"}


def _measured(path: Path) -> dict:
    report = json.loads(path.read_text())
    out = {"prompts": report["num_prompts"], "lossless": report["lossless"]}
    for r in report["results"]:
        if r["method"] in ("eagle3", "ngram"):
            out[f"{r['method']}_k{r['k']}"] = r["mean_acceptance_length"]
    for k, ci in report["ci95"].items():
        out[f"eagle3_k{k}_ci95"] = ci["mean_acceptance_length"]
    return out


def collect(folder: Path, baseline: str) -> dict:
    variants = {}
    for path in sorted(folder.glob("*-metrics.jsonl")):
        name = path.name.removesuffix("-metrics.jsonl")
        evals = _evals(path)
        v = {"replayed_al_by_step": {str(s): al for s, al in sorted(evals.items())},
             "last_step": max(evals)}
        for split in ("indist", "heldout"):
            report = folder / f"{name}-eval-{split}.json"
            if report.is_file():
                v[f"measured_{split}"] = _measured(report)
        if (folder / f"{name}-crash-log.txt").is_file():
            v["crashed"] = f"{name}-crash-log.txt"
        variants[name] = v
    base = _evals(folder / f"{baseline}-metrics.jsonl")
    for v in variants.values():  # vs the baseline at the same step, per k both have
        step = v["last_step"]
        mine, theirs = v["replayed_al_by_step"][str(step)], base.get(step, {})
        v["vs_baseline_at_step"] = {k: round(100 * (mine[k] / theirs[k] - 1), 1)
                                    for k in ("1", "3", "6") if mine.get(k) and theirs.get(k)}
    return {"benchmark": "recipe ablation (issue 31)", "folder": str(folder),
            "baseline": baseline, "command": " ".join(["python", *sys.argv]),
            "date": time.strftime("%Y-%m-%d"), "variants": variants}


def markdown(result: dict) -> str:
    lines = ["| variant | step | replayed AL k=1 / 3 / 6 | vs baseline k=3 / 6 |",
             "|---|---:|---|---|"]
    for name, v in result["variants"].items():
        al = v["replayed_al_by_step"][str(v["last_step"])]
        vs = v["vs_baseline_at_step"]
        lines.append(f"| {name} | {v['last_step']} | "
                     + " / ".join(f"{al[k]:.3f}" if al.get(k) else "-" for k in ("1", "3", "6"))
                     + " | " + " / ".join(f"{vs[k]:+.1f} %" if k in vs else "-"
                                          for k in ("3", "6")) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--baseline", required=True, help="the variant the others are compared with")
    p.add_argument("--out", type=Path, help="write the JSON here")
    a = p.parse_args(argv)
    result = collect(a.folder, a.baseline)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
