"""The files of an `eyas eval` report (eyas.serve.eval_report.EvalReport): report.json,
report.md (one table per method and k, per prompt set and per source, with 95 % intervals)
and two plots, al_vs_k.png and acceptance_by_position.png (docs/eval.md)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eyas.serve.eval_report import TIE_ULPS, EvalReport, fmt

log = logging.getLogger(__name__)


def write_report(out: Path, report: EvalReport) -> None:
    """report.json, report.md and the two plots (skipped, with a log line, without
    matplotlib)."""
    (out / "report.json").write_text(report_json(report.to_dict()))
    (out / "report.md").write_text(markdown(report))
    try:
        import matplotlib
    except ImportError:
        for old in ("al_vs_k.png", "acceptance_by_position.png"):  # an earlier eval's
            (out / old).unlink(missing_ok=True)
        log.info("matplotlib is not installed: no plots (pip install matplotlib)")
    else:
        matplotlib.use("Agg")
        _plot(out, report)
    log.info("report written to %s", out)


STEP_NOTE = ("- tokens per step = new tokens per decode step of the target, the steps that "
             "drafted nothing included: the number to compare drafters by (n-gram drafts only "
             "where its lookup matches, so its acceptance length leaves out its other steps)")


def markdown(report: EvalReport) -> str:
    ties = (f"; {len(report.ties)} divergence(s) at a tie within {report.dtype} rounding, "
            f"listed below" if report.ties else "")
    lossless = {True: "yes (every output equals the target's greedy output)",
                False: f"NO ({len(report.mismatches)} differing generations)",
                None: "not checked"}[report.lossless] + ties
    lines = [
        f"# eyas eval: {report.target}", "",
        f"- draft: {report.draft or 'none (n-gram only)'}",
        f"- {report.num_prompts} prompts, up to {report.max_new_tokens} new tokens, temperature "
        f"{report.temperature:g}, {report.settings}, {report.device} {report.dtype}",
        f"- lossless: {lossless}",
        *([f"- rows left out of the prompts: "
           f"{', '.join(f'{k} {n}' for k, n in report.skipped_prompts.items())} "
           f"(each logged with its row or id)"] if report.skipped_prompts else []),
        "- mean acceptance length = 1 + accepted / drafts (bonus token included), as vLLM "
        "reports it: over the steps that drafted", STEP_NOTE, "",
        "| method | k | mean acceptance length | tokens per step | draft acceptance rate "
        "| acceptance by position | tokens/s | speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report.results:
        per_pos = " / ".join(f"{x:.2f}" for x in r.per_position_acceptance) or "-"
        lines.append(f"| {r.method} | {r.k or '-'} | {fmt(r.mean_acceptance_length)} | "
                     f"{fmt(r.tokens_per_step)} | {fmt(r.draft_acceptance_rate)} | {per_pos} "
                     f"| {r.tokens_per_s:.1f} | x{r.speedup:.2f} |")
    if report.replayed:
        forward = "block forward" if report.primary == "dflash" else "TTT forward"
        lines += ["", f"Measured against replayed on training's {forward} over the same "
                  "continuations (95 % intervals, bootstrap over prompts):", "",
                  "| k | measured AL | replayed AL | measured by position | replayed by "
                  "position |", "|---|---|---|---|---|"]
        for k, rep in report.replayed.items():
            ci = report.ci95.get(k, {})
            lines.append(f"| {k} | {fmt(report.mean_acceptance_length.get(k))} "
                         f"{_interval(ci.get('mean_acceptance_length'))} | "
                         f"{fmt(rep.get('mean_acceptance_length'))} "
                         f"{_interval((rep.get('ci95') or {}).get('mean_acceptance_length'))} | "
                         f"{_rates(report.per_position_acceptance.get(k))} | "
                         f"{_rates(rep.get('per_position_acceptance'))} |")
    if report.by_source:
        rows = [*report.by_source["sources"].items()]
        if "without_source" in report.by_source:
            rows.append(("*ids naming no source*", report.by_source["without_source"]))
        rows.append(("**all prompts**", report.by_source["all"]))
        cols = list(report.by_source["all"]["mean_acceptance_length"])
        lines += ["", "Mean acceptance length by prompt source (a prompt id without its last "
                  "\"/\" part, or the file of a FILE:ROW id):", "",
                  "| source | prompts | " + " | ".join(cols) + " |",
                  "|---|---:|" + "---:|" * len(cols)]
        for src, row in rows:
            als = row["mean_acceptance_length"]
            lines.append(f"| {src} | {row['prompts']} | "
                         + " | ".join(fmt(als.get(c)) for c in cols) + " |")
    lines += _set_tables(report) + _tie_lines(report)
    return "\n".join(lines) + "\n"


def report_json(data: dict) -> str:
    """report.json's text: indented, but each per_prompt row on one line (an eval of 1,000
    prompts at 7 k's would be ~90,000 lines of them otherwise)."""
    rows = data.get("per_prompt") or {}
    mark = {key: f"\u0000per_prompt {key}" for key in rows}
    text = json.dumps({**data, "per_prompt": mark} if rows else data, indent=2)
    for key, lines in rows.items():
        body = ",\n".join("      " + json.dumps(row) for row in lines)
        text = text.replace(json.dumps(mark[key]), f"[\n{body}\n    ]" if lines else "[]")
    return text + "\n"


