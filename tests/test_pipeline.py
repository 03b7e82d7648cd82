"""`eyas run` planning and `eyas demo --fast`: the whole CLI pipeline end to end on CPU."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path

import pytest
import yaml

from eyas.config import ConfigError
from eyas.errors import EyasError
from eyas.demo import DemoConfig, demo
from eyas.evaluate import EvalConfig
from eyas.pipeline import RunConfig, plan, run


def _write(tmp_path, spec) -> str:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_plan_wires_folders_and_refuses_unknown_keys(tmp_path, llama_dir):
    from eyas.store.manifest import write_manifest

    spec = {"target": str(llama_dir), "data": "chats.jsonl", "work_dir": "w",
            "vocab": {"draft_vocab_size": 256}}
    plans = plan(RunConfig(pipeline=_write(tmp_path, spec), dry_run=True))
    assert [p.step for p in plans] == ["prepare", "capture", "vocab", "train", "export", "eval"]
    assert all(p.action == "run" for p in plans)
    by = {p.step: p.config for p in plans}
    work = tmp_path / "w"
    assert by["capture"].data == str(work / "prepared")
    assert by["train"].data == str(work / "captured") and by["train"].vocab == str(work / "vocab")
    assert by["export"].checkpoint == str(work / "train")
    assert by["eval"].draft == str(work / "draft") and by["vocab"].draft_vocab_size == 256
    online = plan(RunConfig(pipeline=_write(tmp_path, {**spec, "train": {"online": True}})))
    assert "capture" not in [p.step for p in online]
    assert {p.step: p for p in online}["train"].config.data == str(work / "prepared")
    # quoted booleans mean what they mean to the step's config (bool("false") is True)
    for no in ("false", "no", "off"):
        quoted = plan(RunConfig(pipeline=_write(tmp_path, {
            **spec, "train": {"online": no}, "regenerate": {"enabled": no}})))
        assert [p.step for p in quoted][:2] == ["prepare", "capture"]
        assert {p.step: p for p in quoted}["train"].config.data == str(work / "captured")
    with pytest.raises(ConfigError, match="unknown top-level key.*'traine'"):
        plan(RunConfig(pipeline=_write(tmp_path, {**spec, "traine": {}})))
    with pytest.raises(ConfigError, match="section 'train'.*'lrr'"):
        plan(RunConfig(pipeline=_write(tmp_path, {**spec, "train": {"lrr": 1}})))
    for section in (5, ["lr: 1"], "online"):  # an AttributeError traceback before
        with pytest.raises(ConfigError, match=r"section 'train' must be a mapping of key: value"):
            plan(RunConfig(pipeline=_write(tmp_path, {**spec, "train": section})))
    with pytest.raises(ConfigError, match="needs a top-level 'target'"):
        plan(RunConfig(pipeline=_write(tmp_path, {"data": "x", "work_dir": "w"})))
    # regenerate stops conversations at the length prepare keeps, unless its section says
    regen = {**spec, "regenerate": {"enabled": True}, "prepare": {"max_length": 512}}
    by = {p.step: p.config for p in plan(RunConfig(pipeline=_write(tmp_path, regen)))}
    assert by["regenerate"].max_length == 512 == by["prepare"].max_length
    # and prepare keeps the first max_length tokens of a conversation whose last answer
    # crossed it (an audit: its default policy, drop, threw the whole conversation away)
    assert by["prepare"].length_policy == "truncate"
    regen["regenerate"]["max_length"] = 0
    regen["prepare"]["length_policy"] = "drop"
    by = {p.step: p.config for p in plan(RunConfig(pipeline=_write(tmp_path, regen)))}
    assert by["regenerate"].max_length == 0 and by["prepare"].length_policy == "drop"
    assert by["regenerate"].chat_template is None
    # and asks the target in the template prepare renders with (through a server, counts the
    # prompts' tokens in it)
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    regen["prepare"]["chat_template"] = str(tmp_path / "t.jinja")
    for backend in ({}, {"backend": "openai", "server_url": ["http://localhost:1"]}):
        regen["regenerate"].update(backend)
        by = {p.step: p.config for p in plan(RunConfig(pipeline=_write(tmp_path, regen)))}
        assert by["regenerate"].chat_template == str(tmp_path / "t.jinja")
    assert plan(RunConfig(pipeline=_write(tmp_path, spec)))[0].config.length_policy == "drop"
    # --from-step skips steps that must have finished: said up front, not as a missing input
    with pytest.raises(ConfigError, match=r"--from-step capture skips prepare, which has not "
                                          r"finished in .*w/prepared; run without --from-step"):
        plan(RunConfig(pipeline=_write(tmp_path, spec), from_step="capture"))
    # (a manifest of prepare's own config: one of other settings is out of date, refused too)
    prepared = plan(RunConfig(pipeline=_write(tmp_path, spec)))[0].config
    write_manifest(work / "prepared", "prepare", prepared)
    (work / "prepared" / "dataset").mkdir()  # (what its readers need of it: freshness.OUTPUTS)
    until = plan(RunConfig(pipeline=_write(tmp_path, spec), from_step="capture",
                           until_step="train"))
    assert [p.step for p in until] == ["capture", "vocab", "train"]
    with pytest.raises(ConfigError, match=r"--from-step train skips capture"):
        plan(RunConfig(pipeline=_write(tmp_path, spec), from_step="train"))
    # 'enabled' belongs to regenerate: anywhere else it was silently ignored
    with pytest.raises(ConfigError, match=r"'train.dflash_layers' \(--dflash-layers\): "
                                          r"cannot read 'five'"):
        plan(RunConfig(pipeline=_write(tmp_path, {**spec, "train": {
            "draft": "dflash", "dflash_layers": "five"}})))
    with pytest.raises(ConfigError, match=r"'enabled' in section 'prepare' would be ignored"):
        plan(RunConfig(pipeline=_write(tmp_path, {**spec, "prepare": {"enabled": False}})))
    # a step this pipeline skips, or an empty range: a ValueError traceback before
    for flags, want in (({"from_step": "capture"}, r"--from-step capture: this pipeline has no "
                                                   r"capture step \(its steps: prepare, vocab"),
                        ({"until_step": "regenerate"}, r"--until-step regenerate: .*no regen"),
                        ({"from_step": "eval", "until_step": "prepare", "pipeline":
                          _write(tmp_path, spec)}, r"--from-step eval comes after --until-step")):
        args = {"pipeline": _write(tmp_path, {**spec, "train": {"online": True}}), **flags}
        with pytest.raises(ConfigError, match=want):
            plan(RunConfig(**args))


def test_a_pipeline_without_held_out_prompts_wires_eval_and_export_to_work(tmp_path,
                                                                          llama_dir):
    """From a user audit: prepare.eval_fraction 0 (and train's 0) ran prepare, capture and
    train, then export failed for want of a best checkpoint ("use --which last", a flag the
    YAML does not have) and eval on the empty eval split, bench sets given or not. Now: no
    eval prompts and no eval.bench or eval.data is refused by the plan (a dry run too); with
    bench sets eval reads those only; a run without any eval exports its last checkpoint."""
    spec = {"target": str(llama_dir), "data": "chats.jsonl", "work_dir": "w",
            "prepare": {"eval_fraction": 0}}
    with pytest.raises(ConfigError, match=r"prepare.eval_fraction is 0, so the prepared data "
                                          r"has no eval prompts for the eval step: .*eval.bench"):
        plan(RunConfig(pipeline=_write(tmp_path, spec), dry_run=True))
    by = {p.step: p.config for p in plan(RunConfig(pipeline=_write(tmp_path, {
        **spec, "eval": {"bench": ["mt-bench"]}}), dry_run=True))}
    assert by["eval"].data is None and by["eval"].bench == ("mt-bench",)
    assert by["export"].which == "best"  # train holds out its own 2 %
    by = {p.step: p.config for p in plan(RunConfig(pipeline=_write(tmp_path, {
        **spec, "train": {"eval_fraction": 0}, "eval": {"data": "prompts.jsonl"}}),
        dry_run=True))}
    assert by["export"].which == "last" and by["eval"].data == "prompts.jsonl"
    # a section's own choice stands; the default wiring is unchanged
    by = {p.step: p.config for p in plan(RunConfig(pipeline=_write(tmp_path, {
        **spec, "train": {"eval_fraction": 0}, "export": {"which": "step-10"},
        "eval": {"data": "prompts.jsonl"}}), dry_run=True))}
    assert by["export"].which == "step-10"
    by = {p.step: p.config for p in plan(RunConfig(pipeline=_write(tmp_path, {
        **spec, "prepare": {}}), dry_run=True))}
    assert by["export"].which == "best" and by["eval"].data == str(tmp_path / "w" / "prepared")


def test_a_section_that_sets_its_out_is_where_the_next_steps_read(tmp_path, llama_dir):
    # train's section moved its run elsewhere, and export still read work_dir/train: an older
    # run left there was exported and evaluated as this one, without a word
    spec = {"target": str(llama_dir), "data": "chats.jsonl", "work_dir": "w",
            "regenerate": {"enabled": True, "out": str(tmp_path / "regen")},
            "prepare": {"out": str(tmp_path / "prep")}, "capture": {"out": "cap"},
            "vocab": {"out": str(tmp_path / "voc")}, "train": {"out": str(tmp_path / "run")},
            "export": {"out": str(tmp_path / "drafts")}}
    by = {p.step: p.config for p in plan(RunConfig(pipeline=_write(tmp_path, spec)))}
    assert by["prepare"].data == (str(tmp_path / "regen" / "conversations.jsonl"),)
    assert by["capture"].data == by["eval"].data == str(tmp_path / "prep")
    assert by["vocab"].data == (str(tmp_path / "prep"),)
    assert by["train"].data == "cap" and by["train"].vocab == str(tmp_path / "voc")
    assert by["export"].checkpoint == str(tmp_path / "run")
    assert by["eval"].draft == str(tmp_path / "drafts")
    assert by["eval"].out == str(tmp_path / "w" / "eval")  # (a section without out: work_dir)


def test_a_damaged_step_manifest_is_a_clear_error_not_a_traceback(tmp_path, llama_dir):
    # a cut or edited eyas.json in a step's folder was a JSONDecodeError (or AttributeError)
    # traceback from the plan, --dry-run included
    spec = {"target": str(llama_dir), "data": "chats.jsonl", "work_dir": "w"}
    pipeline = _write(tmp_path, spec)
    (tmp_path / "w" / "prepared").mkdir(parents=True)
    for damaged, why in (('{"step": "prepare", ', "Expecting"), ("[1]", "a JSON list")):
        (tmp_path / "w" / "prepared" / "eyas.json").write_text(damaged)
        for cfg in (RunConfig(pipeline=pipeline, dry_run=True),
                    RunConfig(pipeline=pipeline, from_step="capture")):
            with pytest.raises(EyasError, match=rf"w/prepared/eyas.json is damaged \({why}.*In "
                                                rf"`eyas run`, move .*w/prepared away"):
                plan(cfg)


def test_a_work_dir_that_is_no_folder_path_is_a_clear_error(tmp_path, llama_dir):
    # a list, a number, an empty value or a file was a TypeError / FileExistsError traceback
    (tmp_path / "notes.txt").write_text("mine")
    for work, want in (([1, 2], r"work_dir must be a folder path .* not \[1, 2\]"),
                       (5, "not 5"), (None, "not None"), ("", "not ''"),
                       ("notes.txt", r"work_dir .*notes.txt cannot be a folder: .*notes.txt is "
                                     r"a file"),
                       ("notes.txt/w", r"cannot be a folder: .*notes.txt is a file")):
        pipeline = _write(tmp_path, {"target": str(llama_dir), "data": "c.jsonl",
                                     "work_dir": work})
        for cfg in (RunConfig(pipeline=pipeline), RunConfig(pipeline=pipeline, dry_run=True)):
            with pytest.raises(ConfigError, match=want):
                run(cfg)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_an_export_that_lost_a_file_it_wrote_runs_again(tmp_path, llama_dir):
    # a draft folder whose model.safetensors was deleted was "up to date" at every plan
    from eyas import freshness
    from eyas.store.manifest import write_manifest

    spec = {"target": str(llama_dir), "data": "chats.jsonl", "work_dir": "w"}
    cfg = {p.step: p.config for p in plan(RunConfig(pipeline=_write(tmp_path, spec)))}["export"]
    out = Path(cfg.out)
    for name in ("config.json", "model.safetensors"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("{}")
    write_manifest(out, "export", cfg, files={"config.json": "0", "model.safetensors": "0"})
    assert freshness.up_to_date(cfg, out, False) == (True, "up to date")
    (out / "model.safetensors").unlink()
    assert freshness.up_to_date(cfg, out, False) == (
        False, "its output lost model.safetensors since it ran")


def test_a_capture_that_lost_a_part_runs_again(tmp_path, llama_dir):
    """From an audit: a damaged part, deleted as train's message says, left the capture "up
    to date" at every plan, and train refused it again at every run."""
    from eyas import freshness
    from eyas.store.manifest import write_manifest

    spec = {"target": str(llama_dir), "data": "chats.jsonl", "work_dir": "w"}
    cfg = {p.step: p.config for p in plan(RunConfig(pipeline=_write(tmp_path, spec)))}["capture"]
    out = Path(cfg.out)
    out.mkdir(parents=True)
    parts = ["shard-00000-of-00001.part-00000.safetensors",
             "shard-00000-of-00001.part-00001.safetensors"]
    for name in parts:
        (out / name).write_bytes(b"x" * 10)
    (out / "index.json").write_text(json.dumps({"files": [{"file": n, "bytes": 10}
                                                          for n in parts]}))
    write_manifest(out, "capture", cfg)
    assert freshness.up_to_date(cfg, out, False) == (True, "up to date")
    (out / parts[1]).write_bytes(b"x" * 4)  # cut short
    (out / parts[0]).unlink()
    assert freshness.up_to_date(cfg, out, False) == (False, (
        f"its part files {parts[0]}, {parts[1]} are missing or cut since it ran: capture "
        f"resumes and captures their samples again"))


def test_a_target_whose_weights_changed_in_place_reruns_its_steps(tmp_path, llama_dir,
                                                                   monkeypatch):
    import shutil
    from dataclasses import replace

    from safetensors.torch import load_file, save_file

    from eyas import freshness
    from eyas.store.manifest import target_record, write_manifest

    target = tmp_path / "target"
    shutil.copytree(llama_dir, target)
    spec = {"target": str(target), "data": "chats.jsonl", "work_dir": "w"}
    cfg = {p.step: p.config for p in plan(RunConfig(pipeline=_write(tmp_path, spec)))}["capture"]
    out = Path(cfg.out)
    write_manifest(out, "capture", cfg, target=target_record(str(target)))
    (out / "index.json").write_text('{"files": []}')  # (a capture's index, of no part)
    assert freshness.up_to_date(cfg, out, False) == (True, "up to date")
    # fine-tuned in place: every config the same, so only the fingerprint tells
    weights = load_file(str(target / "model.safetensors"))
    weights["model.norm.weight"] += 0.5
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    ok, why = freshness.up_to_date(cfg, out, False)
    assert not ok and re.fullmatch(r"the target's weights changed \(weights_fingerprint "
                                   r"\w{16} -> \w{16}\)", why), why
    # a relative target, planned from another directory: not "weights changed ... -> None";
    # prepare's record has no fingerprint (tokens only), and its template check took the name
    # for a hub model and waited ~46 s on the network before saying anything (no tokenizer
    # is loaded now)
    monkeypatch.chdir(tmp_path)
    spec = {**spec, "target": "target"}
    configs = {p.step: p.config for p in plan(RunConfig(pipeline=_write(tmp_path, spec)))}
    cfg, prep = configs["capture"], configs["prepare"]
    write_manifest(out, "capture", cfg, target=target_record("target"))
    write_manifest(prep.out, "prepare", prep, target=target_record("target", weights=False),
                   chat_template_hash="x")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setattr("eyas.prepare.load_tokenizer", lambda *a, **k: pytest.fail("loaded"))
    for step_cfg, folder in ((cfg, out), (prep, Path(prep.out))):
        ok, why = freshness.up_to_date(step_cfg, folder, False)
        assert not ok and why.startswith(f"its target target does not exist from "
                                         f"{tmp_path / 'elsewhere'} (it ran with {target};"), why
    # an absolute one deleted: no word of directories
    monkeypatch.chdir(tmp_path)
    cfg = replace(cfg, target=str(target))
    write_manifest(out, "capture", cfg, target=target_record(str(target)))
    shutil.rmtree(target)
    ok, why = freshness.up_to_date(cfg, out, False)
    assert (ok, why) == (False, f"its target {target} does not exist (it ran with it)")


def test_regenerate_with_other_settings_starts_over_and_an_interrupted_one_resumes(
        tmp_path, llama_dir, caplog):
    """regenerate refuses to resume a folder made with other generation settings or data; in
    `eyas run` that refusal used to end the pipeline. The old folder is now moved aside and
    regenerate starts over (so the steps after it run again), as for train."""
    from eyas.targets.corpus import synthetic_chats

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(3)))
    spec = {"target": str(llama_dir), "data": str(data), "work_dir": "w",
            "regenerate": {"enabled": True, "max_new_tokens": 4, "device": "cpu"}}
    pipeline, work = _write(tmp_path, spec), tmp_path / "w"
    run(RunConfig(pipeline=pipeline, until_step="prepare"))
    assert [p.action for p in plan(RunConfig(pipeline=pipeline, until_step="prepare"))] == \
        ["skip", "skip"]

    spec["regenerate"]["max_new_tokens"] = 5
    pipeline = _write(tmp_path, spec)
    with caplog.at_level(logging.INFO, logger="eyas.pipeline"):
        plans = run(RunConfig(pipeline=pipeline, until_step="prepare", dry_run=True))
    regen, prepare = plans
    assert regen.action == "run" and regen.start_over
    assert "regenerate starts over (its config changed (max_new_tokens (it ran with 4)))" in \
        regen.reason and "regenerated.previous" in caplog.text
    assert prepare.action == "run" and not prepare.start_over
    run(RunConfig(pipeline=pipeline, until_step="prepare"))
    was = json.loads((work / "regenerated.previous" / "eyas.json").read_text())
    now = json.loads((work / "regenerated" / "eyas.json").read_text())
    assert (was["config"]["max_new_tokens"], now["config"]["max_new_tokens"]) == (4, 5)
    assert now["complete"] and now["stats"]["skipped"] == 0  # generated again, not resumed

    # an interrupted run with the same settings resumes (one with others starts over), and
    # a finished one whose --limit rose resumes
    (work / "regenerated" / "eyas.json").write_text(json.dumps({**now, "complete": False}))
    regen = plan(RunConfig(pipeline=pipeline, until_step="regenerate"))[0]
    assert regen.action == "run" and not regen.start_over and "interrupted" in regen.reason
    other = _write(tmp_path, {**spec, "regenerate": {**spec["regenerate"], "temperature": 0.5}})
    regen = plan(RunConfig(pipeline=other, until_step="regenerate"))[0]
    assert regen.start_over and "temperature (it ran with 0.0)" in regen.reason
    pipeline = _write(tmp_path, spec)
    (work / "regenerated" / "eyas.json").write_text(json.dumps(now))
    forced = plan(RunConfig(pipeline=pipeline, until_step="regenerate", force=True))[0]
    assert forced.start_over and "regenerate starts over (forced)" in forced.reason
    spec["regenerate"]["limit"] = 10
    pipeline = _write(tmp_path, spec)
    regen = plan(RunConfig(pipeline=pipeline, until_step="regenerate"))[0]
    assert regen.action == "run" and not regen.start_over and "limit" in regen.reason
    run(RunConfig(pipeline=pipeline, until_step="regenerate"))
    stats = json.loads((work / "regenerated" / "eyas.json").read_text())["stats"]
    assert stats["skipped"] == stats["input"] == 3
    assert json.loads((work / "regenerated.previous" / "eyas.json").read_text()) == was
    # a second start over keeps the first generation (it was deleted): the plan names where
    spec["regenerate"]["max_new_tokens"] = 6
    pipeline = _write(tmp_path, spec)
    regen = plan(RunConfig(pipeline=pipeline, until_step="regenerate"))[0]
    assert regen.start_over and "the old run moved to regenerated.previous-2" in regen.reason
    run(RunConfig(pipeline=pipeline, until_step="regenerate"))
    assert json.loads((work / "regenerated.previous" / "eyas.json").read_text()) == was
    kept = json.loads((work / "regenerated.previous-2" / "eyas.json").read_text())
    assert kept["config"]["max_new_tokens"] == 5


