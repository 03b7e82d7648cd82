"""The scaling curve's table and plots (benchmarks/scale.py), from its result JSON: one row
per size with its acceptance length per prompt set and k, n-gram's beside, and trained
against served per eval where the JSON records it."""

from __future__ import annotations

import json
from pathlib import Path

# the prompt sets in the order of the table's columns and the plot's lines
SET_NAMES = ("indist", "indist-chat", "heldout", "mt-bench", "gsm8k", "humaneval",
             "mt-bench-t1", "mt-bench-t1p")


def rows(state: dict) -> list[dict]:
    """One row per size with its AL per prompt set and k, sizes ascending."""
    out = []
    for key in sorted(state["sizes"], key=int):
        size = state["sizes"][key]
        als = {}
        for e in size["evals"].values():
            for s, v in e["sets"].items():
                als[s] = v["eagle3"] or {}
        out.append({"conversations": int(key), "train": size["train"], "al": als})
    return out


def markdown(state: dict, base: Path | None = None) -> str:
    """The curve's table (with n-gram and trained == served beside it), then the levers'
    (paired against their control where `base`, the JSON's folder, holds the per-prompt
    counts); a JSON of levers alone has no curve table."""
    if not state["sizes"] and state.get("levers"):
        return "\n".join(levers_table(state, base)).lstrip("\n")
    ks = state["k"].split(",")
    sets = [s for s in SET_NAMES if any(s in r["al"] for r in rows(state))]
    head = "| conversations | tokens | train tokens | GPU min |" + "".join(
        f" {s} k={k} |" for s in sets for k in ks)
    lines = [head, "|" + "---:|" * (4 + len(sets) * len(ks))]
    for r in rows(state):
        t = r["train"]
        cells = [f"{r['al'].get(s, {}).get(k, float('nan')):.3f}" if k in r["al"].get(s, {})
                 else "-" for s in sets for k in ks]
        lines.append(f"| {r['conversations']:,} | {t['tokens']:,} | {t['train_tokens']:,} | "
                     f"{t['gpu_minutes']} | " + " | ".join(cells) + " |")
    lines.append("| n-gram | | | | " + _ngram(state, [(s, k) for s in sets for k in ks]) + " |")
    if any("tokens_per_step" in v for v in state["ngram"].values()):
        lines.append("| n-gram, tokens per step | | | | " + _ngram(
            state, [(s, k) for s in sets for k in ks], "tokens_per_step") + " |")
        lines += ["", STEPS_NOTE]
    served = [(int(n), e, k, f) for n, size in state["sizes"].items()
              for e, rec in size["evals"].items() for k, f in rec.get("fidelity", {}).items()]
    if served:  # trained == served: the measured AL and its replay on training's forward
        lines += ["", "| conversations | eval | k | measured AL [95 %] | replayed on "
                  "training's forward [95 %] |", "|---:|---|---:|---|---|"]
        for n, e, k, f in sorted(served):
            lines.append(f"| {n:,} | {e} | {k} | {_ci(f['measured'], f['measured_ci95'])} | "
                         f"{_ci(f['replayed'], f['replayed_ci95'])} |")
    lines += levers_table(state, base)
    return "\n".join(lines)


def paired_changes(control: dict, variant: dict, base: Path) -> dict:
    """k -> paired_change_ci of `variant` against `control` (two lever records of one size)
    over every prompt of every T = 0 eval both measured and kept per prompt (scale.py's
    OUT-prompts/ files under `base`), prompts matched by id; {} where there are none. A file
    of another draft than its record's is refused."""
    from eyas.serve.eval_report import matched_rows, paired_change_ci

    ours, theirs = {}, {}
    for name, ev in variant["evals"].items():
        if name.endswith(("-t1", "-t1p")):  # sampled: the drafts do not continue one text
            continue
        other = control["evals"].get(name, {})
        files = [base / x for x in (ev.get("per_prompt_file"), other.get("per_prompt_file"))
                 if x]
        if len(files) < 2 or not all(f.is_file() for f in files):
            continue
        mine, yours = (json.loads(f.read_text()) for f in files)
        for kept, rec in ((mine, ev), (yours, other)):
            if kept["draft_id"] != rec["draft_id"]:
                raise ValueError(f"{name}: a per-prompt file of draft {kept['draft_id']} for "
                                 f"an eval of draft {rec['draft_id']}; measure it again")
        mine, yours = mine["per_prompt"], yours["per_prompt"]
        for k in set(mine) & set(yours):
            a, b = matched_rows(mine[k], yours[k])
            ours.setdefault(k, []).extend(a)
            theirs.setdefault(k, []).extend(b)
    return {k: c for k in ours if (c := paired_change_ci(ours[k], theirs[k]))}


