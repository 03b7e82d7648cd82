"""The `eyas eval` report: what it holds (`EvalReport`, one `MethodResult` per method and k),
how it is made from the raw counts (`Measured`, merged across processes by `merge`, turned
into a report with 95 % intervals by `summarize`, one table per prompt set by `by_set`);
eyas.serve.report_files writes it (docs/eval.md). `rounding_tie` tells a divergence the
dtype's rounding explains from a wrong token; `mismatch_message` explains a failed lossless
check.
`cfg` below is an eyas.evaluate.EvalConfig.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections import Counter
from dataclasses import dataclass, field

import torch

from eyas.serve.speculate import SpecStats
from eyas.targets.chat_sources import FILE_SUFFIXES
from eyas.targets.sdpa import target_sdpa_choice

log = logging.getLogger(__name__)


@dataclass
class MethodResult:
    """One decoding method at one k (k = 0 for plain decoding), summed over all prompts."""

    method: str  # "target" (no speculation), "ngram", "eagle3" or "dflash"
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
    # new tokens per decode step of the target (prefills out), the steps where nothing was
    # drafted included. vLLM's acceptance length counts only the steps with a draft: for a
    # drafter that drafts at every step (EAGLE-3, DFlash) the two agree but for the tokens cut
    # at the end of an answer; n-gram drafts only where its lookup finds a match, and its
    # acceptance length says nothing of the other steps. This one compares drafters.
    tokens_per_step: float | None = None


@dataclass
class EvalReport:
    """What `evaluate` returns and writes as report.json."""

    target: str
    draft: str | None
    primary: str  # the method the top-level acceptance fields describe: the draft, else ngram
    temperature: float
    k: list[int]
    num_prompts: int
    max_new_tokens: int
    device: str
    dtype: str
    mean_acceptance_length: dict[str, float]  # str(k) -> AL of `primary`
    per_position_acceptance: dict[str, list[float]]  # str(k) -> rates of `primary`
    # None = not checked (temperature > 0 or --no-check-lossless); true = every output equals
    # the target's greedy output, but for the divergences listed under `ties`
    lossless: bool | None
    mismatches: list[dict]  # divergences beyond the dtype's rounding: each fails the check
    results: list[MethodResult] = field(default_factory=list)
    settings: str = "chain drafts, batch size 1"
    # str(k) -> 95 % intervals of the primary method's mean acceptance length and
    # per-position rates, from a bootstrap over prompts (rounds of one prompt are correlated)
    ci95: dict[str, dict] = field(default_factory=dict)
    # str(k) -> chain decoding replayed on training's forward over the same greedy
    # continuations (at temperature 0; EAGLE-3's TTT forward, eyas.draft.replay, or DFlash's
    # block forward, eyas.dflash.replay): acceptance length, per-position
    # rates, drafts and their 95 % intervals. It equals the measured numbers when the draft
    # is served as it was trained.
    replayed: dict[str, dict] = field(default_factory=dict)
    workers: int = 1  # processes that shared the prompts
    batch_size: int = 1  # prompts decoded at once (eyas.serve.batched when > 1)
    # the SDPA kernels the forwards ran on: "auto" (cuDNN's left out) or "torch" (torch's own
    # choice), EYAS_TARGET_SDPA (eyas.targets.sdpa): each kernel rounds in its own way in bf16
    target_sdpa: str = "auto"
    # only with several sources: "sources": source (a prompt id without its last "/" part,
    # e.g. bigbench/known_unknowns; the file of a FILE:ROW id) -> {"prompts": n,
    # "mean_acceptance_length": {"METHOD k=K": AL}}; "without_source": the same for the
    # prompts whose id names none (if any); "all": every prompt
    by_source: dict[str, dict] = field(default_factory=dict)
    # divergences at a tie of the target's two logits within the dtype's rounding
    # (`rounding_tie`): counted and listed, not failures
    ties: list[dict] = field(default_factory=list)
    # prompt set (or one turn of it: mt-bench/turn-2) -> {"prompts": n, "results": every
    # method and k on those prompts alone, with its own speed, "ci95": "METHOD k=K" -> its
    # intervals on them}; only with --bench
    by_set: dict[str, dict] = field(default_factory=dict)
    # "METHOD k=K" -> [prompt id, drafts, [accepted per position]] per prompt, every drafting
    # method: what another measurement of some of the same prompts (a served run's first 40)
    # is compared with, prompt for prompt
    per_prompt: dict[str, list] = field(default_factory=dict)
    bench: dict[str, dict] = field(default_factory=dict)  # set -> package, sha256, license, ...
    # rows of --data and the prompt sets left out of the prompts, by reason (malformed, no user
    # turn, chat template failed, too long; next turn too long: an MT-bench second turn): each
    # is logged with its row or id
    skipped_prompts: dict[str, int] = field(default_factory=dict)
    # at temperature > 0, how the drafts were chosen (vLLM's draft_sample_method: greedy or
    # probabilistic); None at temperature 0, where both are the argmax. `eyas export` writes
    # it into the serve command so that the draft is served as it was measured
    draft_sampling: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def result(self, method: str, k: int = 0) -> MethodResult:
        return next(r for r in self.results if r.method == method and r.k == k)


# ---------------------------------------------------------------- from counts to a report

def _result(method: str, k: int, outputs: list[list[int]], stats: SpecStats, seconds: float,
            base_tps: float | None) -> MethodResult:
    tokens = sum(len(o) for o in outputs)
    tps = tokens / seconds if seconds > 0 else 0.0
    spec = method != "target"
    result = MethodResult(
        method=method, k=k, new_tokens=tokens, seconds=round(seconds, 4),
        tokens_per_s=round(tps, 3), speedup=round(tps / base_tps, 4) if base_tps else 1.0,
        target_forwards=stats.target_forwards, drafts=stats.drafts,
        draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted,
        # a method that never drafted (n-gram found no match) has no acceptance: None, not 1.0
        mean_acceptance_length=round(stats.mean_acceptance_length, 4)
        if spec and stats.drafts else None,
        draft_acceptance_rate=round(stats.draft_acceptance_rate, 4) if spec and stats.drafts
        else None,
        per_position_acceptance=[round(r, 4) for r in stats.per_position_acceptance]
        if stats.drafts else [],
        tokens_per_step=tokens_per_step(tokens, stats.target_forwards, len(outputs)))
    return result


def tokens_per_step(new_tokens: int, target_forwards: int, generations: int) -> float | None:
    """New tokens per decode step of the target: each generation's prefill is one forward that
    makes its first token, every other forward is a step, drafted or not (None without one)."""
    steps = target_forwards - generations
    return round((new_tokens - generations) / steps, 4) if steps > 0 else None


def _results(measured: Measured) -> list[MethodResult]:
    """Every method and k of `measured`, plain decoding first, speed against it."""
    st, sec = measured.stats, measured.seconds
    base = _result("target", 0, measured.outputs["target", 0], st["target", 0],
                   sec["target", 0], None)
    return [base] + [_result(name, k, measured.outputs[name, k], st[name, k], sec[name, k],
                             base.tokens_per_s) for name, k in st if name != "target"]


@dataclass
class Measured:
    """Raw results of the methods on some prompts (one process's share with --workers)."""

    index: list[int]  # the prompts' positions in the whole prompt list
    stats: dict  # (method, k) -> SpecStats summed over these prompts
    outputs: dict  # (method, k) -> new tokens per prompt, in `index` order
    seconds: dict  # (method, k) -> seconds summed over these prompts
    per_prompt: dict  # (method, k) -> [(drafts, accepted per position)] per prompt
    replayed: dict  # k -> [(drafts, accepted per position)] per prompt (T=0)
    mismatches: list[dict]
    device: str = "cpu"
    dtype: str = "float32"
    prompt_ids: list[str] = field(default_factory=list)  # in `index` order


def merge(parts: list[Measured]) -> Measured:
    """One Measured from the shares of several processes, in prompt order."""
    concat = [j for p in parts for j in p.index]
    order = sorted(range(len(concat)), key=concat.__getitem__)
    first = parts[0]
    whole = Measured(index=sorted(j for p in parts for j in p.index),
                     stats={key: SpecStats(k=s.k) for key, s in first.stats.items()},
                     outputs={}, seconds=dict.fromkeys(first.seconds, 0.0), per_prompt={},
                     replayed={}, mismatches=[m for p in parts for m in p.mismatches],
                     device=first.device, dtype=first.dtype)
    ids = [i for p in parts for i in p.prompt_ids]
    whole.prompt_ids = [ids[i] for i in order] if len(ids) == len(concat) else []
    if whole.prompt_ids:  # the lossless check's findings in prompt order too (a stable sort)
        place = {pid: j for j, pid in zip(concat, ids)}
        whole.mismatches.sort(key=lambda m: place.get(m["prompt_id"], len(concat)))
    for key in first.stats:
        for p in parts:
            whole.stats[key].merge(p.stats[key])
            whole.seconds[key] += p.seconds[key]
        outputs = [o for p in parts for o in p.outputs[key]]
        rows = [r for p in parts for r in p.per_prompt[key]]
        whole.outputs[key] = [outputs[i] for i in order]
        whole.per_prompt[key] = [rows[i] for i in order]
    # replay rows, one per prompt, in prompt order as the rows above: the bootstrap's interval
    # depends on their order; a part whose replay failed (a diagnostic, reported without)
    # leaves the whole without, rather than replayed numbers of some prompts only
    replayed = [set(p.replayed) for p in parts]
    if any(keys != replayed[0] for keys in replayed):
        log.warning("replay on training's forward failed for some prompts: the report has no "
                    "replayed acceptance (the measured one is whole)")
    else:
        for k in first.replayed:
            rows = [c for p in parts for c in p.replayed[k]]
            whole.replayed[k] = [rows[i] for i in order]
    return whole


def concat(parts: list[Measured]) -> Measured:
    """One Measured of several prompt groups (each measured on its own), the groups' prompts
    one after the other."""
    offset, shifted = 0, []
    for p in parts:
        shifted.append(dataclasses.replace(p, index=list(range(offset, offset + len(p.index)))))
        offset += len(p.index)
    return merge(shifted)


def by_set(sets: dict[str, Measured]) -> dict[str, dict]:
    """Per prompt group, its prompt count, every method and k on it alone (its own speed) and
    each drafting method's 95 % intervals on its prompts ("ci95": "METHOD k=K" -> intervals,
    as bootstrap_ci gives them: a served run on the same set is compared with these); a set
    asked in several turns (mt-bench/turn-1, mt-bench/turn-2) also as a whole, before its
    turns, its interval resampling questions (a question's turns together: they are not
    independent draws)."""
    def row(m: Measured) -> dict:
        question = [re.sub(r"/turn-\d+/", "/", i) for i in m.prompt_ids] \
            if len(m.prompt_ids) == len(m.index) else [str(j) for j in range(len(m.index))]
        return {"prompts": len(m.index), "results": [dataclasses.asdict(r) for r in _results(m)],
                "ci95": {f"{name} k={k}": bootstrap_ci(by_question(rows, question), k)
                         for (name, k), rows in m.per_prompt.items() if name != "target"}}

    out = {}
    for name in dict.fromkeys(g.rsplit("/turn-", 1)[0] for g in sets):
        groups = [g for g in sets if g.rsplit("/turn-", 1)[0] == name]
        if groups != [name]:
            out[name] = row(concat([sets[g] for g in groups]))
        out.update((g, row(sets[g])) for g in groups)
    return out


def by_question(rows: list[tuple[int, list[int]]], question: list[str]) -> list:
    """Per-prompt (drafts, accepted per position) rows summed per question (`question[i]`:
    row i's), in the order questions first appear: the units a bootstrap resamples."""
    out: dict[str, tuple[int, list[int]]] = {}
    for q, (d, a) in zip(question, rows):
        d0, a0 = out.get(q, (0, []))
        n = max(len(a0), len(a))
        out[q] = (d0 + d, [x + y for x, y in zip(a0 + [0] * (n - len(a0)),
                                                 list(a) + [0] * (n - len(a)))])
    return list(out.values())


def summarize(cfg, measured: Measured, num_prompts: int,
              prompt_ids: list[str] | None = None) -> EvalReport:
    """The report of measured results: per method and k, speed against plain decoding,
    95 % intervals, the replayed acceptance and (given the prompts' ids) acceptance by
    source."""
    results = _results(measured)
    for r in results:
        if r.method == "target":
            log.info("no speculation: %.1f tokens/s", r.tokens_per_s)
        else:
            log.info("%s k=%d: mean acceptance length %s, per position %s, %s tokens per "
                     "step, %.1f tokens/s (x%.2f)", r.method, r.k,
                     fmt(r.mean_acceptance_length, 3),
                     r.per_position_acceptance, fmt(r.tokens_per_step, 3), r.tokens_per_s,
                     r.speedup)
    report = _report(cfg, results, measured.mismatches, num_prompts, measured)
    report.ci95 = {str(k): bootstrap_ci(measured.per_prompt[report.primary, k], k)
                   for k in cfg.k if (report.primary, k) in measured.per_prompt}
    for k, rows in measured.replayed.items():
        report.replayed[str(k)] = {**pooled(rows, k), "ci95": bootstrap_ci(rows, k)}
    if prompt_ids is not None:
        report.by_source = by_source(measured, prompt_ids)
        report.per_prompt = {f"{name} k={k}": [[prompt_ids[j], d, list(a)]
                                              for j, (d, a) in zip(measured.index, rows)]
                             for (name, k), rows in measured.per_prompt.items()
                             if name != "target"}
    report.workers = cfg.workers
    report.batch_size = cfg.batch_size
    report.target_sdpa = target_sdpa_choice()
    report.settings = f"chain drafts, batch size {cfg.batch_size}" + (
        ", torch's SDPA choice (EYAS_TARGET_SDPA=torch)" if report.target_sdpa == "torch"
        else "") + (
        f", {cfg.draft_sampling} drafts (vLLM draft_sample_method)" if cfg.temperature else "")
    return report


def pooled(rows: list[tuple[int, list[int]]], k: int) -> dict:
    """Drafts, mean acceptance length (1 + accepted / drafts) and per-position rates of
    per-prompt (drafts, accepted per position) rows taken together."""
    drafts = sum(d for d, _ in rows)
    accepted = [sum(a[i] for _, a in rows) for i in range(k)]
    return {"drafts": drafts,
            "mean_acceptance_length": round(1 + sum(accepted) / drafts, 4) if drafts else None,
            "per_position_acceptance": [round(a / drafts, 4) if drafts else 0.0
                                        for a in accepted]}


def source_of(prompt_id: str) -> str | None:
    """A prompt's source: its id without the last "/" part (real_data.py's ids are
    SOURCE/TASK/N, the prompt sets' SET/N), or the file of a `FILE:ROW` id (a row without an
    id column, eyas.targets.chat.sample_id: one with a "/" or a chat file's suffix); None for
    an id that names no source."""
    file = re.fullmatch(r"(.+):\d+", prompt_id)
    # a file in the working directory has no "/": known by its suffix, as --data reads it
    if file and ("/" in prompt_id or file[1].endswith(FILE_SUFFIXES)):
        return file[1]
    return prompt_id.rsplit("/", 1)[0] if "/" in prompt_id else None


def by_source(measured: Measured, prompt_ids: list[str]) -> dict[str, dict]:
    """Mean acceptance length of every drafting method and k per prompt source (prompts in
    `measured.index` order), when the prompts come from more than one: "sources" (source ->
    row), "without_source" (the prompts whose id names none, if any) and "all" (every
    prompt); a row is {"prompts": n, "mean_acceptance_length": {"METHOD k=K": AL}}."""
    sources = [source_of(prompt_ids[j]) for j in measured.index]
    if len(set(sources)) < 2:
        return {}

    def row(rows: list[int]) -> dict:
        als = {f"{name} k={k}": pooled([per_prompt[i] for i in rows], k)["mean_acceptance_length"]
               for (name, k), per_prompt in measured.per_prompt.items() if name != "target"}
        return {"prompts": len(rows), "mean_acceptance_length": als}

    out = {"sources": {src: row([i for i, s in enumerate(sources) if s == src])
                       for src in sorted(set(sources) - {None})}}
    if None in sources:
        out["without_source"] = row([i for i, s in enumerate(sources) if s is None])
    out["all"] = row(list(range(len(sources))))
    return out


def primary_per_prompt(report: dict) -> dict[str, list]:
    """k -> the primary drafter's per-prompt rows ([id, drafts, accepted per position]) of a
    report.json's `per_prompt` (keys "METHOD k=K"); {} for a report without them."""
    primary = report.get("primary") or "eagle3"
    out = {}
    for key, rows in (report.get("per_prompt") or {}).items():
        method, _, k = key.rpartition(" k=")
        if method == primary:
            out[k] = rows
    return out


def matched_rows(ours: list, theirs: list) -> tuple[list, list]:
    """The prompts both per-prompt row lists hold ([id, drafts, accepted per position, or
    their sum]), matched by id in `ours`' order, as paired_change_ci's two (drafts, accepted
    per position) lists. Ids must be unique in each list (eval makes them so): a report with
    two rows under one id is refused, since either could be the other's pair."""
    for rows, name in ((ours, "first"), (theirs, "second")):
        twice = [i for i, n in Counter(r[0] for r in rows).items() if n > 1]
        if twice:
            raise ValueError(f"paired rows: the {name} report has {len(twice)} prompt id(s) "
                             f"more than once ({twice[:3]}); measure it again with this "
                             f"eyas eval, which renames them ID#2, ...")
    by_id = {r[0]: r for r in theirs}

    def row(r: list) -> tuple[int, list]:
        return r[1], list(r[2]) if isinstance(r[2], (list, tuple)) else [r[2]]

    pairs = [(r, by_id[r[0]]) for r in ours if r[0] in by_id]
    return [row(a) for a, _ in pairs], [row(b) for _, b in pairs]


def paired_change_ci(ours: list[tuple[int, list[int]]], theirs: list[tuple[int, list[int]]],
                     n: int = 1000, seed: int = 0) -> dict:
    """The change of mean acceptance length from `theirs` to `ours` (AL_ours / AL_theirs - 1,
    each pooled: 1 + accepted / drafts) with its 95 % interval, from per-prompt (drafts,
    accepted per position) rows of two drafts measured on the same prompts, row i of each
    being prompt i: a bootstrap that draws the same prompts for both, so the prompts'
    own difficulty, shared by the two, leaves the interval (two drafts of one target at
    T = 0 continue the same text, so a prompt's counts differ by the draft alone)."""
    import numpy as np

    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired rows: {len(ours)} against {len(theirs)} prompts")
    d = np.array([[r[0] for r in ours], [r[0] for r in theirs]], dtype=np.float64)  # (2, P)
    a = np.array([[sum(r[1]) for r in ours], [sum(r[1]) for r in theirs]], dtype=np.float64)
    if not d[0].sum() or not d[1].sum():
        return {}

    def change(pick) -> np.ndarray:
        al = 1 + a[:, pick].sum(-1) / np.maximum(d[:, pick].sum(-1), 1)  # (2,) or (2, n)
        return al[0] / al[1] - 1

    pick = np.random.default_rng(seed).integers(0, d.shape[1], size=(n, d.shape[1]))
    boot = change(pick)  # (n,): each draw's change
    return {"change": round(float(change(np.arange(d.shape[1]))), 5), "prompts": d.shape[1],
            "ci95": [round(float(np.percentile(boot, q)), 5) for q in (2.5, 97.5)]}


def bootstrap_ci(rows: list[tuple[int, list[int]]], k: int, n: int = 1000,
                 seed: int = 0) -> dict:
    """95 % intervals of the mean acceptance length and of each position's rate from
    per-prompt (drafts, accepted per position) counts, resampling prompts with replacement
    (the rounds of one prompt are not independent draws)."""
    import numpy as np

    if not rows or not sum(d for d, _ in rows):  # nothing drafted: no interval
        return {}
    drafts = np.array([d for d, _ in rows], dtype=np.float64)  # (P,)
    acc = np.array([list(a)[:k] + [0] * (k - len(a)) for _, a in rows],
                   dtype=np.float64)  # (P, k)
    pick = np.random.default_rng(seed).integers(0, len(rows), size=(n, len(rows)))  # (n, P)
    d = np.maximum(drafts[pick].sum(1), 1)  # (n,)
    a = acc[pick].sum(1)  # (n, k)
    al = 1 + a.sum(1) / d
    rates = a / d[:, None]
    lo, hi = 2.5, 97.5
    return {"mean_acceptance_length": [round(float(np.percentile(al, q)), 4) for q in (lo, hi)],
            "per_position_acceptance": [[round(float(np.percentile(rates[:, i], q)), 4)
                                         for q in (lo, hi)] for i in range(k)]}


def _report(cfg, results, mismatches, num_prompts: int,
            measured: Measured) -> EvalReport:
    primary = next((m for m in ("eagle3", "dflash") if any(r.method == m for r in results)),
                   "ngram")
    mine = [r for r in results if r.method == primary]
    for m in mismatches:
        m["tie"] = rounding_tie(m.get("margin"), m.get("logit"), measured.dtype)
    ties = [m for m in mismatches if m["tie"]]
    mismatches = [m for m in mismatches if not m["tie"]]
    return EvalReport(
        target=cfg.target, draft=cfg.draft, primary=primary, temperature=cfg.temperature,
        k=list(cfg.k), num_prompts=num_prompts, max_new_tokens=cfg.max_new_tokens,
        device=measured.device, dtype=measured.dtype,
        mean_acceptance_length={str(r.k): r.mean_acceptance_length for r in mine},
        per_position_acceptance={str(r.k): r.per_position_acceptance for r in mine},
        lossless=(not mismatches) if cfg.lossless_check else None,
        mismatches=mismatches, results=results, ties=ties,
        draft_sampling=cfg.draft_sampling if cfg.temperature else None)


TIE_ULPS = 2


def rounding_tie(margin: float | None, logit: float | None, dtype: str) -> bool:
    """Whether a divergence is a tie of the target's two best logits within the dtype's
    rounding: |margin| <= TIE_ULPS ulps of the greedy token's logit in `dtype`.

    Why two: the logits leave the lm_head rounded to the dtype's grid. Where the exact
    logits of the two tokens are equal, or closer than that grid, the plain and the k+1-token
    forward may round each of them one step differently (their sums run in other orders), so
    the gap between the two moves by up to 2 ulps and the argmax can flip. A margin of 0 is
    an exact tie (the two forwards break it differently). The ulp is the dtype's spacing at
    the logit's magnitude: eps * 2^floor(log2 |logit|) (eps 2^-23 in float32, 2^-7 in
    bfloat16, 2^-10 in float16). Larger differences are not rounding of the output alone and
    fail the check."""
    if margin is None or logit is None:
        return False
    eps = torch.finfo(getattr(torch, dtype)).eps
    ulp = eps * 2.0 ** math.floor(math.log2(abs(logit))) if logit else 0.0
    return abs(margin) <= TIE_ULPS * ulp


# ---------------------------------------------------------------- writing it

def mismatch_message(report: EvalReport) -> str:
    shown = "; ".join(
        f"{m['prompt_id']} ({m['method']} k={m['k']}): first divergence at new token "
        f"{m['position']}, greedy {m['expected']} vs speculative {m['got']}"
        + (f" (target logit margin {m['margin']:.4g})" if m.get("margin") is not None else "")
        for m in report.mismatches[:10])
    more = f" and {len(report.mismatches) - 10} more" if len(report.mismatches) > 10 else ""
    if report.dtype == "float32":
        # already the most exact dtype eval runs in: only the margin tells rounding from a bug
        advice = ("This run was already float32: a margin below ~1e-4 is float32 rounding "
                  "(the two forwards sum in different orders), a difference with a clear "
                  "margin is a bug: please report it.")
    else:
        advice = ("Re-run with --dtype float32 to tell them apart (a difference in float32 "
                  "with a clear margin is a bug: please report it).")
    ties = (f" ({len(report.ties)} more divergence(s) at a tie within {TIE_ULPS} ulps of "
            f"{report.dtype} rounding are listed in the report and do not fail it)"
            if report.ties else "")
    return (f"lossless check failed: speculative decoding differs from the target's greedy "
            f"output in {len(report.mismatches)} generation(s) by more than {report.dtype} "
            f"rounding of the logits: {shown}{more}{ties}. The report is "
            f"written regardless. In {report.dtype} this can be rounding rather than a bug: "
            f"verification scores k+1 tokens in one forward, plain decoding one at a time, and "
            f"a near-tie of the top two logits (margin near 0) can flip. {advice} Pass "
            f"--no-check-lossless to skip the check.")


def fmt(x, digits: int = 2) -> str:
    """A number for the log and report.md: "-" where there is none (a method that drafted
    nothing)."""
    return "-" if x is None else f"{x:.{digits}f}"
