"""benchmarks/recipe.py: variants and peer trainers on one work folder, each measured on the
splits asked (the bench split per prompt set). The eyas steps and the peers' trainers are
stubbed, as in tests/test_scale.py: recipe.py's own part is which commands it runs and what
it records; the real runs are in docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import recipe  # noqa: E402


def _report(al: float, sets: list[str] | None) -> dict:
    res = [{"method": "eagle3", "k": k, "mean_acceptance_length": al + k / 10,
            "per_position_acceptance": [0.5] * k, "speedup": 1.0} for k in (3, 6)]
    report = {"num_prompts": 2, "results": res, "ci95": {"3": [al, al + 1]}}
    if sets:
        report["by_set"] = {name: {"prompts": 1, "results": [
            {**r, "mean_acceptance_length": r["mean_acceptance_length"] + i}
            for r in res]} for i, name in enumerate(sets)}
    return report


@pytest.fixture
def steps(monkeypatch):
    """eyas train/export/eval stubbed: each writes what recipe.py reads; the peers' trainers
    are recorded and write their draft and peer.json."""
    events = []

    def fake_run(step, *args, log, out):
        args = [str(x) for x in args]
        events.append((step, out.parent.name if step != "eval" else out.name, args))
        out.mkdir(parents=True, exist_ok=True)
        if step == "train":
            (out / "metrics.jsonl").write_text(
                json.dumps({"kind": "train", "tokens_per_s": 1.0}) + "\n"
                + json.dumps({"kind": "eval", "step": 4, "acc": [0.5],
                              "chain": {"acceptance_length": {"3": 2.0}}}) + "\n")
        elif step == "eval":
            sets = args[args.index("--bench") + 1].split(",") if "--bench" in args else None
            (out / "report.json").write_text(json.dumps(_report(2.0, sets)))
        return 1.0

    def fake_subprocess(cmd, stdout, stderr, env):
        events.append(("peer", Path(cmd[cmd.index("--out") + 1]).name, cmd))
        base = Path(cmd[cmd.index("--out") + 1])
        (base / "draft").mkdir(parents=True)
        (base / "peer.json").write_text(json.dumps({"steps": 3, "wall_s": {"train": 42.0}}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(recipe, "run", fake_run)
    monkeypatch.setattr(recipe, "_best_eval", lambda run_dir: {
        "step": 4, "chain": {"acceptance_length": {"3": 2.0}}})
    monkeypatch.setattr(recipe.subprocess, "run", fake_subprocess)
    return events


def test_bench_split_runs_the_sets_and_records_each(tmp_path, steps):
    work, data = tmp_path / "work", tmp_path / "data"
    data.mkdir()
    out = tmp_path / "recipe.json"
    result = recipe.main(["--work", str(work), "--data", str(data), "--target", "t",
                          "--variants", "default,peer-specforge-b16", "--splits",
                          "heldout,bench", "--bench", "mt-bench,gsm8k", "--bench-prompts",
                          "5", "--k", "3,6", "--out", str(out)])
    evals = [args for step, _, args in steps if step == "eval"]
    bench = [a for a in evals if "--bench" in a]
    assert len(bench) == 2 and len(evals) == 4  # heldout and bench, for each variant
    assert all(a[a.index("--bench") + 1] == "mt-bench,gsm8k"
               and a[a.index("--num-prompts") + 1] == "5" for a in bench)
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    for name in ("default", "peer-specforge-b16"):
        v = saved["variants"][name]
        assert set(v["bench"]) == {"all", "mt-bench", "gsm8k"}
        assert v["bench"]["gsm8k"]["3"]["al"] == pytest.approx(3.3)  # its own table's
        assert v["bench"]["all"]["3"]["ci95"] == [2.0, 3.0]  # the sets pooled, with intervals
        assert v["heldout"]["6"]["al"] == pytest.approx(2.6)
    # the peer's own flags follow the shared ones
    peer = [cmd for step, _, cmd in steps if step == "peer"]
    assert len(peer) == 1 and peer[0][-2:] == ["--batch-size", "16"]
    assert peer[0][peer[0].index("--epochs") + 1] == "8"
    assert peer[0][1].endswith("peers/specforge_train.py")
    assert saved["variants"]["peer-specforge-b16"]["train_s"] == 42.0  # its trainer's time

    # a second call (the stage's table pass) trains nothing again and keeps the peer's time
    steps.clear()
    again = recipe.main(["--work", str(work), "--data", str(data), "--target", "t",
                         "--variants", "peer-specforge-b16", "--splits", "heldout",
                         "--k", "3,6", "--out", str(out)])
    assert not [e for e in steps if e[0] in ("peer", "train")]
    assert again["variants"]["peer-specforge-b16"]["train_s"] == 42.0


def test_unknown_variants_and_splits_are_refused(tmp_path, steps):
    argv = ["--work", str(tmp_path), "--data", str(tmp_path), "--target", "t", "--out",
            str(tmp_path / "o.json")]
    with pytest.raises(SystemExit, match="peer-specforge-b16"):  # the peers are listed too
        recipe.main([*argv, "--variants", "nope"])
    with pytest.raises(SystemExit, match="unknown split"):
        recipe.main([*argv, "--variants", "default", "--splits", "heldout,served"])
    with pytest.raises(SystemExit, match="unknown split"):  # before the baseline is read
        recipe.main([*argv, "--variants", "default", "--splits", "served",
                     "--baseline", "default"])
    assert steps == []


def test_each_variant_is_paired_against_the_baseline_prompt_by_prompt(tmp_path, steps,
                                                                     monkeypatch):
    """The peer run's table: each variant's change against the first row (the pipeline's own
    draft with --baseline) paired prompt by prompt from the eval reports' per-prompt counts,
    per split and k; here the peer accepts one token less on every second prompt, its rows
    listed in another order, and one prompt only the baseline measured."""
    from eyas.serve.eval_report import paired_change_ci

    work, data = tmp_path / "work", tmp_path / "data"
    data.mkdir()
    ids = [f"heldout/t/{i}" for i in range(10)]
    fake = recipe.run

    def run(step, *args, log, out):
        took = fake(step, *args, log=log, out=out)
        if step == "eval":
            peer = out.parent.name.startswith("recipe-peer")
            rows = [[i, 10, [3 - (peer and n % 2), 1]] for n, i in enumerate(ids)]
            report = json.loads((out / "report.json").read_text())
            report.update(primary="eagle3", per_prompt={
                "eagle3 k=3": rows[::-1] if peer else rows + [["heldout/t/x", 10, [9, 9]]],
                "ngram k=3": rows})
            (out / "report.json").write_text(json.dumps(report))
        return took

    monkeypatch.setattr(recipe, "run", run)
    # the pipeline's own draft, measured in the work folder (real_model.py's eval-heldout)
    run("train", log=None, out=work / "run")
    run("eval", log=None, out=work / "eval-heldout")
    out = tmp_path / "recipe.json"
    argv = ["--work", str(work), "--data", str(data), "--target", "t", "--variants",
            "peer-speculators", "--splits", "heldout", "--k", "3", "--out", str(out)]
    result = recipe.main([*argv, "--baseline", "default"])
    want = paired_change_ci([(10, [3 - n % 2, 1]) for n in range(10)], [(10, [3, 1])] * 10)
    assert want["change"] < 0 and want["ci95"][1] < 0
    assert result["paired"] == {"peer-speculators": {"heldout": {"3": want}}}
    assert json.loads(out.read_text())["paired"] == result["paired"]
    line = (f"- peer-speculators against default, paired prompt by prompt: heldout k=3 "
            f"{100 * want['change']:+.1f} % [{100 * want['ci95'][0]:+.1f}, "
            f"{100 * want['ci95'][1]:+.1f}] over 10 prompts")
    assert line in recipe.markdown(result).splitlines()
    assert recipe.main(argv)["paired"] == {}  # one variant alone: nothing to pair against