def _prepared(tmp_path, llama_dir):
    """Three chats prepared by `eyas run --until-step prepare`: (the data file, the pipeline
    YAML, prepare's eyas.json, that RunConfig)."""
    from eyas.targets.corpus import synthetic_chats

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(3)))
    pipeline = _write(tmp_path, {"target": str(llama_dir), "data": str(data), "work_dir": "w"})
    prepare = RunConfig(pipeline=pipeline, until_step="prepare")
    run(prepare)
    return data, pipeline, tmp_path / "w" / "prepared" / "eyas.json", prepare


def test_a_chat_template_edited_in_place_prepares_again(tmp_path, llama_dir):
    # every config equal, so the plan skipped prepare and the rows stayed rendered with the old
    # template (`eyas prepare` by itself prepared again)
    import shutil

    from eyas.targets.corpus import synthetic_chats

    target = tmp_path / "target"
    shutil.copytree(llama_dir, target)
    template = tmp_path / "chat.jinja"
    template.write_text((target / "chat_template.jinja").read_text())
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(3)))
    spec = {"target": str(target), "data": str(data), "work_dir": "w"}
    for prepare in ({"chat_template": str(template)}, {}):  # a template file, the target's own
        pipeline = _write(tmp_path, {**spec, "prepare": prepare})
        run(RunConfig(pipeline=pipeline, until_step="prepare"))
        assert [p.action for p in plan(RunConfig(pipeline=pipeline, until_step="prepare"))] == \
            ["skip"]
        edited = Path(prepare.get("chat_template") or target / "chat_template.jinja")
        edited.write_text(edited.read_text().replace("<|eot_id|>", "<|eot_id|>\n"))
        again = plan(RunConfig(pipeline=pipeline, until_step="prepare"))[0]
        assert again.action == "run" and re.fullmatch(
            r"its chat template changed \(chat_template_hash \w{16} -> \w{16}\)",
            again.reason), again.reason