def levers_table(state: dict, base: Path | None = None) -> list[str]:
    """Per lever size: one row per variant (the curve's own point at that size first), its
    training's replayed chain AL at k = 3 on the capture's eval split (`best`), its AL per
    prompt set and k, and its mean over those cells against the control's (the variant
    named `default`, else the curve's point); under the table, each variant's change against
    that control paired prompt by prompt with its 95 % interval, where `base` holds both
    drafts' per-prompt counts (paired_changes)."""
    out, ks = [], state["k"].split(",")
    for key in sorted(state.get("levers", {}), key=int):
        table = {}
        if key in state["sizes"]:
            table["curve point (earlier run)"] = (state["sizes"][key], "")
        variants = state["levers"][key]["variants"]
        for name in sorted(variants, key=lambda x: x != "default"):  # the control first
            # a record without its recipe predates session 46's default: the assistant's
            # positions (scale.BEFORE_RECIPES)
            table[name] = (variants[name], " ".join(variants[name]["flags"]) or (
                "(the recipe)" if "recipe" in variants[name] else
                "(the recipe then: --loss-mask-at input)"))
        als = {name: {s: e["eagle3"] or {} for ev in v["evals"].values()
                      for s, e in ev["sets"].items()} for name, (v, _) in table.items()}
        sets = [s for s in SET_NAMES if any(s in a for name, a in als.items()
                                            if name in state["levers"][key]["variants"])]
        cells = [(s, k) for s in sets for k in ks]
        ctl = als.get("default") or als.get("curve point (earlier run)") or {}

        def change(a: dict) -> str:
            """The mean AL of `a` over the cells both it and the control have, against the
            control's mean over the same cells (a variant measured on fewer sets is compared
            on those only)."""
            both = [(s, k) for s, k in cells if k in a.get(s, {}) and k in ctl.get(s, {})]
            if not both:
                return "-"
            ours, theirs = (sum(x[s][k] for s, k in both) for x in (a, ctl))
            return f"{100 * (ours / theirs - 1):+.1f} %"

        out += ["", f"Levers at {int(key):,} conversations (one capture, same evals):", "",
                "| variant | flags | train tok/s | train s | replayed k=3 | " + " | ".join(
                    f"{s} k={k}" for s, k in cells) + " | vs control |",
                "|---|---|---:|---:|---:|" + "---:|" * (len(cells) + 1)]
        for name, (v, flags) in table.items():
            t, vs = v["train"], change(als[name])
            replayed = ((t.get("best") or {}).get("chain_by_k") or {}).get("3")
            out.append(f"| {name} | {flags} | {t.get('train_tokens_per_s') or '-'} | "
                       f"{t.get('seconds', {}).get('train', '-')} | "
                       f"{'-' if replayed is None else f'{replayed:.3f}'} | " + " | ".join(
                           f"{als[name][s][k]:.3f}" if k in als[name].get(s, {}) else "-"
                           for s, k in cells) + f" | {vs} |")
        out.append("| n-gram | | | | | " + _ngram(state, cells) + " | |")
        # the control: the variant `default`, else the curve's own point at this size (a
        # lever added beside a size trained before, e.g. more epochs of the whole corpus)
        control, against = ((variants["default"], "default") if "default" in variants else
                            (state["sizes"].get(key), "the curve point"))
        if base is None or control is None:
            continue
        notes = []
        for name in (x for x in variants if x != "default"):
            try:
                paired = paired_changes(control, variants[name], base)
            except ValueError as err:  # said in the table: a lease's write goes on
                notes.append(f"- {name} against {against}: not paired ({err})")
                continue
            if paired:
                notes.append(f"- {name} against {against}, paired prompt by prompt: " + "; ".join(
                    f"k={k} {100 * c['change']:+.1f} % [{100 * c['ci95'][0]:+.1f}, "
                    f"{100 * c['ci95'][1]:+.1f}] over {c['prompts']} prompts"
                    for k, c in sorted(paired.items(), key=lambda x: int(x[0]))))
        out += [""] + notes if notes else []
    return out


STEPS_NOTE = ("The acceptance lengths are vLLM's, 1 + accepted / drafts, over the steps that "
              "drafted. The draft drafts at every step, so its AL is also its tokens per step "
              "of the target (less the tokens cut at an answer's end); n-gram drafts only where "
              "its lookup matches, and its tokens per step, the steps without a match included, "
              "is the number to set beside the draft's AL.")


def _ngram(state: dict, cells: list[tuple[str, str]], key: str = "al") -> str:
    """n-gram's AL (or another of its records, e.g. tokens_per_step) at each (prompt set, k)
    cell, as table cells ('-' where not measured)."""
    als = [state["ngram"].get(s, {}).get(key, {}).get(k) for s, k in cells]
    return " | ".join("-" if x is None else f"{x:.3f}" for x in als)


def _ci(value, interval) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")


