"""Served speed (issue 33): vLLM serves the target three ways in one run, no speculation,
n-gram (prompt lookup) and the eyas draft (EAGLE-3), and the output tokens per second of each
are set side by side per prompt set, temperature and batch size.

    python benchmarks/served_speed.py --target /tmp/w/qwen-hf --draft /tmp/w/run/draft \
        --bench mt-bench,humaneval --data heldout.jsonl --num-prompts 80 --batch1-prompts 20 \
        --k 3,5,1,7,2,4,6 --ngram-k 4 --batches 1,8,32,64 --temperatures 0,1 \
        --max-new-tokens 256 --eyas-report eval-t0/report.json --eyas-report eval-t1/report.json \
        --max-minutes 25 --json benchmarks/results/served-qwen-coder.json

What runs. One `vllm.LLM` engine per way: "none", "ngram" at each --ngram-k and each of
--ngram-methods (vLLM's `method: "ngram"`, and `"ngram_gpu"` where asked: the same lookup on
the GPU, which keeps async scheduling on; prompt_lookup_min/max as `eyas eval`'s n-gram
drafter), "eagle3" at each --k. A way that fails is named in the JSON (`failed`, with the
phase: start, warm-up or measure; its engine is closed and what it measured before stays) and
the others run. `--runner v1|v2` runs every engine on that vLLM model runner
(`VLLM_USE_V2_MODEL_RUNNER`: V2 runs the EAGLE draft's steps as full CUDA graphs, V1 captures
them piecewise and runs their attention between the pieces); by default vLLM chooses (0.24: V2
for Llama targets, V1 for Qwen2 and for n-gram), and each engine records the runner it used.
`--attention` sets the attention kernels of every engine (vLLM 0.24's V2 runner can die
starting an EAGLE-3 engine on FlashAttention 3's defaults: ATTENTION below); given a list
(`fa3-nosplit,triton,fa2`), the first eagle3 way runs first, once per setting in the list's
order until its engine starts, and the whole run then uses the setting that started it
(those that did not are under `failed` with their errors). When the run's attention or
runner is not vLLM's own, no speculation is also measured as vLLM serves it by default, on its
own attention and runner ("none (auto attention, auto runner)": for Qwen2 in vLLM 0.24, V1,
where a random 1.5B-shaped target ran 10 % faster per token than on V2 in session 25), unless
--no-default-baseline, and each speedup is over the faster of the two: a server without a
draft needs no workaround. `--engine-args` sets any other vllm.LLM argument.
vLLM cannot change `speculative_config` on a live engine, so each way costs one engine start
(about 60-100 s on an H200 with CUDA graphs; 20 s on the CPU with the tiny test target);
everything else (prompt sets, temperatures, batch sizes) reuses it. The first eagle3 way
(the first --k) runs first, then the others in that order, --k in the order given: a lease
that ends while serving keeps what the run is for (session 29's lost its only eagle3 engine
queued behind the two engines without speculation, which any run measures alike).
Each engine is warmed up (every batch shape and temperature, a few tokens) before any timing,
and its prefix cache is emptied before each measurement (every measurement prefills its
prompts).

Batch B is a closed loop of B clients, as `vllm bench serve --max-concurrency B`: B requests
in flight, a new one added as soon as one finishes, until the set's prompts run out (the
last B - 1 finish at a lower concurrency); the engine's max_num_seqs is the largest batch, at
least 8 and 1 + the largest k (below that vLLM 0.24's V2 runner leaves the draft's decode
steps out of its CUDA graphs: engine_kwargs).
Timing per request from this process: time to first token, and time per output token
(TPOT: first token to last over the tokens after the first, as vLLM's benchmark defines
it). Output tokens/s = all output tokens of a measurement over its wall time. At batch 1
each request's tokens and seconds are kept (`per_request`), and the speedup over no
speculation gets a 95 % interval from them (the prompts resampled, paired: ratio_ci95).
Acceptance as
vLLM counts it: its spec-decode counters (read as benchmarks/vllm_serve.py reads them),
taken before and after each measurement; beside it `eyas eval`'s acceptance on the same
prompts from each --eyas-report (matched by temperature and prompt set, pooled from the
report's per-prompt counts over exactly the prompts a row served where the report has them:
"(same prompts)" in the tables; and at T > 0 by how
the drafts were drawn: --draft-sampling greedy, vLLM's default, or probabilistic, which this
run passes to vLLM as the eagle3 ways' draft_sample_method).

Prompts: eyas eval's own (eyas.evaluate.load_prompts: the target's chat template with
`add_generation_prompt`, as `eyas regenerate --backend vllm` renders a user turn), handed to
vLLM as token ids; MT-bench's first turn only (its second follows the target's own answer).
Sampling is plain (temperature, top_p 1; the target's generation_config penalties are not
applied, as in eyas eval), stopping at the target's end-of-turn ids. At T=0 every
speculative output is compared with the same batch's output without speculation.

--max-minutes stops cleanly: no engine is started that the time left cannot hold (judged by
the longest engine so far), no measurement begins after the budget; the JSON (written after
every measurement) and the markdown table say what ran and what did not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

for key, value in (("VLLM_USE_FLASHINFER_SAMPLER", "0"), ("VLLM_NO_USAGE_STATS", "1"),
                   ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
    os.environ.setdefault(key, value)  # before vLLM is imported (its engine process reads them)

sys.path.insert(0, str(Path(__file__).parent))
from vllm_serve import counters, hf_folder  # noqa: E402  (read as vllm_serve.py reads them)

from eyas.serve.export_readme import draft_sampling as report_draft_sampling  # noqa: E402
from eyas.serve.export_readme import speculative_config  # noqa: E402

WARMUP_TOKENS = 8


NGRAM_METHODS = ("ngram", "ngram_gpu")  # vLLM's prompt lookup on the CPU, and on the GPU

# --attention: vLLM's attention settings for every engine of a run (target and draft alike).
# vLLM 0.24's V2 runner captures the draft's first (prefill) step as a full CUDA graph with
# attention metadata left over from the target's capture (vllm-project/vllm#47561, fixed after
# 0.24 by #48261): FlashAttention 3's split-KV combine then reads out of bounds and the
# engine dies at start. Seen here on a target of 2 K/V heads (Qwen2.5-1.5B's shape), not on
# Llama-8B's 8. Each choice takes a different way around it.
ATTENTION = {
    "auto": {},  # vLLM's choice (FlashAttention 3 on an H100/H200)
    "fa3-nosplit": {"attention_config": {"flash_attn_max_num_splits_for_cuda_graph": 1}},
    "fa2": {"attention_config": {"flash_attn_version": 2}},  # no ahead-of-time schedule
    "triton": {"attention_config": {"backend": "TRITON_ATTN"}},
}


def attentions(a) -> list[str]:
    """--attention's settings in the order to try them (one, or a comma-separated list)."""
    names = [n for n in a.attention.split(",") if n]
    bad = [n for n in names if n not in ATTENTION]
    if bad or not names:
        raise SystemExit(f"--attention {a.attention!r}: use one of {', '.join(ATTENTION)}, "
                         "or several separated by commas (tried in order)")
    return names


