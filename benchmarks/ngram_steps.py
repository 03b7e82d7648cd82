"""Adds n-gram's tokens per step to a scaling curve's result JSON (benchmarks/scale.py) from
n-gram-only `eyas eval` reports, for n-gram records made before eyas eval reported it.

vLLM's acceptance length, 1 + accepted / drafts, counts only the steps that drafted. The draft
drafts at every step; n-gram only where its lookup finds a match, so its AL says nothing of its
other steps, and set beside the draft's AL it flatters n-gram. Tokens per decode step of the
target, those steps included, is the number the two compare by (docs/eval.md). n-gram does not
depend on the draft, so its reports can be made anywhere the target runs (the CPU here):

    eyas eval --target smol-hf --bench mt-bench,gsm8k,humaneval --num-prompts 80 --k 3,6 \\
        --max-new-tokens 96 --dtype float32 --out ng-bench
    eyas eval --target smol-hf --data scale-realdata/heldout.jsonl --num-prompts 200 ... \\
        --out ng-heldout
    python benchmarks/ngram_steps.py results/scale-smollm2.json ng-bench heldout=ng-heldout

A report with one table per set (--bench) gives each of its sets; one without names its set
(SET=DIR); a report.json file does as well as its folder. A report at T = 1 gives the curve's
sampled sets (scale.py's `--t1-bench`, named SET-t1, e.g. mt-bench-t1: seeded, its n-gram AL
repeated to the fourth digit on the H200). Reports made before eyas eval wrote tokens per step
give them from their counts. Each is checked against the JSON's eval settings (k, prompts, new
tokens, dtype), and its n-gram AL must be within --tolerance of the JSON's (0.1 %: the same
outputs; greedy outputs on another device may differ in a few tokens, and a larger tolerance
takes those); the record keeps where it was measured and the AL there. The table and plots are
written again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from scale import per_set  # noqa: E402
from scale_report import markdown, plot  # noqa: E402


def add(state: dict, report: dict, where: str, name: str | None, tolerance: float) -> list[str]:
    """Record the tokens per step of every set of `report` (or the one `name`) into state's
    n-gram records; returns the sets done. Raises SystemExit on a mismatch."""
    settings = dict(x.split("=") for x in
                    next(iter(state["ngram"].values()))["settings"].split())
    ks = sorted(int(k) for k in settings["k"].split(","))
    if sorted(report["k"]) != ks or report["max_new_tokens"] != int(settings["tokens"]) or \
            report["dtype"] != settings["dtype"] or report["temperature"] not in (0, 1):
        raise SystemExit(f"{where}: k {report['k']}, {report['max_new_tokens']} tokens, "
                         f"{report['dtype']}, T={report['temperature']} are not the curve's "
                         f"({settings}; T = 0, or 1 for its -t1 sets)")
    t1 = report["temperature"] == 1  # scale.py's T = 1 evals: their sets are named SET-t1
    by_set = report.get("by_set") or {}
    sets = [s + "-t1" * t1 for s in by_set if "/turn-" not in s] if by_set else [name]
    if name and t1 != name.endswith("-t1"):
        raise SystemExit(f"{where}: a report at T={report['temperature']} for the set {name}: "
                         "the curve's T = 1 sets are named SET-t1, its T = 0 ones SET")
    if by_set and name:
        raise SystemExit(f"{where}: a report of the --bench sets {sets} names its own; "
                         f"give it without {name}=")
    if not by_set and not name:
        raise SystemExit(f"{where}: a report of one prompt list: name its set, SET={where}")
    done = []
    for s, entry in per_set(report, sets, t1).items():
        rec = state["ngram"].get(s)
        if rec is None:
            raise SystemExit(f"{where}: the JSON has no n-gram record of {s}")
        if entry["prompts"] != rec["prompts"]:
            raise SystemExit(f"{where}: {s} has {entry['prompts']} prompts, the curve's "
                             f"n-gram {rec['prompts']}")
        steps = entry.get("steps", {}).get("ngram")
        if not steps:
            raise SystemExit(f"{where}: no tokens per step, nor the counts to make them")
        for k, al in entry["ngram"].items():
            if (al is None) != (rec["al"][k] is None) or (  # None: n-gram never drafted
                    al is not None and abs(al / rec["al"][k] - 1) > tolerance):
                raise SystemExit(f"{where}: {s} n-gram AL {al} at k={k} against the "
                                 f"JSON's {rec['al'][k]}: not the same outputs")
        rec["tokens_per_step"] = steps
        rec["tokens_per_step_run"] = {"device": report["device"], "al_there": entry["ngram"],
                                      "date": datetime.date.today().isoformat()}
        done.append(s)
    return done


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="the scaling curve's JSON (scale.py --out)")
    p.add_argument("reports", nargs="+", help="eyas eval --out folders (or their report.json), "
                   "SET=DIR for one prompt list")
    p.add_argument("--tolerance", type=float, default=0.001,
                   help="largest relative difference of n-gram's AL from the JSON's (the same "
                        "outputs give the same AL; another device's may differ in a few tokens)")
    a = p.parse_args(argv)
    out = Path(a.result)
    state = json.loads(out.read_text())
    for arg in a.reports:
        name, _, folder = arg.rpartition("=")
        path = Path(folder)
        report = json.loads((path if path.is_file() else path / "report.json").read_text())
        print(f"{folder}: {', '.join(add(state, report, folder, name or None, a.tolerance))}")
    out.write_text(json.dumps(state, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(state) + "\n")
    for k in state["k"].split(","):
        plot(state, out.with_name(f"{out.stem}-k{k}.png"), k)
    return state


if __name__ == "__main__":
    main()