def _set_tables(report: EvalReport) -> list[str]:
    """One table per prompt set (and per turn): every method and k on its prompts alone."""
    lines = []
    for name, row in report.by_set.items():
        src = report.bench.get(name.rsplit("/turn-", 1)[0])
        origin = f"; {src['package']} {src['version']}" if src else ""
        cis = row.get("ci95") or {}
        lines += ["", f"### {name} ({row['prompts']} prompts{origin})", "",
                  "| method | k | mean acceptance length [95 %] | tokens per step | tokens/s "
                  "| speedup |", "|---|---:|---:|---:|---:|---:|"]
        for r in row["results"]:
            ci = cis.get(f"{r['method']} k={r['k']}", {}).get("mean_acceptance_length")
            al = f"{fmt(r['mean_acceptance_length'])} {_interval(ci)}".strip()
            lines.append(f"| {r['method']} | {r['k'] or '-'} | {al} | "
                         f"{fmt(r.get('tokens_per_step'))} | {r['tokens_per_s']:.1f} | "
                         f"x{r['speedup']:.2f} |")
    return lines


def _tie_lines(report: EvalReport) -> list[str]:
    if not report.ties:
        return []
    lines = ["", f"Ties (target logit margin within {TIE_ULPS} ulps of the logit in "
             f"{report.dtype}: rounding, not a failure):", "",
             "| prompt | method | k | new token | greedy | speculative | margin |",
             "|---|---|---:|---:|---:|---:|---:|"]
    return lines + [f"| {m['prompt_id']} | {m['method']} | {m['k']} | {m['position']} | "
                    f"{m['expected']} | {m['got']} | {m['margin']:.3g} |" for m in report.ties]


def _interval(ci) -> str:
    return "" if not ci else f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def _rates(rates) -> str:
    return " / ".join(f"{x:.2f}" for x in rates or []) or "-"


def _plot(out: Path, report: EvalReport) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method in ("eagle3", "dflash", "ngram"):
        rs = [r for r in report.results if r.method == method]
        if rs:
            rs = [r for r in rs if r.mean_acceptance_length is not None]  # (none drafted)
            ax.plot([r.k for r in rs], [r.mean_acceptance_length for r in rs], "o-", label=method)
    ax.set(xlabel="k (draft tokens per step)", ylabel="mean acceptance length",
           title=f"T={report.temperature:g}, {report.num_prompts} prompts")
    ax.set_xticks(report.k)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "al_vs_k.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for r in report.results:
        if r.method == report.primary and r.per_position_acceptance:  # (none drafted: [])
            ax.plot(range(1, r.k + 1), r.per_position_acceptance, "o-", label=f"k={r.k}")
    ax.set_xticks(range(1, max(report.k) + 1))
    ax.set(xlabel="draft position", ylabel="acceptance rate (per draft)", ylim=(0, 1.02),
           title=f"{report.primary}, T={report.temperature:g}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=120)
    plt.close(fig)