MIN_NUM_SEQS = 8  # (engine_kwargs: vLLM 0.24 V2 needs room for the draft's graphs)


def engine_kwargs(a, attention: str | None = None) -> dict:
    """The vLLM engine arguments every way of a run shares: the run's batches and memory,
    the settings of `attention` (by default --attention's first), then --engine-args (a JSON
    object, given last: it wins, and an attention_config it gives is merged into the
    attention's key by key)."""
    # max_num_seqs: the largest batch, but never below MIN_NUM_SEQS nor 1 + the largest k.
    # vLLM 0.24's V2 runner captures the draft's decode steps in CUDA graphs only at sizes
    # that are multiples of 1 + k and at most max_num_seqs: at max_num_seqs 1 (a run of
    # batch 1 alone) it captured none, and a step at k = 3 cost 5.2 ms on session 41's H200
    # against 3.6 on session 40's H100 at max_num_seqs 8 (other machines: not an A/B). The
    # closed loop of B clients keeps B requests in flight whatever the engine allows, so a
    # larger max_num_seqs changes no measurement's concurrency.
    ks = [int(k) for k in f"{a.k},{a.ngram_k}".split(",") if k.strip()]
    engine = {"max_num_seqs": max([int(b) for b in a.batches.split(",")] +
                                  [MIN_NUM_SEQS] + [1 + k for k in ks]),
              "gpu_memory_utilization": a.gpu_memory_utilization,
              "max_model_len": a.max_model_len, "enforce_eager": a.enforce_eager,
              "disable_log_stats": False}
    engine.update(ATTENTION[attention or attentions(a)[0]])  # (serve_one copies the whole)
    try:
        extra = json.loads(a.engine_args) if a.engine_args else {}
    except json.JSONDecodeError as err:
        raise SystemExit(f"--engine-args is not JSON ({err}): give an object, e.g. "
                         "'{\"attention_config\": {\"backend\": \"TRITON_ATTN\"}}'") from None
    if not isinstance(extra, dict):
        raise SystemExit(f"--engine-args must be a JSON object of vllm.LLM arguments, got "
                         f"{type(extra).__name__}")
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(engine.get(key), dict):
            engine[key] = {**engine[key], **value}
        else:
            engine[key] = value
    return engine


@dataclass(frozen=True)
class Way:
    """One engine: how vLLM serves the target ("none", "ngram" or "eagle3") and its k; an
    n-gram way's `method` is vLLM's ("ngram", or "ngram_gpu": the lookup on the GPU, which
    keeps vLLM's async scheduling on where "ngram" turns it off)."""

    name: str
    k: int = 0
    method: str = ""
    attention: str = ""  # an --attention setting of its own ("": the run's)
    runner: str = ""  # a --runner setting of its own ("": the run's)

    @property
    def label(self) -> str:
        way = self.name if self.name == "none" else f"{self.method or self.name} k={self.k}"
        own = [x for x in (self.attention and f"{self.attention} attention",
                           self.runner and f"{self.runner} runner") if x]
        return way + (f" ({', '.join(own)})" if own else "")

    def runner_variable(self, run_runner: str) -> str | None:
        """VLLM_USE_V2_MODEL_RUNNER for this way's engine: "1" or "0", or None where vLLM
        is to choose (the variable removed: a way of its own on runner auto, e.g. the
        default baseline, after engines that set it); "" leaves the environment as it is."""
        runner = self.runner or run_runner
        if runner == "auto":
            return None if self.runner else ""
        return "1" if runner == "v2" and self.name != "ngram" else "0"  # (0.24's V2: no n-gram)

    def speculative_config(self, draft: str, lookup: tuple[int, int],
                           draft_sampling: str = "greedy") -> dict | None:
        if self.name == "none":
            return None
        if self.name == "ngram":
            return {"method": self.method or "ngram", "num_speculative_tokens": self.k,
                    "prompt_lookup_min": lookup[0], "prompt_lookup_max": lookup[1]}
        return speculative_config("eagle3", draft, self.k, draft_sampling)


