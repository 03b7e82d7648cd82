"""benchmarks/real_model_h200.sh's stage `served` as a lease runs it, its wiring only: which
commands it runs, in which order, with which reports. A `python3` first on PATH records each
call and writes what the real one would (the folder its --out names, with a manifest and a
report), since the real calls need an H200, vLLM and the 1.5B target."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).parent.parent
FAKE = """#!/bin/bash
echo "python3 $*" >> "$W/calls.txt"
prev=""
for x in "$@"; do
  if [ "$prev" = "--out" ]; then
    mkdir -p "$x" && echo '{}' > "$x/eyas.json" && echo '{}' > "$x/report.json" &&
      echo table > "$x/report.md"
  fi
  prev=$x
done
"""


def _stage(tmp_path: Path, stage: str = "served", **env) -> tuple[list[str], str]:
    w, bin_dir = tmp_path / "w", tmp_path / "bin"
    w.mkdir(exist_ok=True)
    bin_dir.mkdir(exist_ok=True)
    (w / "repo").symlink_to(REPO)
    (bin_dir / "python3").write_text(FAKE)
    (bin_dir / "python3").chmod(0o755)
    done = subprocess.run(["bash", "benchmarks/real_model_h200.sh"], cwd=REPO,
                          env={**os.environ, "W": str(w), "STAGES": stage,
                               "QWEN_GGUF": str(w / "qwen15.gguf"),
                               "PATH": f"{bin_dir}:{os.environ['PATH']}", **env},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = (w / "calls.txt").read_text().splitlines()
    # (every stage converts the SmolLM2 GGUF first: left out)
    return [c for c in calls if "convert --target" not in c or "smol" not in c], \
        (w / "results/stages.txt").read_text()


def test_a_carried_draft_is_measured_by_eyas_eval_first_then_served_beside_its_reports(
        tmp_path):
    draft = tmp_path / "w/qrun/draft"
    calls, stages = _stage(tmp_path, SERVED_DRAFT=str(draft), SERVED_TEMPS="0",
                           SERVED_EVALS_FIRST="bench")
    assert "holds no exported draft" in stages and len(calls) == 1  # (convert only)
    shutil.rmtree(tmp_path / "w")
    draft.mkdir(parents=True)
    (draft / "config.json").write_text("{}")
    calls, stages = _stage(tmp_path, SERVED_DRAFT=str(draft), SERVED_TEMPS="0.0,1",
                           SERVED_EVALS_FIRST="bench,indist", SERVED_EVAL_K="2,3")
    assert [c.split()[1:3] for c in calls] == [["-m", "eyas"]] * 3 + \
        [["benchmarks/served_speed.py", "--target"]]
    assert "convert" in calls[0]
    for call, temp, out in ((calls[1], "0.0", "eval-bench"), (calls[2], "1", "eval-bench-t1")):
        assert f"--draft {draft} --k 2,3" in call and f"--temperature {temp}" in call
        assert "--bench mt-bench,humaneval" in call and "--num-prompts 80" in call
        assert call.endswith(f"--out {tmp_path}/w/qrun/{out}")
        assert (tmp_path / f"w/results/{out}/report.json").is_file()  # home with the next poll
    speed = calls[3]
    assert f"--draft {draft}" in speed and "--temperatures 0.0,1" in speed
    assert speed.count("--eyas-report") == 2 and "eval-bench-t1/report.json" in speed
    assert "indist ignored" in stages and "real_model.py" not in " ".join(calls)
    assert not (tmp_path / "w/results/eval-indist").exists()


def test_the_pipeline_runs_the_evals_it_is_told_to_before_serving(tmp_path):
    calls, _ = _stage(tmp_path, SERVED_EVALS_FIRST="bench", SERVED_TEMPS="0",
                      SERVED_CONVERSATIONS=str(REPO / "benchmarks/results/served-h200-s26/"
                                               "qwen15-conversations.jsonl.gz"),
                      SERVED_TOP_UP="1", SERVED_TRAIN="16000", SERVED_EVAL_ARGS="--no-ngram --seed 0")
    pipeline = next(c for c in calls if "benchmarks/real_model.py" in c)
    assert "--evals-first bench" in pipeline and "--top-up" in pipeline
    assert "--max-train 16000" in pipeline and "--eval-args=--no-ngram --seed 0 " in pipeline
    assert "--online" not in pipeline  # (captured to disk unless SERVED_ONLINE)
    # the merged answers go home as soon as they exist, not after the evals or the serving
    assert f"--keep-conversations {tmp_path}/w/results/qwen-conversations.jsonl.gz" in pipeline
    # the command after export copies the bench report home and hands it to served_speed.py
    after = pipeline.split("--after-export ", 1)[1]
    assert after.index("eval-bench/report.json") < after.index("served_speed.py")
    assert "--eyas-report" in after
    assert "--bench mt-bench,humaneval --bench-prompts 80" in pipeline
    assert "--bench mt-bench,humaneval --data" in after
    # SERVED_BENCH: the standard sets that a short lease evaluates and serves
    shutil.rmtree(tmp_path / "w")
    calls, _ = _stage(tmp_path, SERVED_EVALS_FIRST="bench", SERVED_BENCH="mt-bench")
    pipeline = next(c for c in calls if "benchmarks/real_model.py" in c)
    assert "--bench mt-bench --bench-prompts 80" in pipeline
    assert "--bench mt-bench --data" in pipeline.split("--after-export ", 1)[1]
    # carried answers used as they are: nothing to send home; several files are one input
    shutil.rmtree(tmp_path / "w")
    parts = [REPO / "benchmarks/results/served-h200-s26/qwen15-conversations.jsonl.gz",
             REPO / "benchmarks/results/served-h200-s29/qwen15-conversations-chat.jsonl.gz"]
    calls, _ = _stage(tmp_path, SERVED_CONVERSATIONS=",".join(map(str, parts)),
                      SERVED_ONLINE="1", SERVED_TRAIN_ARGS="--online-cache cpu --online-cache-gb 90")
    pipeline = next(c for c in calls if "real_model.py" in c)
    assert "--keep-conversations" not in pipeline and " --online " in pipeline
    assert "--train-args=--online-cache cpu --online-cache-gb 90 " in pipeline
    with gzip.open(parts[0], "rt") as a, gzip.open(parts[1], "rt") as b:
        rows = a.read() + b.read()
    assert (tmp_path / "w/qwen-conversations.jsonl").read_text() == rows
    # a source left out of what is carried: session 29's 12,000 chat-first conversations
    shutil.rmtree(tmp_path / "w")
    calls, stages = _stage(tmp_path, SERVED_CONVERSATIONS=",".join(map(str, parts)),
                           SERVED_DROP_SOURCES="bigbench,nosuchsource")
    # (split at newlines only: answers hold U+2028, which str.splitlines also splits at)
    kept = (tmp_path / "w/qwen-conversations.jsonl").read_text().split("\n")[:-1]
    assert len(kept) == 12000 and not any("bigbench/" in line.split(",")[0] for line in kept)
    assert kept == [x for x in rows.split("\n")[:-1] if not x.startswith('{"id": "bigbench/')]
    assert "served: 12000 of 16612 carried conversations kept" in stages


def test_ngram_steps_measures_the_curve_s_sets_at_its_eval_settings(tmp_path):
    calls, stages = _stage(tmp_path, "ngram-steps")
    evals = sorted((c for c in calls if " eval " in c), key=lambda c: c.rsplit("/", 1)[1])
    assert len(evals) == 3 and stages.count("rc 0") >= 3
    for c in evals:  # the curve's: k 3,6, 96 new tokens, float32, batches of 64, n-gram only
        assert "--k 3,6 --max-new-tokens 96 --dtype float32" in c and "--batch-size 64" in c
        assert "--ngram" in c and "--draft" not in c
    data = f"{tmp_path}/w/scale-realdata"
    assert f"--data {data}/indist.jsonl --num-prompts 200" in evals[0]
    assert f"--data {data}/indist_chat.jsonl --num-prompts 200" in evals[1]
    assert "--bench mt-bench --num-prompts 80 --temperature 1" in evals[2]


def test_t1_sampling_measures_both_draft_samplings_on_one_draft_after_its_export(tmp_path):
    calls, _ = _stage(tmp_path, "t1-sampling", T1S_TEMPS="1 0.7")
    [pipeline] = calls  # the evals are its command after export, side by side
    assert f"--conversations {tmp_path}/w/conversations-2000.jsonl" in pipeline
    after = pipeline.split("--after-export ", 1)[1]
    evals = [e for e in after.split(" & ") if "eyas eval" in e]
    assert len(evals) == 5 and after.rstrip().endswith("wait")
    for temp in ("1", "0.7"):
        for sampling in ("greedy", "probabilistic"):
            [e] = [e for e in evals if f"--temperature {temp} --draft-sampling {sampling}" in e]
            assert f"--draft {tmp_path}/w/t1s/draft --bench mt-bench" in e
    assert sum("--temperature" not in e for e in evals) == 1  # T = 0 beside them


def test_a_carried_draft_is_served_beside_the_reports_an_earlier_lease_made(tmp_path):
    """SERVED_EVAL_REPORTS with SERVED_EVALS_FIRST=none: no eval runs again; the committed
    reports go where served_speed.py's --eyas-report glob finds them."""
    draft = tmp_path / "w/qrun/draft"
    draft.mkdir(parents=True)
    (draft / "config.json").write_text("{}")
    reports = [REPO / "benchmarks/results/served-h100-s39" / name / "report.json"
               for name in ("eval-bench", "eval-heldout")]
    calls, stages = _stage(tmp_path, SERVED_DRAFT=str(draft), SERVED_TEMPS="0",
                           SERVED_EVALS_FIRST="none",
                           SERVED_EVAL_REPORTS=",".join(map(str, reports)))
    assert not any(" eval " in c for c in calls) and "ignored" not in stages
    speed = calls[-1]
    assert "served_speed.py" in speed and speed.count("--eyas-report") == 2
    for report in reports:
        copied = tmp_path / "w/qrun" / report.parent.name / "report.json"
        assert f"--eyas-report {copied}" in speed
        assert copied.read_bytes() == report.read_bytes()
    # a report that is not there is named, and the serving goes on without it
    again = tmp_path / "again"
    (again / "w/qrun/draft").mkdir(parents=True)
    (again / "w/qrun/draft/config.json").write_text("{}")
    calls, stages = _stage(again, SERVED_DRAFT=str(again / "w/qrun/draft"), SERVED_TEMPS="0",
                           SERVED_EVALS_FIRST="none",
                           SERVED_EVAL_REPORTS=str(tmp_path / "nowhere/eval-x/report.json"))
    assert "nowhere/eval-x/report.json not copied" in stages and "served_speed.py" in calls[-1]