def test_a_second_run_in_the_same_work_dir_is_refused_while_the_first_runs(tmp_path,
                                                                           llama_dir, caplog):
    # two `eyas run` on one work_dir planned from the same folders and ran the same steps
    # into them side by side; the refusal names the process, and a dry run beside it says
    # that its plan reads folders being written (an audit: it called a step under way
    # "interrupted" without a word)
    from eyas.pipeline import RUN_LOCK
    from eyas.store import locks

    data, pipeline, manifest, prepare = _prepared(tmp_path, llama_dir)
    with locks.exclusive(tmp_path / "w" / RUN_LOCK, "held by the test"):
        with pytest.raises(EyasError, match=rf"another `eyas run` \(process {os.getpid()}\) "
                                            rf"is running the pipeline in .*w; wait for it"):
            run(prepare)
        with caplog.at_level(logging.WARNING, logger="eyas.pipeline"):
            assert [p.action for p in run(RunConfig(pipeline=pipeline, until_step="prepare",
                                                    dry_run=True))] == ["skip"]  # a look
        assert f"another `eyas run` (process {os.getpid()}) is running the pipeline" in \
            caplog.text
    assert [p.action for p in run(prepare)] == ["skip"]


def test_the_plan_says_an_earlier_capture_is_deleted_first(tmp_path, llama_dir):
    # eyas run captures with --overwrite: a capture of other inputs was deleted (it can be
    # TBs) with no word in the plan or the log
    data, pipeline, manifest, prepare = _prepared(tmp_path, llama_dir)
    captured = tmp_path / "w" / "captured"
    captured.mkdir()
    (captured / "shard-00000-of-00001.state.json").write_text("{}")
    capture = plan(RunConfig(pipeline=pipeline, until_step="capture"))[-1]
    assert capture.step == "capture" and capture.action == "run"
    assert "an earlier capture there made from other inputs or settings is deleted first" in \
        capture.reason


