"""The `eyas eval` report: what it holds (`EvalReport`, one `MethodResult` per method and k)
and how it is written: report.json, report.md and two plots, al_vs_k.png and
acceptance_by_position.png (docs/eval.md). `mismatch_message` explains a failed lossless
check.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class MethodResult:
    """One decoding method at one k (k = 0 for plain decoding), summed over all prompts."""

    method: str  # "target" (no speculation), "ngram" or "eagle3"
    k: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float  # tokens_per_s / the target's
    target_forwards: int  # prefills included
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    mean_acceptance_length: float | None  # None for plain decoding
    draft_acceptance_rate: float | None
    per_position_acceptance: list[float]


@dataclass
class EvalReport:
    """What `evaluate` returns and writes as report.json."""

    target: str
    draft: str | None
    primary: str  # the method the top-level acceptance fields describe: eagle3, else ngram
    temperature: float
    k: list[int]
    num_prompts: int
    max_new_tokens: int
    device: str
    dtype: str
    mean_acceptance_length: dict[str, float]  # str(k) -> AL of `primary`
    per_position_acceptance: dict[str, list[float]]  # str(k) -> rates of `primary`
    lossless: bool | None  # None = not checked (temperature > 0 or --no-check-lossless)
    mismatches: list[dict]
    results: list[MethodResult] = field(default_factory=list)
    settings: str = "chain drafts, batch size 1"
    # str(k) -> 95 % intervals of the primary method's mean acceptance length and
    # per-position rates, from a bootstrap over prompts (rounds of one prompt are correlated)
    ci95: dict[str, dict] = field(default_factory=dict)
    # str(k) -> chain decoding replayed on training's TTT forward over the same greedy
    # continuations (eyas.replay; EAGLE-3 at temperature 0): acceptance length, per-position
    # rates, drafts and their 95 % intervals. It equals the measured numbers when the draft
    # is served as it was trained.
    replayed: dict[str, dict] = field(default_factory=dict)
    workers: int = 1  # processes that shared the prompts (each its own batch-1 stream)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def result(self, method: str, k: int = 0) -> MethodResult:
        return next(r for r in self.results if r.method == method and r.k == k)


def mismatch_message(report: EvalReport) -> str:
    shown = "; ".join(
        f"{m['prompt_id']} ({m['method']} k={m['k']}): first divergence at new token "
        f"{m['position']}, greedy {m['expected']} vs speculative {m['got']}"
        + (f" (target logit margin {m['margin']:.4g})" if m.get("margin") is not None else "")
        for m in report.mismatches[:10])
    more = f" and {len(report.mismatches) - 10} more" if len(report.mismatches) > 10 else ""
    return (f"lossless check failed: speculative decoding differs from the target's greedy "
            f"output in {len(report.mismatches)} generation(s): {shown}{more}. The report is "
            f"written regardless. In {report.dtype} this can be rounding rather than a bug: "
            f"verification scores k+1 tokens in one forward, plain decoding one at a time, and "
            f"a near-tie of the top two logits (margin near 0) can flip. Re-run with --dtype "
            f"float32 to tell them apart (a difference in float32 with a clear margin is a "
            f"bug: please report it), or pass --no-check-lossless to skip the check.")


def write_report(out: Path, report: EvalReport) -> None:
    """report.json, report.md and the two plots (skipped, with a log line, without
    matplotlib)."""
    (out / "report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    (out / "report.md").write_text(markdown(report))
    try:
        import matplotlib
    except ImportError:
        log.info("matplotlib is not installed: no plots (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    _plot(out, report)
    log.info("report written to %s", out)


def _fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(report: EvalReport) -> str:
    lossless = {True: "yes (every output equals the target's greedy output)",
                False: f"NO ({len(report.mismatches)} differing generations)",
                None: "not checked"}[report.lossless]
    lines = [
        f"# eyas eval: {report.target}", "",
        f"- draft: {report.draft or 'none (n-gram only)'}",
        f"- {report.num_prompts} prompts, up to {report.max_new_tokens} new tokens, temperature "
        f"{report.temperature:g}, {report.settings}, {report.device} {report.dtype}",
        f"- lossless: {lossless}",
        "- mean acceptance length = 1 + accepted / drafts (bonus token included), as vLLM "
        "reports it", "",
        "| method | k | mean acceptance length | draft acceptance rate | acceptance by position "
        "| tokens/s | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report.results:
        per_pos = " / ".join(f"{x:.2f}" for x in r.per_position_acceptance) or "-"
        lines.append(f"| {r.method} | {r.k or '-'} | {_fmt(r.mean_acceptance_length)} | "
                     f"{_fmt(r.draft_acceptance_rate)} | {per_pos} | {r.tokens_per_s:.1f} | "
                     f"x{r.speedup:.2f} |")
    if report.replayed:
        lines += ["", "Measured against replayed on training's TTT forward over the same "
                  "continuations (95 % intervals, bootstrap over prompts):", "",
                  "| k | measured AL | replayed AL | measured by position | replayed by "
                  "position |", "|---|---|---|---|---|"]
        for k, rep in report.replayed.items():
            ci = report.ci95.get(k, {})
            lines.append(f"| {k} | {_fmt(report.mean_acceptance_length.get(k))} "
                         f"{_interval(ci.get('mean_acceptance_length'))} | "
                         f"{_fmt(rep['mean_acceptance_length'])} "
                         f"{_interval(rep['ci95']['mean_acceptance_length'])} | "
                         f"{_rates(report.per_position_acceptance.get(k))} | "
                         f"{_rates(rep['per_position_acceptance'])} |")
    return "\n".join(lines) + "\n"


def _interval(ci) -> str:
    return "" if not ci else f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def _rates(rates) -> str:
    return " / ".join(f"{x:.2f}" for x in rates or []) or "-"


def _plot(out: Path, report: EvalReport) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method in ("eagle3", "ngram"):
        rs = [r for r in report.results if r.method == method]
        if rs:
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
        if r.method == report.primary:
            ax.plot(range(1, r.k + 1), r.per_position_acceptance, "o-", label=f"k={r.k}")
    ax.set_xticks(range(1, max(report.k) + 1))
    ax.set(xlabel="draft position", ylabel="acceptance rate (per draft)", ylim=(0, 1.02),
           title=f"{report.primary}, T={report.temperature:g}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=120)
    plt.close(fig)