def test_slim_hides_the_largest_results_for_a_lease_and_puts_them_back(tmp_path):
    """benchmarks/h200_slim.sh in a clone of this repository: `hide` takes the tracked
    results over 1 MB out of the working tree (the device carries what is on disk), leaving
    it small enough for a 36 MB part beside it; `restore` puts back what it took and any
    tracked result the tree lacks, and keeps a lease's results copied over tracked files
    (session 50 lost its corpus JSON to a restore that checked out all of results/)."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    script = "benchmarks/h200_slim.sh"  # the script as it is here, committed or not
    shutil.copy(REPO / script, clone / script)
    subprocess.run(["git", "update-index", "--assume-unchanged", script], cwd=clone, check=True)
    big = clone / "benchmarks/results/served-h200-s41/qwen15-conversations-topup.jsonl.gz"
    before = big.read_bytes()

    def slim(step: str) -> str:
        done = subprocess.run(["bash", "benchmarks/h200_slim.sh", step], cwd=clone,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    out = slim("hide")
    assert not big.exists() and (clone / ".slim" / big.relative_to(clone)).exists()
    tree = int(out.rsplit("tree: ", 1)[1].split()[0])
    assert tree < 29 * 2**20  # 64 MiB less a 36 MB part
    assert "pyproject.toml" in {p.name for p in clone.iterdir()}  # (results only)
    new = clone / "benchmarks/results/scale-smollm2-corpus.md"  # a lease's copy, not committed
    new.write_text("the lease's table\n")
    lost = clone / "benchmarks/results/scale-smollm2.md"  # tracked, under 1 MB, gone
    kept = lost.read_bytes()
    lost.unlink()
    slim("restore")
    assert big.read_bytes() == before and not (clone / ".slim").exists()
    assert lost.read_bytes() == kept and new.read_text() == "the lease's table\n"
    status = subprocess.run(["git", "status", "--short"], cwd=clone, capture_output=True,
                            text=True, check=True).stdout
    assert status == " M benchmarks/results/scale-smollm2-corpus.md\n"