def percentiles(xs: list[float]) -> dict:
    """Mean, p50 and p90 in milliseconds (None without values)."""
    if not xs:
        return {"mean": None, "p50": None, "p90": None}
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
    return {"mean": round(1e3 * statistics.fmean(xs), 3), "p50": round(1e3 * q[4], 3),
            "p90": round(1e3 * q[8], 3)}


def drive(engine, prompts: list[list[int]], params, batch: int, tag: str) -> list[dict]:
    """Generate `prompts` with at most `batch` requests in flight (a closed loop of `batch`
    clients); per prompt, in order: its tokens and its add / first-token / finish times."""
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.DELTA  # each step returns only the new tokens
    done = [{"tokens": [], "added": None, "first": None, "finished": None} for _ in prompts]
    queue, in_flight = list(range(len(prompts))), 0
    while queue or in_flight:
        while queue and in_flight < batch:
            i = queue.pop(0)
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompts[i]}, params)
            done[i]["added"], in_flight = time.perf_counter(), in_flight + 1
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            r = done[int(out.request_id.rsplit("-", 1)[1])]
            new = list(out.outputs[0].token_ids)
            if new and r["first"] is None:
                r["first"] = now
            r["tokens"] += new
            if out.finished:
                r["finished"], in_flight = now, in_flight - 1
    return done


def spec_delta(before: dict, after: dict) -> dict | None:
    """vLLM's spec-decode counts between two `counters` readings: drafts, draft tokens,
    accepted tokens, mean acceptance length and per-position rates."""
    n = after["num_drafts"] - before["num_drafts"]
    if not n:  # e.g. n-gram on sampled text that never repeats its suffix
        return {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                "acceptance_length": None, "per_position": None}
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    per_pos = [a - b for a, b in zip(after["per_pos"] or [], before["per_pos"]
                                     or [0] * len(after["per_pos"] or []))]
    return {"drafts": n, "draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
            "accepted_tokens": accepted, "acceptance_length": round(1 + accepted / n, 4),
            "per_position": [round(x / n, 4) for x in per_pos]}


def eyas_eval_al(reports: list[dict], way: Way, group: str, temperature: float,
                 draft_sampling: str = "greedy",
                 prompt_ids: list[str] | None = None) -> dict | None:
    """`eyas eval`'s acceptance for `way` on prompt set `group` at `temperature` from the
    reports given: a --bench report's result for that set first, else the overall result of
    a report that measured one set (the --data prompts; whatever the order of the reports);
    the 95 % interval where the report has one (the set's own, or the primary method's over a
    one-set report's prompts). Given the served prompts' ids (`prompt_ids`) and a report
    that kept every prompt's counts (`per_prompt`) with all of them: eval's acceptance and
    interval on exactly those prompts ("same_prompts": true; a batch-1 row serves the set's
    first --batch1-prompts, eval measured the whole set). At T > 0 only reports
    that drew their drafts as this run serves them (`draft_sampling`) count: greedy and
    probabilistic drafts accept differently."""
    same_t = [rep for rep in reports if abs(rep["temperature"] - temperature) <= 1e-6
              and (not temperature or report_draft_sampling(rep) == draft_sampling)]
    for rep in [r for r in same_t if group in (r.get("by_set") or {})] + \
            [r for r in same_t if not r.get("by_set")]:
        per_set = rep.get("by_set") or {}
        if group in per_set:
            results, n = per_set[group]["results"], per_set[group]["prompts"]
        else:
            results, n = rep["results"], rep["num_prompts"]
        hit = next((r for r in results if r["method"] == way.name and r["k"] == way.k), None)
        if hit is None:
            continue
        if group in per_set:  # the set's own interval (older reports have none)
            ci = (per_set[group].get("ci95") or {}).get(f"{way.name} k={way.k}", {}) \
                .get("mean_acceptance_length")
        else:  # a report of one set (no by_set): its primary method's interval
            ci = (rep.get("ci95") or {}).get(str(way.k), {}).get("mean_acceptance_length") \
                if way.name == rep.get("primary") else None
        got = {"acceptance_length": hit["mean_acceptance_length"], "ci95": ci,
               "per_position": hit["per_position_acceptance"], "drafts": hit["drafts"],
               "prompts": n, "device": rep.get("device"), "dtype": rep.get("dtype")}
        return {**got, **same_prompts(rep, way, prompt_ids)}
    return None


def same_prompts(report: dict, way: Way, prompt_ids: list[str] | None) -> dict:
    """`eyas eval`'s acceptance of `way` on exactly the prompts `prompt_ids`, pooled from the
    report's per-prompt counts, with its bootstrap interval; {} where the report lacks any
    of them (reports written before per_prompt, or other prompts)."""
    from eyas.serve.eval_report import bootstrap_ci, pooled

    rows = {pid: (d, a) for pid, d, a in
            (report.get("per_prompt") or {}).get(f"{way.name} k={way.k}", [])}
    if not prompt_ids or any(pid not in rows for pid in prompt_ids):
        return {}
    picked = [rows[pid] for pid in prompt_ids]
    whole = pooled(picked, way.k)
    return {"acceptance_length": whole["mean_acceptance_length"],
            "ci95": bootstrap_ci(picked, way.k).get("mean_acceptance_length"),
            "per_position": whole["per_position_acceptance"], "drafts": whole["drafts"],
            "prompts": len(picked), "same_prompts": True}


