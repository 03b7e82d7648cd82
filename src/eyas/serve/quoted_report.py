"""The `eyas eval` report an export's README quotes as the draft's acceptance
(`eyas export --acceptance-report`): read, and refused where it measured something else
than the draft exported (n-gram, another draft family, another training run, another step,
another target) or did not finish (docs/export.md)."""

from __future__ import annotations

import logging
from pathlib import Path

from eyas.draft.formats import read_json
from eyas.errors import EyasError
from eyas.store.checkpoint import STEP_DIR
from eyas.store.manifest import MANIFEST, check_same_target, peek_manifest, read_manifest

log = logging.getLogger(__name__)


def read_report(path: str | None, target: dict, train: dict | None, step: Path,
                 family: str = "eagle3") -> dict | None:
    """The `eyas eval` report to quote: one that measured a draft of `family` (eagle3, dflash)
    from this training run (`train`'s manifest) at checkpoint `step`, as far as the eval's
    manifest tells, on this target (the README would otherwise quote n-gram's, another draft's,
    another step's or another target's acceptance as this draft's). A report made on the same
    model in another precision (`--accept-other-weights`) is what serving it gives, so it may
    be quoted."""
    if path is None:
        return None
    p = Path(path)
    p = p / "report.json" if p.is_dir() else p
    if not p.is_file():
        raise EyasError(f"--acceptance-report {path}: no report.json there; pass the --out "
                        f"folder of `eyas eval` or its report.json")
    report = read_json(p, "pass the report.json `eyas eval` wrote")
    if not isinstance(report, dict) or not isinstance(report.get("mean_acceptance_length"), dict):
        raise EyasError(f"{p} is not an `eyas eval` report (no mean_acceptance_length)")
    if report.get("primary") != family:
        name = {"eagle3": "an EAGLE-3", "dflash": "a DFlash"}[family]
        raise EyasError(f"{p} measured {report.get('primary')}, not {name} draft (an eval "
                        f"without --draft measures n-gram); quote the report of `eyas eval "
                        f"--draft` on this draft")
    evaluated = {}
    if (p.parent / MANIFEST).is_file():
        evaluated = read_manifest(p.parent, step="eval")
        if evaluated.get("complete") is False:
            raise EyasError(f"--acceptance-report {path}: that eval did not finish (its "
                            f"{MANIFEST} says complete: false; a lossless check that failed "
                            f"leaves it so too), so its report.json may be another eval's: run "
                            f"`eyas eval` there again, or quote a finished one")
        check_same_target(evaluated.get("target"), target, f"--acceptance-report {path}",
                          fix="measure this draft with `eyas eval` on the target it was "
                              "trained for", weights=False)
        # each run's `run` (or its id, for an older eyas), as the eval recorded them, else
        # as far as its inputs on disk still tell
        runs = set(evaluated["draft_runs"]) if evaluated.get("draft_runs") else \
            runs_measured(evaluated)
        ours = {train.get("run"), train.get("id")} - {None} if train is not None else set()
        if train is not None and runs and not runs & ours:
            raise EyasError(f"--acceptance-report {path} measured a draft of another training "
                            f"run than {train.get('path')}; measure this one (`eyas eval "
                            f"--draft` on this export or on the run) and quote that report")
    _check_step_measured(path, _step_measured(evaluated, report), step)
    return report


def step_number(checkpoint: str | Path | None) -> int | None:
    """N of a checkpoints/step-N folder (N in eyas's eight digits), None for any other path."""
    match = STEP_DIR.match(Path(checkpoint or "").name)
    return int(match.group(1)) if match else None


def _step_measured(evaluated: dict, report: dict) -> int | None:
    """The training step whose draft an eval measured: the checkpoint it recorded
    (`draft_checkpoint`); for an eval from before it did, the `checkpoint` of the export it
    measured while that folder still holds the same export, or a --draft that names a step
    folder. None where none tells (an older eval of a run folder, or one without eyas.json)."""
    named = [evaluated.get("draft_checkpoint")]
    for item in evaluated.get("inputs") or []:
        made = peek_manifest(item["path"]) if item.get("step") == "export" and \
            item.get("path") else None
        if made and made.get("id") == item.get("id"):
            named.append(made.get("checkpoint"))
    named.append(report.get("draft"))
    return next((n for n in map(step_number, named) if n is not None), None)


def _check_step_measured(path: str, measured: int | None, step: Path) -> None:
    exported = step_number(step)
    if measured is None or exported is None:
        log.warning("--acceptance-report %s: cannot tell whether it measured %s, the "
                    "checkpoint exported (an eval by an eyas from before evals recorded their "
                    "checkpoint, of a run folder or of an export replaced since, does not "
                    "say); the README quotes it as this draft's: make sure it is", path,
                    step.name)
    elif measured != exported:
        raise EyasError(f"--acceptance-report {path} measured step {measured}, but this export "
                        f"is step {exported}; re-run `eyas eval --draft` on this export and "
                        f"quote that report, or export the step it measured (--which "
                        f"step-{measured})")


def runs_measured(evaluated: dict) -> set[str]:
    """The training runs whose draft an eval measured (their `run`, which stays one while a
    run trains, and for an eyas from before runs recorded one, the run's manifest id then):
    its draft input, a run folder, or an export folder (still on disk) and the run that
    export came from."""
    trains = []
    for item in evaluated.get("inputs") or []:
        if item.get("step") == "train":
            trains.append(item)
        elif item.get("step") == "export" and item.get("path"):
            made = peek_manifest(item["path"])  # while it holds the export measured
            if made and made.get("id") == item.get("id"):
                trains += [i for i in made.get("inputs") or [] if i.get("step") == "train"]
    # where its inputs no longer tell (an export replaced since): the run folder around the
    # checkpoint it recorded measuring (a run started over there since is another run)
    step = Path(evaluated.get("draft_checkpoint") or "")
    if not trains and step_number(step) is not None and \
            (step.parent.parent / MANIFEST).is_file():
        made = peek_manifest(step.parent.parent)
        if made and made.get("step") == "train":
            trains.append(made)
    return {i.get("run") or i.get("id") for i in trains} - {None}