def _count_hashing(monkeypatch) -> list[Path]:
    """The paths store.manifest.file_sha256 reads from now on, in order."""
    from eyas.store import manifest as store

    hashed, sha256 = [], store.file_sha256
    monkeypatch.setattr(store, "file_sha256",
                        lambda path, *a: hashed.append(Path(path)) or sha256(path, *a))
    return hashed


def test_the_plan_reads_no_data_file_its_size_and_mtime_vouch_for(tmp_path, llama_dir,
                                                                   monkeypatch):
    """Every plan (`--dry-run` too) hashed all chat data, and prepare hashed it again: slow for
    large data. A file at the size and mtime_ns its manifest recorded keeps the recorded sha256
    unread; another mtime is hashed, so other rows under the same path are still noticed."""
    data, pipeline, record, prepare = _prepared(tmp_path, llama_dir)
    assert {"size", "mtime_ns", "sha256"} <= set(json.loads(record.read_text())["data_files"][0])
    hashed = _count_hashing(monkeypatch)

    assert plan(prepare)[0].action == "skip"
    run(RunConfig(pipeline=pipeline, until_step="prepare", force=True))  # prepare itself too
    assert data not in hashed

    def move_mtime():  # by a whole second: a filesystem's clock may be coarse
        st = data.stat()
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    # the same rows under another mtime (a copy, a checkout) are read, and the same data
    move_mtime()
    assert plan(prepare)[0].action == "skip" and hashed.count(data) == 1
    # a manifest from before the stamps: read, and the same data
    body = json.loads(record.read_text())
    for r in body["data_files"]:
        del r["size"], r["mtime_ns"]
    record.write_text(json.dumps(body))
    hashed.clear()
    assert plan(prepare)[0].action == "skip" and hashed.count(data) == 1
    # other rows of the same size: noticed (the write moved the mtime)
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[::-1]))
    move_mtime()
    p = plan(prepare)[0]
    assert p.action == "run" and f"its input data changed ({data} differs)" in p.reason


def test_from_step_refuses_a_skipped_step_the_plan_would_run_again(tmp_path, llama_dir,
                                                                   caplog):
    """--from-step checked only that the steps it skips had finished: after an edit of
    prepare's section, `--from-step vocab` counted tokens of the old prepared rows. A skipped
    step that is out of date is now refused with the plan's reason, unless --allow-stale."""
    from eyas import freshness
    from eyas.store.manifest import read_manifest, write_manifest
    from eyas.targets.corpus import synthetic_chats

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(4)))
    spec = {"target": str(llama_dir), "data": str(data), "work_dir": "w"}
    pipeline, work = _write(tmp_path, spec), tmp_path / "w"

    def finish_capture():  # (a capture manifest of the plan's own config: no model run)
        cfg = {p.step: p.config for p in plan(RunConfig(pipeline=pipeline))}["capture"]
        write_manifest(cfg.out, "capture", cfg, inputs=[read_manifest(work / "prepared")])
        (Path(cfg.out) / "index.json").write_text('{"files": []}')  # its index, of no part

    run(RunConfig(pipeline=pipeline, until_step="prepare"))
    finish_capture()
    vocab = RunConfig(pipeline=pipeline, from_step="vocab", until_step="vocab")
    assert [(p.step, p.action) for p in plan(vocab)] == [("vocab", "run")]  # all current

    # prepare's settings changed: the plan would run prepare again, so --from-step refuses
    pipeline = _write(tmp_path, {**spec, "prepare": {"max_length": 64}})
    assert plan(RunConfig(pipeline=pipeline))[0].reason == "config changed (max_length)"
    with pytest.raises(EyasError, match=r"--from-step vocab skips prepare, which is out of "
                                        r"date: config changed \(max_length\)\. .*run without "
                                        r"--from-step .*or with --from-step prepare.*--allow-stale"
                       ) as refused:
        plan(vocab)
    assert refused.value.flag == "--from-step"
    # I know: the old prepared rows are used as they are, and the log says so
    with caplog.at_level(logging.WARNING, logger="eyas.pipeline"):
        stale = plan(dataclasses.replace(vocab, allow_stale=True))
    assert [p.step for p in stale] == ["vocab"]
    assert "--allow-stale: prepare is out of date (config changed (max_length))" in caplog.text
    with pytest.raises(ConfigError, match=r"--allow-stale is for --from-step"):
        RunConfig(pipeline=pipeline, allow_stale=True)

    # other rows in the data file: the reason is the plan's, for the data
    pipeline = _write(tmp_path, spec)
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(5)))
    with pytest.raises(EyasError, match=rf"skips prepare, which is out of date: its input "
                                        rf"data changed \({re.escape(str(data))} differs\)"):
        plan(vocab)
    # prepare ran again on them (--until-step prepare): capture holds the old rows' states
    run(RunConfig(pipeline=pipeline, until_step="prepare"))
    why = r"its input from prepare changed since it ran \(.*w/prepared\)"
    assert re.fullmatch(why, {p.step: p for p in plan(RunConfig(pipeline=pipeline))}[
        "capture"].reason)
    with pytest.raises(EyasError, match=rf"skips capture, which is out of date: {why}\. .*"
                                        r"or with --from-step capture"):
        plan(vocab)
    # an interrupted train on that old capture starts over, not resumed on the new one
    train = {p.step: p.config for p in plan(RunConfig(pipeline=pipeline))}["train"]
    write_manifest(train.out, "train", train, inputs=[read_manifest(work / "captured")],
                   complete=False)
    finish_capture()
    assert [p.step for p in plan(vocab)] == ["vocab"]
    assert re.fullmatch(r"its input from capture changed since it ran \(.*w/captured\)",
                        freshness.starts_over("train", train, Path(train.out), False, False))