def measure(llm, way: Way, group: str, prompts, temperature: float, batch: int, a,
            stop_ids, reference: dict, reports: list[dict], early: list | None = None) -> dict:
    """One (way, prompt set, temperature, batch) measurement: speed, vLLM's acceptance, the
    lossless check at T=0 and eyas eval's acceptance beside it. A T=0 row measured before
    the same batch without speculation (the way that picked --attention's setting) waits in
    `early` with its outputs, and is checked when that batch's reference arrives."""
    from vllm import SamplingParams

    ids = [p.ids.tolist() for p in prompts]
    prompt_ids = [p.id for p in prompts]
    params = SamplingParams(temperature=temperature, top_p=1.0, max_tokens=a.max_new_tokens,
                            ignore_eos=a.ignore_eos, stop_token_ids=sorted(stop_ids),
                            detokenize=False)
    llm.reset_prefix_cache()
    before = counters(llm) if way.name != "none" else None
    t0 = time.perf_counter()
    done = drive(llm.llm_engine, ids, params, batch, f"{way.label}-{group}-{temperature}-{batch}")
    seconds = time.perf_counter() - t0
    tokens = [r["tokens"] for r in done]
    n_out = sum(len(t) for t in tokens)
    tpot = [(r["finished"] - r["first"]) / (len(r["tokens"]) - 1) for r in done
            if len(r["tokens"]) > 1]
    row = {"way": way.name, "k": way.k, **({"method": way.method} if way.method else {}),
           **({"attention": way.attention} if way.attention else {}),
           **({"runner": way.runner} if way.runner else {}),
           "set": group, "temperature": temperature,
           "batch": batch, "prompts": len(ids), "output_tokens": n_out,
           "seconds": round(seconds, 3), "output_tokens_per_s": round(n_out / seconds, 2),
           "tpot_ms": percentiles(tpot),
           "ttft_ms": percentiles([r["first"] - r["added"] for r in done if r["first"]]),
           "vllm": spec_delta(before, counters(llm)) if before else None,
           # batch 1: one request at a time, so the speedups' intervals resample these
           **({"per_request": [[len(r["tokens"]), round(r["finished"] - r["added"], 5)]
                               for r in done]} if batch == 1 else {}),
           "same_outputs_as_no_speculation": None,
           "prompt_ids": prompt_ids,
           "eyas_eval": eyas_eval_al(reports, way, group, temperature, a.draft_sampling,
                                     prompt_ids)
           if way.name != "none" else None}
    if temperature == 0 and not (way.name == "none" and (way.attention or way.runner)):
        # (the default baseline is not the outputs' reference)
        key = (group, batch)
        if way.name == "none":
            reference[key] = tokens
            for _, waiting, outputs in [e for e in early or [] if e[0] == key]:
                waiting["same_outputs_as_no_speculation"] = sum(
                    t == r for t, r in zip(outputs, tokens))
        elif key in reference:
            row["same_outputs_as_no_speculation"] = sum(
                t == r for t, r in zip(tokens, reference[key]))
        elif early is not None:
            early.append((key, row, tokens))
    return row


def ratio_ci95(fast: dict | None, slow: dict | None, resamples: int = 2000) -> list | None:
    """The 95 % interval of `fast`'s tokens/s over `slow`'s, where both rows served the same
    prompts one request at a time (batch 1, `per_request`): the prompts resampled with
    replacement, each time the ratio of the two rows' tokens over seconds on that sample
    (paired: a long answer weighs alike in both); None otherwise."""
    a, b = (fast or {}).get("per_request"), (slow or {}).get("per_request")
    if not a or not b or len(a) != len(b):
        return None
    rng, n, ratios = random.Random(0), len(a), []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        ta, sa = sum(a[i][0] for i in pick), sum(a[i][1] for i in pick)
        tb, sb = sum(b[i][0] for i in pick), sum(b[i][1] for i in pick)
        if sa > 0 and sb > 0 and tb > 0:
            ratios.append(ta / sa / (tb / sb))
    ratios.sort()
    if not ratios:
        return None
    return [round(ratios[int(0.025 * len(ratios))], 3),
            round(ratios[min(len(ratios) - 1, int(0.975 * len(ratios)))], 3)]


def speedups(rows: list[dict]) -> list[dict]:
    """Per (set, temperature, batch): the fastest n-gram and eagle3 k, their tokens/s and
    the eagle3's speedup over no speculation and over the fastest n-gram."""
    out = []
    for key in dict.fromkeys((r["set"], r["temperature"], r["batch"]) for r in rows):
        same = [r for r in rows if (r["set"], r["temperature"], r["batch"]) == key]

        def best(name):
            got = [r for r in same if r["way"] == name]
            return max(got, key=lambda r: r["output_tokens_per_s"]) if got else None

        none, ngram, eagle = best("none"), best("ngram"), best("eagle3")
        tps = {n: r and r["output_tokens_per_s"] for n, r in
               (("none", none), ("ngram", ngram), ("eagle3", eagle))}
        out.append({
            "set": key[0], "temperature": key[1], "batch": key[2],
            "none_tokens_per_s": tps["none"],
            **({"none_attention": none["attention"]} if none and none.get("attention") else {}),
            **({"none_runner": none["runner"]} if none and none.get("runner") else {}),
            "ngram_best_k": ngram and ngram["k"], "ngram_tokens_per_s": tps["ngram"],
            "ngram_best_method": ngram and ngram.get("method", "ngram"),
            "eagle3_best_k": eagle and eagle["k"], "eagle3_tokens_per_s": tps["eagle3"],
            "eagle3_over_none": round(tps["eagle3"] / tps["none"], 3)
            if eagle and none else None,
            "eagle3_over_none_ci95": ratio_ci95(eagle, none),
            "eagle3_over_ngram": round(tps["eagle3"] / tps["ngram"], 3)
            if eagle and ngram else None,
            "ngram_over_none": round(tps["ngram"] / tps["none"], 3) if ngram and none else None,
            "eagle3_vllm_al": eagle and eagle["vllm"] and eagle["vllm"]["acceptance_length"],
            "eagle3_eyas_eval_al": eagle and eagle["eyas_eval"]
            and eagle["eyas_eval"]["acceptance_length"],
            "eagle3_eyas_eval_ci95": eagle and eagle["eyas_eval"] and eagle["eyas_eval"]["ci95"],
            "eagle3_eyas_eval_same_prompts": bool(eagle and eagle["eyas_eval"]
                                                  and eagle["eyas_eval"].get("same_prompts")),
            "tpot_p50_ms_none": none and none["tpot_ms"]["p50"],
            "tpot_p50_ms_eagle3": eagle and eagle["tpot_ms"]["p50"],
            **break_even(none, eagle)})
    return out


