"""`eyas run` with step folders removed once the steps after them used them (captured/, the
hidden states, often terabytes, once train ran): edits of their sections, --from-step, and a
step that never ran reading one. Real steps on a tiny random Llama, on CPU."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import pytest
import yaml

from eyas.config import ConfigError
from eyas.errors import EyasError
from eyas.pipeline import RunConfig, plan, run
from eyas.targets.corpus import synthetic_chats


def _pipeline(tmp_path, llama_dir, **sections) -> dict:
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(6)))
    return {"target": str(llama_dir), "data": str(data), "work_dir": "w",
            "vocab": {"draft_vocab_size": 64},
            "train": {"max_steps": 2, "batch_tokens": 256, "eval_every": 2, "save_every": 2},
            **sections}


def _write(tmp_path, spec, name="pipeline.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def _actions(cfg: RunConfig) -> dict[str, tuple[str, str]]:
    return {p.step: (p.action, p.reason) for p in plan(cfg)}


def test_an_edit_of_a_removed_step_runs_it_and_the_steps_after_it(tmp_path, llama_dir, caplog):
    """captured/ removed once train used it, then capture's section edited: the plan called
    train up to date and skipped everything, the edit ignored. Train's manifest now records
    the capture config it read, so the plan sees the change with captured/ gone."""
    spec = _pipeline(tmp_path, llama_dir)
    pipeline, work = _write(tmp_path, spec), tmp_path / "w"
    run(RunConfig(pipeline=pipeline, until_step="train"))
    shutil.rmtree(work / "captured")
    until_train = RunConfig(pipeline=pipeline, until_step="train")
    assert {a for a, _ in _actions(until_train).values()} == {"skip"}

    edited = _write(tmp_path, {**spec, "capture": {"model_dtype": "fp32"}}, "edited.yaml")
    plans = _actions(RunConfig(pipeline=edited, until_step="train"))
    why = "config changed (model_dtype) since train read its output, which has been removed"
    assert plans["capture"] == ("run", why)
    assert [s for s, (a, _) in plans.items() if a == "run"] == ["capture", "vocab", "train"]
    with caplog.at_level(logging.INFO, logger="eyas.pipeline"):  # what --dry-run prints
        run(RunConfig(pipeline=edited, until_step="train", dry_run=True))
    assert f"capture    run   {why}" in caplog.text

    # --from-step skips capture: out of date like any edited step, --allow-stale takes it
    export = RunConfig(pipeline=edited, from_step="export")
    with pytest.raises(EyasError, match=r"--from-step export skips capture, which is out of "
                                        r"date: config changed \(model_dtype\) since train "
                                        r"read its output.*--allow-stale") as refused:
        plan(export)
    assert refused.value.flag == "--from-step"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eyas.pipeline"):
        assert [p.step for p in plan(dataclasses.replace(export, allow_stale=True))] == \
            ["export", "eval"]
    assert "--allow-stale: capture is out of date (config changed (model_dtype)" in caplog.text

    # a train manifest from before inputs recorded their config: the edit cannot be seen,
    # and capture stays skipped, as it was (no error)
    manifest = work / "train" / "eyas.json"
    recorded = manifest.read_text()
    old = json.loads(recorded)
    for read in old["inputs"]:
        del read["config"]
    manifest.write_text(json.dumps(old))
    plans = _actions(RunConfig(pipeline=edited, until_step="train"))
    assert {a for a, _ in plans.values()} == {"skip"}
    assert plans["capture"][1].startswith("its output was removed after train used it")
    assert [p.step for p in plan(export)] == ["export", "eval"]
    manifest.write_text(recorded)

    # the edit runs: capture again with fp32, then train from scratch on it
    run(RunConfig(pipeline=edited, until_step="train"))
    captured = json.loads((work / "captured" / "eyas.json").read_text())
    assert captured["config"]["model_dtype"] == "fp32"
    assert (work / "train.previous" / "eyas.json").is_file()
    shutil.rmtree(work / "captured")
    assert {a for a, _ in _actions(RunConfig(pipeline=edited, until_step="train")).values()} \
        == {"skip"}


def test_from_step_skips_a_removed_folder_unless_a_step_that_runs_reads_it(tmp_path,
                                                                          llama_dir):
    """`--from-step eval` refused ("capture has not finished") once captured/ was removed,
    though train, which read it, was up to date and nothing that runs reads it. A removed
    folder a step that runs reads is still refused, --allow-stale or not."""
    spec = _pipeline(tmp_path, llama_dir,
                     eval={"k": [2], "num_prompts": 2, "max_new_tokens": 4, "ngram": False})
    pipeline, work = _write(tmp_path, spec), tmp_path / "w"
    run(RunConfig(pipeline=pipeline))
    shutil.rmtree(work / "captured")
    assert [p.step for p in plan(RunConfig(pipeline=pipeline, from_step="eval"))] == ["eval"]
    assert [p.step for p in plan(RunConfig(pipeline=pipeline, from_step="export"))] == \
        ["export", "eval"]
    run(RunConfig(pipeline=pipeline, from_step="eval"))  # eval runs, on prepared/ and draft/
    # train reads captured/: nothing to take as it is
    for stale in (False, True):
        with pytest.raises(ConfigError, match=r"--from-step train skips capture, whose output "
                                              r".*w/captured was removed, but train, which runs, "
                                              r"reads it: use --from-step capture to make it "
                                              r"again .*--allow-stale does not apply"):
            plan(RunConfig(pipeline=pipeline, from_step="train", allow_stale=stale))

    # prepared/ too: capture, vocab and eval read it; eval runs with --from-step eval
    shutil.rmtree(work / "prepared")
    assert {p.action for p in plan(RunConfig(pipeline=pipeline))} == {"skip"}
    with pytest.raises(ConfigError, match=r"--from-step eval skips prepare, whose output "
                                          r".*w/prepared was removed, but eval, which runs"):
        plan(RunConfig(pipeline=pipeline, from_step="eval"))
    assert [p.step for p in plan(RunConfig(pipeline=pipeline, from_step="export",
                                           until_step="export"))] == ["export"]


def test_a_removed_folder_that_a_step_which_never_ran_reads_is_made_again(tmp_path, llama_dir):
    """prepared/ removed once capture and vocab used it, before eval ever ran: the plan
    skipped prepare (its readers were up to date), and eval, which reads it too, failed on
    the missing folder. Now a step that runs and reads a removed folder runs its step again."""
    spec = _pipeline(tmp_path, llama_dir,
                     eval={"k": [2], "num_prompts": 2, "max_new_tokens": 4, "ngram": False})
    pipeline, work = _write(tmp_path, spec), tmp_path / "w"
    run(RunConfig(pipeline=pipeline, until_step="export"))
    shutil.rmtree(work / "prepared")
    plans = _actions(RunConfig(pipeline=pipeline))
    assert [s for s, (a, _) in plans.items() if a == "run"] == \
        ["prepare", "capture", "vocab", "train", "export", "eval"]
    run(RunConfig(pipeline=pipeline))
    assert json.loads((work / "eval" / "eyas.json").read_text())["complete"] is not False


def test_a_data_edit_under_a_removed_prepared_folder_prepares_again(tmp_path, llama_dir):
    """prepared/ removed once capture and vocab used it, then the chat data file rewritten
    with other rows: the plan called everything up to date, the new data ignored. Capture's
    manifest now records the data_files prepare read, so the plan sees the change with
    prepared/ gone."""
    spec = _pipeline(tmp_path, llama_dir)
    pipeline, work = _write(tmp_path, spec), tmp_path / "w"
    until_vocab = RunConfig(pipeline=pipeline, until_step="vocab")
    run(until_vocab)
    shutil.rmtree(work / "prepared")
    data = tmp_path / "chats.jsonl"
    rows = data.read_text()
    data.write_text(rows)  # touched, not edited: the same data
    assert {a for a, _ in _actions(until_vocab).values()} == {"skip"}

    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chats(6)[::-1]))
    plans = _actions(until_vocab)
    assert plans["prepare"] == ("run", f"its input data changed ({data} differs) since "
                                       f"capture read its output, which has been removed")
    assert [s for s, (a, _) in plans.items() if a == "run"] == ["prepare", "capture", "vocab"]

    # capture and vocab manifests from before inputs recorded data_files: the edit cannot be
    # seen, and prepare stays skipped, as it was (no error)
    manifests = {work / name / "eyas.json": None for name in ("captured", "vocab")}
    for manifest in manifests:
        manifests[manifest] = recorded = manifest.read_text()
        old = json.loads(recorded)
        for read in old["inputs"]:
            del read["data_files"]
        manifest.write_text(json.dumps(old))
    assert {a for a, _ in _actions(until_vocab).values()} == {"skip"}
    for manifest, recorded in manifests.items():
        manifest.write_text(recorded)

    run(until_vocab)
    prepared = json.loads((work / "prepared" / "eyas.json").read_text())
    captured = json.loads((work / "captured" / "eyas.json").read_text())
    assert captured["inputs"][0]["data_files"] == prepared["data_files"]
    shutil.rmtree(work / "prepared")
    assert {a for a, _ in _actions(until_vocab).values()} == {"skip"}