def test_a_touched_data_file_is_read_once_not_at_every_plan(tmp_path, llama_dir, monkeypatch):
    """A data file whose mtime moved but whose rows did not (`touch`, a copy) was hashed by
    every plan until prepare ran again: the new stamp was recorded only by prepare. The plan
    that finds the same sha256 now records the stamp in prepare's manifest (the id, which
    leaves stamps out, is unchanged), so the next plan does not read the file."""
    data, _, record, prepare = _prepared(tmp_path, llama_dir)
    before = json.loads(record.read_text())
    hashed = _count_hashing(monkeypatch)

    st = data.stat()  # touched, by a whole second: a filesystem's clock may be coarse
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert plan(prepare)[0].action == "skip" and hashed.count(data) == 1
    assert plan(prepare)[0].action == "skip" and hashed.count(data) == 1  # not read again
    after = json.loads(record.read_text())
    assert after["data_files"][0]["mtime_ns"] == st.st_mtime_ns + 10**9
    assert {k: v for k, v in after.items() if k != "data_files"} == \
        {k: v for k, v in before.items() if k != "data_files"}  # (the id and all else kept)
    assert not list(record.parent.glob("*.tmp"))
    # other rows, touched again: read, and prepare runs, at every plan until it has
    data.write_text(data.read_text().replace("a", "b", 1))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    for _ in range(2):
        p = plan(prepare)[0]
        assert p.action == "run" and f"its input data changed ({data} differs)" in p.reason
    assert hashed.count(data) == 3 and json.loads(record.read_text()) == after


def test_a_failed_step_gets_the_pipeline_hint_when_it_refuses_a_flag_the_pipeline_set(
        tmp_path, llama_dir, monkeypatch):
    """The hint follows the error's `flag` (the option it refuses), not words of its message:
    it was chosen by finding "--out" or "--resume" in the text."""
    import eyas.prepare

    pipeline = _write(tmp_path, {"target": str(llama_dir), "data": "chats.jsonl",
                                 "work_dir": "w"})
    hint = r"In `eyas run` this step's --out is .*prepared: to start it over, move that folder"
    for error, hinted in ((EyasError("that folder is not yours", flag="--out"), True),
                          (EyasError("no checkpoint there", flag="--resume"), True),
                          (EyasError("pass the --out folder of `eyas vocab` as --vocab"), False)):
        def refuse(cfg, error=error):
            raise error

        monkeypatch.setattr(eyas.prepare, "prepare", refuse)
        with pytest.raises(EyasError, match="step prepare failed") as failed:
            run(RunConfig(pipeline=pipeline, until_step="prepare"))
        assert bool(re.search(hint, str(failed.value))) == hinted, failed.value
        assert failed.value.__cause__ is error


def test_a_half_saved_demo_target_is_trained_again(tmp_path):
    """A demo killed while saving its target left config.json alone, which every later run
    took for a trained target and then failed to load; the target is now saved beside and
    renamed, and a folder without weights or tokenizer is trained again."""
    from eyas.demo import pretrain_target
    from eyas.targets.corpus import synthetic_chats

    half = tmp_path / "target"
    half.mkdir()
    (half / "config.json").write_text("{}")
    out = pretrain_target(half, synthetic_chats(20, seed=0), hidden=32, layers=1, steps=2,
                          seed=0)
    assert (out / "tokenizer.json").is_file() and list(out.glob("*.safetensors"))
    assert not (tmp_path / "target.tmp").exists()
    # the same settings again: kept; another size (the full demo after --fast): trained again
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    pretrain_target(half, synthetic_chats(20, seed=0), hidden=32, layers=1, steps=2, seed=0)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    pretrain_target(half, synthetic_chats(20, seed=0), hidden=48, layers=1, steps=2, seed=0)
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 48


def test_demo_refuses_a_foreign_out_and_keeps_it(tmp_path):
    """The demo wrote pipeline.yaml and data/chats.jsonl into any --out (and replaced a
    target/ without weights), so a user's files of those names were lost; a file as --out was
    a NotADirectoryError traceback. Only an earlier demo's folder is resumed."""
    from eyas.demo import _check_out

    cases = {"mine.txt": "x", "data/chats.jsonl": '{"mine": 1}\n',
             "pipeline.yaml": "target: my/model\nwork_dir: elsewhere\n"}
    for i, (name, text) in enumerate(cases.items()):
        out = tmp_path / f"foreign{i}"
        (out / name).parent.mkdir(parents=True)
        (out / name).write_text(text)
        with pytest.raises(EyasError, match=r"did not write .*Move those away, or choose "
                                            r"another --out") as err:
            demo(DemoConfig(out=str(out), fast=True))
        assert err.value.flag == "--out"
        assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) \
            == [name] and (out / name).read_text() == text
    (tmp_path / "file").write_text("x")
    with pytest.raises(EyasError, match=r"--out .*file is a file; give a folder"):
        demo(DemoConfig(out=str(tmp_path / "file"), fast=True))
    # a demo killed while it trained its target: only its pipeline.yaml and data, resumed
    killed = tmp_path / "killed"
    (killed / "data").mkdir(parents=True)
    (killed / "pipeline.yaml").write_text(f"work_dir: {killed / 'work'}\n")
    _check_out(killed)
    (killed / "notes.txt").write_text("mine")
    with pytest.raises(EyasError, match=r"\(notes\.txt\)"):
        _check_out(killed)