def break_even(none: dict | None, eagle: dict | None) -> dict:
    """What one verify step of the eagle3 row costs and the acceptance length at which it
    would only match no speculation: a step yields AL tokens per request in TPOT x AL (mean
    TPOT), against one token per step in the TPOT without speculation. A draft pays on this
    target, batch and k only where its AL is above `eagle3_break_even_al`."""
    if not (none and eagle and eagle["vllm"] and eagle["vllm"]["acceptance_length"]
            and none["tpot_ms"]["mean"] and eagle["tpot_ms"]["mean"]):
        return {"eagle3_step_ms": None, "eagle3_break_even_al": None}
    step = eagle["tpot_ms"]["mean"] * eagle["vllm"]["acceptance_length"]
    return {"eagle3_step_ms": round(step, 3),
            "eagle3_break_even_al": round(step / none["tpot_ms"]["mean"], 3)}


def _ratio(a: float | None, b: float | None) -> str:
    """a / b to two places from the tokens/s themselves (the summary's ratio, rounded to three,
    would be rounded twice: 1.1251 -> 1.125 -> 1.12)."""
    return "-" if a is None or not b else f"{a / b:.2f}"


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _runners(result: dict) -> str:
    """The model runner each engine ran on, as vLLM chose it (and what was asked)."""
    used = [f"{e['way']} {e['model_runner']}" for e in result.get("engines", [])
            if e.get("model_runner")]
    asked = result.get("model_runner")
    return (f" (runner asked: {asked}" + (f"; used: {', '.join(used)}" if used else "") + ")"
            if asked or used else "")


def _ngram_k(s: dict) -> str:
    """The fastest n-gram's k, and its method when that is not plain "ngram"."""
    method = s.get("ngram_best_method")
    return _f(s["ngram_best_k"]) + (f", {method}" if method not in (None, "ngram") else "")


def _interval(ci: list | None) -> str:
    return f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""


def _none_setting(s: dict) -> str:
    """The summary's no-speculation engine, where it is the default baseline: " (auto)",
    " (auto, auto runner)"."""
    runner = s.get("none_runner")
    own = [x for x in (s.get("none_attention"), runner and f"{runner} runner") if x]
    return f" ({', '.join(own)})" if own else ""