def plot(state: dict, path: Path, k: str) -> None:
    """AL at k against conversations (log x), one line per prompt set, n-gram dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    table = rows(state)
    # n-gram's tokens per step where the JSON has them (its AL counts drafting steps only)
    steps = any("tokens_per_step" in v for v in state["ngram"].values())
    for i, s in enumerate(x for x in SET_NAMES if any(x in r["al"] for r in table)):
        pts = [(r["conversations"], r["al"][s][k]) for r in table if k in r["al"].get(s, {})]
        color = f"C{i}"
        if pts:
            ax.plot(*zip(*pts), "o-", color=color, label=s)
        rec = state["ngram"].get(s, {})
        per_step = rec.get("tokens_per_step", {}).get(k)
        ng = per_step if per_step is not None else rec.get("al", {}).get(k)
        if ng is not None and table:  # dotted: its AL, where its tokens per step are not known
            ax.axhline(ng, color=color, linewidth=1,
                       linestyle="--" if per_step is not None or not steps else ":")
    ax.set_xscale("log")
    ax.set_xlabel("training conversations (regenerated by the target)")
    ax.set_ylabel(f"mean acceptance length, k = {k}" + (
        "\n(the draft's is also its tokens per step)" if steps else ""), fontsize=9)
    ax.set_title(f"{Path(state['target']).name}: eyas train defaults; dashed = n-gram"
                 + (" tokens per step (dotted: its AL)" if steps else " AL"), fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def curve_points(states: list[tuple[str, dict]], k: str,
                 sets: list[str]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """label -> prompt set -> [(conversations, the draft's AL at k)] per size of each JSON
    (several curves on one plot: e.g. the curve's order and the whole corpus's)."""
    return {label: {s: [(r["conversations"], r["al"][s][k]) for r in rows(state)
                        if k in r["al"].get(s, {})] for s in sets}
            for label, state in states}


def plot_curves(states: list[tuple[str, dict]], path: Path, k: str, sets: list[str],
                bar: float | None = None) -> None:
    """The draft's AL at k against conversations (log x) of several JSONs on one plot: one
    colour per prompt set, one marker per JSON; n-gram's AL (the first JSON's, dotted) and
    issue 31's bar (MT-bench at k = 3) where given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 6))
    points = curve_points(states, k, sets)
    for j, (label, state) in enumerate(states):
        for i, s in enumerate(sets):
            pts = points[label][s]
            if pts:
                ax.plot(*zip(*pts), "os^D"[j % 4] + ("-" if len(pts) > 1 else ""),
                        color=f"C{i}", markersize=7 if j else 5,
                        label=f"{s} ({label})" if j else s)
    first = states[0][1]
    for i, s in enumerate(sets):
        ng = first["ngram"].get(s, {}).get("al", {}).get(k)
        if ng is not None:
            ax.axhline(ng, color=f"C{i}", linewidth=1, linestyle=":")
    if bar is not None:
        ax.axhline(bar, color="black", linewidth=1, linestyle="--",
                   label=f"issue 31's bar, MT-bench k = 3 ({bar})")
    ax.set_xscale("log")
    ax.set_xlabel("training conversations (regenerated by the target)")
    ax.set_ylabel(f"the draft's mean acceptance length, k = {k}", fontsize=9)
    ax.set_title(f"{Path(first['target']).name}: " + " and ".join(
        label for label, _ in states) + "; dotted = n-gram's AL", fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="the tables of scale.py's JSONs again (each "
                                "JSON's .md beside it), or with --plot one plot of them all")
    p.add_argument("json", nargs="+")
    p.add_argument("--plot", help="write PLOT-k3.png, PLOT-k6.png (per --k): every JSON's "
                   "sizes on one plot, labelled LABEL=JSON or by the file's name")
    p.add_argument("--sets", default="mt-bench,gsm8k,humaneval,indist-chat,mt-bench-t1",
                   help="--plot's prompt sets (those measured on the same prompts in each)")
    p.add_argument("--k", default="3,6")
    p.add_argument("--bar", type=float, default=2.9, help="--plot: issue 31's bar at k = 3 "
                   "(0: none)")
    a = p.parse_args(argv)
    states = []
    for item in a.json:
        label, _, name = item.rpartition("=")
        out = Path(name)
        states.append((label or out.stem, json.loads(out.read_text())))
        if not a.plot:
            out.with_suffix(".md").write_text(markdown(states[-1][1], out.parent) + "\n")
            print(f"wrote {out.with_suffix('.md')}")
    for k in a.k.split(",") if a.plot else ():
        path = Path(f"{a.plot}-k{k}.png")
        plot_curves(states, path, k, a.sets.split(","), a.bar if k == "3" and a.bar else None)
        print(f"wrote {path}")


if __name__ == "__main__":  # the table again, e.g. once a lease's OUT-prompts/ is committed
    main()