def test_demo_fast_runs_the_whole_pipeline_then_skips_and_reruns_what_changed(tmp_path, caplog):
    out = tmp_path / "demo"
    report = demo(DemoConfig(out=str(out), fast=True))
    assert report["lossless"] is True
    al = report["mean_acceptance_length"]
    assert set(al) >= {"1", "2", "3", "4"} or set(map(str, al)) >= {"1", "2", "3", "4"}
    assert max(al.values()) > 1.3, al  # a trained draft is accepted well beyond chance
    for step in ("prepared", "captured", "vocab", "train", "draft", "eval"):
        assert (out / "work" / step / "eyas.json").is_file(), step
    config = json.loads((out / "work" / "draft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]

    # a second run finds every step up to date and runs nothing
    pipeline = str(out / "pipeline.yaml")
    plans = run(RunConfig(pipeline=pipeline, dry_run=True))
    assert [p.action for p in plans] == ["skip"] * len(plans), [(p.step, p.reason) for p in plans]
    # captured/ deleted once train used it (hidden states are the big files): still up to date,
    # until train must run again; the same for prepared/, which capture, vocab and eval read
    captured, prepared = out / "work" / "captured", out / "work" / "prepared"  # eval: its prompts
    captured.rename(out / "captured.kept")
    prepared.rename(out / "prepared.kept")
    plans = {p.step: p for p in run(RunConfig(pipeline=pipeline, dry_run=True))}
    assert {p.action for p in plans.values()} == {"skip"}, [p.reason for p in plans.values()]
    assert plans["capture"].reason == "its output was removed after train used it, which is " \
        "up to date (it runs again when that step must)"
    assert plans["prepare"].reason.startswith("its output was removed after vocab and eval "
                                              "used it, which are up to date")
    spec = yaml.safe_load(Path(pipeline).read_text())
    changed = out / "changed.yaml"  # beside it: its work_dir is relative to the YAML
    changed.write_text(yaml.safe_dump({**spec, "train": {**spec.get("train", {}), "lr": 5e-3}}))
    plans = {p.step: p for p in plan(RunConfig(pipeline=str(changed)))}
    assert plans["capture"].action == plans["prepare"].action == "run"
    (out / "captured.kept").rename(captured)
    (out / "prepared.kept").rename(prepared)
    changed.unlink()

    # a manifest from before an option existed (no key for it) is up to date while the option
    # keeps its default, and not once it is set
    manifest = out / "work" / "eval" / "eyas.json"
    record = json.loads(manifest.read_text())
    defaults = {f.name: json.loads(json.dumps(f.default)) for f in dataclasses.fields(EvalConfig)
                if f.default is not dataclasses.MISSING}
    gained = next(k for k, v in record["config"].items()
                  if k in defaults and v == defaults[k] and isinstance(v, int)
                  and not isinstance(v, bool))
    record["config"].pop(gained)
    manifest.write_text(json.dumps(record))
    plans = run(RunConfig(pipeline=pipeline, dry_run=True))
    assert [p.action for p in plans] == ["skip"] * len(plans), [(p.step, p.reason) for p in plans]
    spec = yaml.safe_load(open(pipeline))
    spec["eval"][gained] = defaults[gained] + 1
    open(pipeline, "w").write(yaml.safe_dump(spec))
    plans = plan(RunConfig(pipeline=pipeline))
    assert [p.step for p in plans if p.action == "run"] == ["eval"] and gained in plans[-1].reason
    spec["eval"].pop(gained)
    open(pipeline, "w").write(yaml.safe_dump(spec))

    # options that change how a step logs, checkpoints, batches or writes, not what it makes,
    # leave every step up to date (they used to start the trained run over)
    for section, key, value in (("train", "log_every", 3), ("train", "num_workers", 0),
                                ("train", "save_every", 7), ("train", "keep_last", 5),
                                ("capture", "batch_tokens", 1000), ("capture", "file_mb", 64),
                                ("capture", "writer_threads", 1), ("capture", "device", "cpu"),
                                ("capture", "packing", "padded"),
                                ("capture", "attn_implementation", "eager")):
        spec.setdefault(section, {})[key] = value
    open(pipeline, "w").write(yaml.safe_dump(spec))
    plans = plan(RunConfig(pipeline=pipeline))
    assert [p.action for p in plans] == ["skip"] * len(plans), [(p.step, p.reason) for p in plans]
    for section, key in (("train", "log_every"), ("train", "num_workers"), ("train", "save_every"),
                         ("train", "keep_last"), ("capture", "batch_tokens"),
                         ("capture", "file_mb"), ("capture", "writer_threads"),
                         ("capture", "device"), ("capture", "packing"),
                         ("capture", "attn_implementation")):
        spec[section].pop(key)
    open(pipeline, "w").write(yaml.safe_dump(spec))

    # changing the eval section re-runs eval only; changing vocab re-runs vocab and after
    spec = yaml.safe_load(open(pipeline))
    spec["eval"]["max_new_tokens"] += 1
    open(pipeline, "w").write(yaml.safe_dump(spec))
    plans = plan(RunConfig(pipeline=pipeline))
    assert [p.step for p in plans if p.action == "run"] == ["eval"]
    assert "max_new_tokens" in plans[-1].reason
    spec["vocab"]["draft_vocab_size"] -= 1
    open(pipeline, "w").write(yaml.safe_dump(spec))
    ran = [p.step for p in plan(RunConfig(pipeline=pipeline)) if p.action == "run"]
    assert ran == ["vocab", "train", "export", "eval"]

    # a finished train run re-run (here its lr changed) starts over, the old run moved aside:
    # it used to resume at its last step and train nothing, under the new config's name
    # (fewer steps too: this test's time goes to training)
    spec["vocab"]["draft_vocab_size"] += 1
    spec["train"]["lr"] = spec["train"].get("lr", 1e-3) / 2
    spec["train"]["max_steps"] = 8
    open(pipeline, "w").write(yaml.safe_dump(spec))
    plans = plan(RunConfig(pipeline=pipeline))
    train_plan = next(p for p in plans if p.step == "train")
    assert train_plan.start_over and "its config changed (lr, max_steps)" in train_plan.reason
    assert not next(p for p in plans if p.step == "vocab").start_over  # (train only)
    before = (out / "work" / "draft" / "model.safetensors").read_bytes()
    run(RunConfig(pipeline=pipeline))
    steps = [json.loads(ln)["step"] for ln in
             (out / "work" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] <= 1 and (out / "work" / "train.previous" / "eyas.json").is_file()
    assert (out / "work" / "draft" / "model.safetensors").read_bytes() != before
    assert all(p.action == "skip" for p in run(RunConfig(pipeline=pipeline, dry_run=True)))
    # an interrupted run with the same settings and inputs resumes (nothing moved aside)
    record = json.loads((out / "work" / "train" / "eyas.json").read_text())
    (out / "work" / "train" / "eyas.json").write_text(json.dumps({**record, "complete": False}))
    train_plan = next(p for p in plan(RunConfig(pipeline=pipeline)) if p.step == "train")
    assert train_plan.action == "run" and not train_plan.start_over
    assert "interrupted" in train_plan.reason

    # the same data path with other rows is other data: prepare runs again (it was skipped)
    (out / "work" / "train" / "eyas.json").write_text(json.dumps(record))  # (finished again)
    data = Path(spec["data"])  # (the demo writes an absolute path)
    text = data.read_text()
    data.write_text("".join(text.splitlines(keepends=True)[:-1]))
    prepare_plan = next(p for p in plan(RunConfig(pipeline=pipeline)) if p.step == "prepare")
    assert prepare_plan.action == "run" and "its input data changed" in prepare_plan.reason
    data.write_text(text)
    assert all(p.action == "skip" for p in plan(RunConfig(pipeline=pipeline)))

    # a step's own fix names its flags, which the pipeline sets: the failure says where its
    # folder is and how to start it over from the pipeline
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("notes")
    spec["eval"]["out"] = str(mine)
    open(pipeline, "w").write(yaml.safe_dump(spec))
    with pytest.raises(EyasError, match=r"step eval failed: .*In `eyas run` this step's --out "
                                        r"is .*mine") as failed:
        run(RunConfig(pipeline=pipeline))
    assert failed.value.__cause__.flag == "--out"  # (eval's check_out refused the folder)
    assert (mine / "report.md").read_text() == "notes"


def _regenerate_starts_over(tmp_path, pipeline, because: str) -> None:
    """The plan starts regenerate over `because` ..., and the run moves the old one aside."""
    regen = plan(RunConfig(pipeline=pipeline, until_step="regenerate"))[0]
    assert regen.action == "run" and regen.start_over
    assert f"regenerate starts over ({because}" in regen.reason
    run(RunConfig(pipeline=pipeline, until_step="regenerate"))
    assert (tmp_path / "w" / "regenerated.previous" / "eyas.json").is_file()


def test_regenerate_on_a_target_whose_weights_changed_starts_over(tmp_path, llama_dir):
    """regenerate's resume refuses another model behind the same --target (two models' answers
    in one folder); in `eyas run` that refusal ended the pipeline, where a changed setting
    starts over. Other weights now start over too (the old answers moved aside)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from eyas.targets.corpus import synthetic_chats

    target = tmp_path / "target"
    shutil.copytree(llama_dir, target)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(2)))
    spec = {"target": str(target), "data": str(data), "work_dir": "w",
            "regenerate": {"enabled": True, "max_new_tokens": 3, "device": "cpu"}}
    pipeline = _write(tmp_path, spec)
    run(RunConfig(pipeline=pipeline, until_step="regenerate"))
    weights = load_file(str(target / "model.safetensors"))
    weights["model.norm.weight"] += 0.5  # fine-tuned in place
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    _regenerate_starts_over(tmp_path, pipeline, "the target's weights changed "
                                                "(weights_fingerprint")


def test_regenerate_asks_in_prepares_template_and_starts_over_when_it_changes(tmp_path,
                                                                             llama_dir):
    """`eyas run` passes prepare's chat_template to regenerate (it asked in the tokenizer's
    own while prepare rendered its answers in the file's); an edit of that file makes the
    answers another template's, so regenerate starts over (its resume refused the rest)."""
    from eyas.targets.corpus import synthetic_chats
    from eyas.targets.tiny import LLAMA3_TEMPLATE as own

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(2)))
    template = tmp_path / "served.jinja"
    template.write_text(own)
    spec = {"target": str(llama_dir), "data": str(data), "work_dir": "w",
            "prepare": {"chat_template": str(template)},
            "regenerate": {"enabled": True, "max_new_tokens": 3, "device": "cpu"}}
    pipeline = _write(tmp_path, spec)
    run(RunConfig(pipeline=pipeline, until_step="regenerate"))
    manifest = json.loads((tmp_path / "w" / "regenerated" / "eyas.json").read_text())
    assert manifest["config"]["chat_template"] == str(template)
    assert plan(RunConfig(pipeline=pipeline, until_step="regenerate"))[0].action == "skip"
    # the same template under another path, or a key of how it runs: still up to date
    moved = tmp_path / "moved.jinja"
    moved.write_text(own)
    spec["prepare"]["chat_template"] = str(moved)
    spec["regenerate"]["batch_size"] = 7
    assert plan(RunConfig(pipeline=_write(tmp_path, spec), until_step="regenerate"))[0] \
        .action == "skip"
    spec["prepare"]["chat_template"] = str(template)
    pipeline = _write(tmp_path, spec)
    template.write_text(own.replace("{{", "{{- ", 1))
    _regenerate_starts_over(tmp_path, pipeline, "its chat template changed (chat_template_hash")


def test_a_removed_folder_whose_reader_is_past_until_step_is_not_made_again(tmp_path,
                                                                            llama_dir):
    """A step whose folder was removed after use is skipped while the steps that read it are
    up to date, but the look-ahead saw only the steps up to --until-step: with captured/
    removed once train had run, `--until-step vocab` (or capture) captured again, hours and
    terabytes for a real target, though `eyas run` by itself skipped it."""
    from eyas.targets.corpus import synthetic_chats

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(6)))
    spec = {"target": str(llama_dir), "data": str(data), "work_dir": "w",
            "vocab": {"draft_vocab_size": 64},
            "train": {"max_steps": 2, "batch_tokens": 256, "eval_every": 2, "save_every": 2}}
    pipeline = _write(tmp_path, spec)
    run(RunConfig(pipeline=pipeline, until_step="train"))
    (tmp_path / "w" / "captured").rename(tmp_path / "captured.kept")
    whole = {p.step: p for p in plan(RunConfig(pipeline=pipeline, until_step="train"))}
    assert {p.action for p in whole.values()} == {"skip"}, [p.reason for p in whole.values()]
    assert whole["capture"].reason.startswith("its output was removed after train used it")
    for until in ("capture", "vocab"):
        plans = {p.step: p for p in plan(RunConfig(pipeline=pipeline, until_step=until))}
        assert plans["capture"].action == "skip", (until, plans["capture"].reason)
        assert plans["capture"].reason == whole["capture"].reason
    # once train must run (its section changed), capture runs again, up to vocab too
    changed = _write(tmp_path, {**spec, "train": {**spec["train"], "lr": 5e-3}})
    plans = {p.step: p for p in plan(RunConfig(pipeline=changed, until_step="vocab"))}
    assert plans["capture"].action == "run"