def markdown(result: dict) -> str:
    """The summary (best k per way, speedups) and every measured configuration, with the
    command that made them."""
    lines = [f"`{result['command']}`", "",
             f"{result['device']}, vLLM {result['vllm_version']}"
             + _runners(result)
             + (f", attention {result['attention']}" if result.get("attention", "auto") != "auto"
                else "")
             + f", {result['dtype']}, {result['max_new_tokens']} new tokens"
             + (f"; stopped early: {result['stopped_early']}" if result["stopped_early"]
                else ""), "",
             "| set | T | batch | none tok/s | n-gram tok/s (k) | eyas tok/s (k) | x none | "
             "x n-gram | AL vLLM | AL eyas eval [95 %] | TPOT p50 ms none / eyas | "
             "break-even AL |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result["summary"]:
        ci = s["eagle3_eyas_eval_ci95"]
        lines.append(
            f"| {s['set']} | {s['temperature']:g} | {s['batch']} | {_f(s['none_tokens_per_s'], 1)}"
            + _none_setting(s) + " "
            f"| {_f(s['ngram_tokens_per_s'], 1)} ({_ngram_k(s)}) "
            f"| {_f(s['eagle3_tokens_per_s'], 1)} ({_f(s['eagle3_best_k'])}) "
            f"| {_ratio(s['eagle3_tokens_per_s'], s['none_tokens_per_s'])}"
            + _interval(s.get("eagle3_over_none_ci95")) + " "
            f"| {_ratio(s['eagle3_tokens_per_s'], s['ngram_tokens_per_s'])} "
            f"| {_f(s['eagle3_vllm_al'], 3)} | {_f(s['eagle3_eyas_eval_al'], 3)}"
            + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
            + (" (same prompts)" if s.get("eagle3_eyas_eval_same_prompts") else "")
            + f" | {_f(s['tpot_p50_ms_none'])} / {_f(s['tpot_p50_ms_eagle3'])} "
            f"| {_f(s.get('eagle3_break_even_al'))} |")
    lines += ["", "| way | set | T | batch | prompts | tok/s | TPOT mean / p50 / p90 ms | "
                  "AL vLLM | AL eyas eval | same outputs (T=0) |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        t = r["tpot_ms"]
        same = r["same_outputs_as_no_speculation"]
        same = "-" if same is None else f"{same} / {r['prompts']}"
        way = Way(r["way"], r["k"], r.get("method", ""), r.get("attention", ""),
                  r.get("runner", ""))
        lines.append(
            f"| {way.label} "
            f"| {r['set']} "
            f"| {r['temperature']:g} | {r['batch']} | {r['prompts']} | {r['output_tokens_per_s']:.1f} "
            f"| {_f(t['mean'])} / {_f(t['p50'])} / {_f(t['p90'])} "
            f"| {_f(r['vllm'] and r['vllm']['acceptance_length'], 3)} "
            f"| {_f(r['eyas_eval'] and r['eyas_eval']['acceptance_length'], 3)}"
            + (" (same prompts)" if r["eyas_eval"] and r["eyas_eval"].get("same_prompts")
               else "") + f" | {same} |")
    if result["not_run"]:
        lines += ["", "Not run: " + ", ".join(result["not_run"])]
    for f in result.get("failed", []):
        lines += ["", f"Failed ({f.get('phase', 'start')}"
                  + (f", attention {f['attention']}" if f.get("attention") else "")
                  + f"): {f['way']}: {f['error']}"]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="a Hugging Face folder (a .gguf is converted)")
    p.add_argument("--draft", default=None, help="an `eyas export` folder; none: no eagle3 ways")
    p.add_argument("--data", default=None, help="a JSONL of held-out prompts (as eyas eval --data)")
    p.add_argument("--bench", default="", help="standard sets, e.g. mt-bench,humaneval "
                   "(eyas.store.benchsets; archives in $EYAS_BENCH_CACHE)")
    p.add_argument("--num-prompts", type=int, default=80, help="the first N of each set")
    p.add_argument("--batch1-prompts", type=int, default=20,
                   help="at batch 1 only the first N of each set (its time grows with N)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true", help="every answer max-new-tokens long")
    p.add_argument("--k", default="1,2,3,4,5,6,7", help="eagle3 k values, in the order run")
    p.add_argument("--ngram-k", default="4", help="n-gram k values ('' for none)")
    p.add_argument("--ngram-methods", default="ngram",
                   help="vLLM n-gram methods, each at every --ngram-k: ngram (the lookup on "
                        "the CPU; vLLM then turns async scheduling off), ngram_gpu (on the "
                        "GPU, async scheduling stays on; vLLM >= 0.14, its V1 runner only)")
    p.add_argument("--runner", choices=("auto", "v1", "v2"), default="auto",
                   help="vLLM's model runner for every engine of the run: v1 / v2 set "
                        "VLLM_USE_V2_MODEL_RUNNER to 0 / 1 (V2 runs the EAGLE draft's steps as "
                        "full CUDA graphs, V1 piecewise; n-gram ways stay on V1, which V2 "
                        "refuses); auto leaves vLLM's choice (0.24: V2 for Llama, V1 for "
                        "Qwen2; V1 for n-gram). Each engine records the runner vLLM used; "
                        "run once per runner to compare (v1 / v2 also measure no "
                        "speculation on vLLM's choice: --no-default-baseline)")
    p.add_argument("--attention", default="auto",
                   help="attention settings for every engine: auto (vLLM's), fa3-nosplit "
                        "(FlashAttention 3 without split-KV in CUDA graphs), fa2 "
                        "(FlashAttention 2), triton (vLLM's Triton kernels); the last three "
                        "avoid vLLM 0.24's crash starting an EAGLE-3 engine on the V2 runner "
                        "for some targets (vllm#47561). A comma-separated list: the first "
                        "eagle3 way runs first with each in turn, and the first that starts "
                        "it is the run's")
    p.add_argument("--no-default-baseline", dest="default_baseline", action="store_false",
                   help="when the run's --attention or --runner is not vLLM's own (auto), "
                        "no speculation is also measured on vLLM's own attention and runner, "
                        "and each speedup is over the faster of the two (a server without a "
                        "draft needs no workaround); this flag skips that engine")
    p.add_argument("--engine-args", default="",
                   help="more vllm.LLM arguments for every engine, as a JSON object (applied "
                        "after --attention; recorded in the result's `engine`)")
    p.add_argument("--ngram-min", type=int, default=2, help="vLLM's prompt_lookup_min")
    p.add_argument("--ngram-max", type=int, default=4, help="vLLM's prompt_lookup_max")
    p.add_argument("--batches", default="1,8,32,64", help="concurrencies")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--draft-sampling", choices=("greedy", "probabilistic"), default="greedy",
                   help="at T > 0, how the eagle3 ways draw drafts (vLLM's draft_sample_method; "
                        "greedy is its default); --eyas-report rows are matched to it")
    p.add_argument("--eyas-report", action="append", default=[],
                   help="an `eyas eval` report.json on the same prompts (once per temperature)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (always so on the CPU; not how vLLM serves on a GPU)")
    p.add_argument("--hf-dir", default="/tmp/vllm-target", help="where a .gguf is converted")
    p.add_argument("--max-minutes", type=float, default=0, help="budget; 0 = no limit")
    p.add_argument("--json", required=True, help="the result; the table goes beside it (.md)")
    return p.parse_args(argv)


def load_sets(a) -> dict[str, list]:
    """Prompt set name -> its prompts, rendered as `eyas eval` renders them."""
    from eyas.evaluate import EvalConfig, load_prompts
    from eyas.targets.models import load_tokenizer

    cfg = EvalConfig(target=a.target, data=a.data, out="(none)", num_prompts=a.num_prompts,
                     max_new_tokens=a.max_new_tokens, k=(1,),
                     bench=tuple(b for b in a.bench.split(",") if b))
    prompts, _ = load_prompts(cfg, load_tokenizer(a.target))
    sets: dict[str, list] = {}
    for p in prompts:
        sets.setdefault(p.group or "data", []).append(p)
    return sets


def serve_one(way: Way, a, sets: dict, engine: dict, deadline: float, result: dict,
              state: dict) -> dict:
    """Start one engine for `way`, warm it up, measure every (set, temperature, batch) the
    budget allows, stop it; returns its record (start, warm-up and total seconds)."""
    import vllm

    from eyas.serve.vllm_generate import VLLMGenerator

    batches = result["batches"]
    spec = way.speculative_config(a.draft, (a.ngram_min, a.ngram_max), a.draft_sampling)
    variable = way.runner_variable(a.runner)  # read by vLLM when it builds the engine's config
    if variable is None:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    elif variable:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = variable
    t0 = time.perf_counter()
    state["phase"] = "start"
    gen = VLLMGenerator(result["target_dir"], dtype=a.dtype, seed=0,
                        **json.loads(json.dumps(engine)),  # a copy: the record stays as given
                        speculative_config=spec)
    try:
        started = time.perf_counter() - t0
        record = {"way": way.label, "speculative_config": spec, "start_s": round(started, 1),
                  "model_runner": model_runner(gen.llm), "measurements": 0}
        result["engines"].append(record)
        state["phase"] = "warm-up"
        warm = [p.ids.tolist() for ps in sets.values() for p in ps][:max(batches)]
        for t in result["temperatures"]:  # every sampling path at the largest batch, untimed
            drive(gen.llm.llm_engine, warm, vllm.SamplingParams(
                temperature=t, max_tokens=WARMUP_TOKENS, ignore_eos=True), max(batches),
                f"warm{t}")
        record["warmup_s"] = round(time.perf_counter() - t0 - started, 1)
        state["phase"] = "measure"
        _measure_all(way, a, sets, gen, deadline, result, state, record)
    finally:  # a failed measurement must not leave its engine holding the GPU for the next
        gen.close()
    record["total_s"] = round(time.perf_counter() - t0, 1)
    return record


def model_runner(llm) -> str | None:
    """Which model runner vLLM chose for this engine: "v2" or "v1" (vLLM 0.24 runs some
    architectures, Llama among them and Qwen2 not, on V2 unless told otherwise; a feature V2
    lacks, n-gram for one, sends it back to V1); None where this vLLM does not say."""
    try:
        return "v2" if llm.llm_engine.vllm_config.use_v2_model_runner else "v1"
    except AttributeError:
        return None


def _measure_all(way: Way, a, sets: dict, gen, deadline: float, result: dict, state: dict,
                 record: dict) -> None:
    """Every (set, temperature, batch) of one engine that the budget allows."""
    for group, prompts in sets.items():
        for t in result["temperatures"]:
            for b in result["batches"]:
                key = (group, t, b)
                # begin only what the budget holds, judged by the same measurement before
                if time.perf_counter() + state["last_seconds"].get(key, 0) > deadline:
                    result["stopped_early"] = f"--max-minutes {a.max_minutes} in {way.label}"
                    result["not_run"].append(f"{way.label} {group} T={t:g} batch {b}")
                    continue
                row = measure(gen.llm, way, group, prompts[:a.batch1_prompts] if b == 1
                              else prompts, t, b, a, gen.stop_ids, state["reference"],
                              state["reports"], state["early"])
                state["last_seconds"][key] = row["seconds"]
                result["rows"].append(row)
                record["measurements"] += 1
                state["write"]()


def attach_reports(result: dict, report_paths: list[str]) -> dict:
    """`served_speed.py attach --json X --eyas-report R ...`: `eyas eval`'s acceptance set
    beside every speculative row of a finished run, and its summary and table made again,
    for reports made after the run (a lease that serves first and evaluates after)."""
    reports = [json.loads(Path(r).read_text()) for r in report_paths]
    for row in result["rows"]:  # a row these reports do not cover keeps what it had
        if row["way"] != "none":
            row["eyas_eval"] = eyas_eval_al(reports, Way(row["way"], row["k"]), row["set"],
                                            row["temperature"],
                                            result.get("draft_sampling", "greedy"),
                                            row.get("prompt_ids")) \
                or row.get("eyas_eval")
    result["eyas_reports"] = list(dict.fromkeys(result.get("eyas_reports", []) + report_paths))
    result["summary"] = speedups(result["rows"])
    return result