def test_a_step_whose_output_files_are_gone_is_out_of_date_or_removed_after_use(tmp_path,
                                                                               llama_dir):
    """From an audit: with eval's report.json, the vocab's file or train's best step deleted,
    the plan called the step up to date, and the step after it failed on the missing file
    (export advising --which, a flag `eyas run` lacks). A report or draft that is gone is made
    again; an intermediate output pruned after use counts as removed after use."""
    import shutil

    from eyas.targets.corpus import synthetic_chats

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(6)))
    spec = {"target": str(llama_dir), "data": str(data), "work_dir": "w",
            "vocab": {"draft_vocab_size": 64},
            "train": {"max_steps": 2, "batch_tokens": 256, "eval_every": 2, "save_every": 2},
            "eval": {"num_prompts": 1, "max_new_tokens": 4, "k": [1]}}
    pipeline, work = _write(tmp_path, spec), tmp_path / "w"
    run(RunConfig(pipeline=pipeline))
    (work / "eval" / "report.json").unlink()
    by = {p.step: p for p in plan(RunConfig(pipeline=pipeline))}
    assert by["eval"].action == "run"
    assert by["eval"].reason == "its output lost report.json since it ran"
    (work / "vocab" / "vocab.safetensors").unlink()
    shutil.rmtree(work / "train" / "checkpoints" / "step-00000002")
    by = {p.step: p for p in plan(RunConfig(pipeline=pipeline))}
    assert by["vocab"].action == "skip" and by["vocab"].reason.startswith(
        "its output was removed after train used it")
    assert by["train"].action == "skip", by["train"].reason  # (export read it: removed after)
    assert by["export"].action == "skip" and by["eval"].action == "run"
    # a step that must run reads it: made again
    changed = _write(tmp_path, {**spec, "export": {"dtype": "fp32"}})
    by = {p.step: p for p in plan(RunConfig(pipeline=changed))}
    assert by["train"].action == "run" and by["export"].action == "run", [(p.step, p.reason) for p in by.values()]


def _small_spec(tmp_path, llama_dir, work: Path) -> dict:
    """A pipeline of six synthetic chats on the tiny llama, 2 training steps, in `work`."""
    from eyas.targets.corpus import synthetic_chats

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(6)))
    return {"target": str(llama_dir), "data": str(data), "work_dir": str(work),
            "vocab": {"draft_vocab_size": 64},
            "train": {"max_steps": 2, "batch_tokens": 256, "eval_every": 2, "save_every": 2}}


def test_a_work_dir_moved_or_renamed_holds_the_same_runs(tmp_path, llama_dir):
    """From an audit: with work_dir moved (to a bigger disk, a renamed project folder), every
    step's recorded --out and the folders wired into it differed, so the plan ran everything
    again: the capture deleted first, the draft retrained."""
    import shutil

    spec = _small_spec(tmp_path, llama_dir, tmp_path / "a" / "w")
    run(RunConfig(pipeline=_write(tmp_path, spec), until_step="train"))
    (tmp_path / "a").rename(tmp_path / "b")
    moved = _write(tmp_path, {**spec, "work_dir": str(tmp_path / "b" / "w")})
    plans = plan(RunConfig(pipeline=moved, until_step="train"))
    assert [(p.action, p.reason) for p in plans] == [("skip", "up to date")] * 4
    # nor are prepare's process count and train's device (from an audit: lowering num_proc
    # recaptured and retrained)
    how = _write(tmp_path, {**spec, "work_dir": str(tmp_path / "b" / "w"),
                            "prepare": {"num_proc": 2},
                            "train": {**spec["train"], "device": "cpu"}})
    assert {p.action for p in plan(RunConfig(pipeline=how, until_step="train"))} == {"skip"}
    # a real change still counts, and the folder's own name is part of what it is
    changed = _write(tmp_path, {**spec, "work_dir": str(tmp_path / "b" / "w"),
                                "train": {**spec["train"], "lr": 5e-3}})
    assert plan(RunConfig(pipeline=changed, until_step="train"))[-1].action == "run"
    # captured/ pruned after train, then moved: removed after use still (a review: train's
    # record of it named the old place, so capture ran and train started over)
    shutil.rmtree(tmp_path / "b" / "w" / "captured")
    (tmp_path / "b").rename(tmp_path / "c")
    moved = _write(tmp_path, {**spec, "work_dir": str(tmp_path / "c" / "w")})
    plans = {p.step: p for p in plan(RunConfig(pipeline=moved, until_step="train"))}
    assert {p.action for p in plans.values()} == {"skip"}, [p.reason for p in plans.values()]
    assert plans["capture"].reason.startswith("its output was removed after train used it")


def test_a_moved_work_dir_reads_its_steps_inputs_where_they_are_now(tmp_path, llama_dir):
    """From an audit: after a move, each step's recorded inputs were looked up at the old
    place: a prepare run again there went unseen by capture (and a copy's capture saw the
    original's), and a retrained run's export refused its own draft as another run's."""
    spec = _small_spec(tmp_path, llama_dir, tmp_path / "a" / "w")
    run(RunConfig(pipeline=_write(tmp_path, spec), until_step="export"))
    (tmp_path / "a").rename(tmp_path / "b")
    moved = {**spec, "work_dir": str(tmp_path / "b" / "w"),
             "train": {**spec["train"], "lr": 5e-3}}
    run(RunConfig(pipeline=_write(tmp_path, moved), until_step="export"))  # (export replaced)
    moved["prepare"] = {"max_length": 1024}
    run(RunConfig(pipeline=_write(tmp_path, moved), until_step="prepare"))
    by = {p.step: p for p in plan(RunConfig(pipeline=_write(tmp_path, moved),
                                            until_step="capture"))}
    assert by["capture"].action == "run" and by["capture"].reason.startswith(
        f"its input from prepare changed since it ran ({tmp_path / 'b' / 'w' / 'prepared'})")


def test_a_moved_work_dir_with_regenerate_holds_the_same_runs(tmp_path, llama_dir):
    """From a review: prepare's record of regenerate's conversations.jsonl named its old
    place, so a moved work_dir prepared (and captured, trained) again."""
    from eyas.targets.corpus import synthetic_chats

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(3)))
    spec = {"target": str(llama_dir), "data": str(data), "work_dir": str(tmp_path / "a" / "w"),
            "regenerate": {"enabled": True, "max_new_tokens": 3, "device": "cpu"}}
    run(RunConfig(pipeline=_write(tmp_path, spec), until_step="prepare"))
    (tmp_path / "a").rename(tmp_path / "b")
    moved = _write(tmp_path, {**spec, "work_dir": str(tmp_path / "b" / "w")})
    plans = plan(RunConfig(pipeline=moved, until_step="prepare"))
    assert [(p.action, p.reason) for p in plans] == [("skip", "up to date")] * 2


def test_each_steps_result_neutral_options_are_its_own():
    """A step's RESULT_NEUTRAL names options that change how it runs, not what it makes
    (freshness.changed_options skips them); a name that is not one of its options (a typo, a
    renamed flag) would silently make a real change count as one."""
    import importlib

    from eyas.pipeline import STEP_FUNCS

    for step, (module, _, cls_name) in STEP_FUNCS.items():
        cls = getattr(importlib.import_module(module), cls_name)
        names = {f.name for f in dataclasses.fields(cls)}
        assert getattr(cls, "RESULT_NEUTRAL", frozenset()) <= names, step


def test_a_pipeline_yaml_that_would_lose_what_it_says_is_refused(tmp_path, llama_dir):
    """From an audit: a section given twice kept only the last one's keys; an empty top-level
    data was wired in as the path "None" (or refused as prepare's --data); a capture section
    beside train.online: true was dropped without a word."""
    (tmp_path / "dup.yaml").write_text(f"target: {llama_dir}\ndata: d.jsonl\nwork_dir: w\n"
                                       "train: {lr: 0.1}\ntrain:\n  epochs: 2\n")
    with pytest.raises(ConfigError, match=r"key 'train' appears twice \(lines 4 and 5\): YAML "
                                          r"would keep the last one only; merge them"):
        plan(RunConfig(pipeline=str(tmp_path / "dup.yaml")))
    for empty in (None, ""):
        with pytest.raises(ConfigError, match=r"top-level 'data' is empty; give it a chat file"):
            plan(RunConfig(pipeline=_write(tmp_path, {"target": str(llama_dir), "data": empty,
                                                      "work_dir": "w"})))
    with pytest.raises(ConfigError, match=r"export.format speculators is not written for "
                                          r"DFlash drafts .*set export.format: vllm"):
        plan(RunConfig(pipeline=_write(tmp_path, {
            "target": str(llama_dir), "data": "d.jsonl", "work_dir": "w",
            "train": {"draft": "dflash"}, "export": {"format": "speculators"}})))
    with pytest.raises(ConfigError, match=r"section 'capture' would be ignored with "
                                          r"train.online: true .*move what it sets into 'train'"):
        plan(RunConfig(pipeline=_write(tmp_path, {
            "target": str(llama_dir), "data": "d.jsonl", "work_dir": "w",
            "capture": {"aux_layer_ids": [0, 1, 3]}, "train": {"online": True}})))


def test_a_path_spelled_another_way_is_the_same_input(tmp_path, llama_dir, monkeypatch):
    """From an audit: `data: chats.jsonl` for the absolute path a run was made with (or the
    target's folder by another spelling) prepared, captured and trained everything again."""
    from eyas.targets.corpus import synthetic_chats

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(4)))
    spec = {"target": str(llama_dir), "data": str(data), "work_dir": str(tmp_path / "w")}
    run(RunConfig(pipeline=_write(tmp_path, spec), until_step="prepare"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").symlink_to(llama_dir)
    again = _write(tmp_path, {**spec, "data": "chats.jsonl", "target": "model"})
    assert [(p.action, p.reason) for p in plan(RunConfig(pipeline=again,
                                                         until_step="prepare"))] == \
        [("skip", "up to date")]
    (tmp_path / "other.jsonl").write_text(data.read_text())  # the same rows, another file
    other = _write(tmp_path, {**spec, "data": "other.jsonl"})
    assert plan(RunConfig(pipeline=other, until_step="prepare"))[0].action == "run"