def draft_first(ways: list[Way]) -> list[Way]:
    """`ways` with the first eagle3 way moved to the front (the rest keep their order)."""
    eagle = [w for w in ways if w.name == "eagle3"][:1]
    return eagle + [w for w in ways if w not in eagle]


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["attach"]:
        p = argparse.ArgumentParser(prog="served_speed.py attach",
                                    description=attach_reports.__doc__)
        p.add_argument("--json", required=True, help="a served_speed.py result, rewritten")
        p.add_argument("--eyas-report", action="append", required=True,
                       help="an eyas eval report.json on the same prompts (repeatable)")
        a = p.parse_args(argv[1:])
        out = Path(a.json)
        result = attach_reports(json.loads(out.read_text()), a.eyas_report)
        out.write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(result))
        return result
    a = parse_args(argv)
    tries = attentions(a)
    engine = engine_kwargs(a, tries[0])  # (a bad --engine-args stops here, before any work)
    methods = [m for m in a.ngram_methods.split(",") if m]
    if set(methods) - set(NGRAM_METHODS) or not methods:
        raise SystemExit(f"--ngram-methods {a.ngram_methods!r}: use some of {NGRAM_METHODS}")
    started = time.perf_counter()
    deadline = started + 60 * a.max_minutes if a.max_minutes else float("inf")
    batches = [int(b) for b in a.batches.split(",")]
    temps = [float(t) for t in a.temperatures.split(",")]
    ways = [Way("none")] + [Way("ngram", int(k), "" if m == "ngram" else m)
                            for m in methods for k in a.ngram_k.split(",") if k] + \
        ([Way("eagle3", int(k)) for k in a.k.split(",") if k] if a.draft else [])
    sets = load_sets(a)
    reports = [json.loads(Path(r).read_text()) for r in a.eyas_report]
    target_dir = hf_folder(a.target, Path(a.hf_dir), a.dtype)

    import torch
    import vllm
    import vllm.envs

    if a.runner != "auto" and "VLLM_USE_V2_MODEL_RUNNER" not in vllm.envs.environment_variables:
        raise SystemExit(f"--runner {a.runner}: vLLM {vllm.__version__} has no "
                         "VLLM_USE_V2_MODEL_RUNNER (one model runner only); leave --runner out")
    result = {
        "benchmark": "served-speed", "issue": 33, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                        time.gmtime()),
        "command": "python benchmarks/served_speed.py " + " ".join(argv),
        "vllm_version": vllm.__version__, "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
        else f"CPU ({platform.machine()}, {os.cpu_count()} cores)",
        "target": a.target, "target_dir": target_dir, "draft": a.draft, "dtype": a.dtype,
        "engine": engine,
        "sets": {name: len(ps) for name, ps in sets.items()}, "batch1_prompts": a.batch1_prompts,
        "max_new_tokens": a.max_new_tokens, "ignore_eos": a.ignore_eos, "batches": batches,
        "temperatures": temps, "ways": [w.label for w in ways],
        "ngram_lookup": [a.ngram_min, a.ngram_max], "eyas_reports": a.eyas_report,
        "draft_sampling": a.draft_sampling,
        "model_runner": a.runner,  # as asked; each engine's record says which vLLM used
        # set once one starts eagle3 (without a draft, a list's first serves the run)
        "attention": tries[0] if len(tries) == 1 or not a.draft else None,
        "attention_tried": tries,
        "engines": [], "rows": [], "summary": [], "stopped_early": None, "not_run": [],
        "failed": []}
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write():
        result["summary"] = speedups(result["rows"])
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        out.write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(result))

    state = {"reference": {}, "last_seconds": {}, "reports": reports, "write": write,
             "phase": None, "early": [], "longest": 0.0}

    def run(way: Way, engine: dict, attention: str | None = None) -> bool:
        """Serve one way; False where it failed (named under `failed`, the run goes on)."""
        try:
            record = serve_one(way, a, sets, engine, deadline, result, state)
        except Exception as e:  # noqa: BLE001 (one way failed: the others still run)
            if way == Way("none"):
                raise  # nothing to compare against
            print(f"{way.label} failed ({state['phase']}"
                  + (f", attention {attention}" if attention else "")
                  + f"): {type(e).__name__}: {e}", flush=True)
            # what it measured before failing stays: each row is a whole measurement
            result["failed"].append({"way": way.label, "phase": state["phase"],
                                     **({"attention": attention} if attention else {}),
                                     "error": f"{type(e).__name__}: {e}"[:500]})
            write()
            return False
        if attention:
            record["attention"] = attention
        state["longest"] = max(state["longest"], record["total_s"])
        write()
        return True

    ways = draft_first(ways)
    eagle = [w for w in ways if w.name == "eagle3"]
    if len(tries) > 1 and eagle:
        # --attention's list: the first eagle3 way, once per setting until its engine starts
        # (a failure after the start, in warm-up or measuring, is not the setting's)
        ways.remove(eagle[0])
        for attention in tries:
            if time.perf_counter() + state["longest"] > deadline:
                result["stopped_early"] = f"--max-minutes {a.max_minutes} before " \
                                          f"{eagle[0].label} on attention {attention}"
                result["attention"] = tries[0]
                result["not_run"] += [f"{eagle[0].label} (attention {attention})"]
                break
            result["attention"] = attention  # (what the JSON written meanwhile is serving on)
            if run(eagle[0], engine_kwargs(a, attention), attention) or \
                    state["phase"] != "start":
                break
            result["attention"] = None
        else:  # none started it: the rest of the run on the first, without eagle3
            result["attention"] = tries[0]
            result["not_run"] += [f"{w.label} (no --attention setting started "
                                  f"{eagle[0].label})" for w in eagle[1:]]
            ways = [w for w in ways if w.name != "eagle3"]
        engine = result["engine"] = engine_kwargs(a, result["attention"])
    if a.default_baseline and (result["attention"] != "auto" or a.runner != "auto"):
        # no speculation as vLLM serves it by default too (its attention and its model
        # runner: V1 for Qwen2 in 0.24): the speedups are over the faster
        ways.insert(ways.index(Way("none")) + 1, Way(
            "none", attention="auto" if result["attention"] != "auto" else "",
            runner="auto" if a.runner != "auto" else ""))
    for n, way in enumerate(ways):
        if result["stopped_early"] is None and \
                time.perf_counter() + state["longest"] > deadline:
            result["stopped_early"] = f"--max-minutes {a.max_minutes} before {way.label}"
        if result["stopped_early"]:
            result["not_run"] += [w.label for w in ways[n:]]
            break
        run(way, engine_kwargs(a, way.attention) if way.attention else engine,
            way.attention or None)
    write()
    print(markdown(result))
    return result


if __name__ == "__main__":  # vLLM starts its engine core in another process
    main()
